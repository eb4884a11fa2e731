"""KV events: the sans-IO core (batch decoding, hashes) and KVEventStream against real servers.

Live tests run lmcache 0.5.6 and 0.5.7rc2 servers; lmcache-driven stores (the only
ones that log ``stored`` events) are made by ``server_scripts/lmcache_store.py``
inside the server's environment.

Every live test runs on asyncio and natively under trio.
"""

from __future__ import annotations

import gc
import json
import subprocess
import time
from collections.abc import Iterator
from typing import Any, TypeVar

import anyio
import msgpack
import pytest
import torch
from servers import server_python
from storer import LmcacheStorer, astore

import lmkv_async as lmkv
from lmkv_async.errors import ProtocolError, UnsupportedOperationError
from lmkv_async.events import KVEventStream
from lmkv_async.testing import LocalServer, server_env
from lmkv_async.wire import hashing
from lmkv_async.wire.dialect import DIALECT_052
from lmkv_async.wire.events import (
    KVRemoved,
    KVResync,
    KVStored,
    control_frames,
    decode_batch,
    is_stream_end,
)
from lmkv_async.wire.frames import pack

T = TypeVar("T")

LAYOUT = lmkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                       block_size=16)
C = 256


# ------------------------------------------------------------------ sans-IO
def _batch(**over: Any) -> bytes:
    body: dict[str, Any] = {"enabled": True, "incarnation": 7, "next_cursor": 3, "lost": False,
                            "events": [
                                {"seq": 2, "kind": "stored", "medium": "CPU", "model_name": "m",
                                 "block_hashes": [b"\x01" * 32], "parent_block_hash": None,
                                 "token_ids": [1, 2, 3]},
                                {"seq": 3, "kind": "removed", "medium": "CPU", "model_name": "m",
                                 "block_hashes": [b"\x01" * 32, b"\x02" * 32],
                                 "parent_block_hash": None, "token_ids": []},
                                {"seq": 4, "kind": "future-kind", "medium": "CPU",
                                 "model_name": "m", "block_hashes": []},
                            ]}
    body.update(over)
    out: bytes = msgpack.packb(body, use_bin_type=True)
    return out


def test_decode_batch_types_each_record() -> None:
    b = decode_batch(_batch())
    assert (b.enabled, b.incarnation, b.next_cursor, b.lost) == (True, 7, 3, False)
    assert b.records == (
        KVStored(2, "m", (b"\x01" * 32,), None, (1, 2, 3), "CPU"),
        KVRemoved(3, "m", (b"\x01" * 32, b"\x02" * 32), "CPU"),
    )  # the unknown kind is skipped, as the server's own adapter does


