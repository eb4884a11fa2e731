"""The public API under trio, against real servers (anyio's pytest plugin, trio backend).

Every test body runs in ``trio.run``: connect (``async with`` and the plain
await + ``aclose`` form), store / lookup / retrieve(out=) and the ``_many``
forms bit for bit, a zero-copy view, a KV-event stream, a Fleet; trio cancel
scopes cut connects and stores at several points; and after every exit the
server's ``/status`` shows no session, lock or registration of ours. The
library runs natively in the trio run (no asyncio loop anywhere).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator

import pytest
import torch
import trio
from servers import ServerPool, ServerSpec, assert_left_nothing, left_on
from storer import LmcacheStorer

import lmkv_async as lmkv
from lmkv_async.testing import LocalServer
from lmkv_async.wire import hashing
from lmkv_async.wire.events import KVResync, KVStored

pytestmark = pytest.mark.anyio

LAYOUT = lmkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                       block_size=16)
_models = itertools.count()


@pytest.fixture
def anyio_backend() -> str:
    """This module's tests run on trio."""
    return "trio"


def model_name() -> str:
    return f"trio-{time.monotonic_ns()}-{next(_models)}"


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**31, (n,), generator=g).tolist()


def kv_for(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.planes, LAYOUT.num_layers, n, LAYOUT.hidden_dim,
                       generator=g).to(LAYOUT.dtype)


@pytest.fixture(params=["0.5.6", "0.5.7rc2"])
def srv(request: pytest.FixtureRequest, server_factory: Callable[..., LocalServer]
        ) -> LocalServer:
    return server_factory(request.param, shm=True)


# ------------------------------------------------------------------ the operations
async def test_operations_bit_exact_under_trio(srv: LocalServer, seen_ids: set[int]) -> None:
    async with lmkv.connect(srv.url, srv.http_url, model_name(), layout=LAYOUT) as ctx:
        C = ctx.chunk_size
        toks = tokens(3 * C + 5, 1)
        kv = kv_for(len(toks), 1)
        res = await ctx.store(kv, toks)
        assert res.stored_tokens == 3 * C
        assert await ctx.lookup(toks) == 3 * C
        out = torch.empty(LAYOUT.planes, LAYOUT.num_layers, 3 * C, LAYOUT.hidden_dim,
                          dtype=LAYOUT.dtype)
        got = await ctx.retrieve(toks, out=out)
        assert got is not None and got.data_ptr() == out.data_ptr()
        assert torch.equal(out, kv[:, :, : 3 * C])
        fresh = await ctx.retrieve(toks)
        assert fresh is not None and torch.equal(fresh, kv[:, :, : 3 * C])

        seqs = [tokens(2 * C, 10 + i) for i in range(4)]
        kvs = [kv_for(2 * C, 10 + i) for i in range(4)]
        stored = await ctx.store_many(list(zip(kvs, seqs, strict=True)))
        assert [r.unwrap().stored_tokens for r in stored] == [2 * C] * 4  # type: ignore[union-attr]
        found = await ctx.lookup_many([*seqs, tokens(2 * C, 99)])
        assert [r.unwrap() for r in found] == [2 * C] * 4 + [0]
        back = await ctx.retrieve_many(seqs)
        for r, want in zip(back, kvs, strict=True):
            t = r.unwrap()
            assert t is not None and torch.equal(t, want)
        status = await ctx.status()
        assert ctx.instance_id in {int(i) for i in status["registered_non_cuda_instance_ids"]}
        assert await left_on(srv, set()) == []  # no lock or session while still registered
    await assert_left_nothing(srv, seen_ids)


async def test_plain_await_connect_then_aclose(srv: LocalServer, seen_ids: set[int]) -> None:
    ctx = await lmkv.connect(srv.url, srv.http_url, model_name(), layout=LAYOUT)
    try:
        toks = tokens(2 * ctx.chunk_size, 2)
        await ctx.store(kv_for(len(toks), 2), toks)
        assert await lmkv.lookup(ctx, toks) == len(toks)
    finally:
        await lmkv.close(ctx)
    assert ctx.closed
    await ctx.aclose()  # idempotent
    await assert_left_nothing(srv, seen_ids)


async def test_typed_errors_under_trio(srv: LocalServer, seen_ids: set[int]) -> None:
    async with lmkv.connect(srv.url, srv.http_url, model_name(), layout=LAYOUT) as ctx:
        with pytest.raises(lmkv.InvalidInputError):
            await ctx.lookup([1, -5, 3])
        with pytest.raises(lmkv.LayoutMismatchError):
            await ctx.store(torch.zeros(2, 3, 256, 128, dtype=LAYOUT.dtype), tokens(256, 3))
    with pytest.raises(lmkv.ClosedError):
        await ctx.lookup(tokens(256, 3))
    await assert_left_nothing(srv, seen_ids)


