"""Faults against real server processes: kill, restart, freeze, reaping, cancellation.

Every async test runs on asyncio and natively under trio; the
random-cancellation test cuts with cancel scopes on both, and with a plain
``Task.cancel`` on asyncio as well.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import pytest
import torch
from servers import VERSIONS, assert_quiescent, checked_context
from test_context import LAYOUT, random_kv, same_bits, tokens_for
from timing import EARLY, SETTLE, SLACK, eventually, fast, timed, within

import lmkv_async as lmkv
from lmkv_async._session import heartbeat_interval_for
from lmkv_async.testing import LocalServer

pytestmark = pytest.mark.anyio

T = TypeVar("T")


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test here runs on asyncio and natively under trio."""
    return str(request.param)





def pending_requests(ctx: lmkv.AsyncKVContext) -> int:
    """Requests still awaiting a reply (timed-out prepare_stores kept for late replies excluded)."""
    return sum(c.in_flight - c.late_pending for c in ctx._transport.connections)


def pending_ops(ctx: lmkv.AsyncKVContext) -> list[str]:
    """Ops of the requests awaiting a reply (late-reply entries excluded)."""
    return [p.op for c in ctx._transport.connections for p in c._pending.values()
            if p.late is None]


async def reconnected(ctx: lmkv.AsyncKVContext) -> None:
    """Wait for ZMQ to reconnect after a restart (its retry interval backs off to 1 s).

    A call made before that fails with ServerUnavailableError once the reconnect grace,
    counted from the disconnect, is over; that is the documented behaviour.
    """
    await eventually(lambda: all(c.connected for c in ctx._transport.connections),
                     what="the context's sockets reconnect")


@pytest.mark.parametrize("version", VERSIONS)
async def test_kill_fails_pending_calls_fast_then_restart_recovers(
    version: str, server_factory: Callable[..., LocalServer]
) -> None:
    server = server_factory(version, private=True)
    async with checked_context(server, "faults", layout=LAYOUT, timeout=30) as ctx:
        C = ctx.chunk_size
        assert ctx.transport == "shm"
        stored = [tokens_for(2 * C) for _ in range(3)]
        kvs = [random_kv(LAYOUT, 2 * C, seed=40 + i) for i in range(3)]
        for kv, toks in zip(kvs, stored, strict=True):
            await ctx.store(kv, toks)
        await assert_quiescent(ctx)  # the stores' end_session steps are done, too
        # Freeze so the calls are surely in flight, then SIGKILL the frozen process.
        server.freeze()
        calls: list[Callable[[], Any]] = [lambda t=t: ctx.retrieve(t) for t in stored]
        calls += [lambda i=i: ctx.store(random_kv(LAYOUT, 2 * C, seed=50 + i),
                                        tokens_for(2 * C)) for i in range(2)]
        calls.append(lambda: ctx.lookup(stored[0]))
        results: list[Any] = [None] * len(calls)
        done = [False] * len(calls)

        async def call(i: int) -> None:
            try:
                results[i] = await calls[i]()
            except Exception as exc:  # as gather(return_exceptions=True): judged below
                results[i] = exc
            done[i] = True

        async with anyio.create_task_group() as tg:
            for i in range(len(calls)):
                tg.start_soon(call, i)
            # each call's first request is on the wire (and unanswered) before the kill;
            # the query follows a lookup unanswered where the server's normal pool is one
            # thread
            queries = ["query_prefetch_status"] * 4 if ctx._s.pipelines_lookup_query else []
            expected = sorted(["lookup"] * 4 + ["prepare_store"] * 2 + queries)
            await eventually(
                lambda: sorted(op for op in pending_ops(ctx) if op != "ping") == expected,
                what=lambda: f"{expected} pending, not {pending_ops(ctx)}")
            assert not any(done)
            t0 = time.monotonic()
            server.kill()
        elapsed = time.monotonic() - t0
        assert all(done)
        assert all(isinstance(r, lmkv.ServerUnavailableError) for r in results), results
        fast(elapsed, limit=2 * SLACK, what="pending calls failing after a kill (deadline 30s)")
        assert pending_requests(ctx) == 0
        # while the server is down, a call fails with the same typed error within its deadline
        _, exc, elapsed = await timed(ctx.lookup(stored[0], timeout=1.0))
        assert isinstance(exc, lmkv.ServerUnavailableError), repr(exc)
        fast(elapsed, limit=1.0 + SLACK, what="a call against a dead server, timeout 1s")
        # Restart on the same ports: the context re-registers and re-maps SHM by itself.
        server.restart()
        await reconnected(ctx)
        toks = tokens_for(2 * C)
        kv = random_kv(LAYOUT, 2 * C, seed=60)
        res = await ctx.store(kv, toks)
        assert res.written_chunks == 2
        out = await ctx.retrieve(toks)
        assert out is not None and same_bits(out, kv)
        assert ctx.transport == "shm"
        assert ctx.instance_id in server.status()["registered_non_cuda_instance_ids"]
        assert await ctx.lookup(stored[0]) == 0  # the old server's cache is gone


