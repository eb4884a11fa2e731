"""The GPU side of a session: :class:`GpuTransfers` moves chunk objects between the
server's SHM pool and CUDA memory (:mod:`.cuda` builds the per-operation copies).

What this module owns (one :class:`GpuTransfers` per session, made on the first
CUDA transfer, so CPU-only programs never touch CUDA):

* **Registration.** The pool mapping is registered once with ``cudaHostRegister``
  (torch's own CUDA runtime binding, ``torch.cuda.cudart()``), so copies from and
  to it are DMA transfers at PCIe speed rather than staged through the driver's
  bounce buffers. It is unregistered before the mapping is unmapped: on close,
  and when a re-registration after a server restart retires the mapping (as soon
  as no copy queued on it is still running). Registering pins every page and
  takes time in proportion to the pool's size, so it runs on a throwaway thread: its
  CUDA error state (``cudaGetLastError`` is per thread) dies with the thread and
  cannot surface later as a spurious error in an unrelated kernel launch.
* **Fallback.** If registration fails (``RLIMIT_MEMLOCK``, permissions, a
  driver that refuses it) or ``LMKV_CUDA_REGISTER=0`` is set, transfers go
  through a ring of pinned staging buffers: a CPU copy between the pool and a
  staging buffer overlapped with the DMA of the previous one. That path is
  roughly half as fast; it is logged once at WARNING and shown in
  ``ctx.stats()["gpu"]`` and :attr:`GpuTransfers.path`.
* **Ordering.** Copies are queued on one dedicated stream per device, after
  the work already queued on the caller's current stream (so a store sees a
  source tensor the caller just computed, and a retrieve does not race the
  caller's earlier use of ``out``). The caller's tensors are marked with
  ``record_stream`` so the caching allocator does not reuse them while a copy
  is still queued, even if the caller drops them after cancelling.
* **Waiting.** The copies are enqueued from a worker thread (the staging path
  does CPU copies there too); completion is awaited on the event loop by polling
  a CUDA event with backoff, never by blocking (:func:`wait_event`): a poll per
  1 ms sleep until shortly before the transfer should end at the rate measured
  so far, then ``sleep(0)`` yields near the end, then sleeps backing off to 2 ms.
* **Cancellation.** A cancelled transfer keeps waiting (for the worker that
  queues the copies, then for the event) until every queued copy has completed,
  and only then lets the cancellation through (:func:`._shield.finish`: anyio
  and trio cancel scopes as well as asyncio's ``Task.cancel``). The operation's
  release steps (``commit_retrieve``, which frees the server's read lock, and
  a store's commit) therefore never run while a DMA still reads or writes the
  slots behind them.

Backend-neutral (asyncio and trio, through anyio). The registration runs as a
job of the session's :class:`~._background.Background` (a caller cancelled while
it runs abandons its wait, not the registration); its throwaway thread is
awaited from a worker thread, so the event loop never blocks on it.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, Literal, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import torch
from torch import Tensor

from ._background import Background, Job
from ._kernel_args import _check_placements
from ._shield import finish
from .errors import TransportUnavailableError
from .kernel import stream_copy
from .memory import Region, RegionArg
from .shm import PoolMapping

__all__ = ["STAGING_BUFFERS", "DeviceCopy", "GpuTransfers", "HostRegistration", "wait_event"]

# The public module's name: users configure one logger for the whole GPU path.
log = logging.getLogger("lmkv_async.cuda")

T = TypeVar("T")

#: cudaHostRegisterPortable: pinned for every CUDA context, so one registration
#: serves outputs on any GPU of the process.
_REGISTER_PORTABLE = 1
#: Staging ring (fallback path): buffers and the size of each.
STAGING_BUFFERS = 4
#: Rate assumed before anything was measured: high on purpose, so the first wait
#: sleeps too little (and then polls) rather than oversleeping the transfer.
_INITIAL_RATE = 80e9
#: Yield with sleep(0) from this long before the expected end ...
_SPIN_BEFORE = 0.0015
#: ... until this long after it, then back off (up to _BACKOFF_MAX per sleep).
_SPIN = 0.003
_BACKOFF_MAX = 0.002


def _cuda_error(ret: object) -> int:
    # torch's binding returns a pybind11 enum (cudaError.success == 0)
    value: Any = getattr(ret, "value", ret)
    return int(value)


# torch.cuda's Event/Stream/cudart are untyped: typed wrappers keep mypy --strict useful.
def _cudart() -> Any:
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _event(timing: bool = False) -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]


def _query(ev: torch.cuda.Event) -> bool:
    return bool(ev.query())  # type: ignore[no-untyped-call]


def _new_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]


class _FreshThread(Generic[T]):
    """``fn`` on a fresh thread that ends with it, started at once (also from sync
    code); :meth:`wait` awaits its end without blocking the event loop."""

    __slots__ = ("_error", "_result", "_thread")

    def __init__(self, fn: Callable[[], T]) -> None:
        self._result: T | None = None
        self._error: BaseException | None = None

        def body() -> None:
            try:
                self._result = fn()
            except BaseException as exc:  # handed to whoever waits
                self._error = exc

        self._thread = threading.Thread(target=body, name="lmkv-cuda-register", daemon=True)
        self._thread.start()

    async def wait(self) -> T:
        """The thread's result (or its error), once it has ended.

        A worker thread joins it, so the loop keeps running; a cancellation of the
        caller waits for the end too (the thread pins or unpins memory the caller
        unmaps next) and is raised again afterwards.
        """
        if self._thread.is_alive():
            await finish(anyio.to_thread.run_sync(self._thread.join))
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]


class HostRegistration:
    """``cudaHostRegister`` of one mapping ``[address, address + size)``.

    :meth:`register` returns an error message (None on success); :meth:`unregister`
    is idempotent. Both block, so call them through :class:`_FreshThread`.
    """

    def __init__(self, address: int, size: int) -> None:
        self.address = address
        self.size = size
        self.registered = False

    def register(self) -> str | None:
        """Pin the mapping; returns why that failed, or None."""
        if os.environ.get("LMKV_CUDA_REGISTER", "1") == "0":
            return "LMKV_CUDA_REGISTER=0"
        rt = _cudart()
        err = _cuda_error(rt.cudaHostRegister(self.address, self.size, _REGISTER_PORTABLE))
        if err != 0:
            return f"cudaHostRegister failed: {rt.cudaGetErrorString(err)} (error {err})"
        self.registered = True
        return None

    def unregister(self) -> None:
        """Unpin (before the mapping is unmapped)."""
        if self.registered:
            self.registered = False
            err = _cuda_error(_cudart().cudaHostUnregister(self.address))
            if err != 0:
                log.warning("cudaHostUnregister of %#x failed (error %d)", self.address, err)


class _PoolState:
    """A pool mapping as the GPU side sees it: its registration and copies in flight."""

    __slots__ = ("error", "job", "pool", "ready", "reg", "retired", "users")

    def __init__(self, pool: PoolMapping) -> None:
        self.pool = pool
        self.reg = HostRegistration(pool.address, pool.size)
        self.error: str | None = None
        self.users = 0
        self.retired = False
        #: set once the registration attempt has ended (made by the first transfer)
        self.ready: anyio.Event | None = None
        #: the job that registers, when the session's group ran it
        self.job: Job[None] | None = None


class _Staging:
    """A ring of pinned host buffers for transfers from memory CUDA does not know."""

    def __init__(self, nbuf: int, size: int) -> None:
        self.size = size
        self.bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(nbuf)]
        self.events = [_event() for _ in range(nbuf)]
        self.lock = threading.Lock()  # one transfer at a time owns the ring


def _host_view(addr: int, nbytes: int) -> Tensor:
    """uint8 CPU tensor over raw memory already checked against its region."""
    buf = (ctypes.c_char * nbytes).from_address(addr)
    return torch.frombuffer(buf, dtype=torch.uint8)


class Pending:
    """What an enqueue returns: the event that marks the end of its copies."""

    __slots__ = ("end", "nbytes", "start")

    def __init__(self, start: torch.cuda.Event, end: torch.cuda.Event, nbytes: int) -> None:
        self.start = start
        self.end = end
        self.nbytes = nbytes


class DeviceCopy:
    """A sink (retrieve) or source (store) that moves data on the GPU.

    :mod:`._ops` awaits :meth:`run` in place of offloading a CPU copy. ``h2d`` says
    the direction (pool -> device for retrieves). ``per_chunk`` copies one chunk
    object between host memory (``host``, a uint8 view of ``nbytes``) and the
    device; it runs on the dedicated stream.
    """

    def __init__(self, gpu: GpuTransfers, device: torch.device, *, h2d: bool,
                 tensors: Sequence[Tensor], geometry: tuple[int, int, int, int],
                 tokens: int | None, chunk_tokens: int,
                 per_chunk: Callable[[int, int, Tensor], None],
                 done: Callable[[int], None] | None = None) -> None:
        self.gpu = gpu
        self.done = done  # called with the hit (in chunks) once a retrieve's copies completed
        self.device = device
        self.h2d = h2d
        self.tensors = tuple(tensors)
        self.geometry = geometry  # (P, L, D, itemsize)
        self.tokens = tokens  # None: the sink's hit decides (retrieve)
        self.chunk_tokens = chunk_tokens
        self.per_chunk = per_chunk
        # Captured here, on the caller's thread: torch's current stream is per thread.
        self.caller_stream = torch.cuda.current_stream(device)

    async def run(self, *args: Any, nbytes: int) -> None:
        """The copy of one operation: ``(hit, chunks, region)`` for a retrieve sink,
        ``(chunks, region)`` for a store source. Returns once the copies completed."""
        if self.h2d:
            hit, chunks, region = args
            tokens = hit * self.chunk_tokens
        else:
            chunks, region = args
            assert self.tokens is not None
            tokens = self.tokens
        P, L, D, it = self.geometry
        placed = _check_placements(chunks, region, P=P, L=L, T=tokens, C=self.chunk_tokens,
                                   row=D * it)
        row = P * L * D * it
        work = [(p.k, p.addr, p.ntok * row) for p in placed]
        await self.gpu.transfer(self, work, region)
        if self.h2d and self.done is not None:
            self.done(args[0])


class GpuTransfers:
    """A session's GPU side: streams, pool registrations, the staging ring, counters."""

    def __init__(self, session: Any) -> None:
        self._session = session  # for its pool mappings (current and retired)
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._pools: dict[int, _PoolState] = {}  # id(pool) -> state
        self._staging: _Staging | None = None
        self._staging_lock = threading.Lock()
        self._rate = _INITIAL_RATE
        self.fallback_reason: str | None = None
        self.bytes_h2d = 0
        self.bytes_d2h = 0
        self.transfers = 0
        self.staged_transfers = 0
        self.closed = False
        self._unregistering: list[_FreshThread[None]] = []
        #: the last transfer: enqueue_ms (worker thread), wait_ms (event poll), gpu_ms
        #: (event-timed copy), began (its time.perf_counter() when it was queued)
        self.last: dict[str, float] = {}

    # ------------------------------------------------------------------ state
    @property
    def path(self) -> Literal["registered", "staging"]:
        """``"registered"`` while every transfer so far went straight to the pool,
        ``"staging"`` once one had to fall back to the pinned staging ring."""
        return "staging" if self.fallback_reason is not None else "registered"

    def snapshot(self) -> dict[str, Any]:
        """Counters for ``ctx.stats()["gpu"]``."""
        return {
            "path": self.path,
            "fallback_reason": self.fallback_reason,
            "registered_bytes": sum(s.pool.size for s in self._pools.values()
                                    if s.reg.registered),
            "transfers": self.transfers,
            "staged_transfers": self.staged_transfers,
            "bytes_h2d": self.bytes_h2d,
            "bytes_d2h": self.bytes_d2h,
            "measured_gbps": round(self._rate / 1e9, 2) if self.transfers else None,
            "last": dict(self.last),
        }

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The dedicated copy stream of ``device`` (made on first use)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        s = self._streams.get(index)
        if s is None:
            s = self._streams[index] = _new_stream(index)
        return s

    # ------------------------------------------------------------------ registration
    def _mapping(self, region: RegionArg) -> PoolMapping | None:
        """The session's mapping whose bounds ``region`` is, if any."""
        if not isinstance(region, Region):
            return None  # inline data: per-chunk tensors CUDA knows nothing of
        s = self._session
        for pool in (s.pool, *s._retired_pools):
            if pool is not None and pool.region == region:
                return pool  # type: ignore[no-any-return]
        return None

    async def _pool_for(self, region: RegionArg) -> _PoolState | None:
        """The registered state of the pool the copy touches, or None (staging)."""
        pool = self._mapping(region)
        if pool is None or pool is not self._session.pool:
            return None  # inline data, or a retired mapping (its registration is dropped)
        st = self._pools.get(id(pool))
        if st is None:
            st = self._pools[id(pool)] = _PoolState(pool)
        if st.ready is None:
            st.ready = anyio.Event()
            bg = self._background()
            if bg is not None:
                # A job of the session's group: a cancelled caller abandons its wait,
                # not the registration (aclose() waits for it).
                st.job = bg.start_soon(self._register, st, name="lmkv-cuda-register")
            else:  # no running group (a session closing): inline, to its end
                await finish(self._register(st))
        await st.ready.wait()
        return st if st.reg.registered and not st.retired else None

    def _background(self) -> Background | None:
        """The session's task group, if it still takes jobs."""
        bg = getattr(self._session, "background", None)
        return bg if isinstance(bg, Background) and bg.running else None

    async def _register(self, st: _PoolState) -> None:
        try:
            await self._register_now(st)
        finally:
            assert st.ready is not None
            st.ready.set()

    async def _register_now(self, st: _PoolState) -> None:
        t0 = time.monotonic()
        error = await _FreshThread(st.reg.register).wait()
        if error is None:
            log.info("registered SHM pool %s (%d MiB) with CUDA in %.2fs", st.pool.name,
                     st.pool.size >> 20, time.monotonic() - t0)
            return
        st.error = error
        if self.fallback_reason is None:
            log.warning("cannot register SHM pool %s with CUDA (%s): GPU transfers fall back "
                        "to a pinned staging ring, about half as fast", st.pool.name, error)
        self.fallback_reason = error

    def retire(self, pool: PoolMapping) -> None:
        """The session replaced ``pool`` (server restart, remap): unregister it as soon
        as no queued copy uses it; the session unmaps it later (at close)."""
        st = self._pools.get(id(pool))
        if st is None:
            return
        st.retired = True
        if st.users == 0:
            self._drop(st)

    def _drop(self, st: _PoolState) -> None:
        # Unpinning takes a while: a thread does it; aclose() waits for it before the
        # session unmaps the retired mapping.
        self._pools.pop(id(st.pool), None)
        if st.reg.registered:
            self._unregistering.append(_FreshThread(st.reg.unregister))

    async def aclose(self) -> None:
        """Unregister every mapping (before the session unmaps them); wait for queued
        copies first. Called by the session's teardown after its tasks finished."""
        self.closed = True
        for s in self._streams.values():
            ev = _event()
            ev.record(s)
            await wait_event(ev, 0, self._rate)  # copies still queued (abandoned operations)
        for st in list(self._pools.values()):
            if st.job is not None:
                await st.job.wait()
            elif st.ready is not None:
                await st.ready.wait()
            self._drop(st)
        for unpin in self._unregistering:
            try:
                await unpin.wait()
            except Exception as exc:  # logged; the mapping is unmapped regardless
                log.warning("cudaHostUnregister raised: %s", exc)
        self._unregistering.clear()

    # ------------------------------------------------------------------ staging
    def _staging_ring(self, need: int) -> _Staging:
        with self._staging_lock:
            if self._staging is None or self._staging.size < need:
                self._staging = _Staging(STAGING_BUFFERS, need)
            return self._staging

    # ------------------------------------------------------------------ transfer
    async def transfer(self, copy: DeviceCopy, work: list[tuple[int, int, int]],
                       region: RegionArg) -> None:
        """Queue ``work`` ((chunk index, host address, bytes), checked) and await it."""
        if self.closed:
            raise TransportUnavailableError("the context's GPU transfers are closed")
        if not work:
            return
        st = await self._pool_for(region)
        staging = st is None  # the ring is made in the worker: pinning memory takes a while
        stream = self.stream(copy.device)
        total = sum(w[2] for w in work)
        if st is not None:
            st.users += 1
        try:
            # To its end whatever cancels the caller: a cancellation while the worker
            # queues copies must not skip the wait for them (the queued DMA would
            # outlive the release steps that follow). It is raised again afterwards.
            await finish(self._queue_and_wait(copy, work, stream, staging, total))
            # finish() raises asyncio's Task.cancel again itself; a cancelled scope (anyio,
            # trio, Job.cancel() from aclose()) is raised here, as soon as the copies are
            # done, not at whatever await comes next (the operation may have none left).
            await anyio.lowlevel.checkpoint_if_cancelled()
        finally:
            if st is not None:
                st.users -= 1
                if st.retired and st.users == 0:
                    self._drop(st)

    async def _queue_and_wait(self, copy: DeviceCopy, work: list[tuple[int, int, int]],
                              stream: torch.cuda.Stream, staging: bool, total: int) -> None:
        t0 = time.perf_counter()
        began = time.monotonic()  # the first DMA starts about now
        pending = await anyio.to_thread.run_sync(self._enqueue, copy, work, stream, staging)
        t1 = time.perf_counter()
        await wait_event(pending.end, total, self._rate, began)
        t2 = time.perf_counter()
        gpu_ms = self._learn(pending)
        self.last = {"enqueue_ms": (t1 - t0) * 1e3, "wait_ms": (t2 - t1) * 1e3,
                     "gpu_ms": gpu_ms, "began": t0}
        self._count(copy.h2d, staging, total)

    def _count(self, h2d: bool, staged: bool, total: int) -> None:
        self.transfers += 1
        if staged:
            self.staged_transfers += 1
        if h2d:
            self.bytes_h2d += total
        else:
            self.bytes_d2h += total

    def _learn(self, pending: Pending) -> float:
        """Fold the transfer's GPU time into the rate the next wait plans with."""
        try:
            ms = float(pending.start.elapsed_time(pending.end))
        except RuntimeError:
            return -1.0
        if ms > 0.05 and pending.nbytes > (8 << 20):
            # The latest rate wins when it is higher: a slow first transfer (allocator
            # warm-up, contention) must not make later waits oversleep.
            rate = pending.nbytes / (ms / 1e3)
            self._rate = rate if self._rate == _INITIAL_RATE else max(
                rate, 0.7 * self._rate + 0.3 * rate)
        return ms

    def _enqueue(self, copy: DeviceCopy, work: list[tuple[int, int, int]],
                 stream: torch.cuda.Stream, use_staging: bool) -> Pending:
        """Worker thread: queue every copy on ``stream``; returns its end event."""
        total = sum(w[2] for w in work)
        staging = self._staging_ring(max(w[2] for w in work)) if use_staging else None
        with torch.cuda.device(copy.device), torch.cuda.stream(stream):
            stream.wait_stream(copy.caller_stream)
            for t in copy.tensors:
                t.record_stream(stream)
            start, end = _event(timing=True), _event(timing=True)
            start.record(stream)
            if staging is None:
                for k, addr, nb in work:
                    copy.per_chunk(k, nb, _host_view(addr, nb))
            elif copy.h2d:
                with staging.lock:
                    self._staged_h2d(copy, work, stream, staging)
            else:
                with staging.lock:
                    self._staged_d2h(copy, work, stream, staging)
            end.record(stream)
        return Pending(start, end, total)

    @staticmethod
    def _staged_h2d(copy: DeviceCopy, work: list[tuple[int, int, int]],
                    stream: torch.cuda.Stream, staging: _Staging) -> None:
        # CPU copy into buffer i while the DMA of buffer i-1 runs.
        n = len(staging.bufs)
        for i, (k, addr, nb) in enumerate(work):
            buf, ev = staging.bufs[i % n], staging.events[i % n]
            ev.synchronize()  # its previous DMA is done (worker thread: may block)
            stream_copy(buf[:nb], _host_view(addr, nb))  # the C kernel's threads, GIL released
            copy.per_chunk(k, nb, buf[:nb])
            ev.record(stream)

    @staticmethod
    def _staged_d2h(copy: DeviceCopy, work: list[tuple[int, int, int]],
                    stream: torch.cuda.Stream, staging: _Staging) -> None:
        # DMA into up to n buffers ahead; drain each into the pool in order.
        n = len(staging.bufs)
        queued: collections.deque[tuple[int, int, int]] = collections.deque()

        def drain() -> None:
            j, addr, nb = queued.popleft()
            staging.events[j % n].synchronize()
            stream_copy(_host_view(addr, nb), staging.bufs[j % n][:nb])

        for i, (k, addr, nb) in enumerate(work):
            if len(queued) == n:
                drain()
            copy.per_chunk(k, nb, staging.bufs[i % n][:nb])
            staging.events[i % n].record(stream)
            queued.append((i, addr, nb))
        while queued:
            drain()