async def test_unreachable_server_is_a_typed_error() -> None:
    from lmkv_async.testing import free_port

    port = free_port()
    with pytest.raises((lmkv.ServerTimeoutError, lmkv.ServerUnavailableError)):
        await lmkv.connect(f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{port}", "m",
                           layout=LAYOUT, timeout=1.0)


# ------------------------------------------------------------------ cancellation
@pytest.mark.parametrize("after", [0.0, 0.05, 0.2, 0.6])
async def test_cancel_scope_cut_mid_store_leaves_nothing(
    srv: LocalServer, after: float, seen_ids: set[int]
) -> None:
    """A trio cancel scope ends around a store loop, inside ``async with connect``."""
    stores = 0
    with trio.move_on_after(after) as scope:
        async with lmkv.connect(srv.url, srv.http_url, model_name(), layout=LAYOUT,
                                timeout=10) as ctx:
            C = ctx.chunk_size
            for i in itertools.count():
                toks = tokens(8 * C, 100 + i)
                await ctx.store(kv_for(8 * C, i), toks)
                stores += 1
    assert scope.cancelled_caught
    # cut at 0 s, the connect may never have started (nothing to see, nothing to leave)
    await assert_left_nothing(srv, seen_ids, must_have_seen=after > 0)


async def test_cancel_scope_cut_store_with_plain_connect(
    srv: LocalServer, seen_ids: set[int]
) -> None:
    """The non-``async with`` form: the store is cut, aclose() afterwards leaves nothing."""
    ctx = await lmkv.connect(srv.url, srv.http_url, model_name(), layout=LAYOUT)
    C = ctx.chunk_size
    cut = 0
    for i, after in enumerate((0.0, 0.002, 0.01, 0.03)):
        with trio.move_on_after(after) as scope:
            await ctx.store(kv_for(16 * C, i), tokens(16 * C, 200 + i))
        cut += scope.cancelled_caught
    assert cut >= 1, "no store was cut: the test proves nothing"
    # the context is still usable after a cut store
    toks = tokens(C, 300)
    await ctx.store(kv_for(C, 300), toks)
    assert await ctx.lookup(toks) == C
    with trio.CancelScope() as outer:
        outer.cancel()
        await ctx.aclose()  # already cancelled: the cleanup still runs to its end
    assert ctx.closed
    await assert_left_nothing(srv, seen_ids)


async def test_nursery_cancelled_mid_transfer(srv: LocalServer, seen_ids: set[int]) -> None:
    """Workers in a nursery; the nursery is cancelled while they transfer."""
    done = [0, 0]

    async def worker(w: int) -> None:
        async with lmkv.connect(srv.url, srv.http_url, model_name(), layout=LAYOUT) as ctx:
            C = ctx.chunk_size
            for i in itertools.count():
                toks = tokens(4 * C, 1000 * w + i)
                await ctx.store(kv_for(4 * C, i), toks)
                assert await ctx.retrieve(toks) is not None
                done[w] += 1

    async with trio.open_nursery() as nursery:
        for w in range(2):
            nursery.start_soon(worker, w)
        with trio.fail_after(30):
            while min(done) < 1:
                await trio.sleep(0.01)
        await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    await assert_left_nothing(srv, seen_ids)


# ------------------------------------------------------------------ views, events, fleet
async def test_retrieve_view_and_copy_to(srv: LocalServer, seen_ids: set[int]) -> None:
    async with lmkv.connect(srv.url, srv.http_url, model_name(), layout=LAYOUT) as ctx:
        C = ctx.chunk_size
        toks = tokens(2 * C, 4)
        kv = kv_for(2 * C, 4)
        await ctx.store(kv, toks)
        out = torch.empty_like(kv)
        async with ctx.retrieve_view(toks) as view:
            assert view.num_tokens == 2 * C
            assert torch.equal(torch.cat([t.clone() for t in view.tensors], dim=2), kv)
            await view.copy_to(out)
            status = await trio.to_thread.run_sync(srv.status)
            assert status["storage_manager"]["l1_manager"]["read_locked_count"] > 0
        assert torch.equal(out, kv)
        assert await left_on(srv, set()) == []  # the lock went with the block
        with trio.move_on_after(0.0):  # cut while opening: nothing held after
            async with ctx.retrieve_view(toks) as view:
                await trio.sleep(1)
        assert await left_on(srv, set()) == []
    await assert_left_nothing(srv, seen_ids)


