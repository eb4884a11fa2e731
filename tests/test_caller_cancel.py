"""Cleanup when the *caller's* scope ends: the ways real services stop work.

Starlette cancels a streaming response through an anyio task group when the
client disconnects (level-triggered: every later await in the scope raises
again); routers put ``anyio.move_on_after``, ``asyncio.timeout`` or a task group
around a whole request; shutdown code writes ``asyncio.wait_for(ctx.aclose(), t)``.
Each test ends the caller's scope that way around ``async with lmkv.connect(...)``
doing stores and retrieves, then polls ``/status``: nothing of the context may
be left (registration, session, lock) within 6 s.

Also here: one test per defect of the close and release paths that only the
caller's cancellation exposed (threads joined, commit and prepare budgets, a
reaped registration).

Every async test runs on asyncio and natively under trio, except those about
asyncio's own ways of cancelling (``asyncio.timeout``, ``asyncio.wait_for``, a
plain ``Task.cancel``; each says why).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import pytest
import torch
from servers import assert_left_nothing
from timing import SLACK

import lmkv_async as lmkv
from lmkv_async import _ops, _session
from lmkv_async.memory import offload
from lmkv_async.testing import LocalServer

pytestmark = pytest.mark.anyio

T = TypeVar("T")

LAYOUT = lmkv.KVLayout(
    num_layers=4, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16, block_size=16
)
_models = itertools.count()


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test here runs on asyncio and natively under trio."""
    return str(request.param)


#: A cut by asyncio's ``Task.cancel`` (once, edge-triggered; asyncio only) or by a
#: cancel scope (level-triggered: anyio's on asyncio, trio's under trio).
CUTS = pytest.mark.parametrize(
    ("anyio_backend", "cut"),
    [("asyncio", "task_cancel"), ("asyncio", "cancel_scope"), ("trio", "cancel_scope")],
)


def model_name() -> str:
    return f"caller-cancel-{next(_models)}"


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**31, (n,), generator=g).tolist()


def kv_for(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.planes, LAYOUT.num_layers, n, LAYOUT.hidden_dim, generator=g).to(
        LAYOUT.dtype
    )


@pytest.fixture(params=["0.5.6", "0.5.7rc2"])
def shm_server(
    request: pytest.FixtureRequest, server_factory: Callable[..., LocalServer]
) -> LocalServer:
    return server_factory(request.param, shm=True)


class Worker:
    """Stores and retrieves in a loop inside ``async with connect``."""

    def __init__(self, server: LocalServer) -> None:
        self.server = server
        self.ops = 0

    async def run(self, seed: int = 1) -> None:
        async with lmkv.connect(
            self.server.url, self.server.http_url, model_name(), layout=LAYOUT, timeout=10
        ) as ctx:
            C = ctx.chunk_size
            for i in itertools.count():
                toks = tokens(4 * C, seed * 1000 + i)
                await ctx.store(kv_for(4 * C, i), toks)
                out = await ctx.retrieve(toks)
                assert out is not None
                self.ops += 1


@pytest.mark.parametrize("after", [0.15, 0.4, 0.9])
async def test_anyio_move_on_after_around_connect(
    shm_server: LocalServer, after: float, seen_ids: set[int]
) -> None:
    w = Worker(shm_server)
    with anyio.move_on_after(after) as scope:
        await w.run()
    assert scope.cancelled_caught
    await assert_left_nothing(shm_server, seen_ids)


async def test_task_group_cancelled_mid_transfer(
    shm_server: LocalServer, seen_ids: set[int]
) -> None:
    """Starlette's cancel-on-disconnect: a sibling cancels the group mid-transfer."""
    w = Worker(shm_server)
    async with anyio.create_task_group() as tg:
        tg.start_soon(w.run)
        while w.ops < 2:  # mid-transfer: the loop is busy storing/retrieving
            await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    await assert_left_nothing(shm_server, seen_ids)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # asyncio.timeout is asyncio's
@pytest.mark.parametrize("after", [0.5, 1.5])
async def test_asyncio_timeout_around_connect(
    shm_server: LocalServer, after: float, seen_ids: set[int]
) -> None:
    w = Worker(shm_server)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(after):
            await w.run()
    await assert_left_nothing(shm_server, seen_ids)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # asyncio.wait_for cuts the aclose
async def test_wait_for_aclose_then_aclose_again(shm_server: LocalServer) -> None:
    ctx = await lmkv.connect(shm_server.url, shm_server.http_url, model_name(), layout=LAYOUT)
    C = ctx.chunk_size
    await ctx.store(kv_for(2 * C, 0), tokens(2 * C, 0))
    try:
        await asyncio.wait_for(ctx.aclose(), 0.0005)
    except TimeoutError:
        pass  # cut short, or not: the cleanup must happen either way
    t0 = time.monotonic()
    await ctx.aclose()  # waits for the same cleanup; never starts a second one
    assert time.monotonic() - t0 < _session.CLOSE_TOTAL + SLACK
    assert ctx.closed
    await assert_left_nothing(shm_server, {ctx.instance_id})


