"""KV straight into GPU memory: CUDA outputs, sources and paged GPU caches (lmkv_async.cuda).

Marked ``gpu`` and skipped at collection on machines without CUDA, so CPU CI
reports one skipped module, never passing tests; ``nox -s gpu`` runs them on a
CUDA machine.

The server is ``fake_lmcache.FakeLMCache`` (its ``fake`` fixture): a real ZMQ
ROUTER + HTTP server that keeps chunk objects in a real POSIX SHM segment in the
layout lmcache 0.5.6 uses (C-order ``[2, L, C, D]`` objects at slot offsets, protocol
reference §6.3). A real lmcache server is used by
``test_real_server_round_trip`` where a server environment exists
(``LMKV_LMCACHE_PYTHON_056``) and the machine has CUDA.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import secrets
import time
from collections.abc import Callable
from multiprocessing import shared_memory
from types import SimpleNamespace
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device: run `nox -s gpu` (or pytest -m gpu) on a GPU machine",
                allow_module_level=True)

import fake_lmcache as fl
from fake_lmcache import COMMIT_RETRIEVE, PREP_RETRIEVE, FakeLMCache, open_ctx
from test_context import random_kv, same_bits, tokens_for

import lmkv_async as lmkv
from lmkv_async import _cuda_transfers as gpu_transfers
from lmkv_async import cuda as lmkv_cuda
from lmkv_async import kernel
from lmkv_async.shm import PoolMapping
from lmkv_async.testing import find_server_python

pytestmark = [pytest.mark.gpu, pytest.mark.anyio, pytest.mark.usefixtures("short_cleanup")]

C = fl.C
LAYOUT = fl.LAYOUT
DEV = torch.device("cuda", 0)


def gpu_bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return same_bits(a.cpu(), b.cpu())


async def seeded(ctx: lmkv.AsyncKVContext, chunks: int, seed: int
                 ) -> tuple[list[int], torch.Tensor]:
    toks = tokens_for(chunks * C, seed=30_000 + seed)
    kv = random_kv(LAYOUT, chunks * C, seed=seed)
    assert (await ctx.store(kv, toks)).written_chunks == chunks
    return toks, kv


# ----------------------------------------------------------------------------- dense


async def test_retrieve_into_cuda_out_is_bit_exact(fake: FakeLMCache) -> None:
    async with open_ctx(fake) as ctx:
        toks, kv = await seeded(ctx, 3, seed=1)
        out = torch.full((2, LAYOUT.num_layers, 4 * C, LAYOUT.hidden_dim), -7.0, device=DEV)
        view = await ctx.retrieve([*toks, 1, 2, 3], out=out)
        assert view is not None and view.device == DEV
        assert view.data_ptr() == out.data_ptr() and view.shape[2] == 3 * C
        assert gpu_bits_equal(view, kv)
        assert bool((out[:, :, 3 * C:] == -7.0).all()), "wrote past the hit"
        snap = ctx.stats()["gpu"]
        assert snap["path"] == "registered" and snap["fallback_reason"] is None
        assert snap["registered_bytes"] == fl.POOL and snap["bytes_h2d"] == 3 * fl.SLOT
        # a miss leaves out untouched and returns None
        out.fill_(-7.0)
        assert await ctx.retrieve(tokens_for(C, seed=99), out=out) is None
        assert bool((out == -7.0).all())


async def test_store_from_cuda_is_bit_exact(fake: FakeLMCache) -> None:
    async with open_ctx(fake) as ctx:
        toks = tokens_for(2 * C + 5, seed=2)
        kv = random_kv(LAYOUT, len(toks), seed=2)
        res = await ctx.store(kv.to(DEV), toks)
        assert (res.total_chunks, res.written_chunks, res.ignored_tokens) == (2, 2, 5)
        assert same_bits(fake.read_slot(fl.GUARD), kv[:, :, :C])
        assert same_bits(fake.read_slot(fl.GUARD + fl.SLOT), kv[:, :, C:2 * C])
        back = await ctx.retrieve(toks)  # CPU path reads what the GPU path wrote
        assert back is not None and same_bits(back, kv[:, :, :2 * C])
        assert ctx.stats()["gpu"]["bytes_d2h"] == 2 * fl.SLOT


async def test_store_sees_work_queued_on_the_callers_stream(fake: FakeLMCache) -> None:
    async with open_ctx(fake) as ctx:
        toks = tokens_for(2 * C, seed=3)
        kv = random_kv(LAYOUT, len(toks), seed=3).to(DEV)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            src = torch.zeros_like(kv)
            torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time ahead of the fill
            src.copy_(kv)
            assert (await ctx.store(src, toks)).written_chunks == 2
        back = await ctx.retrieve(toks)
        assert back is not None and gpu_bits_equal(back, kv)


async def test_retrieve_many_into_cuda_outs(fake: FakeLMCache) -> None:
    async with open_ctx(fake) as ctx:
        items = [await seeded(ctx, 1 + i % 2, seed=10 + i) for i in range(4)]
        outs = [torch.empty((2, LAYOUT.num_layers, 2 * C, LAYOUT.hidden_dim), device=DEV)
                for _ in items]
        res = await ctx.retrieve_many([t for t, _ in items], outs=outs)
        for r, (_, kv) in zip(res, items, strict=True):
            assert r.error is None and r.value is not None and gpu_bits_equal(r.value, kv)


async def test_validation_is_the_cpu_paths(fake: FakeLMCache) -> None:
    async with open_ctx(fake) as ctx:
        toks, _ = await seeded(ctx, 1, seed=20)
        bad_dtype = torch.empty((2, LAYOUT.num_layers, C, LAYOUT.hidden_dim),
                                dtype=torch.float16, device=DEV)
        with pytest.raises(lmkv.LayoutMismatchError):
            await ctx.retrieve(toks, out=bad_dtype)
        short = torch.empty((2, LAYOUT.num_layers, C - 1, LAYOUT.hidden_dim), device=DEV)
        with pytest.raises(lmkv.LayoutMismatchError):
            await ctx.retrieve(toks, out=short)
        aliased = torch.empty((2, LAYOUT.num_layers, 1, LAYOUT.hidden_dim),
                              device=DEV).expand(2, LAYOUT.num_layers, C, LAYOUT.hidden_dim)
        with pytest.raises(lmkv.LayoutMismatchError):
            await ctx.retrieve(toks, out=aliased)


# ----------------------------------------------------------------------------- paged


def _caches(nb: int, fill: float = 0.0) -> list[torch.Tensor]:
    shape = (nb, 2, LAYOUT.num_kv_heads, LAYOUT.block_size, LAYOUT.head_dim)
    return [torch.full(shape, fill, dtype=LAYOUT.dtype, device=DEV)
            for _ in range(LAYOUT.num_layers)]


async def test_paged_gpu_round_trip(fake: FakeLMCache) -> None:
    async with open_ctx(fake) as ctx:
        n = 2 * C
        nblk = n // LAYOUT.block_size
        g = torch.Generator().manual_seed(5)
        src_ids = torch.randperm(nblk + 7, generator=g)[:nblk].tolist()
        kv = random_kv(LAYOUT, n, seed=5)
        src = _caches(nblk + 7)
        cpu_src = [c.cpu() for c in src]
        kernel.dense_to_paged(kv, cpu_src, src_ids)
        for c, cc in zip(src, cpu_src, strict=True):
            c.copy_(cc)
        toks = tokens_for(n, seed=6)
        assert (await ctx.store_blocks(src, src_ids, toks)).written_chunks == 2
        assert same_bits(fake.read_slot(fl.GUARD), kv[:, :, :C])
        dst_ids = list(reversed(range(3, 3 + nblk)))
        dst = _caches(nblk + 5, fill=-1.0)
        assert await ctx.retrieve_blocks(toks, dst, dst_ids) == n
        packed = torch.empty_like(kv)
        kernel.paged_to_dense(packed, [c.cpu() for c in dst], dst_ids)
        assert same_bits(packed, kv)
        untouched = [b for b in range(nblk + 5) if b not in dst_ids]
        for c in dst:
            assert bool((c[untouched] == -1.0).all()), "blocks outside the table written"


# ----------------------------------------------------------------------------- fallback


async def test_staging_fallback_is_visible_and_exact(fake: FakeLMCache,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("LMKV_CUDA_REGISTER", "0")
    monkeypatch.setattr(gpu_transfers, "STAGING_BUFFERS", 2)  # wrap the ring
    caplog.set_level(logging.WARNING, "lmkv_async.cuda")
    async with open_ctx(fake) as ctx:
        toks = tokens_for(5 * C, seed=7)
        kv = random_kv(LAYOUT, len(toks), seed=7)
        assert (await ctx.store(kv.to(DEV), toks)).written_chunks == 5
        out = await ctx.retrieve(toks, out=torch.empty(kv.shape, device=DEV))
        assert out is not None and gpu_bits_equal(out, kv)
        snap = ctx.stats()["gpu"]
        assert snap["path"] == "staging" and snap["fallback_reason"] == "LMKV_CUDA_REGISTER=0"
        assert snap["staged_transfers"] == 2 and snap["registered_bytes"] == 0
        assert any("staging ring" in r.getMessage() for r in caplog.records)


async def test_inline_server_with_cuda_tensors(fake_factory: Callable[..., FakeLMCache]) -> None:
    fake = fake_factory(shm=False)
    async with open_ctx(fake) as ctx:
        assert ctx.transport == "pickle"
        toks = tokens_for(2 * C, seed=8)
        kv = random_kv(LAYOUT, len(toks), seed=8)
        assert (await ctx.store(kv.to(DEV), toks)).written_chunks == 2
        out = await ctx.retrieve(toks, out=torch.empty(kv.shape, device=DEV))
        assert out is not None and gpu_bits_equal(out, kv)


# ----------------------------------------------------------------------------- cancellation


async def test_cancel_waits_for_queued_copies_before_commit(
        fake: FakeLMCache, monkeypatch: pytest.MonkeyPatch) -> None:
    done_at: list[float] = []
    real_wait = gpu_transfers.wait_event

    async def slow_wait(ev: torch.cuda.Event, nbytes: int, rate: float,
                        started: float | None = None) -> None:
        try:
            await real_wait(ev, nbytes, rate, started)
        finally:
            done_at.append(time.monotonic())

    real_enqueue = lmkv_cuda.GpuTransfers._enqueue

    def slow_enqueue(self: Any, copy: Any, work: Any, stream: Any, use_staging: Any) -> Any:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU time queued before the copies
        return real_enqueue(self, copy, work, stream, use_staging)

    async with open_ctx(fake) as ctx:
        toks, kv = await seeded(ctx, 2, seed=9)
        monkeypatch.setattr(gpu_transfers, "wait_event", slow_wait)
        monkeypatch.setattr(lmkv_cuda.GpuTransfers, "_enqueue", slow_enqueue)
        out = torch.zeros(kv.shape, device=DEV)
        task = asyncio.create_task(ctx.retrieve(toks, out=out))
        while not any(r.op == PREP_RETRIEVE for r in fake.requests()):
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        rid = fake.last_rid("retrieve")
        await fake.wait_ops(rid, [fl.LOOKUP, fl.QUERY, PREP_RETRIEVE, COMMIT_RETRIEVE, fl.END])
        commit = next(r for r in fake.requests() if r.rid == rid and r.op == COMMIT_RETRIEVE)
        assert done_at and commit.t >= done_at[0], "read lock released before the copy ended"
        torch.cuda.synchronize()
        assert gpu_bits_equal(out, kv)  # the queued copy completed


async def test_cancelled_operation_task_waits_for_its_copies(
        fake: FakeLMCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """What aclose() does to an operation it gave up on: cancel the operation's own task,
    here while the worker is still queueing copies. The release steps wait for them."""
    done_at: list[float] = []
    real_wait = gpu_transfers.wait_event

    async def timed_wait(ev: torch.cuda.Event, nbytes: int, rate: float,
                         started: float | None = None) -> None:
        try:
            await real_wait(ev, nbytes, rate, started)
        finally:
            done_at.append(time.monotonic())

    real_enqueue = lmkv_cuda.GpuTransfers._enqueue

    def slow_enqueue(self: Any, copy: Any, work: Any, stream: Any, use_staging: Any) -> Any:
        time.sleep(0.1)  # still queueing when the task is cancelled
        with torch.cuda.stream(stream):
            torch.cuda._sleep(400_000_000)
        return real_enqueue(self, copy, work, stream, use_staging)

    async with open_ctx(fake) as ctx:
        toks, kv = await seeded(ctx, 2, seed=19)
        monkeypatch.setattr(gpu_transfers, "wait_event", timed_wait)
        monkeypatch.setattr(lmkv_cuda.GpuTransfers, "_enqueue", slow_enqueue)
        out = torch.zeros(kv.shape, device=DEV)
        caller = asyncio.create_task(ctx.retrieve(toks, out=out))
        while not any(r.op == PREP_RETRIEVE for r in fake.requests()):
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.03)
        ops = [t for t in ctx._s._tasks if t.name == "lmkv-op"]  # the retrieve's job
        assert len(ops) == 1
        ops[0].cancel()
        with pytest.raises((asyncio.CancelledError, lmkv.ClosedError)):
            await caller
        rid = fake.last_rid("retrieve")
        await fake.wait_ops(rid, [fl.LOOKUP, fl.QUERY, PREP_RETRIEVE, COMMIT_RETRIEVE, fl.END])
        commit = next(r for r in fake.requests() if r.rid == rid and r.op == COMMIT_RETRIEVE)
        assert done_at and commit.t >= done_at[0], "read lock released before the copy ended"
        assert gpu_bits_equal(out, kv)


# ----------------------------------------------------------------------------- registration


def _pool_file(nbytes: int) -> shared_memory.SharedMemory:
    return shared_memory.SharedMemory(name=f"lmkv_gpu_{os.getpid()}_{secrets.token_hex(4)}",
                                      create=True, size=nbytes)


async def test_registration_lifecycle_on_a_pool_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """The transfer path against a pool file in the server's slot layout, without a
    server: register once, retire (remap) -> unregister, close -> unregister before
    unmap."""
    calls: list[str] = []
    real_reg = lmkv_cuda.HostRegistration.register
    real_unreg = lmkv_cuda.HostRegistration.unregister

    def reg(self: Any) -> Any:
        calls.append(f"register {self.address:#x}")
        return real_reg(self)

    def unreg(self: Any) -> None:
        if self.registered:
            calls.append(f"unregister {self.address:#x}")
        real_unreg(self)

    monkeypatch.setattr(lmkv_cuda.HostRegistration, "register", reg)
    monkeypatch.setattr(lmkv_cuda.HostRegistration, "unregister", unreg)
    seg = _pool_file(8 * fl.SLOT)
    try:
        kv = random_kv(LAYOUT, 2 * C, seed=11)
        pool = PoolMapping(seg.name, seg.size)
        # chunk objects at 4 KiB-aligned slot offsets, C-order [2, L, C, D]
        offsets = [5 * fl.SLOT, fl.SLOT]
        for i, off in enumerate(offsets):
            chunk = kv[:, :, i * C:(i + 1) * C].contiguous()
            seg.buf[off:off + fl.SLOT] = ctypes.string_at(chunk.data_ptr(), fl.SLOT)
        session = SimpleNamespace(pool=pool, _retired_pools=[], gpu=None)
        result: list[torch.Tensor] = []
        out = torch.empty(kv.shape, device=DEV)
        sink = lmkv_cuda.dense_sink(session, out, C, result)
        chunks = [(i, pool.address + off) for i, off in enumerate(offsets)]
        await sink.run(2, chunks, pool.region, nbytes=2 * fl.SLOT)
        assert gpu_bits_equal(result[0], kv)
        await lmkv_cuda.dense_sink(session, out, C, []).run(2, chunks, pool.region, nbytes=0)
        assert calls == [f"register {pool.address:#x}"], "registered more than once"
        # out-of-pool slot: the CPU path's bounds check, nothing copied
        with pytest.raises(lmkv.CopyBoundsError):
            await sink.run(1, [(0, pool.address + seg.size - 8)], pool.region, nbytes=0)
        # a remap retires the mapping: unregistered (in the background), then unmapped
        gpu = session.gpu
        session._retired_pools.append(pool)
        session.pool = None
        gpu.retire(pool)
        await gpu.aclose()
        assert calls[-1] == f"unregister {pool.address:#x}"
        pool.close()
    finally:
        seg.close()
        seg.unlink()


async def test_close_unregisters_before_unmapping(fake: FakeLMCache,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    real_unreg = lmkv_cuda.HostRegistration.unregister
    real_close = PoolMapping.close

    def unreg(self: Any) -> None:
        if self.registered:
            order.append("unregister")
        real_unreg(self)

    def close(self: PoolMapping) -> None:
        if not self._closed:
            order.append("munmap")
        real_close(self)

    monkeypatch.setattr(lmkv_cuda.HostRegistration, "unregister", unreg)
    monkeypatch.setattr(PoolMapping, "close", close)
    async with open_ctx(fake) as ctx:
        toks, kv = await seeded(ctx, 1, seed=12)
        out = await ctx.retrieve(toks, out=torch.empty(kv.shape, device=DEV))
        assert out is not None
    assert order == ["unregister", "munmap"]


# ----------------------------------------------------------------------------- loop


async def test_event_loop_keeps_ticking_during_a_large_transfer(
        fake_factory: Callable[..., FakeLMCache], monkeypatch: pytest.MonkeyPatch) -> None:
    slots = 64
    fake = fake_factory(pool_size=fl.GUARD + slots * fl.SLOT)
    async with open_ctx(fake) as ctx:
        toks, kv = await seeded(ctx, slots, seed=13)
        out = torch.empty(kv.shape, device=DEV)
        await ctx.retrieve(toks, out=out)  # registers the pool
        gaps: list[float] = []
        stop = False

        async def tick() -> None:
            last = time.perf_counter()
            while not stop:
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.01)
        gaps.clear()
        for _ in range(5):
            assert await ctx.retrieve(toks, out=out) is not None
            assert (await ctx.store(out, toks)).written_chunks == 0
        stop = True
        await ticker
        assert gpu_bits_equal(out, kv)
        assert max(gaps) < 0.005 + fl.SLACK / 10, f"loop stalled {max(gaps) * 1e3:.1f} ms"


# ----------------------------------------------------------------------------- real server


async def test_real_server_round_trip(server_factory: Callable[..., Any]) -> None:
    if find_server_python("0.5.6") is None:
        pytest.skip("no lmcache 0.5.6 server environment (LMKV_LMCACHE_PYTHON_056)")
    srv = server_factory("0.5.6", extra_args=("--no-l1-use-lazy",))
    layout = lmkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                           block_size=16)
    async with lmkv.connect(srv.url, srv.http_url, f"gpu-{secrets.token_hex(3)}",
                            layout=layout, heartbeat_interval=0) as ctx:
        assert ctx.transport == "shm"
        toks = tokens_for(3 * ctx.chunk_size, seed=14)
        kv = random_kv(layout, len(toks), seed=14).to(DEV)
        assert (await ctx.store(kv, toks)).written_chunks == 3
        out = await ctx.retrieve(toks, out=torch.empty_like(kv))
        assert out is not None and gpu_bits_equal(out, kv)
        assert ctx.stats()["gpu"]["path"] in ("registered", "staging")
