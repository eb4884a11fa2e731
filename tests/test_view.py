"""``ctx.retrieve_view``: zero-copy views of the server's SHM slots, against real servers.

The read lock is checked through ``/status`` (``read_locked_count``) while the
context is still registered: held inside the block, gone after every exit.
Every async test runs on asyncio and natively under trio.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable

import anyio
import pytest
import torch
from servers import assert_quiescent, checked_context
from test_context import LAYOUT, model_name, random_kv, same_bits, tokens_for
from timing import SETTLE, SLACK, eventually, fast

import lmkv_async as lmkv
from lmkv_async.testing import LocalServer

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test here runs on asyncio and natively under trio."""
    return str(request.param)


@pytest.fixture
async def ctx(server: LocalServer) -> AsyncIterator[lmkv.AsyncKVContext]:
    async with checked_context(server, model_name(), layout=LAYOUT, timeout=20) as c:
        yield c


def _shm_only(ctx: lmkv.AsyncKVContext) -> None:
    if ctx.transport != "shm":
        pytest.skip("retrieve_view needs an SHM server (the pickle case is its own test)")


async def read_locks(ctx: lmkv.AsyncKVContext) -> int:
    status = await ctx.status()
    return int(status["storage_manager"]["l1_manager"]["read_locked_count"])


async def stored(ctx: lmkv.AsyncKVContext, chunks: int, seed: int) -> tuple[list[int],
                                                                            torch.Tensor]:
    toks = tokens_for(chunks * ctx.chunk_size)
    kv = random_kv(LAYOUT, len(toks), seed=seed)
    assert (await ctx.store(kv, toks)).written_chunks == chunks
    return toks, kv


async def test_view_is_bit_exact_and_holds_the_lock_only_inside(
        ctx: lmkv.AsyncKVContext) -> None:
    _shm_only(ctx)
    C = ctx.chunk_size
    toks, kv = await stored(ctx, 3, seed=1)
    await assert_quiescent(ctx)
    async with ctx.retrieve_view(toks) as view:
        assert (view.num_tokens, view.num_chunks, view.chunk_size) == (3 * C, 3, C)
        assert await read_locks(ctx) == 3  # held while the block runs
        assert len(view.tensors) == 3
        for i, t in enumerate(view.tensors):
            assert isinstance(t, lmkv.ViewTensor)
            assert tuple(t.shape) == (2, LAYOUT.num_layers, C, LAYOUT.hidden_dim)
            assert t.dtype == LAYOUT.dtype
            assert same_bits(t, kv[:, :, i * C:(i + 1) * C])
        out = torch.zeros((2, LAYOUT.num_layers, 4 * C, LAYOUT.hidden_dim), dtype=LAYOUT.dtype)
        got = await view.copy_to(out)
        assert same_bits(got, kv)
        assert not out[:, :, 3 * C:].view(torch.int16).any()  # past the hit: untouched
        cat = torch.cat(view.tensors, dim=2)  # owns its memory: a plain tensor
        assert type(cat) is torch.Tensor and same_bits(cat, kv)
    await assert_quiescent(ctx)
    assert same_bits(got, kv) and same_bits(cat, kv)  # copies outlive the block


async def test_views_raise_after_the_block(ctx: lmkv.AsyncKVContext) -> None:
    _shm_only(ctx)
    toks, kv = await stored(ctx, 2, seed=2)
    async with ctx.retrieve_view(toks) as view:
        t = view.tensors[1]
        sub = t[0, 1:]  # a view of a view: still guarded
        reshaped = t.view(-1)
        assert isinstance(sub, lmkv.ViewTensor) and isinstance(reshaped, lmkv.ViewTensor)
        copy = t.clone()
        assert type(copy) is torch.Tensor
    assert view.closed
    await assert_quiescent(ctx)
    for use in (lambda: t.sum(), lambda: sub.clone(), lambda: reshaped[0],
                lambda: torch.equal(t, copy), lambda: copy.copy_(t), lambda: t + 1,
                lambda: view.tensors):
        with pytest.raises(lmkv.ViewClosedError, match="block has ended"):
            use()
    with pytest.raises(lmkv.ViewClosedError):
        await view.copy_to(torch.empty_like(kv))
    assert isinstance(lmkv.ViewClosedError("x"), lmkv.ClosedError)
    assert same_bits(copy, kv[:, :, ctx.chunk_size:])