@pytest.mark.parametrize("version", VERSIONS)
async def test_kill_during_transfers(version: str,
                                     server_factory: Callable[..., LocalServer]) -> None:
    """SIGKILL at a random moment of a busy stream: every call ends fast, typed."""
    server = server_factory(version, private=True)
    layout = lmkv.KVLayout(num_layers=8, num_kv_heads=4, head_dim=64)  # 1 MiB per chunk
    async with checked_context(server, "busy", layout=layout, timeout=30) as ctx:
        C = ctx.chunk_size
        toks = tokens_for(8 * C)
        kv = random_kv(layout, 8 * C, seed=7)
        await ctx.store(kv, toks)
        stop = anyio.Event()
        errors: list[BaseException] = []
        slowest = 0.0
        finished = 0

        ended = 0
        all_ended = anyio.Event()

        async def worker(i: int) -> None:
            nonlocal ended
            try:
                await work(i)
            finally:
                ended += 1
                if ended == 4:
                    all_ended.set()

        async def work(i: int) -> None:
            nonlocal slowest, finished
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
                else:
                    finished += 1
                slowest = max(slowest, time.monotonic() - t0)

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(worker, i)
            # the stream is running (some calls done), then the kill lands at a random moment
            await eventually(lambda: finished >= 4, what="4 transfers done before the kill")
            await anyio.sleep(random.Random(version).uniform(0.0, 0.3))
            killed_at = time.monotonic()
            server.kill()
            with anyio.fail_after(10 * SLACK):
                await all_ended.wait()
        fast(time.monotonic() - killed_at, limit=2 * SLACK, what="workers ending after a kill")
        assert errors and all(isinstance(e, lmkv.ServerUnavailableError) for e in errors), errors
        server.restart()
        await reconnected(ctx)
        out = await ctx.lookup(toks)
        assert out == 0


@pytest.mark.parametrize("version", VERSIONS)
async def test_frozen_server_times_out_then_recovers(
    version: str, server_factory: Callable[..., LocalServer]
) -> None:
    server = server_factory(version, private=True)
    async with checked_context(server, "frozen", layout=LAYOUT, timeout=30) as ctx:
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
                _, exc, elapsed = await timed(call())
                assert isinstance(exc, lmkv.ServerTimeoutError), repr(exc)
                within(elapsed, 1.0, what="timeout=1.0 against a frozen server")
                assert isinstance(exc, TimeoutError)
                assert exc.timeout is not None and exc.op is not None
                # the timed-out request is gone; only background release steps may wait
                assert exc.op not in pending_ops(ctx), pending_ops(ctx)
                assert set(pending_ops(ctx)) <= {"wait_prefetch_status", "free_lookup_locks",
                                                 "end_session", "commit_retrieve"}
        finally:
            server.resume()
        # usable again at once
        out = await ctx.retrieve(toks)
        assert out is not None and same_bits(out, kv)
        # the store whose prepare was answered late was still filled and committed
        async def stored() -> bool:
            return await ctx.lookup(fresh) == 2 * C

        await eventually(stored, timeout=2 * SETTLE, interval=0.2, what="late store landed")
        late = await ctx.retrieve(fresh)
        assert late is not None and same_bits(late, fresh_kv)
        # the release steps of the timed-out calls ran after the resume: nothing held
        await assert_quiescent(ctx, timeout=2 * SETTLE)


