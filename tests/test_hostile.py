"""A hostile server: the client against a fake lmcache MP server that misbehaves on purpose.

The fake is ``fake_lmcache.FakeLMCache`` (a real ZMQ ROUTER, HTTP server and SHM
segment; see that module): it behaves like a small in-memory lmcache by default, and
each test here overrides the reply to one operation: malformed msgpack, a wrong uid
or op echo, too few or too many frames, hostile slot descriptors, a lying lookup
count, a pickle that would run code, silence.

Every case asserts that the client

* raises a typed ``lmkv_async`` error within its deadline,
* never writes outside the slots it was legitimately given (the segment is
  compared byte for byte against its sentinel / snapshot; a read or write
  outside the mapping would crash the process),
* still sends the release steps the protocol requires (recorded per request id,
  by the integer op id of the 0.5.6 table; a 0.5.2-speaking fake translates), and
* stays usable afterwards (a bit-exact round trip through the same context).

The ``fake_factory`` fixture also fails a test whose client sent an op frame that is
not an int of the table the fake speaks (a string op would kill a 0.5.2 server's
loop), or during which a handler of the fake raised.

Timing bounds come from ``timing.SLACK`` (``$LMKV_TEST_SLACK``); waits poll.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from fake_lmcache import (
    CLEANUP,
    COMMIT_RETRIEVE,
    COMMIT_STORE,
    DIALECTS,
    END,
    FREE,
    GUARD,
    LAYOUT,
    LOOKUP,
    NO_RESULT,
    NOOP,
    NOT_FOUND,
    PING,
    POOL,
    PREP_RETRIEVE,
    PREP_STORE,
    QUERY,
    REGISTER,
    SENTINEL,
    SHAPE,
    SHORT,
    SLOT,
    TAIL,
    TIMEOUT,
    UNREGISTER,
    VALID_OPS,
    WAIT,
    C,
    FakeLMCache,
    Handler,
    Hold,
    Later,
    Multi,
    Req,
    ctx_fake,
    open_ctx,
    slot,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servers import assert_quiescent
from test_context import random_kv, same_bits, tokens_for
from timing import SETTLE, SLACK, eventually, fast, timed, within

import lmkv_async as lmkv
import lmkv_async._session as lmkv_session
import lmkv_async.transport as lmkv_transport
from lmkv_async.wire import DIALECT_052, DIALECT_056
from lmkv_async.wire import requests as wire_requests

OUT_FILL = 0x5A5A5A5A  # int32 pattern for caller buffers


# ----------------------------------------------------------------------------- helpers


def changed_outside(before: torch.Tensor, after: torch.Tensor,
                    allowed: Sequence[tuple[int, int]] = ()) -> list[int]:
    """Byte offsets that differ between two segment copies outside ``allowed`` ranges."""
    mask = before != after
    for lo, hi in allowed:
        mask[lo:hi] = False
    return mask.nonzero().flatten()[:8].tolist()


def filled_out(n_tokens: int) -> torch.Tensor:
    out = torch.empty((2, LAYOUT.num_layers, n_tokens, LAYOUT.hidden_dim), dtype=LAYOUT.dtype)
    out.view(torch.int32).fill_(OUT_FILL)
    return out


def untouched(t: torch.Tensor) -> bool:
    return bool((t.contiguous().view(torch.int32) == OUT_FILL).all())

# ----------------------------------------------------------------------------- fixtures

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("short_cleanup")]


@pytest.fixture(params=DIALECTS)
def any_fake(request: pytest.FixtureRequest, fake_factory: Callable[..., FakeLMCache]
             ) -> FakeLMCache:
    """A fake speaking the 0.5.6 table, then one speaking 0.5.2 (no bounded free)."""
    return fake_factory(dialect=request.param)


async def round_trip(ctx: lmkv.AsyncKVContext, fake: FakeLMCache, seed: int) -> None:
    """The context still works: store, lookup, retrieve (with and without out=), bit-exact."""
    fake.clear_overrides()
    toks = tokens_for(2 * C + 3, seed=10_000 + seed)
    kv = random_kv(LAYOUT, len(toks), seed=seed)
    res = await ctx.store(kv, toks)
    assert res.total_chunks == 2 and res.written_chunks == 2
    assert await ctx.lookup(toks) == 2 * C
    out = await ctx.retrieve(toks)
    assert out is not None and same_bits(out, kv[:, :, : 2 * C])
    buf = filled_out(3 * C)
    view = await ctx.retrieve(toks, out=buf)
    assert view is not None and same_bits(view, kv[:, :, : 2 * C]) and untouched(buf[:, :, 2 * C:])


async def seed_chunks(ctx: lmkv.AsyncKVContext, n: int, seed: int) -> tuple[list[int],
                                                                             torch.Tensor]:
    toks = tokens_for(n * C, seed=20_000 + seed)
    kv = random_kv(LAYOUT, n * C, seed=seed)
    assert (await ctx.store(kv, toks)).written_chunks == n
    # The store's end_session runs in the background: wait for it, so a fault a test
    # installs next cannot be consumed by this store's release step.
    fake = ctx_fake(ctx)
    if ctx.transport == "shm":
        await fake.wait_ops(fake.last_rid("store"), [PREP_STORE, COMMIT_STORE, END])
    else:  # inline: a probe lookup for the cached prefix, then the commit with the data
        await fake.wait_ops(fake.last_rid("probe"), [LOOKUP, QUERY, END])
        await fake.wait_ops(fake.last_rid("store"), [COMMIT_STORE, END])
    return toks, kv


# ----------------------------------------------------------------------------- sanity


async def test_fake_server_round_trip_shm(fake: FakeLMCache) -> None:
    async with open_ctx(fake) as ctx:
        assert ctx.transport == "shm" and ctx.server_version == "0.5.6-gfake"
        assert ctx.dialect is DIALECT_056
        # the client maps what the server announced, not the file (whose tail is sentinel)
        assert ctx._s.pool is not None and ctx._s.pool.size == POOL
        before = fake.segment()
        toks, kv = await seed_chunks(ctx, 2, seed=1)
        rid = fake.last_rid("store")
        await fake.wait_ops(rid, [PREP_STORE, COMMIT_STORE, END])
        # exactly the two reserved slots were written, with the chunk objects
        assert changed_outside(before, fake.segment(), [(GUARD, GUARD + 2 * SLOT)]) == []
        assert same_bits(fake.read_slot(GUARD), kv[:, :, :C])
        assert same_bits(fake.read_slot(GUARD + SLOT), kv[:, :, C:])
        snap = fake.segment()
        out = await ctx.retrieve(toks)
        assert out is not None and same_bits(out, kv)
        await fake.wait_ops(fake.last_rid("retrieve"),
                            [LOOKUP, QUERY, PREP_RETRIEVE, COMMIT_RETRIEVE, END])
        assert await ctx.lookup(toks) == 2 * C
        await fake.wait_ops(fake.last_rid("lookup"), [LOOKUP, QUERY, FREE, END])
        assert changed_outside(snap, fake.segment()) == [], "a retrieve wrote into the pool"
        await round_trip(ctx, fake, seed=2)
    assert UNREGISTER in [r.op for r in fake.requests()]
    assert not fake.registered


async def test_fake_server_round_trip_pickle(fake_factory: Callable[..., FakeLMCache]) -> None:
    fake = fake_factory(shm=False)
    async with open_ctx(fake) as ctx:
        assert ctx.transport == "pickle"
        await round_trip(ctx, fake, seed=3)
        await fake.wait_ops(fake.last_rid("retrieve"), [LOOKUP, QUERY, PREP_RETRIEVE, END])


# ----------------------------------------------------------------------------- reply frames


def _corrupt(kind: str, *, process: bool = True) -> Handler:
    """A reply to the request that is broken in one way.

    With ``process`` the fake first handles the request as usual (reserves slots,
    consumes a prefetch result, ...), as a server whose reply got mangled would.
    """

    def handler(req: Req, fake: FakeLMCache) -> Any:
        good = fake.frames(req, fake.default(req) if process else 0)
        uid, op = req.uid_frame, req.op_frame
        if kind == "bad-msgpack":
            return [uid, op, b"\xc1\xff\x00"]
        if kind == "truncated-msgpack":
            return [uid, op, b"\x82\xa7context"]
        if kind == "wrong-uid":
            return [msgpack.packb(msgpack.unpackb(uid) + 1_000_000), *good[1:]]
        if kind == "wrong-op":
            return [uid, msgpack.packb(NOOP if req.op != NOOP else PING), *good[2:]]
        if kind == "string-op-echo":
            name = DIALECT_056.op_name(req.op)  # type: ignore[arg-type]
            return [uid, msgpack.packb(name), *good[2:]]
        if kind == "one-frame":
            return [uid]
        if kind == "extra-frames":
            return [*good, msgpack.packb(True)] if len(good) == 3 else [*good, b"\xc0", b"\xc0"]
        if kind == "no-reply":
            return None
        raise AssertionError(kind)

    return handler


FAULTS = ["bad-msgpack", "truncated-msgpack", "wrong-uid", "wrong-op", "string-op-echo",
          "one-frame", "extra-frames", "no-reply"]
SILENT = {"wrong-uid", "no-reply"}

#: target op -> (operation to run, release steps expected for its request id)
TARGETS: dict[str, tuple[int, str]] = {
    "lookup": (LOOKUP, "lookup"),
    "query": (QUERY, "lookup"),
    "prepare_store": (PREP_STORE, "store"),
    "commit_store": (COMMIT_STORE, "store"),
    "prepare_retrieve": (PREP_RETRIEVE, "retrieve"),
    "commit_retrieve": (COMMIT_RETRIEVE, "retrieve"),
    "end_session": (END, "retrieve"),
}

def _fault_params() -> list[Any]:
    params = []
    for target in TARGETS:
        for fault in FAULTS:
            params.append(pytest.param(target, fault, id=f"{target}-{fault}"))
    return params


def _expected_ops(target: str) -> list[int]:
    """What the client must send for the operation's request id."""
    if target in ("lookup", "query"):
        # result unknown: consume it with wait_prefetch_status, free the hit, end the session
        return [LOOKUP, QUERY, WAIT, FREE, END] if target == "query" else [LOOKUP, WAIT, FREE, END]
    if target == "prepare_store":
        return [PREP_STORE, END]  # no commit: the slots were not filled
    if target == "commit_store":
        return [PREP_STORE, COMMIT_STORE, END]
    return [LOOKUP, QUERY, PREP_RETRIEVE, COMMIT_RETRIEVE, END]