async def test_aclose_under_an_already_cancelled_anyio_scope(shm_server: LocalServer) -> None:
    """Level-triggered: every await in the scope raises; the cleanup must still run."""
    ctx = await lmkv.connect(shm_server.url, shm_server.http_url, model_name(), layout=LAYOUT)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await ctx.aclose()
    assert ctx.closed
    await assert_left_nothing(shm_server, {ctx.instance_id})


async def test_connect_cancelled_at_many_points_leaves_nothing(
    shm_server: LocalServer, seen_ids: set[int]
) -> None:
    """A cancelled connect undoes its registration (and joins its pre-fault thread)."""
    for after in (0.0, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2):
        with anyio.move_on_after(after):
            async with lmkv.connect(
                shm_server.url, shm_server.http_url, model_name(), layout=LAYOUT, prefault=True
            ):
                await anyio.sleep(10)
    await assert_left_nothing(shm_server, seen_ids)


# ---------------------------------------------------------------------- item 2: threads


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # Task.cancel of the internal offload
async def test_offload_waits_for_its_thread_under_task_cancel() -> None:
    """A plain Task.cancel() must not return while the copy thread still runs."""
    started, finished = threading.Event(), threading.Event()

    def slow_copy() -> None:
        started.set()
        time.sleep(0.3)
        finished.set()

    task = asyncio.ensure_future(offload(slow_copy, nbytes=1 << 30))
    while not started.is_set():
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished.is_set(), "the cancellation surfaced while the thread was still copying"


@CUTS
async def test_cancelled_copy_to_releases_the_lock_only_after_the_copy(
    shm_server: LocalServer, monkeypatch: pytest.MonkeyPatch, cut: str
) -> None:
    from lmkv_async import kernel, view

    async with lmkv.connect(
        shm_server.url, shm_server.http_url, model_name(), layout=LAYOUT
    ) as ctx:
        C = ctx.chunk_size
        toks = tokens(2 * C, 7)
        kv = kv_for(2 * C, 7)
        await ctx.store(kv, toks)
        copying = threading.Event()
        real = kernel.chunks_to_dense
        done_at: list[float] = []

        def slow(*args: Any, **kwargs: Any) -> None:
            copying.set()
            time.sleep(0.3)
            real(*args, **kwargs)
            done_at.append(time.monotonic())

        monkeypatch.setattr(view.kernel, "chunks_to_dense", slow)
        out = torch.empty(
            LAYOUT.planes, LAYOUT.num_layers, 2 * C, LAYOUT.hidden_dim, dtype=LAYOUT.dtype
        )
        cancelled_at = 0.0
        async with ctx.retrieve_view(toks) as v:
            if cut == "task_cancel":
                task = asyncio.ensure_future(v.copy_to(out))
                while not copying.is_set():
                    await asyncio.sleep(0.001)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:
                ended: list[str] = []

                async def copy() -> None:
                    try:
                        await v.copy_to(out)
                        # Level-triggered: a copy_to that finished its copy may return
                        # (anyio's scope on asyncio: its thread wait is shielded); the
                        # next checkpoint raises the cut then.
                        ended.append("returned")
                        await anyio.lowlevel.checkpoint()
                    except anyio.get_cancelled_exc_class():
                        ended.append("cancelled")
                        raise
                    ended.append("not cut")

                async with anyio.create_task_group() as tg:  # re-raises all but the cut
                    tg.start_soon(copy)
                    while not copying.is_set():
                        await anyio.sleep(0.001)
                    tg.cancel_scope.cancel()
                # the cut reached the caller: never swallowed
                assert ended in (["cancelled"], ["returned", "cancelled"]), ended
            cancelled_at = time.monotonic()
        assert done_at and done_at[0] <= cancelled_at, "lock released under a running copy"
        assert torch.equal(out.view(torch.int16), kv[:, :, : 2 * C].view(torch.int16))


# ------------------------------------------------------------- item 3: the commit's budget