#: The smallest reap timeout 0.5.2 and 0.5.6 accept (0 turns reaping off, else >= 30 s);
#: the registration grace must be >= it. A never-pinged context is judged against the
#: grace (default 3600 s), so the test must set both or the control is never reaped.
REAP = 30.0
REAP_ARGS = ("--worker-reap-timeout-seconds", f"{REAP:g}",
             "--worker-registration-grace-seconds", f"{REAP:g}")


@pytest.mark.parametrize("version", VERSIONS)
async def test_heartbeat_outlives_reap_timeout_silent_control_is_reaped(
    version: str, server_factory: Callable[..., LocalServer]
) -> None:
    """Two idle contexts on one server: the one without a heartbeat is reaped after the
    grace, the one with the default (derived) heartbeat stays registered and usable."""
    server = server_factory(version, private=True, extra_args=REAP_ARGS)
    real = await lmkv.connect(server.url, server.http_url, "idle-real", layout=LAYOUT)
    control = await lmkv.connect(server.url, server.http_url, "idle-control", layout=LAYOUT,
                                 heartbeat_interval=0)
    try:
        # the interval comes from the server's /config: a quarter of the reap timeout
        assert real._s.reap_timeout == REAP
        assert (real._s.heartbeat_interval
                == heartbeat_interval_for(REAP) == REAP / 4)
        assert control._s._heartbeat is None
        for ctx in (real, control):
            toks = tokens_for(ctx.chunk_size)
            await ctx.store(random_kv(LAYOUT, len(toks), seed=80), toks)
        last_signal = time.monotonic()  # the control's last contact with the server

        def registered() -> list[int]:
            return list(server.status()["registered_non_cuda_instance_ids"])

        assert {real.instance_id, control.instance_id} <= set(registered())
        # The reaper scans every REAP / 4, so the control goes between REAP and
        # 1.25 * REAP after its last signal; poll (without blocking the loop) until then.
        await eventually(lambda: anyio.to_thread.run_sync(
            lambda: control.instance_id not in registered()),
            timeout=1.25 * REAP + SETTLE, interval=0.5, what="the control context is reaped")
        assert time.monotonic() - last_signal >= REAP - EARLY, "reaped before the grace"
        # idle for longer than the reap timeout, kept alive by its pings alone
        assert real.instance_id in registered()
        toks = tokens_for(real.chunk_size)
        kv = random_kv(LAYOUT, len(toks), seed=81)
        assert (await real.store(kv, toks, timeout=5)).written_chunks == 1
        out = await real.retrieve(toks, timeout=5)
        assert out is not None and same_bits(out, kv)
        await assert_quiescent(real)
    finally:
        await control.aclose()
        await real.aclose()
    await assert_quiescent(server)


def test_heartbeat_interval_derivation() -> None:
    """A quarter of the reap timeout, clamped to [1, 10] s; 120 s when none is known."""
    assert heartbeat_interval_for(30.0) == 7.5
    assert heartbeat_interval_for(8.0) == 2.0
    assert heartbeat_interval_for(2.0) == 1.0      # floor: never a busy loop
    assert heartbeat_interval_for(400.0) == 10.0   # ceiling
    assert heartbeat_interval_for(None) == 10.0    # unknown: the 120 s default
    assert heartbeat_interval_for(0.0) == 10.0     # reaping off: still a slow ping


#: Each way of cutting an operation at a random point, on the backends that have it:
#: asyncio's ``Task.cancel`` (once, edge-triggered), and a cancel scope's deadline
#: (``anyio.move_on_after``: level-triggered; a trio cancel scope under trio).
RANDOM_CUTS = pytest.mark.parametrize(
    ("anyio_backend", "cut"),
    [("asyncio", "task_cancel"), ("asyncio", "cancel_scope"), ("trio", "cancel_scope")],
)

#: Marks an operation cut short in :func:`test_random_cancellation_leaves_nothing_behind`.
CANCELLED = object()