async def test_kv_events_under_trio(server_factory: Callable[..., LocalServer]) -> None:
    srv = server_factory("0.5.7rc2", l1_size_gb=0.2)
    model = model_name()
    storer = LmcacheStorer(srv, model)  # lmcache's own client: its stores are recorded
    try:
        async with lmkv.connect(srv.url, srv.http_url, model, layout=LAYOUT) as ctx:
            C = ctx.chunk_size
            async with ctx.kv_events() as stream:
                first = await stream.next()
                assert isinstance(first, KVResync) and first.reason == "start"
                toks = tokens(2 * C, 5)
                await trio.to_thread.run_sync(storer.store, toks)
                seen: list[KVStored] = []
                with trio.fail_after(10):
                    while len(seen) < 2:
                        ev = await stream.next()
                        if isinstance(ev, KVStored):
                            seen.append(ev)
                assert {r.block_hashes for r in seen} == {
                    (h,) for h in hashing.chunk_hashes(toks, C)}
                assert await wait_subscribers(srv, 1) == 1
            assert stream.closed
            assert await wait_subscribers(srv, 0) == 0
            async for ev in ctx.kv_events():  # leaving the loop closes the stream
                assert isinstance(ev, KVResync)
                break
    finally:
        storer.close()
    assert await wait_subscribers(srv, 0) == 0


async def wait_subscribers(server: LocalServer, n: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        got = int((await trio.to_thread.run_sync(server.status))["kv_events"]["subscribers"])
        if got == n or time.monotonic() > deadline:
            return got
        await trio.sleep(0.05)


@pytest.fixture
def pair(server_pool: ServerPool) -> Iterator[dict[str, LocalServer]]:
    specs = {"a": ServerSpec("0.5.7rc2", l1_size_gb=0.2), "b": ServerSpec("0.5.6", l1_size_gb=0.2)}
    servers = {name: server_pool.private(spec) for name, spec in specs.items()}
    try:
        yield servers
    finally:
        for s in servers.values():
            server_pool.stop_private(s)


async def test_fleet_under_trio(pair: dict[str, LocalServer], seen_ids: set[int]) -> None:
    a, b = pair["a"], pair["b"]
    async with lmkv.Fleet({"a": (a.url, a.http_url)}, model_name=model_name(), layout=LAYOUT,
                          timeout=5.0) as fleet:
        C = fleet["a"].chunk_size
        toks = tokens(3 * C, 6)
        kv = kv_for(3 * C, 6)
        await fleet["a"].store(kv, toks)
        member_b = fleet.add_member("b", b.url, b.http_url)  # joins in the background
        with trio.fail_after(20):
            while member_b.state != "up":
                await trio.sleep(0.05)
        await member_b.store(kv[:, :, : 2 * C], toks[: 2 * C])
        assert dict(await fleet.lookup(toks)) == {"a": 3 * C, "b": 2 * C}
        assert await fleet.best(toks) == ("a", 3 * C)
        out = torch.empty_like(kv)
        got = await fleet["a"].retrieve(toks, out=out)
        assert got is not None and torch.equal(out, kv)
        with trio.move_on_after(0.0):  # a cut fleet lookup is just cut
            await fleet.lookup(toks)
        assert await fleet["b"].lookup(toks) == 2 * C
    for s in (a, b):
        await assert_left_nothing(s, seen_ids)


async def test_vllm_publisher_under_trio(server_factory: Callable[..., LocalServer]) -> None:
    """A Fleet member's vLLM-format publisher started, fed and closed from trio."""
    import msgspec
    import zmq

    from lmkv_async.testing import free_port
    from lmkv_async.vllm_events import VllmEventPublisher

    srv = server_factory("0.5.7rc2", l1_size_gb=0.2)
    port = free_port()
    zctx = zmq.Context()
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    try:
        async with lmkv.Fleet({"gpu-0": (srv.url, srv.http_url)}, model_name=model_name(),
                              layout=LAYOUT) as fleet:
            C = fleet["gpu-0"].chunk_size
            async with VllmEventPublisher(fleet["gpu-0"], endpoint=f"tcp://127.0.0.1:{port}",
                                          topic="kv") as pub:
                sub.connect(f"tcp://127.0.0.1:{port}")
                await pub.wait_subscribed(10)
                own = tokens(C, 7)
                await fleet["gpu-0"].store(kv_for(C, 7), own)  # announced from our bookkeeping
                ready = await trio.to_thread.run_sync(sub.poll, 10_000)
                assert ready, "nothing published"
                topic, _seq, payload = sub.recv_multipart()
                assert topic == b"kv"
                _ts, events, *_ = msgspec.msgpack.decode(payload)
                (ev,) = events
                want = int.from_bytes(hashing.chunk_hashes(own, C)[0], "big") & (2**64 - 1)
                assert ev["type"] == "BlockStored" and ev["block_hashes"] == [want]
            assert pub._pub is None  # closed with the block
    finally:
        sub.close()
        zctx.term()
