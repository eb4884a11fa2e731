"""One server's life, as seen by one context: detect, register, heartbeat, diagnose, close.

:class:`Session` owns the HTTP client, the ZMQ transport and the SHM mapping.
It detects the release (``/version``, else ``/config`` keys, else a ZMQ probe),
applies the version policy, registers the engine-driven context, keeps it alive
with a heartbeat, registers again after a reconnect, tells a dead request loop
from a frozen server, and runs every RPC and release step. The operation
sequences (:mod:`._ops`) are built on it; the public face (:mod:`.context`)
only holds one.

Release steps run as jobs of the session's :class:`~._background.Background`
that :meth:`Session.close` waits for, for at most :data:`CLOSE_BUDGET` seconds:
a server that never answers cannot hold ``aclose()`` for longer than that. The
close ends the group too (or the caller's ``async with`` does, see
:mod:`._connect`), so nothing the session started outlives it.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Literal, TypeVar

import anyio
import anyio.to_thread

from . import _logctx
from ._background import Background, Job
from ._detect import (
    DEFAULT_READ_TTL,
    NEWEST,
    detect_over_http,
    probe_dialect,
    read_chunk_size,
    refine_capabilities,
    request_loop_answers,
)
from ._locks import KeyedLock
from ._optasks import OpState, TaskKeeper
from ._shield import Once, finish
from .errors import (
    ClosedError,
    KVCacheError,
    ServerError,
    ServerTimeoutError,
    ServerUnavailableError,
    TransportUnavailableError,
    UnsupportedOperationError,
    with_context,
)
from .http import ApiKey, HttpClient
from .layout import KVLayout
from .shm import PoolMapping
from .transport import Connection, LateHandler, Settable, Transport
from .validate import check_timeout
from .wire import requests
from .wire.dialect import Dialect
from .wire.keys import KeyEncoder, RegisterPayload
from .wire.replies import SlotSpec, parse_register
from .wire.requests import Request

if TYPE_CHECKING:
    from .cuda import GpuTransfers

__all__ = ["CLEANUP_TIMEOUT", "CLOSE_BUDGET", "CLOSE_TOTAL", "OpState", "Session",
           "TransportMode"]

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
#: The longest a close takes with a server that answers nothing: the budget, half a
#: second for abandoned operations to fail, the unregister (copies already running in
#: a thread are waited for on top: they end on their own).
CLOSE_TOTAL = CLOSE_BUDGET + 0.5 + UNREGISTER_TIMEOUT

_NEWEST = NEWEST


class Session(TaskKeeper):
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
        background: Background | None = None,
    ) -> None:
        #: None: open() hosts a group of the session's own (``ctx = await connect()``)
        self._hosts_background = background is None
        TaskKeeper.__init__(self, background or Background(f"context {url}"))
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
        self._populating: set[Job[str]] = set()
        #: CUDA side (registration, streams), made by the first GPU transfer (lmkv_async.cuda)
        self.gpu: GpuTransfers | None = None
        self.mode: Literal["shm", "pickle"] = "pickle"
        self.slot_spec: SlotSpec | None = None
        self._registered_generation = -1
        self._register_sent = False
        self.loop_dead = False  # see diagnose_silence
        self._register_lock = anyio.Lock()
        #: SHM retrieves of one prefix are serialised: the server keys pending reads by
        #: (instance, key) and key equality ignores request_id, so a second concurrent
        #: prepare_retrieve of the same key would overwrite the first's pending read.
        self.read_gates = KeyedLock()
        #: open retrieve_view blocks: close() ends them first, so their release steps
        #: run (and their tensors raise) instead of waiting out CLOSE_BUDGET
        self.open_views: set[Callable[[], None]] = set()
        self._heartbeat: Job[None] | None = None
        self.state: Literal["new", "open", "closing", "closed"] = "new"
        #: runs the teardown once; every close (and a failed open) waits for it
        self._closer = Once()
        #: when the server last heard a ping or registration from us (its reaper's clock)
        self._alive_at = time.monotonic()
        self._pinged = False
        self._abandoned = False  # close gave up on unanswered requests: send nothing more
        self.reap_timeout: float | None = None
        self.registration_grace: float | None = None
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
            if self._hosts_background:
                await self.background.host()
            await self._connect()
            await self._register(time.monotonic() + self.timeout)
            self.state = "open"
            if self.heartbeat_interval is None:
                self.heartbeat_interval = heartbeat_interval_for(self.reap_timeout)
            if self.heartbeat_interval > 0:
                self._heartbeat = self.background.start_soon(self._heartbeat_loop,
                                                             name="lmkv-heartbeat")
        except BaseException:
            # Unregister whenever a registration was sent: its reply may have been late
            # or malformed after the server had registered us (unregister is idempotent).
            # Shielded: a cancelled connect must still undo what it did.
            await self.shutdown(unregister=self._register_sent)
            raise

    async def _connect(self) -> None:
        """Everything before registering: HTTP detection, ZMQ connect, dialect, chunk
        size, capabilities (shared with the fleet's light lookup sessions)."""
        await self._detect_server()
        self.transport.start(self.background)
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
        """Version, mode, chunk size and limits over HTTP (:mod:`._detect`)."""
        facts = await detect_over_http(self.http, self.http_url, self.model_name,
                                       self.layout_arg)
        self.server_version = facts.server_version
        self.dialect = facts.dialect
        self.untested_newer = facts.untested_newer
        self.chunk_size = facts.chunk_size
        self.read_ttl = facts.read_ttl
        self.ordered_normal_pool = facts.ordered_normal_pool
        self.reap_timeout = facts.reap_timeout
        self.registration_grace = facts.registration_grace
        self.layout_arg = facts.layout

    def _rpc_here(self, req: Request, deadline: float) -> Awaitable[object]:
        return self.rpc(self.transport.pick(), req, deadline)

    async def _read_chunk_size(self) -> None:
        self.chunk_size = await read_chunk_size(
            self._rpc_here, self.d, self.chunk_size, self.layout,
            time.monotonic() + self.timeout, self.url, self.http_url)

    async def _probe_dialect(self) -> None:
        self.dialect = await probe_dialect(self.transport.pick(), self.timeout, self.url)

    async def _refine_capabilities(self) -> None:
        self.capabilities = await refine_capabilities(
            self._rpc_here, self.d, time.monotonic() + min(self.timeout, 5.0))

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
        self._alive_at = time.monotonic()
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
                    # finish(): a cancelled connect waits for the thread, which touches
                    # the mapping that the failed open's teardown unmaps next
                    how = await finish(anyio.to_thread.run_sync(pool.populate))
                    log.debug("pre-faulted SHM pool %s (%s)", reply.shm_name, how)
                elif self._prefault:
                    # Re-registration (a restarted server): an operation is waiting on us,
                    # and faulting a multi-GB pool under load can outlast its deadline.
                    # Pages fault in on use meanwhile; teardown waits before unmapping.
                    job = self.background.start_soon(anyio.to_thread.run_sync, pool.populate,
                                                     name="lmkv-prefault")
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
            if not self._maybe_reaped():
                return
            async with self._register_lock:
                if self._maybe_reaped():
                    await self._register_again_after_stall(deadline)
            return
        async with self._register_lock:
            if self.transport.generation == self._registered_generation:
                return
            log.info("server connection was re-established; registering again")
            await self._register(deadline)

    def _reap_after(self) -> float | None:
        """Silence after which the server's reaper drops this registration, if known."""
        return self.reap_timeout if self._pinged else self.registration_grace

    def _maybe_reaped(self) -> bool:
        """True after a silence long enough for the server to have reaped us.

        The heartbeat pings every quarter of the reap timeout; a gap past half of it
        means this process stalled (a blocked event loop, a GC pause, a suspended VM),
        and the reaper (it scans every quarter) may have dropped the registration.
        """
        limit = self._reap_after()
        return (limit is not None and self.state == "open"
                and time.monotonic() - self._alive_at > limit / 2)

    async def _register_again_after_stall(self, deadline: float) -> None:
        """Register again (idempotent on the server: a known instance only has its
        liveness refreshed), saying in the log whether the server had dropped us."""
        silent = time.monotonic() - self._alive_at
        try:
            ids = (await self.http.status()).get("registered_non_cuda_instance_ids")
            reaped: bool | None = (isinstance(ids, list)
                                   and self.instance_id not in {int(i) for i in ids})
        except (KVCacheError, ValueError, TypeError):
            reaped = None
        if reaped:
            log.warning("the server dropped this context's registration after %.0f s "
                        "without a ping from it (reap timeout %.0f s: was the event loop "
                        "blocked or the process suspended?); registering again", silent,
                        self._reap_after() or 0.0)
        else:
            log.info("no contact with the server for %.0f s (over half its reap timeout); "
                     "refreshing the registration", silent)
        await self._register(deadline)

    async def _heartbeat_loop(self) -> None:
        assert self.heartbeat_interval is not None
        _logctx.bind(op="heartbeat", server=self.url)  # this task's records
        while True:
            await anyio.sleep(self.heartbeat_interval)
            try:
                deadline = time.monotonic() + min(self.timeout, max(self.heartbeat_interval, 1.0))
                await self.ensure_registered(deadline)
                sent_at = time.monotonic()
                pong = await self.rpc(self.transport.pick(),
                                      requests.ping(self.d, self.instance_id), deadline)
                if pong is not True:
                    log.warning("ping answered %r (expected true)", pong)
                else:
                    self._alive_at = sent_at
                    self._pinged = True
            except ServerTimeoutError as exc:
                log.debug("heartbeat timed out: %s", exc)
                await self._diagnose_silence()
            except (KVCacheError, OSError) as exc:
                log.debug("heartbeat failed: %s", exc)

    async def _diagnose_silence(self) -> None:
        """Tell a dead ZMQ request loop from a slow or frozen server (compat.md §12.11)."""
        answered = await request_loop_answers(self.http, self.transport.zmq_context, self.url,
                                              self.background)
        if answered is None:
            return  # all of it is down or frozen: plain timeouts say enough
        if not answered and not self.loop_dead:
            log.error("the server's ZMQ request loop is unresponsive while its HTTP API reports "
                      "healthy (%s); restart the server", self.url)
        self.loop_dead = not answered

    # ------------------------------------------------------------------ close
    async def shutdown(self, *, unregister: bool = True) -> None:
        """Shielded, bounded, idempotent close (see :mod:`._shield`).

        The first call starts :meth:`teardown`; every call waits for it to end, even
        when the caller is cancelled meanwhile (the cancellation is raised again
        afterwards). It ends within :data:`CLOSE_TOTAL` seconds.
        """
        if self.state != "closed":
            self.state = "closing"
        await self._closer.run(lambda: self.teardown(unregister=unregister))

    async def teardown(self, *, unregister: bool) -> None:
        """Stop the heartbeat, let release steps finish (bounded), unregister, close all.

        Call it through :meth:`shutdown`, which runs it once and shields it.
        """
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await self._heartbeat.wait()
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
                await self.background.drain(self._tasks, give_up - time.monotonic())
            else:
                await anyio.sleep(0.05)
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
            await self.background.drain(self._tasks, 0.5)
            # Last resort: something not waiting on a reply. A job in a copy thread
            # ends only once the thread has (memory.offload), so the pool is not
            # unmapped under it. Release jobs that a cancelled one starts are
            # cancelled (and so waited for) in turn: they would send nothing anyway.
            while self._tasks:
                for task in list(self._tasks):
                    task.cancel()
                for task in list(self._tasks):
                    await task.wait()
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
        for job in list(self._populating):  # a pre-fault thread may still touch the mapping
            await job.wait()
        if self.gpu is not None:
            await self.gpu.aclose()  # cudaHostUnregister before munmap
        for pool in [self.pool, *self._retired_pools]:
            if pool is not None:
                pool.close()
        self.pool = None
        self._retired_pools.clear()
        if self._hosts_background:
            await self.background.aclose()
        self.state = "closed"

    # ------------------------------------------------------------------ plumbing
    async def rpc(self, conn: Connection, req: Request, deadline: float,
                  on_late: LateHandler | None = None, request_id: str | None = None,
                  grace_from: float | None = None,
                  sent: Settable | None = None) -> object:
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

    def check_open(self) -> None:
        """Raise :class:`ClosedError` unless the context is open."""
        if self.state != "open":
            raise ClosedError(f"context is {self.state}")

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
