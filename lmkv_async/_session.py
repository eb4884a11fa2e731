"""One server's life, as seen by one context: detect, register, heartbeat, diagnose, close.

:class:`Session` owns the HTTP client, the ZMQ transport and the SHM mapping.
It detects the release (``/version``, else ``/config`` keys, else a ZMQ probe),
applies the version policy, registers the engine-driven context, keeps it alive
with a heartbeat, registers again after a reconnect, tells a dead request loop
from a frozen server, and runs every RPC and release step. The operation
sequences (:mod:`._ops`) are built on it; the public face (:mod:`.context`)
only holds one.

Release steps run in background tasks that :meth:`Session.close` waits for, for
at most :data:`CLOSE_BUDGET` seconds: a server that never answers cannot hold
``aclose()`` for longer than that.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from . import _logctx
from ._locks import KeyedLock
from .errors import (
    ClosedError,
    InvalidInputError,
    KVCacheError,
    ProtocolError,
    ServerError,
    ServerTimeoutError,
    ServerUnavailableError,
    TransportUnavailableError,
    UnsupportedOperationError,
    UnsupportedServerError,
    with_context,
)
from .http import ApiKey, HttpClient
from .layout import KVLayout, discover_layout
from .shm import PoolMapping
from .transport import Connection, LateHandler, Transport
from .validate import check_timeout
from .wire import requests
from .wire.dialect import (
    CAP_KV_EVENTS,
    NEWEST_TESTED,
    Dialect,
    dialect_from_config,
    dialect_from_probe,
    resolve_version,
)
from .wire.keys import KeyEncoder, RegisterPayload
from .wire.replies import SlotSpec, parse_register
from .wire.requests import Request

if TYPE_CHECKING:
    from .cuda import GpuTransfers

__all__ = ["CLEANUP_TIMEOUT", "CLOSE_BUDGET", "OpState", "Session", "TransportMode"]

log = logging.getLogger("lmkv_async")

TransportMode = Literal["auto", "shm", "pickle"]
T = TypeVar("T")

#: Deadline for release steps (free locks, commit, end_session) after a failure
#: or cancellation. Generous on purpose: it runs in the background, and a frozen
#: server that resumes within it still gets its locks back.
CLEANUP_TIMEOUT = 30.0

#: The longest ``aclose()`` waits for in-flight operations and release steps
#: before it cancels them; then at most :data:`UNREGISTER_TIMEOUT` more.
CLOSE_BUDGET = 3.0
UNREGISTER_TIMEOUT = 1.5

#: ``--l1-read-ttl-seconds`` default (0.5.2 .. 0.5.7), used when ``/config`` lacks it
DEFAULT_READ_TTL = 300.0

_NEWEST = ".".join(map(str, NEWEST_TESTED))


class OpState:
    """Shared between a caller and its operation task."""

    __slots__ = ("abandoned",)

    def __init__(self) -> None:
        self.abandoned = False


class Session:
    """The server-facing state of one context (see the module docstring)."""

    def __init__(
        self,
        url: str,
        http_url: str,
        model_name: str,
        *,
        layout: KVLayout | None,
        timeout: float,
        transport: TransportMode,
        sockets: int,
        shm_dir: str,
        heartbeat_interval: float | None,
        prefault: bool,
        api_key: ApiKey | None,
    ) -> None:
        self.url = url
        self.http_url = http_url
        self.model_name = model_name
        self.timeout = timeout
        self.requested_transport: TransportMode = transport
        self.layout_arg = layout
        self.shm_dir = shm_dir
        self._prefault = prefault
        self.heartbeat_interval = heartbeat_interval
        self.http = HttpClient(http_url, timeout=timeout, api_key=api_key)
        self.transport = Transport(url, sockets=sockets)
        self.instance_id = secrets.randbits(63)
        self.dialect: Dialect | None = None
        self.server_version = ""
        #: the server is newer than the newest release we test
        self.untested_newer = False
        self.capabilities: frozenset[str] = frozenset()
        self.chunk_size = 0
        self.pool: PoolMapping | None = None
        self._retired_pools: list[PoolMapping] = []
        #: pre-faulting of a pool mapped on re-registration (runs behind operations)
        self._populating: set[asyncio.Future[str]] = set()
        #: CUDA side (registration, streams), made by the first GPU transfer (lmkv_async.cuda)
        self.gpu: GpuTransfers | None = None
        self.mode: Literal["shm", "pickle"] = "pickle"
        self.slot_spec: SlotSpec | None = None
        self._registered_generation = -1
        self._register_sent = False
        self.loop_dead = False  # see diagnose_silence
        self._register_lock = asyncio.Lock()
        #: SHM retrieves of one prefix are serialised: the server keys pending reads by
        #: (instance, key) and key equality ignores request_id, so a second concurrent
        #: prepare_retrieve of the same key would overwrite the first's pending read.
        self.read_gates = KeyedLock()
        self._tasks: set[asyncio.Task[Any]] = set()
        #: open retrieve_view blocks: close() ends them first, so their release steps
        #: run (and their tensors raise) instead of waiting out CLOSE_BUDGET
        self.open_views: set[Callable[[], None]] = set()
        self._heartbeat: asyncio.Task[None] | None = None
        self.state: Literal["new", "open", "closing", "closed"] = "new"
        self._abandoned = False  # close gave up on unanswered requests: send nothing more
        self.reap_timeout: float | None = None
        #: the server's L1 read-lock TTL (``--l1-read-ttl-seconds``; 300 s by default on
        #: every supported release, compat.md §6.6), from ``/config`` at connect
        self.read_ttl = DEFAULT_READ_TTL
        #: the server's normal pool is one thread (``/config mp.max_cpu_workers == 1``)
        self.ordered_normal_pool = False

    @property
    def pipelines_lookup_query(self) -> bool:
        """Whether a lookup's result query goes right behind it (see ``_ops._lookup_locked``):
        one server thread runs both in order, and ``free_lookup_locks`` is bounded (0.5.6+)."""
        return self.ordered_normal_pool and self.d.bounded_free

    @property
    def layout(self) -> KVLayout:
        """The layout in use (explicit or discovered at connect)."""
        assert self.layout_arg is not None
        return self.layout_arg

    @property
    def d(self) -> Dialect:
        """The dialect (set once detection ran)."""
        assert self.dialect is not None
        return self.dialect

    # ------------------------------------------------------------------ open
    async def open(self) -> None:
        """Detect, connect, register, start the heartbeat; undo everything on failure."""
        try:
            await self._connect()
            await self._register(time.monotonic() + self.timeout)
            self.state = "open"
            if self.heartbeat_interval is None:
                self.heartbeat_interval = heartbeat_interval_for(self.reap_timeout)
            if self.heartbeat_interval > 0:
                self._heartbeat = asyncio.create_task(self._heartbeat_loop(),
                                                      name="lmkv-heartbeat")
        except BaseException:
            # Unregister whenever a registration was sent: its reply may have been late
            # or malformed after the server had registered us (unregister is idempotent).
            await self.teardown(unregister=self._register_sent)
            raise

    async def _connect(self) -> None:
        """Everything before registering: HTTP detection, ZMQ connect, dialect, chunk
        size, capabilities (shared with the fleet's light lookup sessions)."""
        await self._detect_server()
        self.transport.start()
        if not await self.transport.wait_connected(self.timeout):
            raise ServerUnavailableError("cannot connect to the ZMQ endpoint", server=self.url)
        if self.dialect is None:
            await self._probe_dialect()
        await self._read_chunk_size()
        await self._refine_capabilities()

    def _register_payload(self) -> RegisterPayload:
        """Our engine-driven registration, built from the layout."""
        layout = self.layout
        return RegisterPayload(
            instance_id=self.instance_id,
            model_name=self.model_name,
            world_size=layout.world_size,
            block_size=layout.block_size,
            num_layers=layout.num_layers,
            hidden_dim_size=layout.hidden_dim,
            dtype_str=layout.dtype_name,
            use_mla=layout.use_mla,
            num_physical_slots=self.chunk_size,
        )

    async def _detect_server(self) -> None:
        """Version, mode and chunk size over HTTP (compat.md §11, §14.7)."""
        try:
            self.server_version = await self.http.version()
        except ProtocolError:
            self.server_version = ""
        config = await self.http.config()
        info = resolve_version(self.server_version) if self.server_version else None
        if info is not None:
            if info.dialect is None:
                raise UnsupportedServerError(
                    f"lmcache {self.server_version} is older than 0.5.0", server=self.http_url)
            self.dialect = info.dialect
            self.untested_newer = info.untested_newer
            if info.untested_newer:
                log.warning(
                    "lmcache %s at %s is newer than the newest release lmkv_async is tested "
                    "with (%s); speaking the %s dialect", self.server_version, self.http_url,
                    _NEWEST, info.dialect.name)
        else:
            self.dialect = dialect_from_config(config)
        mp = config.get("mp") or {}
        if mp.get("supported_transfer_mode") == "lmcache_driven":
            raise UnsupportedServerError(
                "the server runs --supported-transfer-mode lmcache_driven, which has no handler "
                "for the engine-driven operations this client uses; restart it with "
                "--supported-transfer-mode auto (or engine_driven)",
                server=self.http_url,
            )
        # /config mp.chunk_size is only a fallback: on 0.5.7 it can be stale after an
        # engine negotiated another size (compat.md §14.4); get_chunk_size decides.
        chunk = mp.get("chunk_size")
        if isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0:
            self.chunk_size = chunk
        l1 = (config.get("storage_manager") or {}).get("l1_manager_config") or {}
        ttl = l1.get("read_ttl_seconds") if isinstance(l1, dict) else None
        if isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and ttl > 0:
            self.read_ttl = float(ttl)
        # One normal-pool thread (the default on every release) runs lookup and
        # query_prefetch_status in arrival order, so the query may follow the lookup
        # without waiting for its ack; with more threads it could overtake it, read 0
        # and leave the lookup's locks behind (protocol reference §2.6).
        workers = mp.get("max_cpu_workers")
        self.ordered_normal_pool = isinstance(workers, int) and workers == 1
        reap = mp.get("worker_reap_timeout_seconds")
        if isinstance(reap, (int, float)) and reap > 0:
            self.reap_timeout = float(reap)
        if self.layout_arg is None:
            self.layout_arg = discover_layout(await self.http.status(), self.model_name)

    async def _read_chunk_size(self) -> None:
        """The chunk size from ``get_chunk_size`` (the portable rule, compat.md §14.7;
        ``negotiate_chunk_size`` is never sent), checked against the layout."""
        if self.d.has_op("get_chunk_size"):
            raw = await self.rpc(self.transport.pick(), requests.get_chunk_size(self.d),
                                 time.monotonic() + self.timeout)
            if isinstance(raw, int) and not isinstance(raw, bool) and raw > 0:
                if self.chunk_size and raw != self.chunk_size:
                    log.warning("the server's get_chunk_size (%d) differs from /config "
                                "mp.chunk_size (%d); using %d", raw, self.chunk_size, raw)
                self.chunk_size = raw
            else:
                raise ProtocolError(f"get_chunk_size answered {raw!r}", op="get_chunk_size",
                                    server=self.url)
        if self.chunk_size <= 0:
            raise ProtocolError("the server reports no chunk size", server=self.http_url)
        if self.chunk_size % self.layout.block_size != 0:
            raise InvalidInputError(
                f"chunk size {self.chunk_size} is not a multiple of block_size "
                f"{self.layout.block_size}"
            )

    async def _probe_dialect(self) -> None:
        # Op 21 with no payload is harmless on every supported table (compat.md §11).
        result = await self.transport.pick().probe(requests.probe(), timeout=self.timeout)
        self.dialect = dialect_from_probe(result)
        if self.dialect is None:
            raise UnsupportedServerError(f"cannot identify the server from {result!r}",
                                         server=self.url)

    async def _refine_capabilities(self) -> None:
        """Capabilities from the version table, confirmed by ``get_experimental`` where
        that is reliable (0.5.6; 0.5.7rc2 answers ``[]`` although it has the stream)."""
        caps = set(self.d.capabilities)
        if self.d.experimental_reliable and CAP_KV_EVENTS in caps:
            try:
                raw = await self.rpc(self.transport.pick(), requests.get_experimental(self.d),
                                     time.monotonic() + min(self.timeout, 5.0))
            except ServerTimeoutError:
                raw = None
            if isinstance(raw, list) and "kv_event_stream" not in raw:
                caps.discard(CAP_KV_EVENTS)
        self.capabilities = frozenset(caps)

    def require(self, capability: str, what: str) -> None:
        """Raise :class:`UnsupportedOperationError` (nothing sent) if the server lacks it."""
        if capability not in self.capabilities:
            raise UnsupportedOperationError(
                f"{what} needs the server capability {capability!r}, which lmcache "
                f"{self.server_version or self.d.name} does not have", server=self.url)

    async def _register(self, deadline: float) -> None:
        """Register our engine-driven context and pick the transfer path."""
        layout = self.layout
        generation = self.transport.generation
        self._register_sent = True
        raw = await self.rpc(self.transport.pick(),
                             requests.register(self.d, self._register_payload()), deadline)
        reply = parse_register(raw)
        old_pool = self.pool
        if old_pool is not None and old_pool.is_current(reply.shm_name, reply.pool_size):
            # Same server (e.g. only one socket of the pool reconnected): keep it.
            self._registered_generation = generation
            return
        mode: Literal["shm", "pickle"] = "pickle"
        new_pool: PoolMapping | None = None
        if reply.has_shm and self.requested_transport == "pickle":
            raise TransportUnavailableError(
                "transport='pickle' but the server has an SHM pool, and an SHM server "
                "serves retrieves only through it; use transport='auto' or 'shm'"
            )
        if reply.has_shm:
            try:
                pool = PoolMapping(reply.shm_name, reply.pool_size, shm_dir=self.shm_dir)
            except OSError as exc:
                if self.requested_transport == "shm":
                    raise TransportUnavailableError(
                        f"cannot map the server's SHM pool {reply.shm_name!r}: {exc}"
                    ) from None
                log.warning(
                    "SHM pool %s cannot be opened (%s); falling back to pickle (inline data): "
                    "stores and lookups work, retrieves from this SHM server raise "
                    "TransportUnavailableError", reply.shm_name, exc)
            else:
                if self._prefault and old_pool is None and not self._populating:
                    how = await asyncio.to_thread(pool.populate)
                    log.debug("pre-faulted SHM pool %s (%s)", reply.shm_name, how)
                elif self._prefault:
                    # Re-registration (a restarted server): an operation is waiting on us,
                    # and faulting a multi-GB pool under load can outlast its deadline.
                    # Pages fault in on use meanwhile; teardown waits before unmapping.
                    job = asyncio.ensure_future(asyncio.to_thread(pool.populate))
                    self._populating.add(job)
                    job.add_done_callback(self._populating.discard)
                new_pool = pool
                mode = "shm"
        elif self.requested_transport == "shm":
            raise TransportUnavailableError(
                "transport='shm' but the server offers no SHM pool (start it with "
                "--shm-name NAME, and --no-l1-use-lazy on GPU hosts)"
            )
        # Publish pool, mode and slot spec together, and only then the generation:
        # operations that see the new generation must see the new mapping with it.
        if old_pool is not None:
            self._retired_pools.append(old_pool)  # may still be in use; unmapped at close
            if self.gpu is not None:
                self.gpu.retire(old_pool)  # unregistered once its queued copies are done
        self.pool = new_pool
        self.mode = mode
        self.slot_spec = (
            SlotSpec(layout.chunk_shape(self.chunk_size), layout.dtype_name, layout.itemsize,
                     reply.pool_size)
            if mode == "shm" else None
        )
        self._registered_generation = generation

    async def ensure_registered(self, deadline: float, since: float | None = None) -> None:
        """Re-register after a reconnect: a restarted server has forgotten us.

        Waits (within the deadline and the reconnect grace left for an operation
        that began at ``since``) for a socket that is down to come back first, so
        an operation never runs against a restarted server before it knows us.
        """
        if not all(c.connected for c in self.transport.connections):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not await self.transport.wait_usable(
                remaining, time.monotonic() if since is None else since
            ):
                raise ServerUnavailableError("the server is unreachable", server=self.url)
        if self.transport.generation == self._registered_generation:
            return
        async with self._register_lock:
            if self.transport.generation == self._registered_generation:
                return
            log.info("server connection was re-established; registering again")
            await self._register(deadline)

    async def _heartbeat_loop(self) -> None:
        assert self.heartbeat_interval is not None
        _logctx.bind(op="heartbeat", server=self.url)  # this task's records
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            try:
                deadline = time.monotonic() + min(self.timeout, max(self.heartbeat_interval, 1.0))
                await self.ensure_registered(deadline)
                await self.rpc(self.transport.pick(), requests.ping(self.d, self.instance_id),
                               deadline)
            except ServerTimeoutError as exc:
                log.debug("heartbeat timed out: %s", exc)
                await self._diagnose_silence()
            except (KVCacheError, OSError) as exc:
                log.debug("heartbeat failed: %s", exc)

    async def _diagnose_silence(self) -> None:
        """Tell a dead ZMQ request loop from a slow or frozen server (compat.md §12.11).

        A 0.5.2 server's request loop dies for good on an op it cannot decode, while
        its HTTP API keeps reporting healthy. If HTTP answers but a harmless op-21
        probe on a fresh socket does not, later timeouts say so.
        """
        if not await self.http.healthcheck():
            return  # all of it is down or frozen: plain timeouts say enough
        probe = Connection(self.transport.zmq_context, self.url, -1)
        probe.start()
        try:
            answered = await probe.wait_connected(2.0)
            if answered:
                await probe.probe(requests.probe(), timeout=2.0)
        except KVCacheError:
            answered = False
        finally:
            probe.close()
        if not answered and not self.loop_dead:
            log.error("the server's ZMQ request loop is unresponsive while its HTTP API reports "
                      "healthy (%s); restart the server", self.url)
        self.loop_dead = not answered

    # ------------------------------------------------------------------ close
    async def teardown(self, *, unregister: bool) -> None:
        """Stop the heartbeat, let release steps finish (bounded), unregister, close all."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
        for end_view in list(self.open_views):
            end_view()
        budget = 1.0 if self.loop_dead else CLOSE_BUDGET
        give_up = time.monotonic() + budget
        # Unregistering with a reservation outstanding would publish it (§6.6): wait for
        # running operations and for late prepare_store replies first (bounded).
        while time.monotonic() < give_up and (
            self._tasks or any(c.late_pending for c in self.transport.connections)
        ):
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=give_up - time.monotonic())
            else:
                await asyncio.sleep(0.05)
        if self._tasks:
            log.warning(
                "aclose: %d operation(s) or release step(s) got no reply within %.1fs; "
                "abandoning them. The server may keep their read locks until its lock TTL, "
                "their sessions until the session TTL, and a store's reservation until the "
                "registration is dropped", len(self._tasks), budget)
            # Fail what is waiting with ClosedError (callers get a typed error, not a
            # CancelledError they did not ask for), and send no further release steps.
            self._abandoned = True
            for c in self.transport.connections:
                c.fail_pending("the context was closed before the server answered")
            await asyncio.wait(list(self._tasks), timeout=0.5)
            for task in list(self._tasks):  # last resort: something not waiting on a reply
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._abandoned = False  # the unregister below is still worth a short try
        conn = self.transport.pick()
        if unregister and self.dialect is not None and not self.loop_dead and conn.connected:
            try:
                await self.rpc(conn, requests.unregister(self.d, self.instance_id),
                               time.monotonic() + min(self.timeout, UNREGISTER_TIMEOUT))
            except KVCacheError as exc:
                log.warning("unregister failed: %s", exc)
        self.transport.close()
        await self.http.aclose()
        if self._populating:  # a pre-fault thread may still touch the mapping
            await asyncio.gather(*self._populating, return_exceptions=True)
        if self.gpu is not None:
            await self.gpu.aclose()  # cudaHostUnregister before munmap
        for pool in [self.pool, *self._retired_pools]:
            if pool is not None:
                pool.close()
        self.pool = None
        self._retired_pools.clear()
        self.state = "closed"

    # ------------------------------------------------------------------ plumbing
    async def rpc(self, conn: Connection, req: Request, deadline: float,
                  on_late: LateHandler | None = None, request_id: str | None = None,
                  grace_from: float | None = None,
                  sent: asyncio.Future[None] | None = None) -> object:
        """One request within ``deadline``; errors carry op, server and request id.

        ``grace_from``: when the request's operation began (one reconnect grace per
        operation, counted from the loss or from then, whichever is later).
        """
        if self._abandoned:
            raise ClosedError("the context was closed before the server answered")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ServerTimeoutError("deadline expired before the request was sent", op=req.op,
                                     server=self.url, request_id=request_id, timeout=0.0)
        try:
            reply = await conn.request(req, timeout=remaining, on_late=on_late,
                                       late_window=CLEANUP_TIMEOUT, request_id=request_id,
                                       grace_from=grace_from, sent=sent)
            self.loop_dead = False
            return reply.result()
        except ServerTimeoutError as exc:
            if self.loop_dead:
                exc.message += (" (the server's ZMQ request loop is unresponsive while its HTTP "
                                "API reports healthy; restart the server)")
            if self.untested_newer:
                exc.message += (f" (lmcache {self.server_version} is newer than the newest "
                                f"release lmkv_async is tested with, {_NEWEST})")
            raise with_context(exc, op=req.op, server=self.url, request_id=request_id) from None
        except ServerError as exc:
            raise with_context(exc, op=req.op, server=self.url, request_id=request_id) from None

    async def cleanup_rpc(self, conn: Connection, generation: int, req: Request,
                          request_id: str | None = None) -> object:
        """A release step: own deadline, failures logged (the caller's error wins).

        Skipped once the socket has lost or replaced its peer: on loopback that
        means the server process died, taking its locks and sessions with it, and
        a stale release sent to a restarted server could strip another client's
        locks (0.5.2's free_lookup_locks is anonymous, compat.md §6.3). It is not
        retried with a fresh reconnect wait.
        """
        if conn.generation != generation or not conn.connected or self._abandoned:
            log.debug("skipping %s: the server connection was lost or the context closed",
                      req.op)
            return None
        try:
            return await self.rpc(conn, req, time.monotonic() + CLEANUP_TIMEOUT,
                                  request_id=request_id)
        except KVCacheError as exc:
            log.warning("release step %s failed: %s", req.op, exc)
            return None

    def release_later(self, steps: Coroutine[Any, Any, None]) -> None:
        """Run release steps in the background: the caller has its answer already.

        They are ordered after everything the operation did on the same socket,
        and close waits for them (bounded) before unregistering.
        """
        self.track(asyncio.create_task(self._after_caller(steps)))

    #: loop iterations a release step waits before its first send (see _after_caller)
    release_yields = 3

    async def _after_caller(self, steps: Coroutine[Any, Any, None]) -> None:
        # Let the operation's caller resume first: it has its answer, and the release
        # step's send (a syscall that wakes ZMQ's I/O thread: 0.1-0.4 ms on a loaded
        # machine) would otherwise run before it. Three iterations cover the operation
        # task's completion, the shield's hand-over and the caller's wake-up.
        try:
            for _ in range(self.release_yields):
                await asyncio.sleep(0)
        except BaseException:
            steps.close()
            raise
        await steps

    def check_open(self) -> None:
        """Raise :class:`ClosedError` unless the context is open."""
        if self.state != "open":
            raise ClosedError(f"context is {self.state}")

    async def run(self, op: Callable[[OpState], Coroutine[Any, Any, T]]) -> T:
        """Run an operation in its own task; shield it from the caller's cancellation."""
        state = OpState()
        task = self.track(asyncio.create_task(op(state)))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and (current is None or not current.cancelling()):
                # aclose() gave up on the operation; its caller was not cancelled
                raise ClosedError("the context was closed while the operation was in "
                                  "flight") from None
            state.abandoned = True
            raise
        except ServerError as exc:  # errors from reply parsing name the server too
            raise with_context(exc, server=self.url) from None

    def track(self, task: asyncio.Task[T]) -> asyncio.Task[T]:
        """Keep a background task until it ends; close waits for all of them."""
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved, so an abandoned task's error is not reported lost

    def deadline(self, timeout: float | None) -> float:
        """Absolute deadline for a per-call ``timeout`` (None: the context default)."""
        return time.monotonic() + check_timeout(timeout, self.timeout)

    def key_encoder(self, tokens: list[int], salt: str) -> KeyEncoder:
        """Keys of ``tokens`` in this server's dialect."""
        return KeyEncoder(self.d, self.model_name, self.layout.world_size, tokens, salt)


def heartbeat_interval_for(reap_timeout: float | None) -> float:
    """Seconds between pings: a quarter of the server's reap timeout, within [1, 10]."""
    reap = reap_timeout or 120.0
    return max(1.0, min(10.0, reap / 4))