async def test_views_are_read_only(ctx: lmkv.AsyncKVContext) -> None:
    _shm_only(ctx)
    toks, kv = await stored(ctx, 1, seed=3)
    async with ctx.retrieve_view(toks) as view:
        t = view.tensors[0]
        for write in (lambda: t.add_(1), lambda: t.zero_(), lambda: t[0].fill_(0),
                      lambda: t.__setitem__((0, 0), 0),
                      lambda: torch.add(t, t, out=t), lambda: t.copy_(torch.zeros_like(t))):
            with pytest.raises(lmkv.InvalidInputError, match="read-only"):
                write()
        assert same_bits(t, kv)  # nothing was written
        dst = torch.empty_like(kv)
        dst.copy_(t)  # reading into a plain tensor is fine
        assert same_bits(dst, kv)


async def test_lock_released_when_the_block_raises(ctx: lmkv.AsyncKVContext) -> None:
    _shm_only(ctx)
    toks, kv = await stored(ctx, 2, seed=4)
    with pytest.raises(ZeroDivisionError):
        async with ctx.retrieve_view(toks) as view:
            assert await read_locks(ctx) == 2
            t = view.tensors[0]
            _ = 1 / 0
    await assert_quiescent(ctx)
    with pytest.raises(lmkv.ViewClosedError):
        t.sum()
    # and the data is still cached and intact
    out = await ctx.retrieve(toks)
    assert out is not None and same_bits(out, kv)


async def test_lock_released_when_the_block_is_cancelled(ctx: lmkv.AsyncKVContext) -> None:
    _shm_only(ctx)
    toks, kv = await stored(ctx, 2, seed=5)
    inside = anyio.Event()
    views: list[lmkv.RetrieveView] = []
    ended: list[str] = []

    async def reader() -> None:
        try:
            async with ctx.retrieve_view(toks) as view:
                views.append(view)
                inside.set()
                await anyio.sleep(3600)
        except anyio.get_cancelled_exc_class():
            ended.append("cancelled")  # the cancellation left the block: not swallowed
            raise
        ended.append("returned")

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        with anyio.fail_after(SETTLE):
            await inside.wait()
        assert await read_locks(ctx) == 2
        tg.cancel_scope.cancel()
    assert ended == ["cancelled"]
    assert views[0].closed
    await assert_quiescent(ctx)
    out = await ctx.retrieve(toks)
    assert out is not None and same_bits(out, kv)


@pytest.mark.parametrize("delay", [0.0, 0.0005, 0.002, 0.005])
async def test_cancelled_while_opening_leaves_nothing(ctx: lmkv.AsyncKVContext,
                                                      delay: float) -> None:
    """Cancellation at different points of the open (lookup, prepare, hand-over)."""
    _shm_only(ctx)
    toks, _ = await stored(ctx, 2, seed=6)
    returned = False

    async def reader() -> None:
        nonlocal returned
        async with ctx.retrieve_view(toks):
            await anyio.sleep(3600)
        returned = True

    async with anyio.create_task_group() as tg:  # re-raises anything but the cancellation
        tg.start_soon(reader)
        await anyio.sleep(delay)
        tg.cancel_scope.cancel()
    assert not returned, "the cancellation was swallowed"
    await assert_quiescent(ctx)


async def test_partial_hit_and_miss(ctx: lmkv.AsyncKVContext) -> None:
    _shm_only(ctx)
    C = ctx.chunk_size
    toks, kv = await stored(ctx, 2, seed=7)
    longer = toks + tokens_for(2 * C) + [1, 2, 3]  # 2 uncached chunks and a partial one
    async with ctx.retrieve_view(longer) as view:
        assert (view.num_tokens, len(view.tensors)) == (2 * C, 2)
        assert await read_locks(ctx) == 2
        assert same_bits(torch.cat(view.tensors, dim=2), kv)
    await assert_quiescent(ctx)
    async with ctx.retrieve_view(tokens_for(3 * C)) as miss:
        assert (miss.num_tokens, miss.tensors) == (0, ())
        out = torch.empty((2, LAYOUT.num_layers, C, LAYOUT.hidden_dim), dtype=LAYOUT.dtype)
        assert (await miss.copy_to(out)).shape[2] == 0
    async with ctx.retrieve_view(toks[: C - 1]) as short:  # under one chunk: nothing sent
        assert short.num_tokens == 0
    await assert_quiescent(ctx)