@pytest.mark.parametrize("version", ["0.5.6", "0.5.7rc2"])
async def test_commit_goes_out_when_the_copy_ends_past_the_deadline(
    version: str, server_factory: Callable[..., LocalServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A server of its own: on the shared one, an L1 that the rest of the run has filled
    # may reserve no slot for the store, which then copies nothing and cannot time out.
    srv = server_factory(version, shm=True, private=True)
    async with lmkv.connect(srv.url, srv.http_url, model_name(), layout=LAYOUT) as ctx:
        C = ctx.chunk_size
        toks = tokens(3 * C, 11)
        kv = kv_for(3 * C, 11)
        real = _ops._copy

        async def late_copy(*args: Any, **kwargs: Any) -> None:
            # runs inside the library, on the caller's backend
            await real(*args, **kwargs)
            await anyio.sleep(0.6)  # the copy ends after the caller's deadline

        monkeypatch.setattr(_ops, "_copy", late_copy)
        try:
            res = await ctx.store(kv, toks, timeout=0.4)
        except lmkv.ServerTimeoutError:
            pass
        else:
            pytest.fail(f"the store returned {res} instead of timing out")
        monkeypatch.setattr(_ops, "_copy", real)
        # The commit went out on its own budget: the slots are published, not write-locked
        deadline = time.monotonic() + SLACK * 4
        while await ctx.lookup(toks) != 3 * C:
            assert time.monotonic() < deadline, "the chunks were never committed"
            await anyio.sleep(0.05)
        out = await ctx.retrieve(toks)
        assert out is not None and torch.equal(out.view(torch.int16), kv.view(torch.int16))
        status = await ctx.status()
        assert status["storage_manager"]["l1_manager"]["write_locked_count"] == 0


# ---------------------------------------------- item 4: Prepared.SENT follows the real send


async def test_prepare_never_sent_frees_the_lookup_locks(
    shm_server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with lmkv.connect(
        shm_server.url, shm_server.http_url, model_name(), layout=LAYOUT
    ) as ctx:
        C = ctx.chunk_size
        toks = tokens(2 * C, 13)
        await ctx.store(kv_for(2 * C, 13), toks)
        gates = ctx._s.read_gates
        real_acquire = gates.acquire

        async def slow_gate(key: bytes, deadline: float, server: str) -> None:
            # runs inside the library, on the caller's backend
            await real_acquire(key, deadline, server)
            await anyio.sleep(max(0.0, deadline - time.monotonic()) + 0.05)

        monkeypatch.setattr(gates, "acquire", slow_gate)
        with pytest.raises(lmkv.ServerTimeoutError):
            await ctx.retrieve(toks, timeout=0.5)
        monkeypatch.setattr(gates, "acquire", real_acquire)
        deadline = time.monotonic() + SLACK * 4
        while True:
            l1 = (await ctx.status())["storage_manager"]["l1_manager"]
            if l1["read_locked_count"] == 0 and not ctx._s._tasks:
                break
            assert time.monotonic() < deadline, f"read locks left: {l1['read_locked_count']}"
            await anyio.sleep(0.05)
        out = await ctx.retrieve(toks)  # and the context still works
        assert out is not None and out.shape[2] == 2 * C


# ---------------------------------------------------- item 5: a reaped registration returns

REAP = 30  # the smallest reap timeout the server accepts


async def test_reaped_registration_is_re_established(
    server_factory: Callable[..., LocalServer], caplog: pytest.LogCaptureFixture
) -> None:
    srv = server_factory(
        "0.5.6", shm=True, private=True, extra_args=("--worker-reap-timeout-seconds", str(REAP))
    )
    async with lmkv.connect(srv.url, srv.http_url, model_name(), layout=LAYOUT, timeout=5) as ctx:
        C = ctx.chunk_size
        # wait for a first heartbeat (reap_timeout/4 = 7.5 s): reaping needs a ping first
        deadline = time.monotonic() + REAP / 4 + 3 * SLACK
        while not ctx._s._pinged:
            assert time.monotonic() < deadline, "no heartbeat was answered"
            await anyio.sleep(0.1)

        def stall() -> bool:
            """Whether the server dropped the registration, judged while still stalled:
            once the loop runs again, a heartbeat may register the context again."""
            stall_until = time.monotonic() + REAP * 1.5 + SLACK
            while time.monotonic() < stall_until:
                time.sleep(0.5)
                if ctx.instance_id not in srv.status()["registered_non_cuda_instance_ids"]:
                    break
            return ctx.instance_id not in srv.status()["registered_non_cuda_instance_ids"]

        # the client stalls (a blocked event loop or trio run) until the server's
        # reaper has dropped it
        assert stall(), (
            "the server did not reap the stalled client: the test proves nothing"
        )
        caplog.set_level(logging.INFO, logger="lmkv_async")
        toks = tokens(2 * C, 17)
        kv = kv_for(2 * C, 17)
        res = await ctx.store(kv, toks)  # the next operation registers again first
        assert res.written_chunks == 2
        out = await ctx.retrieve(toks)
        assert out is not None and torch.equal(out.view(torch.int16), kv.view(torch.int16))
        assert ctx.instance_id in srv.status()["registered_non_cuda_instance_ids"]
        assert any(
            "dropped this context's registration" in r.getMessage() for r in caplog.records
        ), [r.getMessage() for r in caplog.records]
    await assert_left_nothing(srv, {ctx.instance_id})