@pytest.mark.parametrize("bad", [
    b"\xc1",                                   # not msgpack
    pack([1, 2]),                              # not a map
    _batch(enabled=1),                         # wrong type
    _batch(incarnation=True),                  # bool is not an int
    _batch(next_cursor=None),
    _batch(events={}),
    _batch(events=[{"seq": 1}]),               # record without fields
    _batch(events=[{"seq": 1, "kind": "stored", "medium": "CPU", "model_name": "m",
                    "block_hashes": ["not-bin"]}]),
    _batch(events=[{"seq": 1, "kind": "stored", "medium": "CPU", "model_name": "m",
                    "block_hashes": [b"x"], "parent_block_hash": 5}]),
    _batch(events=[{"seq": 1, "kind": "stored", "medium": "CPU", "model_name": "m",
                    "block_hashes": [b"x"], "token_ids": [1.5]}]),
])
def test_decode_batch_rejects_malformed(bad: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_batch(bad)


def test_control_frames() -> None:
    assert control_frames(9, "ack") == [b"\x09", b"", b"ack"]
    assert control_frames(300, "cancel") == [pack(300), b"", b"cancel"]
    assert is_stream_end([b"\x09", b"op"]) and not is_stream_end([b"\x09", b"op", b"x"])


def test_blake3_is_the_package_and_none_hash_follows_compat() -> None:
    # The empty input's digest from BLAKE3's published test vectors (test_vectors.json).
    assert hashing.blake3_digest(b"").hex() == (
        "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262")
    # NONE_HASH = blake3(be64(0) || be32(0)) (compat.md §10).
    assert hashing.NONE_HASH == hashing.blake3_digest(bytes(12))
    assert not hasattr(hashing, "_pure_blake3")  # one hash library (issue 22)


def test_none_hash_and_chain_rules() -> None:
    toks = list(range(3 * C + 5))
    hs = hashing.chunk_hashes(toks, C)
    assert len(hs) == 3  # the partial chunk has no object
    assert hs[0] == hashing.blake3_digest(hashing.NONE_HASH + hashing.token_bytes(toks[:C]))
    assert hs[1] == hashing.hash_chunk(hs[0], hashing.token_bytes(toks[C:2 * C]))
    assert hs[2] == hashing.blake3_digest(hs[1] + hashing.token_bytes(toks[2 * C:3 * C]))


def test_chunk_hashes_match_the_server_package() -> None:
    # The server's own hasher, run in its environment, on the same tokens.
    python = server_python("0.5.7rc2")
    toks = [7, 2**32 - 1, 0, 123456789] * (C // 2)
    code = ("import json,sys;from lmcache.v1.multiprocess.token_hasher import TokenHasher;"
            "h=TokenHasher(chunk_size=256);t=json.loads(sys.stdin.read());"
            "print(json.dumps([x.hex() if isinstance(x,bytes) else TokenHasher.hash_to_bytes(x)"
            ".hex() for x in h.compute_chunk_hashes(t)]))")
    out = subprocess.run([python, "-c", code], input=json.dumps(toks), capture_output=True,
                         text=True, env=server_env(), timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [
        h.hex() for h in hashing.chunk_hashes(toks, C)]


# ------------------------------------------------------------------ live helpers
@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test here runs on asyncio and natively under trio."""
    return str(request.param)


async def next_of(it: Any, kind: type | tuple[type, ...], timeout: float = 10.0) -> Any:
    """The next item of ``kind`` (skipping others), within ``timeout``."""
    step = it.next if isinstance(it, KVEventStream) else it.__anext__
    with anyio.fail_after(timeout):
        while True:
            ev = await step()
            if isinstance(ev, kind):
                return ev


def subscribers(server: LocalServer) -> int:
    return int(server.status()["kv_events"]["subscribers"])


async def wait_subscribers(server: LocalServer, n: int, timeout: float = 5.0) -> int:
    """Poll /status without blocking the loop (closing tasks must get to run)."""
    deadline = time.monotonic() + timeout
    while True:
        got = await anyio.to_thread.run_sync(subscribers, server)
        if got == n or time.monotonic() > deadline:
            return got
        await anyio.sleep(0.05)


@pytest.fixture(params=["0.5.6", "0.5.7rc2"])
def ev_server(request: pytest.FixtureRequest, server_factory: Any) -> LocalServer:
    srv: LocalServer = server_factory(request.param, l1_size_gb=0.2)
    return srv


@pytest.fixture
def storer_factory() -> Iterator[Any]:
    made: list[LmcacheStorer] = []

    def make(server: LocalServer, model: str) -> LmcacheStorer:
        s = LmcacheStorer(server, model)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**31, (n,), generator=g).tolist()


# ------------------------------------------------------------------ live tests
@pytest.mark.anyio
async def test_stream_types_stores_and_removals(ev_server: LocalServer,
                                                storer_factory: Any) -> None:
    model = f"ev-{time.monotonic_ns()}"
    storer = storer_factory(ev_server, model)
    async with lmkv.connect(ev_server.url, ev_server.http_url, model, layout=LAYOUT) as ctx:
        assert "kv_events" in ctx.capabilities
        stream = ctx.kv_events(max_events=4)
        it = aiter(stream)
        first = await anext(it)
        assert isinstance(first, KVResync) and first.reason == "start"
        assert first.discard and first.complete and first.incarnation
        # lmcache-driven: one `stored` record per chunk, chained, with its tokens.
        toks = tokens(1, 3 * C + 10)
        await astore(storer, toks)
        recs = [await next_of(it, KVStored) for _ in range(3)]
        want = hashing.chunk_hashes(toks, C)
        by_hash = {r.block_hashes: r for r in recs}  # not necessarily in chain order
        assert set(by_hash) == {(h,) for h in want}
        for i, h in enumerate(want):
            assert by_hash[(h,)].parent_block_hash == (want[i - 1] if i else None)
            assert by_hash[(h,)].token_ids == tuple(toks[i * C:(i + 1) * C])
        assert {r.medium for r in recs} == {"CPU"} and {r.model_name for r in recs} == {model}
        # engine-driven (this library): no record, only the counter moves.
        before = ev_server.status()["kv_events"]["unbound_stores"]
        toks2 = tokens(2, 2 * C)
        res = await ctx.store(torch.zeros(2, 2, 2 * C, 128, dtype=torch.bfloat16), toks2)
        assert res.written_chunks == 2
        assert ev_server.status()["kv_events"]["unbound_stores"] == before + 2
        # A removal names every hash it dropped, ours included.
        async def clear() -> None:  # no public API for it: the session's own request
            await ctx._s.rpc(ctx._s.transport.pick(),
                             lmkv.wire.requests.clear(ctx._s.d, force=True),
                             time.monotonic() + 5)

        await clear()
        removed = await next_of(it, (KVRemoved, KVStored))
        assert isinstance(removed, KVRemoved), "an engine-driven store produced a stored record"
        assert set(removed.block_hashes) == set(want) | set(hashing.chunk_hashes(toks2, C))
        assert stream.cursor == removed.seq
        assert await wait_subscribers(ev_server, 1) == 1
        await it.aclose()  # what leaving `async for` does
        assert await wait_subscribers(ev_server, 0) == 0
        assert stream.closed


@pytest.mark.anyio
async def test_stream_ends_on_break_and_on_cancellation(ev_server: LocalServer) -> None:
    model = f"ev-end-{time.monotonic_ns()}"
    async with lmkv.connect(ev_server.url, ev_server.http_url, model, layout=LAYOUT) as ctx:
        async for ev in ctx.kv_events():
            assert isinstance(ev, KVResync)
            break
        gc.collect()  # the async generator's finaliser schedules its aclose
        assert await wait_subscribers(ev_server, 0) == 0

        started = anyio.Event()
        ended: list[str] = []

        async def consume() -> None:
            try:
                async with ctx.kv_events() as stream:
                    await stream.next()
                    started.set()
                    await stream.next()  # nothing comes: blocks until cancelled
            except anyio.get_cancelled_exc_class():
                ended.append("cancelled")  # the cancellation left the block: not swallowed
                raise
            ended.append("returned")

        async with anyio.create_task_group() as tg:  # re-raises anything but the cancellation
            tg.start_soon(consume)
            with anyio.fail_after(10):
                await started.wait()
            assert await wait_subscribers(ev_server, 1) == 1
            # The data path is not held up by an idle stream.
            t0 = time.monotonic()
            assert await ctx.lookup(tokens(3, C)) == 0
            assert time.monotonic() - t0 < 1.0
            tg.cancel_scope.cancel()
        assert ended == ["cancelled"]
        assert await wait_subscribers(ev_server, 0) == 0


@pytest.mark.anyio
async def test_backpressure_and_cursor_resume(ev_server: LocalServer,
                                              storer_factory: Any) -> None:
    model = f"ev-bp-{time.monotonic_ns()}"
    storer = storer_factory(ev_server, model)
    async with lmkv.connect(ev_server.url, ev_server.http_url, model, layout=LAYOUT) as ctx:
        toks = tokens(4, 6 * C)
        await astore(storer, toks)  # 6 records, before anyone subscribed
        stream = ctx.kv_events(max_events=1)
        first = await stream.next()
        assert isinstance(first, KVResync) and first.complete  # replayed from seq 1
        one = await next_of(stream, KVStored)
        two = await next_of(stream, KVStored)
        read = stream.batches
        assert read <= 3  # max_events=1: one record a batch (+ an empty first one)
        await anyio.sleep(0.5)
        # One batch per ack, and nothing is read while the consumer does not ask: the
        # server is never more than the one acked batch ahead of the consumer.
        assert stream.batches == read
        await stream.aclose()
        # Resume from the cursor: the rest, and nothing twice.
        resumed = ctx.kv_events(cursor=stream.cursor, max_events=16)
        head = await resumed.next()
        assert isinstance(head, KVResync) and head.complete and head.reason == "start"
        rit = aiter(resumed)  # leaving (or dropping) an iterator closes the stream
        rest = [await next_of(rit, KVStored) for _ in range(4)]
        want = hashing.chunk_hashes(toks, C)
        got = [one.block_hashes[0], two.block_hashes[0]] + [r.block_hashes[0] for r in rest]
        # Records of one store need not come in chain order (one per write-finished
        # event); each names its parent, which is what an index needs.
        assert sorted(got) == sorted(want) and len(set(got)) == 6
        await resumed.aclose()
        # A cursor the log never had: an explicit "lost".
        lost = ctx.kv_events(cursor=10**9)
        head = await lost.next()
        assert isinstance(head, KVResync) and not head.complete and head.discard
        await lost.aclose()


@pytest.mark.anyio
async def test_restart_yields_disconnect_then_restart_resync(server_factory: Any,
                                                             storer_factory: Any) -> None:
    srv: LocalServer = server_factory("0.5.7rc2", l1_size_gb=0.2, private=True)
    model = f"ev-rs-{time.monotonic_ns()}"
    # kv_events without a data-path context: the stream needs only the dialect.
    stream = KVEventStream(srv.url, lmkv.wire.DIALECT_057, model, heartbeat_interval=1.0)
    head = await stream.next()
    assert isinstance(head, KVResync) and head.reason == "start"
    inc = head.incarnation
    storer = storer_factory(srv, model)
    await astore(storer, tokens(5, C))
    assert isinstance(await stream.next(), KVStored)
    storer.close()
    await anyio.to_thread.run_sync(srv.restart)
    with anyio.fail_after(30):
        ev = await stream.next()
    assert isinstance(ev, KVResync) and ev.reason == "disconnected" and not ev.complete
    with anyio.fail_after(30):
        ev = await stream.next()
    assert isinstance(ev, KVResync) and ev.reason == "restart"
    assert ev.discard and ev.complete and ev.incarnation != inc
    storer2 = storer_factory(srv, model)
    toks = tokens(6, C)
    await astore(storer2, toks)
    with anyio.fail_after(10):
        rec = await stream.next()
    assert isinstance(rec, KVStored) and rec.block_hashes == (hashing.chunk_hashes(toks, C)[0],)
    await stream.aclose()


@pytest.mark.anyio
async def test_unsupported_servers_raise_before_sending(server_factory: Any) -> None:
    old: LocalServer = server_factory("0.5.2")
    async with lmkv.connect(old.url, old.http_url, "m-old", layout=LAYOUT) as ctx:
        assert "kv_events" not in ctx.capabilities
        with pytest.raises(UnsupportedOperationError):
            ctx.kv_events()
        # The string op was never sent: 0.5.2's request loop still answers.
        assert await ctx.lookup(tokens(7, C)) == 0
    with pytest.raises(UnsupportedOperationError):
        KVEventStream(old.url, DIALECT_052, "m")
    off: LocalServer = server_factory("0.5.7rc2", l1_size_gb=0.2,
                                      extra_args=("--kv-event-log-size", "0"))
    async with lmkv.connect(off.url, off.http_url, "m-off", layout=LAYOUT) as ctx:
        stream = ctx.kv_events()
        with pytest.raises(UnsupportedOperationError, match="records no KV events"):
            await stream.next()
        assert stream.closed
