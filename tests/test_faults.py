"""Faults against real server processes: kill, restart, freeze, reaping, cancellation."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from servers import VERSIONS, assert_no_leaks
from test_context import LAYOUT, random_kv, same_bits, tokens_for

import lmkv_async as lmkv
from lmkv_async.testing import LocalServer

pytestmark = pytest.mark.anyio


def pending_requests(ctx: lmkv.AsyncKVContext) -> int:
    """Requests still awaiting a reply (timed-out prepare_stores kept for late replies excluded)."""
    return sum(c.in_flight - c.late_pending for c in ctx._transport.connections)


def pending_ops(ctx: lmkv.AsyncKVContext) -> list[str]:
    """Ops of the requests awaiting a reply (late-reply entries excluded)."""
    return [p.op for c in ctx._transport.connections for p in c._pending.values()
            if p.late is None]


@pytest.mark.parametrize("version", VERSIONS)
async def test_kill_fails_pending_calls_fast_then_restart_recovers(
    version: str, server_factory: Callable[..., LocalServer]
) -> None:
    server = server_factory(version, private=True)
    async with lmkv.connect(server.url, server.http_url, "faults", layout=LAYOUT,
                            timeout=30) as ctx:
        C = ctx.chunk_size
        assert ctx.transport == "shm"
        stored = [tokens_for(2 * C) for _ in range(3)]
        kvs = [random_kv(LAYOUT, 2 * C, seed=40 + i) for i in range(3)]
        for kv, toks in zip(kvs, stored, strict=True):
            await ctx.store(kv, toks)
        # Freeze so the calls are surely in flight, then SIGKILL the frozen process.
        server.freeze()
        calls = [asyncio.create_task(ctx.retrieve(t)) for t in stored]
        calls += [asyncio.create_task(ctx.store(random_kv(LAYOUT, 2 * C, seed=50 + i),
                                                tokens_for(2 * C))) for i in range(2)]
        calls.append(asyncio.create_task(ctx.lookup(stored[0])))
        await asyncio.sleep(0.3)
        assert not any(c.done() for c in calls)
        t0 = time.monotonic()
        server.kill()
        results = await asyncio.gather(*calls, return_exceptions=True)
        elapsed = time.monotonic() - t0
        assert all(isinstance(r, lmkv.ServerUnavailableError) for r in results), results
        assert elapsed < 5, f"pending calls took {elapsed:.1f}s to fail (deadline 30s)"
        assert pending_requests(ctx) == 0
        # while the server is down, a call fails with the same typed error within its deadline
        t0 = time.monotonic()
        with pytest.raises(lmkv.ServerUnavailableError):
            await ctx.lookup(stored[0], timeout=1.0)
        assert time.monotonic() - t0 < 3
        # Restart on the same ports: the context re-registers and re-maps SHM by itself.
        server.restart()
        toks = tokens_for(2 * C)
        kv = random_kv(LAYOUT, 2 * C, seed=60)
        res = await ctx.store(kv, toks)
        assert res.written_chunks == 2
        out = await ctx.retrieve(toks)
        assert out is not None and same_bits(out, kv)
        assert ctx.transport == "shm"
        assert ctx.instance_id in server.status()["registered_non_cuda_instance_ids"]
        assert await ctx.lookup(stored[0]) == 0  # the old server's cache is gone
    assert_no_leaks(server)


@pytest.mark.parametrize("version", VERSIONS)
async def test_kill_during_transfers(version: str,
                                     server_factory: Callable[..., LocalServer]) -> None:
    """SIGKILL at a random moment of a busy stream: every call ends fast, typed."""
    server = server_factory(version, private=True)
    layout = lmkv.KVLayout(num_layers=8, num_kv_heads=4, head_dim=64)  # 1 MiB per chunk
    async with lmkv.connect(server.url, server.http_url, "busy", layout=layout,
                            timeout=30) as ctx:
        C = ctx.chunk_size
        toks = tokens_for(8 * C)
        kv = random_kv(layout, 8 * C, seed=7)
        await ctx.store(kv, toks)
        stop = asyncio.Event()
        errors: list[BaseException] = []
        slowest = 0.0

        async def worker(i: int) -> None:
            nonlocal slowest
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    if i % 2:
                        out = await ctx.retrieve(toks)
                        assert out is not None and same_bits(out, kv)
                    else:
                        await ctx.store(random_kv(layout, 4 * C, seed=i), tokens_for(4 * C))
                except lmkv.ServerError as exc:
                    errors.append(exc)
                    stop.set()
                slowest = max(slowest, time.monotonic() - t0)

        workers = [asyncio.create_task(worker(i)) for i in range(4)]
        await asyncio.sleep(random.Random(version).uniform(0.3, 0.8))
        killed_at = time.monotonic()
        server.kill()
        await asyncio.wait_for(asyncio.gather(*workers), timeout=10)
        assert time.monotonic() - killed_at < 5
        assert errors and all(isinstance(e, lmkv.ServerUnavailableError) for e in errors), errors
        server.restart()
        out = await ctx.lookup(toks)
        assert out == 0
    assert_no_leaks(server)


@pytest.mark.parametrize("version", VERSIONS)
async def test_frozen_server_times_out_then_recovers(
    version: str, server_factory: Callable[..., LocalServer]
) -> None:
    server = server_factory(version, private=True)
    async with lmkv.connect(server.url, server.http_url, "frozen", layout=LAYOUT,
                            timeout=30) as ctx:
        C = ctx.chunk_size
        toks = tokens_for(2 * C)
        kv = random_kv(LAYOUT, 2 * C, seed=70)
        await ctx.store(kv, toks)
        server.freeze()
        try:
            fresh = tokens_for(2 * C)
            fresh_kv = random_kv(LAYOUT, 2 * C, seed=71)
            for call in (lambda: ctx.lookup(toks, timeout=1.0),
                         lambda: ctx.retrieve(toks, timeout=1.0),
                         lambda: ctx.store(fresh_kv, fresh, timeout=1.0)):
                t0 = time.monotonic()
                with pytest.raises(lmkv.ServerTimeoutError) as info:
                    await call()
                elapsed = time.monotonic() - t0
                assert 0.9 <= elapsed < 2.5, elapsed
                assert isinstance(info.value, TimeoutError)
                assert info.value.timeout is not None and info.value.op is not None
                # the timed-out request is gone; only background release steps may wait
                assert info.value.op not in pending_ops(ctx), pending_ops(ctx)
                assert set(pending_ops(ctx)) <= {"wait_prefetch_status", "free_lookup_locks",
                                                 "end_session", "commit_retrieve"}
        finally:
            server.resume()
        # usable again at once
        out = await ctx.retrieve(toks)
        assert out is not None and same_bits(out, kv)
        # the store whose prepare was answered late was still filled and committed
        deadline = time.monotonic() + 15
        while await ctx.lookup(fresh) != 2 * C and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        late = await ctx.retrieve(fresh)
        assert late is not None and same_bits(late, fresh_kv)
    # the release steps of the timed-out calls ran after the resume: nothing leaked
    assert_no_leaks(server, timeout=20)


async def test_idle_context_outlives_reap_timeout(
    server_factory: Callable[..., LocalServer]
) -> None:
    servers = [server_factory(v, private=True,
                              extra_args=("--worker-reap-timeout-seconds", "30"))
               for v in VERSIONS]
    ctxs = [await lmkv.connect(s.url, s.http_url, "idle", layout=LAYOUT) for s in servers]
    try:
        for ctx in ctxs:
            toks = tokens_for(ctx.chunk_size)
            await ctx.store(random_kv(LAYOUT, len(toks), seed=80), toks)
        await asyncio.sleep(40)  # idle for longer than the reap timeout
        for ctx, srv in zip(ctxs, servers, strict=True):
            assert ctx.instance_id in srv.status()["registered_non_cuda_instance_ids"]
            toks = tokens_for(ctx.chunk_size)
            kv = random_kv(LAYOUT, len(toks), seed=81)
            t0 = time.monotonic()
            assert (await ctx.store(kv, toks, timeout=5)).written_chunks == 1
            out = await ctx.retrieve(toks, timeout=5)
            assert out is not None and same_bits(out, kv)
            assert time.monotonic() - t0 < 2
    finally:
        for ctx in ctxs:
            await ctx.aclose()
    for srv in servers:
        assert_no_leaks(srv)


async def test_random_cancellation_leaves_nothing_behind(server: LocalServer) -> None:
    """Cancel many mixed operations at random points (seeded); then check the server."""
    rng = random.Random(20261202)
    layout = lmkv.KVLayout(num_layers=4, num_kv_heads=2, head_dim=64)
    async with lmkv.connect(server.url, server.http_url, "cancel", layout=layout,
                            timeout=30) as ctx:
        C = ctx.chunk_size
        prefixes = [tokens_for(rng.randint(1, 4) * C + rng.randint(0, C - 1)) for _ in range(16)]
        data = {i: random_kv(layout, len(t), seed=900 + i) for i, t in enumerate(prefixes)}
        # half the prefixes are stored up front, so retrieves have something to do
        for i in range(0, 16, 2):
            await ctx.store(data[i], prefixes[i])
        completed_stores: set[int] = set(range(0, 16, 2))

        async def one(k: int) -> tuple[str, int, Any]:
            i = rng.randrange(16)
            kind = rng.choice(["store", "retrieve", "retrieve_out", "lookup"])
            if kind == "store":
                return kind, i, await ctx.store(data[i], prefixes[i])
            if kind == "lookup":
                return kind, i, await ctx.lookup(prefixes[i])
            out = None
            if kind == "retrieve_out":
                out = torch.empty(2, layout.num_layers, len(prefixes[i]) // C * C,
                                  layout.hidden_dim, dtype=layout.dtype)
            return kind, i, await ctx.retrieve(prefixes[i], out=out)

        cancelled = 0
        for _round in range(6):
            tasks = [asyncio.create_task(one(k)) for k in range(24)]
            await asyncio.sleep(0)
            for task in tasks:
                delay = rng.choice([0.0, 0.0005, 0.002, 0.005, 0.01, 0.03])
                asyncio.get_running_loop().call_later(delay, task.cancel)
            for outcome in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(outcome, asyncio.CancelledError):
                    cancelled += 1
                    continue
                assert not isinstance(outcome, BaseException), outcome
                kind, i, value = outcome
                if kind == "store":
                    completed_stores.add(i)
                elif kind.startswith("retrieve") and value is not None:
                    assert same_bits(value, data[i][:, :, : value.shape[2]])
        assert cancelled > 20, "the schedule should cancel a good share of operations"
        await asyncio.sleep(0.5)
        assert_no_leaks(server, allowed_instance_ids=[ctx.instance_id], timeout=20)
        # every prefix reads back bit-exact (cancelled stores may or may not have landed)
        for i, toks in enumerate(prefixes):
            out = await ctx.retrieve(toks)
            if i in completed_stores:
                assert out is not None and out.shape[2] == len(toks) // C * C
            if out is not None:
                assert same_bits(out, data[i][:, :, : out.shape[2]])
    assert_no_leaks(server)


async def test_dead_request_loop_is_diagnosed(server_factory: Callable[..., LocalServer]) -> None:
    """A 0.5.2 server's ZMQ loop dies on a string op (which lmkv_async never sends) while
    HTTP stays healthy: the context says so instead of reporting bare timeouts."""
    import httpx
    import zmq

    server = server_factory("0.5.2", private=True)
    async with lmkv.connect(server.url, server.http_url, "deadloop", layout=LAYOUT, timeout=2,
                            heartbeat_interval=0.3) as ctx:
        toks = tokens_for(ctx.chunk_size)
        assert await ctx.lookup(toks) == 0
        zctx = zmq.Context()
        killer = zctx.socket(zmq.DEALER)
        killer.connect(server.url)
        killer.send_multipart([b"\x01", b"\xa4noop"])  # msgpack str "noop": fatal on 0.5.2
        killer.close(linger=2000)  # flush before closing
        zctx.term()
        await asyncio.sleep(0.5)
        with pytest.raises(lmkv.ServerTimeoutError):
            await ctx.lookup(toks, timeout=1)
        assert httpx.get(f"{server.http_url}/healthcheck").status_code == 200
        deadline = time.monotonic() + 15
        while not ctx._s.loop_dead and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        with pytest.raises(lmkv.ServerTimeoutError, match="request loop is unresponsive"):
            await ctx.lookup(toks, timeout=1)
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 5, "aclose must not wait out release deadlines"