@pytest.mark.parametrize(("target", "fault"), _fault_params())
async def test_broken_reply_frames(any_fake: FakeLMCache, target: str, fault: str) -> None:
    fake = any_fake
    op, kind = TARGETS[target]
    async with open_ctx(fake) as ctx:
        toks, kv = await seed_chunks(ctx, 2, seed=4)  # its release steps are done
        if kind == "store":
            toks = tokens_for(2 * C, seed=99)
            kv = random_kv(LAYOUT, 2 * C, seed=99)
        elif kind == "lookup":
            toks = [*toks, *tokens_for(C, seed=98)]  # 3 chunks looked up, 2 cached
        before = fake.segment()
        # A mangled query reply whose result the server already consumed leaves the
        # client unable to learn the hit: see test_lost_query_reply_release.
        corrupt = _corrupt(fault, process=target != "query")
        delivered: list[Req] = []

        def fault_once(req: Req, f: FakeLMCache) -> Any:
            delivered.append(req)
            return corrupt(req, f)

        fake.on(op, fault_once)
        call: Awaitable[Any]
        if kind == "lookup":
            call = ctx.lookup(toks, timeout=SHORT)
        elif kind == "store":
            call = ctx.store(kv, toks, timeout=SHORT)
        else:
            out = filled_out(2 * C)
            call = ctx.retrieve(toks, out=out, timeout=SHORT)
        value, exc, elapsed = await timed(call)

        release_only = target in ("commit_retrieve", "end_session")
        if release_only:
            # a failed release step is logged, not raised: the data is already copied out
            assert exc is None, repr(exc)
            assert value is not None and same_bits(value, kv)
            fast(elapsed, what="a call whose release step is broken")
        elif fault in SILENT:
            assert isinstance(exc, lmkv.ServerTimeoutError), repr(exc)
            assert exc.op == DIALECT_056.op_name(op), exc.op
            within(elapsed, SHORT, what=f"timeout={SHORT}")
        else:
            assert isinstance(exc, lmkv.ProtocolError), repr(exc)
            fast(elapsed, what="a malformed reply")

        rid = fake.last_rid(kind)
        await fake.wait_ops(rid, _expected_ops(target))
        # the fault hit the operation under test, not a release step of an earlier one
        assert [r.rid for r in delivered] == [rid], [(r.op, r.rid) for r in delivered]
        if kind == "lookup":
            # unknown hit: 0.5.6 frees the whole looked-up range (the server bounds it);
            # 0.5.2 frees anonymously, so only what the consume step reported
            free = [r for r in fake.requests() if r.op == FREE and r.rid == rid][-1]
            whole = 3 * C if fake.dialect == "0.5.6" else 2 * C
            assert (free.args[0]["start"], free.args[0]["end"]) == (0, whole)
        if kind == "store":
            allowed = [(GUARD + 2 * SLOT, GUARD + 4 * SLOT)] if target == "commit_store" else []
            assert changed_outside(before, fake.segment(), allowed) == []
        else:
            assert changed_outside(before, fake.segment()) == [], "a retrieve wrote to the pool"
            if kind == "retrieve" and not release_only:
                assert untouched(out), "the caller's buffer was written despite an error"
        await round_trip(ctx, fake, seed=5)


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_lost_query_reply_release(fake_factory: Callable[..., FakeLMCache],
                                        dialect: str) -> None:
    """The query consumed the result, its reply was lost: the consume wait says 0.

    0.5.6 frees the whole looked-up range (bounded by the server to the session's hit);
    0.5.2's free is anonymous and unbounded, so nothing is freed (the locks expire with
    the read TTL) rather than risk another reader's locks."""
    fake = fake_factory(dialect=dialect)
    async with open_ctx(fake) as ctx:
        toks, _ = await seed_chunks(ctx, 2, seed=34)
        fake.on(QUERY, lambda req, f: (f.default(req), None)[1])  # consumed; reply lost
        with pytest.raises(lmkv.ServerTimeoutError):
            await ctx.lookup(toks, timeout=SHORT)
        rid = fake.last_rid("lookup")
        if dialect == "0.5.6":
            await fake.wait_ops(rid, [LOOKUP, QUERY, WAIT, FREE, END])
            free = [r for r in fake.requests() if r.op == FREE and r.rid == rid][-1]
            assert (free.args[0]["start"], free.args[0]["end"]) == (0, 2 * C)
        else:
            await fake.wait_ops(rid, [LOOKUP, QUERY, WAIT, END])