async def wait_event(ev: torch.cuda.Event, nbytes: int, rate: float,
                     started: float | None = None) -> None:
    """Await ``ev`` without blocking the loop.

    The copies began at ``started`` (``time.monotonic()``; default now) and should
    take ``nbytes / rate`` seconds. Until shortly before that, the event is polled
    once per millisecond sleep (the selector's resolution), so an estimate that is
    too pessimistic costs at most about 1 ms; near the expected end the wait only
    yields (``sleep(0)``) between polls; past it, sleeps back off to
    :data:`_BACKOFF_MAX` (copies queued behind other operations' copies).

    Cancellation is held back until the event completed: the copies behind it
    read or write memory whose server-side reservation the caller releases next.
    An anyio or trio cancel scope is held off by a shield (it is level-triggered:
    the next checkpoint after the wait raises it); asyncio's edge-triggered
    ``Task.cancel`` goes through shields, so it is caught and raised again at the end.
    """
    t0 = time.monotonic() if started is None else started
    expected = t0 + nbytes / rate
    caught: BaseException | None = None
    delay = 0.001
    with anyio.CancelScope(shield=True):
        while not _query(ev):
            now = time.monotonic()
            if now < expected - _SPIN_BEFORE:
                pause = 0.001
            elif now < expected + _SPIN:
                pause = 0.0  # just yield: the end is near
            else:
                pause = delay
                delay = min(delay * 2, _BACKOFF_MAX)
            try:
                await anyio.sleep(pause)
            except anyio.get_cancelled_exc_class() as exc:  # Task.cancel (asyncio)
                caught = exc
    if caught is not None:
        raise caught
    await anyio.lowlevel.checkpoint_if_cancelled()  # a scope cancelled meanwhile