@RANDOM_CUTS
async def test_random_cancellation_leaves_nothing_behind(server: LocalServer, cut: str) -> None:
    """Cancel many mixed operations at random points (seeded); then check the server."""
    rng = random.Random(20261202)
    layout = lmkv.KVLayout(num_layers=4, num_kv_heads=2, head_dim=64)
    async with checked_context(server, "cancel", layout=layout, timeout=30) as ctx:
        C = ctx.chunk_size
        prefixes = [tokens_for(rng.randint(1, 4) * C + rng.randint(0, C - 1)) for _ in range(16)]
        data = {i: random_kv(layout, len(t), seed=900 + i) for i, t in enumerate(prefixes)}
        # half the prefixes are stored up front, so retrieves have something to do
        for i in range(0, 16, 2):
            await ctx.store(data[i], prefixes[i])
        completed_stores: set[int] = set(range(0, 16, 2))

        async def one(i: int, kind: str) -> tuple[str, int, Any]:
            if kind == "store":
                return kind, i, await ctx.store(data[i], prefixes[i])
            if kind == "lookup":
                return kind, i, await ctx.lookup(prefixes[i])
            out = None
            if kind == "retrieve_out":
                out = torch.empty(2, layout.num_layers, len(prefixes[i]) // C * C,
                                  layout.hidden_dim, dtype=layout.dtype)
            return kind, i, await ctx.retrieve(prefixes[i], out=out)

        async def cut_after(delay: float, k: int, i: int, kind: str,
                            outcomes: list[Any]) -> None:
            with anyio.move_on_after(delay) as scope:
                try:
                    outcomes[k] = await one(i, kind)
                except Exception as exc:  # as gather(return_exceptions=True): judged below
                    outcomes[k] = exc
            if scope.cancelled_caught:
                outcomes[k] = CANCELLED

        cancelled = 0
        for _round in range(6):
            # drawn in the order the tasks of the Task.cancel form used to draw them
            plans = [(rng.randrange(16), rng.choice(["store", "retrieve", "retrieve_out",
                                                     "lookup"])) for _ in range(24)]
            delays = [rng.choice([0.0, 0.0005, 0.002, 0.005, 0.01, 0.03]) for _ in plans]
            if cut == "task_cancel":
                tasks = [asyncio.create_task(one(i, kind)) for i, kind in plans]
                await asyncio.sleep(0)
                for task, delay in zip(tasks, delays, strict=True):
                    asyncio.get_running_loop().call_later(delay, task.cancel)
                outcomes = [CANCELLED if isinstance(o, asyncio.CancelledError) else o
                            for o in await asyncio.gather(*tasks, return_exceptions=True)]
            else:
                outcomes = [None] * len(plans)
                async with anyio.create_task_group() as tg:
                    for k, ((i, kind), delay) in enumerate(zip(plans, delays, strict=True)):
                        tg.start_soon(cut_after, delay, k, i, kind, outcomes)
            for outcome in outcomes:
                if outcome is CANCELLED:
                    cancelled += 1
                    continue
                assert not isinstance(outcome, BaseException), outcome
                kind, i, value = outcome
                if kind == "store":
                    completed_stores.add(i)
                elif kind.startswith("retrieve") and value is not None:
                    assert same_bits(value, data[i][:, :, : value.shape[2]])
        assert cancelled > 20, "the schedule should cancel a good share of operations"
        # release steps of the cancelled calls finish in the background: poll, loop running
        await assert_quiescent(ctx, timeout=3 * SETTLE)
        # every prefix reads back bit-exact (cancelled stores may or may not have landed)
        for i, toks in enumerate(prefixes):
            out = await ctx.retrieve(toks)
            if i in completed_stores:
                assert out is not None and out.shape[2] == len(toks) // C * C
            if out is not None:
                assert same_bits(out, data[i][:, :, : out.shape[2]])


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

        async def loop_died() -> bool:
            # the poison is on another socket: poll until our requests go unanswered
            _, exc, _ = await timed(ctx.lookup(toks, timeout=1))
            return isinstance(exc, lmkv.ServerTimeoutError)

        await eventually(loop_died, what="the server's request loop stops answering")
        assert httpx.get(f"{server.http_url}/healthcheck").status_code == 200
        await eventually(lambda: ctx._s.loop_dead, timeout=3 * SETTLE,
                         what="the heartbeat diagnoses the dead loop")
        with pytest.raises(lmkv.ServerTimeoutError, match="request loop is unresponsive"):
            await ctx.lookup(toks, timeout=1)
        t0 = time.monotonic()
    # bounded by the 1 s budget for a dead loop, not the release steps' 2 s deadlines
    fast(time.monotonic() - t0, limit=1.0 + 2 * SLACK, what="aclose with a dead request loop")