@pytest.mark.parametrize("version", ["0.5.2", "0.5.6"])
async def test_lost_query_reply_on_a_real_server(
    version: str, server_factory: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same on real servers: the reply to the first query is dropped client-side.

    0.5.6: every lock is freed (checked while the context is registered). 0.5.2: the
    documented residual case -- the lookup's hit stays read-locked until the read TTL,
    no free_lookup_locks is sent for it (an anonymous free could strip another
    reader's locks), and nothing else is held."""
    server = server_factory(version, private=True)  # the leaked locks must not outlive it
    layout = lmkv.KVLayout(num_layers=1, num_kv_heads=1, head_dim=16)
    sent: list[tuple[str, str | None]] = []
    real_request = lmkv_transport.Connection.request

    async def recording(self: Any, req: Any, **kwargs: Any) -> Any:
        sent.append((req.op, kwargs.get("request_id")))
        return await real_request(self, req, **kwargs)

    monkeypatch.setattr(lmkv_transport.Connection, "request", recording)
    async with lmkv.connect(server.url, server.http_url, "hostile-lost-query", layout=layout,
                            heartbeat_interval=0) as ctx:
        toks = tokens_for(2 * ctx.chunk_size, seed=35)
        await ctx.store(random_kv(layout, len(toks), seed=35), toks)
        await assert_quiescent(ctx)
        query_frame = msgpack.packb(ctx.dialect.op_id("query_prefetch_status"))
        dropped: list[bytes] = []
        real = lmkv_transport.Connection._dispatch

        def drop_first_query(self: Any, frames: Sequence[bytes]) -> None:
            if not dropped and len(frames) >= 2 and bytes(frames[1]) == query_frame:
                dropped.append(bytes(frames[0]))
                return
            real(self, frames)

        monkeypatch.setattr(lmkv_transport.Connection, "_dispatch", drop_first_query)
        with pytest.raises(lmkv.ServerTimeoutError):
            await ctx.lookup(toks, timeout=2.0)
        assert dropped
        monkeypatch.setattr(lmkv_transport.Connection, "_dispatch", real)
        rid = [r for op, r in sent if op == "lookup"][-1]
        await eventually(lambda: ("end_session", rid) in sent, what="the session is ended")
        ops = [op for op, r in sent if r == rid]
        if version == "0.5.6":
            assert "free_lookup_locks" in ops, ops
            await assert_quiescent(ctx)
        else:
            assert ops == ["lookup", "query_prefetch_status", "wait_prefetch_status",
                           "end_session"], ops

            def held() -> Any:
                status = server.status()
                return (status.get("active_sessions") == 0 and not ctx._s._tasks
                        and status["storage_manager"]["l1_manager"])

            l1 = await eventually(held, what="the lookup's session ended")
            assert (l1["read_locked_count"], l1["write_locked_count"]) == (2, 0), l1
    if version == "0.5.6":
        await assert_quiescent(server)
    else:  # lookup locks are not tied to the registration: they stay after aclose()
        status = server.status()
        assert status["storage_manager"]["l1_manager"]["read_locked_count"] == 2
        assert status["registered_non_cuda_instance_ids"] == []


# ----------------------------------------------------------------------------- prepare_store


def _store_reply(offsets: list[int], idx: list[int], **slot_changes: Any) -> dict[str, Any]:
    return {"context": {"slots": [slot(o, **slot_changes) for o in offsets],
                        "chunk_indices": idx}}


A, B = GUARD, GUARD + SLOT
BAD_STORE_REPLIES: dict[str, Any] = {
    "offset-negative": _store_reply([-SLOT, A], [0, 1]),
    "offset-minus-one": _store_reply([-1, A], [0, 1]),
    "offset-past-end": _store_reply([A, POOL], [0, 1]),
    "offset-straddles-end": _store_reply([A, POOL - SLOT + 1], [0, 1]),
    "offset-huge": _store_reply([A, 2**63 - 1], [0, 1]),
    "offset-uint64-max": _store_reply([A, 2**64 - 1], [0, 1]),
    "overlap-same": _store_reply([A, A], [0, 1]),
    "overlap-partial": _store_reply([A, A + SLOT // 2], [0, 1]),
    "overlap-by-one-byte": _store_reply([A, A + SLOT - 1], [0, 1]),
    "length-short": _store_reply([A, B], [0, 1], length=SLOT - 1),
    "length-long": _store_reply([A, B], [0, 1], length=SLOT + 1),
    "length-zero": _store_reply([A, B], [0, 1], length=0),
    "length-negative": _store_reply([A, B], [0, 1], length=-SLOT),
    "shape-wrong": _store_reply([A, B], [0, 1], shape=[2, 1, C, 32]),
    "shape-mla": _store_reply([A, B], [0, 1], shape=[1, C, 16]),
    "shape-transposed": _store_reply([A, B], [0, 1], shape=[2, 1, 16, C]),
    "shape-string": _store_reply([A, B], [0, 1], shape="2x1x256x16"),
    "shape-map": _store_reply([A, B], [0, 1], shape={"0": 2}),
    "shape-missing": {"context": {"slots": [{"offset": A, "length": SLOT, "dtype": "float32"}],
                                  "chunk_indices": [0]}},
    "dtype-wrong": _store_reply([A, B], [0, 1], dtype="float16"),
    "dtype-torch-prefix": _store_reply([A, B], [0, 1], dtype="torch.float32"),
    "dtype-int": _store_reply([A, B], [0, 1], dtype=7),
    "offset-str": _store_reply([A], [0], offset=str(A)),
    "offset-float": _store_reply([A], [0], offset=float(A)),
    "offset-bool": _store_reply([A], [0], offset=True),
    "offset-nil": _store_reply([A], [0], offset=None),
    "offset-list": _store_reply([A], [0], offset=[A]),
    "length-float": _store_reply([A], [0], length=float(SLOT)),
    "length-bool": _store_reply([A], [0], length=True),
    "slot-not-map": {"context": {"slots": [[A, SLOT]], "chunk_indices": [0]}},
    "slot-nil": {"context": {"slots": [None], "chunk_indices": [0]}},
    "slots-map": {"context": {"slots": {"0": slot(A)}, "chunk_indices": [0]}},
    "slots-str": {"context": {"slots": "abc", "chunk_indices": []}},
    "slots-nil": {"context": {"slots": None, "chunk_indices": []}},
    "idx-out-of-range": _store_reply([A, B], [0, 2]),
    "idx-negative": _store_reply([A, B], [-1, 0]),
    "idx-duplicate": _store_reply([A, B], [1, 1]),
    "idx-too-few": _store_reply([A, B], [0]),
    "idx-too-many": _store_reply([A], [0, 1]),
    "idx-float": _store_reply([A, B], [0.0, 1]),
    "idx-bool": _store_reply([A, B], [False, True]),
    "idx-str": _store_reply([A, B], ["0", "1"]),
    "idx-missing": {"context": {"slots": [slot(A)]}},
    "idx-bytes": {"context": {"slots": [slot(A)], "chunk_indices": b"\x00"}},
    "more-slots-than-chunks": _store_reply([A, B, B + SLOT], [0, 1, 2]),
    "context-missing": {"slots": [slot(A)], "chunk_indices": [0]},
    "context-nil": {"context": None},
    "context-list": {"context": [slot(A)]},
    "pickle-style-reply": {"context": {}},
    "not-a-map": [slot(A)],
    "a-string": "OK",
    "a-bool": True,
}


@pytest.mark.parametrize("reply", list(BAD_STORE_REPLIES.values()), ids=list(BAD_STORE_REPLIES))
async def test_hostile_prepare_store_reply(fake: FakeLMCache, reply: Any) -> None:
    async with open_ctx(fake) as ctx:
        before = fake.segment()
        fake.on(PREP_STORE, lambda req, f: f.frames(req, reply))
        toks = tokens_for(2 * C, seed=7)
        kv = random_kv(LAYOUT, 2 * C, seed=7)
        value, exc, elapsed = await timed(ctx.store(kv, toks))
        assert isinstance(exc, lmkv.ProtocolError), repr(exc) if exc else value
        fast(elapsed, what="a hostile prepare_store reply")
        # nothing was written anywhere, the tail past the announced pool included
        # (every check runs before the first byte is copied)
        assert changed_outside(before, fake.segment()) == []
        # no commit of slots it did not fill (that would publish garbage), but end_session
        await fake.wait_ops(fake.last_rid("store"), [PREP_STORE, END])
        await round_trip(ctx, fake, seed=8)


async def test_valid_prepare_store_writes_only_its_slots(fake: FakeLMCache) -> None:
    """Slots in odd places (last bytes of the pool, out of order, a skipped chunk)."""
    async with open_ctx(fake) as ctx:
        before = fake.segment()
        last = POOL - SLOT
        reply = _store_reply([last, 8], [2, 0])  # chunk 1 "already cached"
        fake.on(PREP_STORE, lambda req, f: f.frames(req, reply))
        fake.on(COMMIT_STORE, lambda req, f: f.frames(req, True))
        toks = tokens_for(3 * C, seed=9)
        kv = random_kv(LAYOUT, 3 * C, seed=9)
        res = await ctx.store(kv, toks)
        assert (res.total_chunks, res.written_chunks, res.skipped_chunks) == (3, 2, 1)
        assert changed_outside(before, fake.segment(), [(8, 8 + SLOT), (last, POOL)]) == []
        assert same_bits(fake.read_slot(last), kv[:, :, 2 * C:])
        assert same_bits(fake.read_slot(8), kv[:, :, :C])
        await fake.wait_ops(fake.last_rid("store"), [PREP_STORE, COMMIT_STORE, END])


async def test_pool_smaller_than_segment_is_the_bound(
    fake_factory: Callable[..., FakeLMCache]
) -> None:
    """The mapping is what the server announced: slots in the rest of the file are refused."""
    fake = fake_factory(segment_size=POOL, pool_size=POOL // 2)
    assert fake.seg is not None and fake.seg.size == POOL
    async with open_ctx(fake) as ctx:
        before = fake.segment()
        reply = _store_reply([POOL // 2], [0])  # inside the file, outside the announced pool
        fake.on(PREP_STORE, lambda req, f: f.frames(req, reply))
        toks = tokens_for(C, seed=10)
        with pytest.raises(lmkv.ProtocolError, match="outside the pool"):
            await ctx.store(random_kv(LAYOUT, C, seed=10), toks)
        assert changed_outside(before, fake.segment()) == []
        await round_trip(ctx, fake, seed=11)


async def test_unaligned_slots_on_large_copies(fake_factory: Callable[..., FakeLMCache]) -> None:
    """Odd offsets on a 5 MiB store/retrieve (the streaming and threaded copy paths)."""
    fake = fake_factory(pool_size=16 << 20)
    n = 160
    offsets = [GUARD + i * (SLOT + 3) + 1 for i in range(n)]
    async with open_ctx(fake) as ctx:
        before = fake.segment()
        fake.on(PREP_STORE, lambda req, f: f.frames(req, _store_reply(offsets, list(range(n)))))
        fake.on(COMMIT_STORE, lambda req, f: f.frames(req, True))
        toks = tokens_for(n * C, seed=36)
        kv = random_kv(LAYOUT, n * C, seed=36)
        assert (await ctx.store(kv, toks)).written_chunks == n
        spans = [(o, o + SLOT) for o in offsets]
        assert changed_outside(before, fake.segment(), spans) == []
        for i in (0, 1, n // 2, n - 1):
            assert same_bits(fake.read_slot(offsets[i]), kv[:, :, i * C:(i + 1) * C])
        fake.on(LOOKUP, lambda req, f: (f.jobs.__setitem__(req.rid, n),
                                        f.frames(req, NO_RESULT))[1])
        fake.on(PREP_RETRIEVE, lambda req, f: f.frames(
            req, _retrieve_reply([slot(o) for o in offsets])))
        out = await ctx.retrieve(toks)
        assert out is not None and same_bits(out, kv)
        buf = filled_out(n * C + 1)
        fake.on(LOOKUP, lambda req, f: (f.jobs.__setitem__(req.rid, n),
                                        f.frames(req, NO_RESULT))[1])
        fake.on(PREP_RETRIEVE, lambda req, f: f.frames(
            req, _retrieve_reply([slot(o) for o in offsets])))
        view = await ctx.retrieve(toks, out=buf)
        assert view is not None and same_bits(view, kv) and untouched(buf[:, :, n * C:])


async def test_late_prepare_store_reply_is_filled_and_committed(fake: FakeLMCache) -> None:
    """A prepare_store answered after its deadline reserved slots anyway (§6.6)."""
    async with open_ctx(fake) as ctx:
        before = fake.segment()
        fake.on(PREP_STORE,
                lambda req, f: Later(SHORT + 0.3, f.frames(req, f.default(req))))
        toks = tokens_for(2 * C, seed=12)
        kv = random_kv(LAYOUT, 2 * C, seed=12)
        _value, exc, elapsed = await timed(ctx.store(kv, toks, timeout=SHORT))
        assert isinstance(exc, lmkv.ServerTimeoutError) and exc.op == "prepare_store"
        within(elapsed, SHORT, what=f"timeout={SHORT}")
        rid = fake.last_rid("store")
        # the late reply's slots are filled completely, then committed, then the session ends
        await fake.wait_ops(rid, [PREP_STORE, END, COMMIT_STORE, END])
        assert changed_outside(before, fake.segment(), [(GUARD, GUARD + 2 * SLOT)]) == []
        assert same_bits(fake.read_slot(GUARD), kv[:, :, :C])
        assert same_bits(fake.read_slot(GUARD + SLOT), kv[:, :, C:])
        assert await ctx.lookup(toks) == 2 * C
        await round_trip(ctx, fake, seed=13)


async def test_late_hostile_prepare_store_reply_writes_nothing(fake: FakeLMCache) -> None:
    async with open_ctx(fake) as ctx:
        before = fake.segment()
        reply = _store_reply([POOL], [0])
        fake.on(PREP_STORE, lambda req, f: Later(SHORT + 0.2, f.frames(req, reply)))
        toks = tokens_for(C, seed=14)
        with pytest.raises(lmkv.ServerTimeoutError):
            await ctx.store(random_kv(LAYOUT, C, seed=14), toks, timeout=SHORT)
        rid = fake.last_rid("store")
        await fake.wait_ops(rid, [PREP_STORE, END, END])  # no commit
        assert changed_outside(before, fake.segment()) == []
        await round_trip(ctx, fake, seed=15)


# ----------------------------------------------------------------------------- prepare_retrieve


def _retrieve_reply(slots: Any, **extra: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"success": True, "data": b"", "context": {"slots": slots}}
    d.update(extra)
    return d


def _bad_retrieve_replies() -> dict[str, Callable[[list[int]], Any]]:
    """Builders taking the two legitimate offsets of the seeded chunks."""
    return {
        "fewer-slots-than-hit": lambda o: _retrieve_reply([slot(o[0])]),
        "no-slots-for-hit": lambda o: _retrieve_reply([]),
        "more-slots-than-hit": lambda o: _retrieve_reply([slot(o[0]), slot(o[1]), slot(o[1])]),
        "offset-negative": lambda o: _retrieve_reply([slot(o[0]), slot(-SLOT)]),
        "offset-past-end": lambda o: _retrieve_reply([slot(o[0]), slot(POOL)]),
        "offset-straddles-end": lambda o: _retrieve_reply([slot(o[0]), slot(POOL - 1)]),
        "offset-uint64-max": lambda o: _retrieve_reply([slot(o[0]), slot(2**64 - 1)]),
        "length-short": lambda o: _retrieve_reply([slot(o[0]), slot(o[1], length=SLOT - 4)]),
        "length-long": lambda o: _retrieve_reply([slot(o[0]), slot(o[1], length=2 * SLOT)]),
        "shape-wrong": lambda o: _retrieve_reply([slot(o[0]), slot(o[1], shape=[2, 1, C])]),
        "dtype-wrong": lambda o: _retrieve_reply([slot(o[0]), slot(o[1], dtype="bfloat16")]),
        "offset-str": lambda o: _retrieve_reply([slot(o[0]), slot(o[1], offset="0")]),
        "offset-float": lambda o: _retrieve_reply([slot(o[0]), slot(o[1], offset=1.0)]),
        "length-nil": lambda o: _retrieve_reply([slot(o[0]), slot(o[1], length=None)]),
        "slot-list": lambda o: _retrieve_reply([slot(o[0]), [o[1], SLOT]]),
        "slots-map": lambda o: _retrieve_reply({"a": slot(o[0])}),
        "success-int": lambda o: _retrieve_reply([slot(o[0]), slot(o[1])], success=1),
        "success-missing": lambda o: {"data": b"", "context": {"slots": [slot(x) for x in o]}},
        "data-str": lambda o: _retrieve_reply([slot(o[0]), slot(o[1])], data="x"),
        "context-list": lambda o: {"success": True, "data": b"", "context": []},
        "no-slots-no-data": lambda o: {"success": True, "data": b"", "context": {}},
        "not-a-map": lambda o: [slot(o[0]), slot(o[1])],
        "nil": lambda o: None,
    }


@pytest.mark.parametrize("name", list(_bad_retrieve_replies()))
@pytest.mark.parametrize("with_out", [False, True], ids=["alloc", "out"])
async def test_hostile_prepare_retrieve_reply(fake: FakeLMCache, name: str, with_out: bool
                                              ) -> None:
    build = _bad_retrieve_replies()[name]
    async with open_ctx(fake) as ctx:
        toks, _kv = await seed_chunks(ctx, 2, seed=16)
        snap = fake.segment()
        fake.on(PREP_RETRIEVE, lambda req, f: f.frames(req, build([A, B])))
        out = filled_out(2 * C + 7) if with_out else None
        value, exc, elapsed = await timed(ctx.retrieve([*toks, 1, 2, 3], out=out))
        assert isinstance(exc, lmkv.ProtocolError), repr(exc) if exc else value
        fast(elapsed, what="a hostile prepare_retrieve reply")
        assert changed_outside(snap, fake.segment()) == [], "a retrieve wrote to the pool"
        if out is not None:
            assert untouched(out), "the caller's buffer was written despite an error"
        # the pending read is released (commit_retrieve), then the session ends
        await fake.wait_ops(fake.last_rid("retrieve"),
                            [LOOKUP, QUERY, PREP_RETRIEVE, COMMIT_RETRIEVE, END])
        await round_trip(ctx, fake, seed=17)


async def test_prepare_retrieve_failure_is_a_miss_and_frees_locks(fake: FakeLMCache) -> None:
    async with open_ctx(fake) as ctx:
        toks, _ = await seed_chunks(ctx, 2, seed=18)
        fake.on(PREP_RETRIEVE, lambda req, f: f.frames(
            req, {"success": False, "data": b"", "context": {}}))
        out = filled_out(2 * C)
        assert await ctx.retrieve(toks, out=out) is None
        assert untouched(out)
        await fake.wait_ops(fake.last_rid("retrieve"),
                            [LOOKUP, QUERY, PREP_RETRIEVE, FREE, END])
        free = [r for r in fake.requests() if r.op == FREE][-1]
        assert (free.args[0]["start"], free.args[0]["end"]) == (0, 2 * C)
        await round_trip(ctx, fake, seed=19)


async def test_valid_prepare_retrieve_reads_what_the_server_names(fake: FakeLMCache) -> None:
    """Slots in reverse order and at the last bytes of the pool: copied exactly as named."""
    async with open_ctx(fake) as ctx:
        toks, kv = await seed_chunks(ctx, 2, seed=20)
        fake.write_slot(POOL - SLOT, kv[:, :, :C])
        fake.on(PREP_RETRIEVE, lambda req, f: f.frames(
            req, _retrieve_reply([slot(POOL - SLOT), slot(A)])))
        out = await ctx.retrieve(toks)
        assert out is not None
        assert same_bits(out[:, :, :C], kv[:, :, :C]) and same_bits(out[:, :, C:], kv[:, :, :C])


# ----------------------------------------------------------------------------- lookup counts


BAD_COUNTS: dict[str, Any] = {
    "larger-than-requested": 3,
    "much-larger": 2**40,
    "negative": -1,
    "float": 1.0,
    "bool": True,
    "string": "2",
    "list": [2],
    "map": {"hit": 2},
}


@pytest.mark.parametrize("count", list(BAD_COUNTS.values()), ids=list(BAD_COUNTS))
@pytest.mark.parametrize("op", ["lookup", "retrieve"])
async def test_hostile_prefetch_count(fake: FakeLMCache, count: Any, op: str) -> None:
    async with open_ctx(fake) as ctx:
        toks, _ = await seed_chunks(ctx, 2, seed=21)
        too_big = isinstance(count, int) and not isinstance(count, bool) and count > 2

        def lie(req: Req, f: FakeLMCache) -> Any:
            if too_big:
                f.default(req)  # consume the job: the server says it is done
            return f.frames(req, count)

        fake.on(QUERY, lie)
        out = filled_out(2 * C)
        call = ctx.lookup(toks) if op == "lookup" else ctx.retrieve(toks, out=out)
        value, exc, elapsed = await timed(call)
        assert isinstance(exc, lmkv.ProtocolError), repr(exc) if exc else value
        fast(elapsed, what="a hostile prefetch count")
        assert untouched(out)
        rid = fake.last_rid(op)
        if too_big:
            # every chunk it could have locked is freed (bounded by what was looked up)
            await fake.wait_ops(rid, [LOOKUP, QUERY, FREE, END])
        else:
            # unknown result: consumed with wait_prefetch_status, then the real hit is freed
            await fake.wait_ops(rid, [LOOKUP, QUERY, WAIT, FREE, END])
        free = [r for r in fake.requests() if r.op == FREE and r.rid == rid][-1]
        assert (free.args[0]["start"], free.args[0]["end"]) == (0, 2 * C)
        assert free.args[0]["worker_id"] is None
        await round_trip(ctx, fake, seed=22)


async def test_prefetch_never_finishes_times_out(fake: FakeLMCache) -> None:
    async with open_ctx(fake) as ctx:
        toks, _ = await seed_chunks(ctx, 1, seed=23)
        fake.on(QUERY, lambda req, f: f.frames(req, NO_RESULT), times=None)
        fake.on(WAIT, lambda req, f: f.frames(req, NO_RESULT), times=None)
        _, exc, elapsed = await timed(ctx.lookup(toks, timeout=SHORT))
        assert isinstance(exc, lmkv.ServerTimeoutError), repr(exc)
        within(elapsed, SHORT, what=f"timeout={SHORT}")
        waits = [r for r in fake.requests() if r.op == WAIT]
        assert waits and all(0 < r.args[1] <= 1.0 for r in waits)
        rid = fake.last_rid("lookup")
        await eventually(lambda: fake.ops_for(rid)[-1] == END, SETTLE + CLEANUP,
                         what="the session is ended")


# ----------------------------------------------------------------------------- pickle payloads


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


class _EvilStorage:
    """Code hidden in the storage bytes torch hands to torch.load(weights_only=False)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        import torch.storage

        return (torch.storage._load_from_bytes, (pickle.dumps(_Evil(self.marker)),))


def _evil_payloads(marker: Path) -> dict[str, bytes]:
    good = [torch.zeros(SHAPE, dtype=LAYOUT.dtype)]
    return {
        "os-system": pickle.dumps([_Evil(marker)]),
        "in-storage-bytes": pickle.dumps([_EvilStorage(marker)]),
        "after-a-tensor": pickle.dumps([*good, _Evil(marker)]),
        "eval-global": b"cbuiltins\neval\n(Vopen(" + repr(str(marker)).encode()
                       + b",'w')\ntR.",
        "not-a-pickle": b"\x80\x04garbage",
        "a-dict": pickle.dumps({"a": good[0]}),
        "wrong-shape": pickle.dumps([torch.zeros(2, 1, C, 8)]),
        "wrong-dtype": pickle.dumps([torch.zeros(SHAPE, dtype=torch.float16)]),
        "too-few-chunks": pickle.dumps(good),
    }


@pytest.mark.parametrize("shm", [False, True], ids=["pickle-server", "shm-server"])
@pytest.mark.parametrize("payload", list(_evil_payloads(Path("/x"))))
async def test_hostile_pickle_payload(fake_factory: Callable[..., FakeLMCache], tmp_path: Path,
                                      shm: bool, payload: str) -> None:
    fake = fake_factory(shm=shm)
    marker = tmp_path / "pwned"
    data = _evil_payloads(marker)[payload]
    async with open_ctx(fake) as ctx:
        toks, _ = await seed_chunks(ctx, 2, seed=24)
        fake.on(PREP_RETRIEVE, lambda req, f: f.frames(
            req, {"success": True, "data": data, "context": {}}))
        out = filled_out(2 * C)
        value, exc, _elapsed = await timed(ctx.retrieve(toks, out=out))
        assert isinstance(exc, lmkv.ProtocolError), repr(exc) if exc else value
        assert not marker.exists(), "the client ran code from a server pickle"
        assert untouched(out)
        # a pickle prepare released its locks itself; commit is a no-op there: end only
        await fake.wait_ops(fake.last_rid("retrieve"), [LOOKUP, QUERY, PREP_RETRIEVE, END])
        await round_trip(ctx, fake, seed=25)


async def test_shm_slots_on_a_pickle_context(fake_factory: Callable[..., FakeLMCache]) -> None:
    fake = fake_factory(shm=False)
    async with open_ctx(fake) as ctx:
        toks, _ = await seed_chunks(ctx, 1, seed=26)
        fake.on(PREP_RETRIEVE, lambda req, f: f.frames(req, _retrieve_reply([slot(0)])))
        with pytest.raises(lmkv.TransportUnavailableError):
            await ctx.retrieve(toks)
        await fake.wait_ops(fake.last_rid("retrieve"),
                            [LOOKUP, QUERY, PREP_RETRIEVE, COMMIT_RETRIEVE, END])
        await round_trip(ctx, fake, seed=27)


# ----------------------------------------------------------------------------- registration


BAD_REGISTER: dict[str, Any] = {
    "name-with-slash": {"shm_name": "../etc/passwd", "pool_size": POOL},
    "name-absolute": {"shm_name": "/dev/zero", "pool_size": POOL},
    "name-nul": {"shm_name": "a\x00b", "pool_size": POOL},
    "name-int": {"shm_name": 5, "pool_size": POOL},
    "size-negative": {"shm_name": "x", "pool_size": -1},
    "size-str": {"shm_name": "x", "pool_size": "4M"},
    "size-float": {"shm_name": "x", "pool_size": 4.0},
    "missing": {},
    "not-a-map": ["x", POOL],
    "nil": None,
}


@pytest.mark.parametrize("reply", list(BAD_REGISTER.values()), ids=list(BAD_REGISTER))
async def test_hostile_register_reply(fake: FakeLMCache, reply: Any) -> None:
    fake.on(REGISTER, lambda req, f: f.frames(req, reply))
    value, exc, elapsed = await timed(open_ctx(fake).__aenter__())
    assert isinstance(exc, lmkv.ProtocolError), repr(exc) if exc else value
    fast(elapsed, what="a hostile register reply")


@pytest.mark.parametrize("how", ["late", "malformed"])
async def test_failed_registration_is_undone(fake: FakeLMCache, how: str) -> None:
    if how == "late":
        fake.on(REGISTER, lambda req, f: Later(1.0, f.frames(req, f.default(req))))
    else:
        fake.on(REGISTER, lambda req, f: (f.default(req), f.frames(req, {"shm_name": 1}))[1])
    _value, exc, elapsed = await timed(open_ctx(fake, timeout=SHORT).__aenter__())
    if how == "late":
        assert isinstance(exc, lmkv.ServerTimeoutError), repr(exc)
        within(elapsed, SHORT, late=SLACK + lmkv_session.UNREGISTER_TIMEOUT,
               what="timeout, then an unregister")
    else:
        assert isinstance(exc, lmkv.ProtocolError), repr(exc)
        fast(elapsed, what="a malformed register reply, then an unregister")
    assert UNREGISTER in [r.op for r in fake.requests()]
    # the late reply (if any) has arrived and changed nothing: still unregistered
    await eventually(lambda: fake.replies_pending == 0, what="the late reply was sent")
    assert not fake.registered, "the server still holds the registration"


async def test_pool_larger_than_segment(fake_factory: Callable[..., FakeLMCache],
                                        caplog: pytest.LogCaptureFixture) -> None:
    """An announced pool bigger than the file must not be mapped (reads past EOF: SIGBUS)."""
    fake = fake_factory(segment_size=POOL, pool_size=2 * POOL)
    with pytest.raises(lmkv.TransportUnavailableError):
        await open_ctx(fake, transport="shm").__aenter__()
    assert not fake.registered  # the registration made to find out was dropped
    with caplog.at_level(logging.WARNING, logger="lmkv_async"):
        async with open_ctx(fake) as ctx:
            assert ctx.transport == "pickle"
    assert "falling back to pickle" in caplog.text


@pytest.mark.parametrize("name", ["..", ".", "no-such-segment"])
async def test_unmappable_shm_name(fake: FakeLMCache, name: str) -> None:
    fake.register_result = {"shm_name": name, "pool_size": POOL}
    with pytest.raises(lmkv.TransportUnavailableError):
        await open_ctx(fake, transport="shm").__aenter__()
    async with open_ctx(fake) as ctx:
        assert ctx.transport == "pickle"


async def test_register_never_answered(fake: FakeLMCache) -> None:
    fake.on(REGISTER, lambda req, f: None)
    _value, exc, elapsed = await timed(open_ctx(fake, timeout=SHORT).__aenter__())
    assert isinstance(exc, lmkv.ServerTimeoutError), repr(exc)
    # the deadline, then at most UNREGISTER_TIMEOUT for an unregister nobody answers
    within(elapsed, SHORT, late=SLACK + lmkv_session.UNREGISTER_TIMEOUT, what="register")


# ----------------------------------------------------------------------------- deadlines


@pytest.mark.parametrize("op", ["lookup", "retrieve", "store"])
async def test_frozen_server_fails_within_deadline(any_fake: FakeLMCache, op: str) -> None:
    """Nothing is answered any more: the caller gets its error at the deadline, and the
    release steps are still attempted (in the background, each with its own deadline)."""
    fake = any_fake
    async with open_ctx(fake) as ctx:
        toks, kv = await seed_chunks(ctx, 1, seed=28)
        for o in sorted(VALID_OPS - {UNREGISTER}):
            fake.on(o, lambda req, f: None, times=None)
        call = {"lookup": lambda: ctx.lookup(toks, timeout=SHORT),
                "retrieve": lambda: ctx.retrieve(toks, timeout=SHORT),
                "store": lambda: ctx.store(kv, tokens_for(C, seed=29), timeout=SHORT)}[op]()
        _, exc, elapsed = await timed(call)
        assert isinstance(exc, lmkv.ServerTimeoutError), repr(exc)
        within(elapsed, SHORT, what=f"timeout={SHORT}")
        if op == "store":
            expected = [PREP_STORE, END]
        elif fake.dialect == "0.5.6":
            # result unknown and the consume wait unanswered: 0.5.6's free is bounded by
            # the session's hit, so the whole looked-up range is freed
            expected = [LOOKUP, WAIT, FREE, END]
        else:
            expected = [LOOKUP, WAIT, END]  # 0.5.2: an anonymous free only of a known hit
        await fake.wait_ops(fake.last_rid(op), expected, timeout=2 * CLEANUP + SETTLE)


async def test_silence_on_one_request_does_not_block_others(fake: FakeLMCache) -> None:
    """Pipelining: while one request's reply is held back, later requests on the same
    socket are answered; the held one is still pending after them, then gets its own
    reply. A second, never answered, times out at its deadline alone."""
    async with open_ctx(fake) as ctx:
        toks, kv = await seed_chunks(ctx, 1, seed=30)
        gate = threading.Event()
        held: list[Req] = []

        def hold(req: Req, f: FakeLMCache) -> Any:
            held.append(req)
            return Hold(gate, f.frames(req, f.default(req)))

        fake.on(LOOKUP, hold)
        slow = asyncio.create_task(ctx.lookup(toks, timeout=4 * SETTLE))
        await eventually(lambda: held, what="the held lookup reached the server")
        for i in range(10):
            assert await ctx.lookup(toks) == C
            out = await ctx.retrieve(toks)
            assert out is not None and same_bits(out, kv), i
        # head-of-line blocking would have kept the ten behind the held one
        assert not slow.done(), "the held request finished before its reply was released"
        assert "lookup" in [p.op for c in ctx._transport.connections for p in c._pending.values()]
        gate.set()
        assert await slow == C  # its own (late) reply, matched by uid
        # a request that is never answered times out on its own deadline
        def lookups() -> int:
            return len([r for r in fake.requests() if r.op == LOOKUP])

        seen = lookups()
        fake.on(LOOKUP, lambda req, f: None)
        silent = asyncio.create_task(timed(ctx.lookup(tokens_for(C, seed=31), timeout=SHORT)))
        await eventually(lambda: lookups() > seen, what="the silent lookup reached the server")
        assert await ctx.lookup(toks) == C
        _, exc, elapsed = await silent
        assert isinstance(exc, lmkv.ServerTimeoutError), repr(exc)
        within(elapsed, SHORT, what=f"timeout={SHORT}")


async def test_unsolicited_and_duplicate_replies_are_ignored(fake: FakeLMCache) -> None:
    async with open_ctx(fake) as ctx:
        toks, kv = await seed_chunks(ctx, 1, seed=32)

        def noisy(req: Req, f: FakeLMCache) -> Any:
            good = f.frames(req, f.default(req))
            uid = msgpack.unpackb(req.uid_frame)
            return Multi([
                [msgpack.packb(uid + 777), req.op_frame, msgpack.packb(5)],  # unknown uid
                [msgpack.packb(uid + 1), req.op_frame, msgpack.packb(7)],    # a future uid
                [msgpack.packb(uid + 778)],                                  # a lone frame
                good,
                Later(0.05, good),                                           # a duplicate
            ])

        fake.on(QUERY, noisy, times=None)
        for _ in range(3):
            assert await ctx.lookup(toks) == C
            out = await ctx.retrieve(toks)
            assert out is not None and same_bits(out, kv)
        fake.clear_overrides()
        # every duplicate is sent; a probe on the same socket is answered after them
        await eventually(lambda: fake.replies_pending == 0, what="the duplicates were sent")
        assert await ctx._transport.pick().probe(wire_requests.noop(ctx.dialect),
                                                 timeout=TIMEOUT) == "OK"
        assert all(c.in_flight == 0 for c in ctx._transport.connections)
        await round_trip(ctx, fake, seed=33)


# ----------------------------------------------------------------------------- property test

JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True) | st.text(max_size=4) | st.binary(max_size=6),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=4,
)


def _sometimes(valid: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> Any:
    return st.integers(0, 5).flatmap(lambda k: bad if k == 0 else valid)


def slot_strategy(offsets: list[int]) -> st.SearchStrategy[Any]:
    offset = _sometimes(
        st.sampled_from(offsets),
        st.sampled_from([-1, -SLOT, POOL - SLOT + 1, POOL, 2**63 - 1, 2**64 - 1, 0, 8,
                         GUARD + SLOT // 2]) | st.integers(-POOL, 2 * POOL) | JUNK)
    length = _sometimes(st.just(SLOT), st.sampled_from([0, SLOT - 1, SLOT + 1, -SLOT]) | JUNK)
    shape = _sometimes(st.just(list(SHAPE)),
                       st.lists(st.integers(0, 300), max_size=5) | JUNK)
    dtype = _sometimes(st.just("float32"),
                       st.sampled_from(["float16", "bfloat16", "torch.float32", ""]) | JUNK)
    full = st.fixed_dictionaries({"offset": offset, "length": length, "shape": shape,
                                  "dtype": dtype})
    return _sometimes(full, JUNK | full.flatmap(
        lambda d: st.sampled_from(sorted(d)).map(lambda k: {x: v for x, v in d.items()
                                                             if x != k})))


def _slot_ok(s: Any) -> bool:
    """Independent oracle: is this a slot the client may touch?"""
    if not isinstance(s, dict):
        return False
    off, ln, shape, dtype = (s.get(k) for k in ("offset", "length", "shape", "dtype"))
    return (type(off) is int and type(ln) is int and isinstance(shape, list)
            and shape == list(SHAPE) and dtype == "float32" and ln == SLOT
            and 0 <= off and off + ln <= POOL)


def _store_reply_ok(reply: Any, n: int) -> bool:
    if not isinstance(reply, dict) or not isinstance(reply.get("context"), dict):
        return False
    ctx = reply["context"]
    slots, idx = ctx.get("slots"), ctx.get("chunk_indices")
    if not isinstance(slots, list) or not isinstance(idx, list) or len(slots) != len(idx):
        return False
    if not all(_slot_ok(s) for s in slots):
        return False
    if not all(type(i) is int and 0 <= i < n for i in idx) or len(set(idx)) != len(idx):
        return False
    spans = sorted((s["offset"], s["offset"] + SLOT) for s in slots)
    return all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


@st.composite
def store_case(draw: st.DrawFn) -> tuple[int, Any]:
    n = draw(st.integers(1, 3))
    offsets = [GUARD + i * SLOT for i in range(4)] + [POOL - SLOT, 0]
    k = draw(st.integers(0, n + 1))
    slots = draw(st.lists(slot_strategy(offsets), min_size=k, max_size=k))
    idx = draw(_sometimes(st.permutations(range(n)).map(lambda p: list(p[:k])),
                          st.lists(st.integers(-1, n) | JUNK, min_size=k, max_size=k + 1)))
    reply = draw(_sometimes(
        st.just({"context": {"slots": slots, "chunk_indices": idx}}),
        JUNK | st.just({"context": {}}) | st.just({"context": {"slots": slots}})))
    return n, reply


def _run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(coro_fn())  # type: ignore[arg-type]


@settings(max_examples=50, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=store_case())
def test_property_prepare_store_replies(fake: FakeLMCache, case: tuple[int, Any]) -> None:
    n, reply = case
    fake.reset()
    ok = _store_reply_ok(reply, n)
    toks = tokens_for(n * C, seed=40)
    kv = random_kv(LAYOUT, n * C, seed=40)

    async def body() -> None:
        async with open_ctx(fake) as ctx:
            before = fake.segment()
            fake.on(PREP_STORE, lambda req, f: f.frames(req, reply))
            fake.on(COMMIT_STORE, lambda req, f: f.frames(req, True))
            value, exc, _ = await timed(ctx.store(kv, toks))
            rid = fake.last_rid("store")
            if not ok:
                assert isinstance(exc, lmkv.ProtocolError), (reply, exc, value)
                assert changed_outside(before, fake.segment()) == []
                await fake.wait_ops(rid, [PREP_STORE, END])
                return
            assert exc is None, (reply, exc)
            slots, idx = reply["context"]["slots"], reply["context"]["chunk_indices"]
            assert value.written_chunks == len(slots) and value.total_chunks == n
            spans = [(s["offset"], s["offset"] + SLOT) for s in slots]
            assert changed_outside(before, fake.segment(), spans) == []
            for s, i in zip(slots, idx, strict=False):
                assert same_bits(fake.read_slot(s["offset"]), kv[:, :, i * C:(i + 1) * C])
            await fake.wait_ops(rid, [PREP_STORE, COMMIT_STORE, END] if slots
                                else [PREP_STORE, END])

    _run(body)


def _retrieve_outcome(reply: Any, hit: int) -> str:
    """'error' (parse fails), 'miss' (success False), 'shm', or 'pickle' (data path)."""
    if not isinstance(reply, dict):
        return "error"
    success, data = reply.get("success"), reply.get("data", b"")
    ctx = reply.get("context", {})
    if type(success) is not bool or not isinstance(data, bytes) or not isinstance(ctx, dict):
        return "error"
    shm = "slots" in ctx
    slots = ctx.get("slots", [])
    if not isinstance(slots, list) or not all(_slot_ok(s) for s in slots):
        return "error"
    if not success:
        return "miss"
    if shm:
        return "shm" if len(slots) == hit else "error"
    return "pickle" if data else "error"


@st.composite
def retrieve_case(draw: st.DrawFn) -> tuple[int, Any, bool]:
    hit = draw(st.integers(1, 3))
    offsets = [GUARD + i * SLOT for i in range(hit)] + [POOL - SLOT, 0, 8]
    k = draw(_sometimes(st.just(hit), st.integers(0, hit + 1)))
    slots = draw(st.lists(slot_strategy(offsets), min_size=k, max_size=k))
    success = draw(_sometimes(st.just(True), st.just(False) | JUNK))
    data = draw(_sometimes(st.just(b""), st.binary(max_size=16) | JUNK))
    base = {"success": success, "data": data, "context": {"slots": slots}}
    reply = draw(_sometimes(st.just(base), JUNK | st.just({"success": success, "data": data,
                                                             "context": {}})))
    return hit, reply, draw(st.booleans())


@settings(max_examples=50, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=retrieve_case())
def test_property_prepare_retrieve_replies(fake: FakeLMCache, case: tuple[int, Any, bool]
                                           ) -> None:
    hit, reply, with_out = case
    fake.reset()
    outcome = _retrieve_outcome(reply, hit)

    async def body() -> None:
        async with open_ctx(fake) as ctx:
            toks, _kv = await seed_chunks(ctx, hit, seed=41)
            snap = fake.segment()
            fake.on(PREP_RETRIEVE, lambda req, f: f.frames(req, reply))
            out = filled_out(hit * C + 5) if with_out else None
            value, exc, _ = await timed(ctx.retrieve(toks, out=out))
            rid = fake.last_rid("retrieve")
            assert changed_outside(snap, fake.segment()) == [], "a retrieve wrote to the pool"
            if outcome in ("error", "pickle"):
                assert isinstance(exc, lmkv.ProtocolError), (reply, exc, value)
                assert out is None or untouched(out)
                ops = [LOOKUP, QUERY, PREP_RETRIEVE, END] if outcome == "pickle" else \
                    [LOOKUP, QUERY, PREP_RETRIEVE, COMMIT_RETRIEVE, END]
            elif outcome == "miss":
                assert exc is None and value is None, (reply, exc)
                assert out is None or untouched(out)
                ops = [LOOKUP, QUERY, PREP_RETRIEVE, FREE, END]
            else:
                assert exc is None, (reply, exc)
                expected = torch.cat([fake.read_slot(s["offset"])
                                      for s in reply["context"]["slots"]], dim=2)
                assert value is not None and same_bits(value, expected)
                if out is not None:
                    assert value.data_ptr() == out.data_ptr() and untouched(out[:, :, hit * C:])
                ops = [LOOKUP, QUERY, PREP_RETRIEVE, COMMIT_RETRIEVE, END]
            await fake.wait_ops(rid, ops)

    _run(body)


# ----------------------------------------------------------------------------- error details


@pytest.mark.parametrize("fault", ["bad-msgpack", "bad-slot"])
async def test_protocol_errors_name_op_and_server(fake: FakeLMCache, fault: str) -> None:
    async with open_ctx(fake) as ctx:
        if fault == "bad-msgpack":
            fake.on(PREP_STORE, _corrupt("bad-msgpack"))
        else:
            fake.on(PREP_STORE, lambda req, f: f.frames(req, _store_reply([POOL], [0])))
        with pytest.raises(lmkv.ProtocolError) as info:
            await ctx.store(random_kv(LAYOUT, C, seed=50), tokens_for(C, seed=50))
        assert info.value.op == "prepare_store" and info.value.server == fake.url, str(info.value)


def test_fake_is_a_real_router_with_a_real_segment(fake: FakeLMCache) -> None:
    assert fake.seg is not None and os.path.exists(f"/dev/shm/{fake.seg.name}")
    assert os.stat(f"/dev/shm/{fake.seg.name}").st_size == POOL + TAIL
    assert fake.register_result["pool_size"] == POOL
    seg = fake.segment()
    assert seg.numel() == POOL + TAIL and seg.eq(SENTINEL).all()


# ----------------------------------------------------------------------------- detection


async def test_server_older_than_050_is_refused(fake: FakeLMCache) -> None:
    fake.http["/version"] = "0.4.9"
    with pytest.raises(lmkv.UnsupportedServerError, match=r"older than 0\.5\.0"):
        await open_ctx(fake).__aenter__()
    assert fake.requests() == [], "refused from /version alone: nothing goes over ZMQ"


@pytest.mark.parametrize("version_reply", ["404", "unparseable"])
@pytest.mark.parametrize("dialect", DIALECTS)
async def test_config_keys_decide_without_a_version(
    fake_factory: Callable[..., FakeLMCache], version_reply: str, dialect: str
) -> None:
    """No usable /version: the keys of /config mp decide (0.5.6 has session_ttl_seconds,
    a /config with none of the newer keys is 0.5.0-0.5.2); no probe is sent. (On the
    0.5.6 table op 21 is get_chunk_size, which every connect sends once for the chunk
    size; on 0.5.2 it is noop, the probe, which must not appear.)"""
    fake = fake_factory(dialect=dialect)
    fake.http["/version"] = NOT_FOUND if version_reply == "404" else "nightly"
    async with open_ctx(fake) as ctx:
        assert ctx.dialect is (DIALECT_056 if dialect == "0.5.6" else DIALECT_052)
        assert ctx.server_version == ("" if version_reply == "404" else "nightly")
        await round_trip(ctx, fake, seed=60)  # the fake only answers its own table
    op21 = [r for r in fake.requests() if r.op_frame == msgpack.packb(21) and not r.args]
    assert len(op21) == (1 if dialect == "0.5.6" else 0)


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_zmq_probe_when_config_has_no_mp_section(
    fake_factory: Callable[..., FakeLMCache], dialect: str
) -> None:
    """Neither /version nor /config tell: op 21 with no payload decides. On the 0.5.6
    table it is get_chunk_size (an int: the 0.5.3-0.5.4 rules); on 0.5.2 it is noop
    ("OK"). Either way the chunk size then comes from get_chunk_size (18 on 0.5.2)."""
    fake = fake_factory(dialect=dialect)
    fake.http["/version"] = NOT_FOUND
    fake.config = {}
    async with open_ctx(fake) as ctx:
        expected = "0.5.3-0.5.4" if dialect == "0.5.6" else "0.5.0-0.5.2"
        assert ctx.dialect.name == expected and ctx.chunk_size == C
        await round_trip(ctx, fake, seed=61)
    probes = [r for r in fake.requests() if r.op_frame == msgpack.packb(21)]
    assert probes and probes[0].args == [], "the probe is op 21 without a payload"


@pytest.mark.parametrize("source", ["config", "probe"])
async def test_chunk_size_not_a_multiple_of_block_size(fake: FakeLMCache, source: str) -> None:
    # the server's get_chunk_size (op 21 on the 0.5.6 table) decides the chunk size
    fake.on(21, lambda req, f: f.frames(req, 200), times=None)  # LAYOUT.block_size is 16
    if source == "config":
        fake.config["mp"]["chunk_size"] = 200
    else:
        fake.http["/version"] = NOT_FOUND
        fake.config = {}
    with pytest.raises(lmkv.InvalidInputError, match="not a multiple of block_size"):
        await open_ctx(fake).__aenter__()
    assert REGISTER not in [r.op for r in fake.requests()], "nothing may be registered"


# ----------------------------------------------------------------------------- heartbeat


async def test_heartbeat_interval_follows_the_reap_timeout(
    fake_factory: Callable[..., FakeLMCache]
) -> None:
    """With heartbeat_interval=None pings go every reap_timeout / 4 (from /config); with 0
    none at all; with no reap timeout announced, every 10 s."""
    fake = fake_factory()
    fake.config["mp"]["worker_reap_timeout_seconds"] = 4  # -> a 1 s interval
    async with open_ctx(fake, heartbeat_interval=None) as derived, \
            open_ctx(fake, heartbeat_interval=0) as off:
        assert derived._s.heartbeat_interval == 1.0
        pings = await eventually(lambda: len(fake.pings_from(derived.instance_id)) >= 3
                                 and fake.pings_from(derived.instance_id),
                                 timeout=3 + 3 * SLACK, what="three heartbeat pings")
        gaps = [b - a for a, b in itertools.pairwise(pings)]
        assert all(g >= 1.0 - 0.05 for g in gaps), gaps
        assert fake.pings_from(off.instance_id) == []
    unknown = fake_factory()
    del unknown.config["mp"]["worker_reap_timeout_seconds"]
    async with open_ctx(unknown, heartbeat_interval=None) as ctx:
        assert ctx._s.heartbeat_interval == 10.0


# ----------------------------------------------------------------------------- fan-out


async def test_many_calls_pass_salt_and_timeout_to_every_item(fake: FakeLMCache) -> None:
    async with open_ctx(fake) as ctx:
        seqs = [tokens_for(C, seed=70 + i) for i in range(3)]
        kvs = [random_kv(LAYOUT, C, seed=70 + i) for i in range(3)]
        stored = await ctx.store_many(list(zip(kvs, seqs, strict=True)), cache_salt="tenant-x")
        assert all(r.ok and r.value is not None and r.value.written_chunks == 1 for r in stored)
        assert [r.value for r in await ctx.lookup_many(seqs, cache_salt="tenant-x")] == [C] * 3
        assert [r.value for r in await ctx.lookup_many(seqs)] == [0] * 3
        keys = [r.args[0] for r in fake.requests() if r.op in (LOOKUP, PREP_STORE)]
        assert {k["cache_salt"] for k in keys} == {"tenant-x", ""}
        back = await ctx.retrieve_many(seqs, cache_salt="tenant-x")
        assert all(same_bits(r.unwrap(), kv) for r, kv in zip(back, kvs, strict=True))  # type: ignore[arg-type]
        # the per-item timeout, not the context default: all three expire together
        for o in (LOOKUP, PREP_STORE):
            fake.on(o, lambda req, f: None, times=None)
        for call in (lambda: ctx.lookup_many(seqs, timeout=SHORT),
                     lambda: ctx.retrieve_many(seqs, timeout=SHORT, cache_salt="tenant-x"),
                     lambda: ctx.store_many(list(zip(kvs, [tokens_for(C) for _ in kvs],
                                                     strict=True)), timeout=SHORT)):
            results, exc, elapsed = await timed(call())
            assert exc is None, repr(exc)
            assert all(isinstance(r.error, lmkv.ServerTimeoutError) for r in results), results
            within(elapsed, SHORT, what="three items with timeout=SHORT, in parallel")


# ----------------------------------------------------------------------------- paged


@pytest.mark.parametrize("name", ["offset-past-end", "length-short", "fewer-slots-than-hit"])
async def test_hostile_prepare_retrieve_reply_into_blocks(fake: FakeLMCache, name: str) -> None:
    build = _bad_retrieve_replies()[name]
    nb = 2 * C // LAYOUT.block_size
    async with open_ctx(fake) as ctx:
        toks, _ = await seed_chunks(ctx, 2, seed=75)
        snap = fake.segment()
        caches = [torch.full((nb + 4, 2, 1, LAYOUT.block_size, 16), 7.0) for _ in range(1)]
        fake.on(PREP_RETRIEVE, lambda req, f: f.frames(req, build([A, B])))
        _, exc, elapsed = await timed(ctx.retrieve_blocks(toks, caches, list(range(nb))))
        assert isinstance(exc, lmkv.ProtocolError), repr(exc)
        fast(elapsed, what="a hostile reply to retrieve_blocks")
        assert bool((caches[0] == 7.0).all()), "blocks written despite an error"
        assert changed_outside(snap, fake.segment()) == []
        await fake.wait_ops(fake.last_rid("retrieve"),
                            [LOOKUP, QUERY, PREP_RETRIEVE, COMMIT_RETRIEVE, END])
        await round_trip(ctx, fake, seed=76)


@pytest.mark.parametrize("name", ["offset-past-end", "overlap-partial", "idx-out-of-range"])
async def test_hostile_prepare_store_reply_from_blocks(fake: FakeLMCache, name: str) -> None:
    reply = BAD_STORE_REPLIES[name]
    nb = 2 * C // LAYOUT.block_size
    async with open_ctx(fake) as ctx:
        before = fake.segment()
        caches = [torch.randn(nb, 2, 1, LAYOUT.block_size, 16)]
        fake.on(PREP_STORE, lambda req, f: f.frames(req, reply))
        _, exc, elapsed = await timed(ctx.store_blocks(caches, list(range(nb)),
                                                       tokens_for(2 * C, seed=77)))
        assert isinstance(exc, lmkv.ProtocolError), repr(exc)
        fast(elapsed, what="a hostile reply to store_blocks")
        assert changed_outside(before, fake.segment()) == []
        await fake.wait_ops(fake.last_rid("store"), [PREP_STORE, END])
        await round_trip(ctx, fake, seed=78)


# ----------------------------------------------------------------------------- aclose


async def test_aclose_with_operations_in_flight_on_a_silent_server(fake: FakeLMCache) -> None:
    """aclose() waits for running operations at most CLOSE_BUDGET, then cancels them and
    unregisters (at most UNREGISTER_TIMEOUT more); their callers get a typed error."""
    ctx = await open_ctx(fake, timeout=60)
    toks, kv = await seed_chunks(ctx, 1, seed=79)
    for o in sorted(VALID_OPS - {UNREGISTER}):
        fake.on(o, lambda req, f: None, times=None)
    sent = len(fake.requests())
    calls = [asyncio.create_task(ctx.lookup(toks)), asyncio.create_task(ctx.retrieve(toks)),
             asyncio.create_task(ctx.store(kv, tokens_for(C, seed=80)))]
    await eventually(lambda: len(fake.requests()) >= sent + 3, what="the three calls were sent")
    _, exc, elapsed = await timed(ctx.aclose())
    assert exc is None, repr(exc)
    within(elapsed, lmkv_session.CLOSE_BUDGET, late=SLACK, what="aclose on a silent server")
    assert ctx.closed
    # not CancelledError: these callers were never cancelled
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(o, lmkv.ClosedError) for o in outcomes), outcomes
    assert UNREGISTER in [r.op for r in fake.requests()] and not fake.registered
    with pytest.raises(lmkv.ClosedError):
        await ctx.lookup(toks)