async def test_views_of_several_prefixes_at_once(ctx: lmkv.AsyncKVContext) -> None:
    _shm_only(ctx)
    (ta, ka), (tb, kb) = await stored(ctx, 1, seed=8), await stored(ctx, 2, seed=9)
    tc, kc = await stored(ctx, 1, seed=11)
    same: list[torch.Tensor | None] = []
    same_done = anyio.Event()

    async def retrieve_same() -> None:
        same.append(await ctx.retrieve(ta))
        same_done.set()

    async with anyio.create_task_group() as tg:
        async with ctx.retrieve_view(ta) as va, ctx.retrieve_view(tb) as vb:
            assert await read_locks(ctx) == 3
            assert same_bits(va.tensors[0], ka)
            assert same_bits(torch.cat(vb.tensors, dim=2), kb)
            # a plain retrieve of another prefix runs meanwhile
            out = await ctx.retrieve(tc)
            assert out is not None and same_bits(out, kc)
            # one of the same prefix waits for the view (pending reads are keyed by prefix)
            tg.start_soon(retrieve_same)
            await anyio.sleep(0.2)
            assert not same_done.is_set()
        with anyio.fail_after(SETTLE):
            await same_done.wait()
    got = same[0]
    assert got is not None and same_bits(got, ka)
    await assert_quiescent(ctx)


async def test_non_shm_context_raises_before_traffic(
        server: LocalServer, monkeypatch: pytest.MonkeyPatch) -> None:
    if server.config.shm:
        pytest.skip("pickle servers only")
    async with checked_context(server, model_name(), layout=LAYOUT, timeout=20) as ctx:
        with monkeypatch.context() as m:
            m.setattr(ctx._transport, "pick", lambda: pytest.fail("traffic sent"))
            with pytest.raises(lmkv.TransportUnavailableError, match="SHM"):
                ctx.retrieve_view(tokens_for(ctx.chunk_size))  # raises before it is entered


async def test_long_hold_warns_then_views_raise(
        server_factory: Callable[..., LocalServer], caplog: pytest.LogCaptureFixture) -> None:
    """A server with a 2 s read TTL: the view knows it, warns at 0.9 of it, raises past it."""
    server = server_factory("0.5.6", extra_args=("--l1-read-ttl-seconds", "2"))
    async with checked_context(server, model_name(), layout=LAYOUT, timeout=20) as ctx:
        assert ctx._s.read_ttl == 2.0
        toks, kv = await stored(ctx, 1, seed=10)
        caplog.set_level(logging.WARNING, logger="lmkv_async")
        async with ctx.retrieve_view(toks) as view:
            assert view.safe_hold_s == pytest.approx(1.8)
            t = view.tensors[0]
            assert same_bits(t, kv)
            await eventually(lambda: "past the safe hold" in caplog.text, SETTLE,
                             what="the safe-hold warning")
            await eventually(lambda: view.held_s >= 2.0, SETTLE, what="held for the 2 s TTL")
            with pytest.raises(lmkv.ViewClosedError, match="TTL"):
                t.sum()
        await assert_quiescent(ctx)


async def test_aclose_inside_the_block_closes_the_view(server: LocalServer) -> None:
    """aclose() ends an open view first (its release steps run, nothing is left on the
    server), then unmaps the pool: the tensors raise instead of touching unmapped memory."""
    if not server.config.shm:
        pytest.skip("SHM servers only")
    async with checked_context(server, model_name(), layout=LAYOUT, timeout=20) as ctx:
        toks, kv = await stored(ctx, 1, seed=12)
        async with ctx.retrieve_view(toks) as view:
            t = view.tensors[0]
            assert same_bits(t, kv)
            t0 = time.monotonic()
            await ctx.aclose()
            fast(time.monotonic() - t0, limit=SLACK, what="aclose with a view open")
            assert view.closed
            with pytest.raises(lmkv.ViewClosedError, match="context was closed"):
                t.sum()
    # checked_context then finds the server clean (no session, lock or registration)
