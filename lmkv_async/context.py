"""AsyncKVContext: the operation sequences (store, lookup, retrieve) over the MP protocol.

Each operation is a fixed sequence of RPCs (protocol reference §6.4)::

    store    : prepare_store -> copy into slots (SHM) / pickle -> commit_store -> end_session
    lookup   : lookup -> prefetch status -> free_lookup_locks (on a hit) -> end_session
    retrieve : lookup -> prefetch status -> prepare_retrieve -> copy out -> commit_retrieve
               -> end_session

and what each step reserved on the server is released on every exit path. The
sequence runs in its own task that the caller awaits through ``asyncio.shield``:
if the caller is cancelled, the task goes on to its release steps (and a store
whose slots were handed out still fills and commits them, because an unfilled
reservation can later be published as a garbage entry, protocol reference §6.6).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Generator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, TypeVar

import anyio.to_thread
import torch

from . import copy as kcopy
from .buffers import output_pool
from .errors import (
    ClosedError,
    InvalidInputError,
    KVCacheError,
    ProtocolError,
    ServerError,
    ServerTimeoutError,
    ServerUnavailableError,
    TransportUnavailableError,
    UnsupportedServerError,
)
from .fanout import ItemResult, run_bounded
from .http import HttpClient
from .layout import KVLayout, discover_layout
from .pickle_codec import dumps_tensors, loads_tensors
from .shm import PoolMapping
from .transport import RECONNECT_GRACE, Connection, LateHandler, Transport
from .validate import (
    Tokens,
    check_kv,
    check_out,
    check_paged,
    check_salt,
    check_timeout,
    check_tokens,
)
from .wire.dialect import (
    PROBE_OP_ID,
    Dialect,
    dialect_for_version,
    dialect_from_config,
    dialect_from_probe,
    parse_version,
)
from .wire.frames import Reply, pack
from .wire.keys import KeyEncoder, RegisterPayload, encode_register
from .wire.messages import (
    SlotSpec,
    as_bool,
    as_optional_count,
    parse_prepare_retrieve,
    parse_prepare_store,
    parse_register,
)

__all__ = ["AsyncKVContext", "StoreResult", "TransportMode", "connect"]

log = logging.getLogger("lmkv_async")

TransportMode = Literal["auto", "shm", "pickle"]
T = TypeVar("T")

#: Deadline for release steps (free locks, commit, end_session) after a failure
#: or cancellation. Generous on purpose: it runs in the background, and a frozen
#: server that resumes within it still gets its locks back.
CLEANUP_TIMEOUT = 30.0


@dataclass(frozen=True)
class StoreResult:
    """What one ``store`` did, with the same meaning on SHM and pickle servers.

    Only whole chunks are stored: ``total_chunks = len(tokens) // chunk_size``
    and the ``ignored_tokens`` past the last full chunk are not sent.
    ``written_chunks`` were newly written by this call; ``skipped_chunks`` were
    not (already cached, or the server had no room for them).
    """

    total_chunks: int
    written_chunks: int
    chunk_size: int
    ignored_tokens: int

    @property
    def skipped_chunks(self) -> int:
        """Chunks not written: already cached or no room on the server."""
        return self.total_chunks - self.written_chunks

    @property
    def stored_tokens(self) -> int:
        """Tokens covered by chunks newly written by this call."""
        return self.written_chunks * self.chunk_size


#: Copies chunk objects (placements, bounds) into the caller's destination for ``hit`` chunks.
_Sink = Callable[[int, list[tuple[int, int]], kcopy.RegionArg], None]


@dataclass
class _Seq:
    """One operation's RPC sequence: its socket, session and how far it got."""

    conn: Connection
    generation: int  # of conn when the sequence began; release steps need the same peer
    enc: KeyEncoder
    rid: str
    n: int  # full-chunk tokens of the input
    lookup_sent: bool = False
    hit: int | None = None
    retrieve_key: bytes | None = None
    read_gate: bytes | None = None  # held from prepare_retrieve until commit_retrieve


class _KeyedLock:
    """One asyncio lock per key, dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[bytes, tuple[asyncio.Lock, int]] = {}

    async def acquire(self, key: bytes, deadline: float, server: str) -> None:
        lock, users = self._locks.get(key, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._locks[key] = (lock, users + 1)
        try:
            await asyncio.wait_for(lock.acquire(), max(0.0, deadline - time.monotonic()))
        except BaseException as exc:
            self._drop(key)
            if isinstance(exc, TimeoutError):
                raise ServerTimeoutError(
                    "deadline expired waiting for a concurrent retrieve of the same prefix",
                    op="prepare_retrieve", server=server) from None
            raise

    def release(self, key: bytes) -> None:
        self._locks[key][0].release()
        self._drop(key)

    def _drop(self, key: bytes) -> None:
        lock, users = self._locks[key]
        if users <= 1:
            del self._locks[key]
        else:
            self._locks[key] = (lock, users - 1)


class _OpState:
    """Shared between a caller and its operation task."""

    __slots__ = ("abandoned",)

    def __init__(self) -> None:
        self.abandoned = False


def _new_request_id(kind: str) -> str:
    # Fresh per sequence: the server caches chunk hashes per request_id (§5.3).
    return f"lmkv-{kind}-{uuid.uuid4().hex}"


class AsyncKVContext:
    """An open connection to one LMCache MP server for one model and layout.

    Create it with :func:`connect`. All methods are coroutines and may be
    awaited concurrently from many tasks; every call has a deadline
    (``timeout=None`` means the context default, never "wait forever").
    """

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
    ) -> None:
        self.url = url
        self.http_url = http_url
        self.model_name = model_name
        self.timeout = timeout
        self._requested_transport: TransportMode = transport
        self._layout = layout
        self._shm_dir = shm_dir
        self._prefault = prefault
        self._heartbeat_interval = heartbeat_interval
        self._http = HttpClient(http_url, timeout=timeout)
        self._transport = Transport(url, sockets=sockets)
        self.instance_id = secrets.randbits(63)
        self._dialect: Dialect | None = None
        self._server_version = ""
        self._chunk_size = 0
        self._pool: PoolMapping | None = None
        self._retired_pools: list[PoolMapping] = []
        self._mode: Literal["shm", "pickle"] = "pickle"
        self._slot_spec: SlotSpec | None = None
        self._registered_generation = -1
        self._register_sent = False
        self._loop_dead = False  # see _diagnose_silence
        #: SHM retrieves of one prefix are serialised: the server keys pending reads by
        #: (instance, key) and key equality ignores request_id, so a second concurrent
        #: prepare_retrieve of the same key would overwrite the first's pending read.
        self._read_gates = _KeyedLock()
        self._register_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._heartbeat: asyncio.Task[None] | None = None
        self._state: Literal["new", "open", "closing", "closed"] = "new"
        self._reap_timeout: float | None = None

    # ------------------------------------------------------------------ properties
    @property
    def chunk_size(self) -> int:
        """Tokens per server object (``--chunk-size``)."""
        return self._chunk_size

    @property
    def layout(self) -> KVLayout:
        """The KV geometry in use (explicit or discovered)."""
        assert self._layout is not None
        return self._layout

    @property
    def transport(self) -> Literal["shm", "pickle"]:
        """The transfer path really in use: ``"shm"`` or ``"pickle"``."""
        return self._mode

    @property
    def server_version(self) -> str:
        """The server's ``/version`` string, e.g. ``"0.5.6-g3e11e108"``."""
        return self._server_version

    @property
    def dialect(self) -> Dialect:
        """The op-id table chosen for this server."""
        assert self._dialect is not None
        return self._dialect

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` has started."""
        return self._state in ("closing", "closed")

    # ------------------------------------------------------------------ lifecycle
    async def _open(self) -> None:
        try:
            await self._detect_server()
            self._transport.start()
            if not await self._transport.wait_connected(self.timeout):
                raise ServerUnavailableError("cannot connect to the ZMQ endpoint", server=self.url)
            if self._dialect is None:
                await self._probe_dialect()
            await self._register(time.monotonic() + self.timeout)
            self._state = "open"
            if self._heartbeat_interval is None:
                reap = self._reap_timeout or 120.0
                self._heartbeat_interval = max(1.0, min(10.0, reap / 4))
            if self._heartbeat_interval > 0:
                self._heartbeat = asyncio.create_task(self._heartbeat_loop(), name="lmkv-heartbeat")
        except BaseException:
            # Unregister whenever a registration was sent: its reply may have been late
            # or malformed after the server had registered us (unregister is idempotent).
            await self._teardown(unregister=self._register_sent)
            raise

    async def _detect_server(self) -> None:
        """Version, mode and chunk size over HTTP (compat.md §11)."""
        try:
            self._server_version = await self._http.version()
        except ProtocolError:
            self._server_version = ""
        config = await self._http.config()
        version = parse_version(self._server_version) if self._server_version else None
        if version is not None:
            self._dialect = dialect_for_version(version)
            if self._dialect is None:
                raise UnsupportedServerError(
                    f"lmcache {self._server_version} is older than 0.5.0", server=self.http_url
                )
        else:
            self._dialect = dialect_from_config(config)
        mp = config.get("mp") or {}
        mode = mp.get("supported_transfer_mode")
        if mode == "lmcache_driven":
            raise UnsupportedServerError(
                "the server runs --supported-transfer-mode lmcache_driven, which has no handler "
                "for the engine-driven operations this client uses; restart it with "
                "--supported-transfer-mode auto (or engine_driven)",
                server=self.http_url,
            )
        chunk = mp.get("chunk_size")
        if isinstance(chunk, int) and chunk > 0:
            self._chunk_size = chunk
        reap = mp.get("worker_reap_timeout_seconds")
        if isinstance(reap, (int, float)) and reap > 0:
            self._reap_timeout = float(reap)
        if self._layout is None:
            self._layout = discover_layout(await self._http.status(), self.model_name)
        if self._chunk_size <= 0:
            raise ProtocolError("/config has no mp.chunk_size", server=self.http_url)
        if self._chunk_size % self.layout.block_size != 0:
            raise InvalidInputError(
                f"chunk size {self._chunk_size} is not a multiple of block_size "
                f"{self.layout.block_size}"
            )

    async def _probe_dialect(self) -> None:
        # Op 21 with no payload is harmless on every supported table (compat.md §11).
        conn = self._transport.pick()
        result = await conn.probe(PROBE_OP_ID, timeout=self.timeout)
        self._dialect = dialect_from_probe(result)
        if self._dialect is None:
            raise UnsupportedServerError(f"cannot identify the server from {result!r}",
                                         server=self.url)

    async def _register(self, deadline: float) -> None:
        """Register our engine-driven context and pick the transfer path."""
        layout = self.layout
        generation = self._transport.generation
        payload = RegisterPayload(
            instance_id=self.instance_id,
            model_name=self.model_name,
            world_size=layout.world_size,
            block_size=layout.block_size,
            num_layers=layout.num_layers,
            hidden_dim_size=layout.hidden_dim,
            dtype_str=layout.dtype_name,
            use_mla=layout.use_mla,
            num_physical_slots=self._chunk_size,
        )
        conn = self._transport.pick()
        self._register_sent = True
        raw = await self._rpc(conn, "register_kv_cache_engine_driven_context",
                              [encode_register(payload)], deadline)
        reply = parse_register(raw)
        self._registered_generation = generation
        old_pool, self._pool = self._pool, None
        if old_pool is not None:
            if old_pool.is_current(reply.shm_name, reply.pool_size):
                # Same server (e.g. only one socket of the pool reconnected): keep it.
                self._pool = old_pool
                return
            # An operation may still hold addresses into it; unmap at close.
            self._retired_pools.append(old_pool)
        mode: Literal["shm", "pickle"] = "pickle"
        if reply.has_shm and self._requested_transport == "pickle":
            raise TransportUnavailableError(
                "transport='pickle' but the server has an SHM pool, and an SHM server "
                "serves retrieves only through it; use transport='auto' or 'shm'"
            )
        if reply.has_shm:
            try:
                pool = PoolMapping(reply.shm_name, reply.pool_size, shm_dir=self._shm_dir)
            except OSError as exc:
                if self._requested_transport == "shm":
                    raise TransportUnavailableError(
                        f"cannot map the server's SHM pool {reply.shm_name!r}: {exc}"
                    ) from None
                log.warning(
                    "SHM pool %s cannot be opened (%s); falling back to pickle: stores and "
                    "lookups work, retrieves from this SHM server raise "
                    "TransportUnavailableError", reply.shm_name, exc)
            else:
                if self._prefault:
                    how = await asyncio.to_thread(pool.populate)
                    log.debug("pre-faulted SHM pool %s (%s)", reply.shm_name, how)
                self._pool = pool
                mode = "shm"
        elif self._requested_transport == "shm":
            raise TransportUnavailableError(
                "transport='shm' but the server offers no SHM pool (start it with "
                "--shm-name NAME, and --no-l1-use-lazy on GPU hosts)"
            )
        self._mode = mode
        self._slot_spec = (
            SlotSpec(layout.chunk_shape(self._chunk_size), layout.dtype_name, layout.itemsize,
                     reply.pool_size)
            if mode == "shm" else None
        )

    async def _ensure_registered(self, deadline: float) -> None:
        """Re-register after a reconnect: a restarted server has forgotten us.

        Waits (within the deadline) for a socket that is down to come back first,
        so an operation never runs against a restarted server before it knows us.
        """
        if not all(c.connected for c in self._transport.connections):
            remaining = min(deadline - time.monotonic(), RECONNECT_GRACE)
            if remaining <= 0 or not await self._transport.wait_connected(remaining):
                raise ServerUnavailableError("the server is unreachable", server=self.url)
        if self._transport.generation == self._registered_generation:
            return
        async with self._register_lock:
            if self._transport.generation == self._registered_generation:
                return
            log.info("server connection was re-established; registering again")
            await self._register(deadline)

    async def _heartbeat_loop(self) -> None:
        assert self._heartbeat_interval is not None
        while True:
            await asyncio.sleep(self._heartbeat_interval)
            try:
                deadline = time.monotonic() + min(self.timeout, max(self._heartbeat_interval, 1.0))
                await self._ensure_registered(deadline)
                await self._rpc(self._transport.pick(), "ping", [pack(self.instance_id)], deadline)
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
        if not await self._http.healthcheck():
            return  # all of it is down or frozen: plain timeouts say enough
        probe = Connection(self._transport.zmq_context, self.url, -1)
        probe.start()
        try:
            answered = await probe.wait_connected(2.0)
            if answered:
                await probe.probe(PROBE_OP_ID, timeout=2.0)
        except KVCacheError:
            answered = False
        finally:
            probe.close()
        if not answered and not self._loop_dead:
            log.error("the server's ZMQ request loop is unresponsive while its HTTP API reports "
                      "healthy (%s); restart the server", self.url)
        self._loop_dead = not answered

    async def aclose(self) -> None:
        """Finish in-flight release steps, unregister, and close everything.

        Idempotent. Operations still running are allowed to finish their
        release steps (bounded by their deadlines) before the registration is
        dropped, since unregistering with a reservation outstanding would
        publish it (protocol reference §6.6).
        """
        if self._state in ("closing", "closed"):
            return
        self._state = "closing"
        await self._teardown(unregister=True)

    async def _teardown(self, *, unregister: bool) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
        give_up = time.monotonic() + CLEANUP_TIMEOUT + self.timeout
        if self._loop_dead:
            # Nothing will be answered: do not wait out the release steps' deadlines.
            for task in self._tasks:
                task.cancel()
            give_up = time.monotonic() + 1.0
        # Unregistering with a reservation outstanding would publish it (§6.6): wait for
        # running operations and for late prepare_store replies first (bounded).
        while time.monotonic() < give_up and (
            self._tasks or any(c.late_pending for c in self._transport.connections)
        ):
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=give_up - time.monotonic())
            else:
                await asyncio.sleep(0.05)
        if unregister and self._dialect is not None and not self._loop_dead:
            try:
                await self._rpc(
                    self._transport.pick(), "unregister_kv_cache_engine_driven_context",
                    [pack(self.instance_id)], time.monotonic() + min(self.timeout, 5.0),
                )
            except KVCacheError as exc:
                log.warning("unregister failed: %s", exc)
        self._transport.close()
        await self._http.aclose()
        for pool in [self._pool, *self._retired_pools]:
            if pool is not None:
                pool.close()
        self._pool = None
        self._retired_pools.clear()
        self._state = "closed"

    async def __aenter__(self) -> AsyncKVContext:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ plumbing
    async def _rpc(self, conn: Connection, op: str, payloads: Sequence[bytes],
                   deadline: float, on_late: LateHandler | None = None) -> object:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ServerTimeoutError("deadline expired before the request was sent", op=op,
                                     server=self.url, timeout=0.0)
        try:
            reply = await conn.request(op, self.dialect.op_id(op), payloads, timeout=remaining,
                                       on_late=on_late, late_window=CLEANUP_TIMEOUT)
            self._loop_dead = False
            return reply.result()
        except ServerError as exc:
            if self._loop_dead and isinstance(exc, ServerTimeoutError):
                exc.message += (" (the server's ZMQ request loop is unresponsive while its HTTP "
                                "API reports healthy; restart the server)")
            if exc.op is None:
                exc.op = op
            if exc.server is None:
                exc.server = self.url
            raise

    async def _cleanup_rpc(self, seq: _Seq, op: str, payloads: Sequence[bytes]) -> object:
        """A release step: own deadline, failures logged (the caller's error wins).

        Skipped once the socket has lost or replaced its peer: on loopback that
        means the server process died, taking its locks and sessions with it, and
        a stale release sent to a restarted server could strip another client's
        locks (0.5.2's free_lookup_locks is anonymous, compat.md §6.3).
        """
        conn = seq.conn
        if conn.generation != seq.generation or not conn.connected:
            log.debug("skipping %s: the server connection was lost", op)
            return None
        try:
            return await self._rpc(conn, op, payloads, time.monotonic() + CLEANUP_TIMEOUT)
        except KVCacheError as exc:
            log.warning("release step %s failed: %s", op, exc)
            return None

    def _release_later(self, steps: Coroutine[Any, Any, None]) -> None:
        """Run release steps in the background: the caller has its answer already.

        They are ordered after everything the operation did on the same socket,
        and aclose() waits for them before unregistering.
        """
        self._track(asyncio.create_task(steps))

    async def _cleanup_rpc_none(self, seq: _Seq, op: str, payloads: Sequence[bytes]) -> None:
        await self._cleanup_rpc(seq, op, payloads)

    def _seq(self, kind: str, toks: Sequence[int], salt: str, n: int) -> _Seq:
        conn = self._transport.pick()
        return _Seq(conn, conn.generation, self._key(toks, salt), _new_request_id(kind), n)

    def _check_open(self) -> None:
        if self._state != "open":
            raise ClosedError(f"context is {self._state}")

    async def _run(self, op: Callable[[_OpState], Coroutine[Any, Any, T]]) -> T:
        """Run an operation in its own task; shield it from the caller's cancellation."""
        state = _OpState()
        task = self._track(asyncio.create_task(op(state)))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            state.abandoned = True
            raise
        except ServerError as exc:  # errors from reply parsing name the server too
            if exc.server is None:
                exc.server = self.url
            raise

    def _track(self, task: asyncio.Task[T]) -> asyncio.Task[T]:
        """Keep a background task until it ends; aclose() waits for all of them."""
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            pass  # retrieved here so an abandoned task's error is not reported as lost

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + check_timeout(timeout, self.timeout)

    def _key(self, tokens: Sequence[int], salt: str) -> KeyEncoder:
        return KeyEncoder(self.model_name, self.layout.world_size, tokens, salt)

    # ------------------------------------------------------------------ lookup
    async def _prefetch_result(self, conn: Connection, rid: str, deadline: float) -> int:
        """Consume the lookup result (exactly once), awaiting it without sleep-polling.

        L1 prefetches finish at once, so one query nearly always answers; if not,
        short server-side waits (bounded, since a wait occupies one of the
        server's normal-pool threads) take over.
        """
        rid_frame = pack(rid)
        count = as_optional_count(
            await self._rpc(conn, "query_prefetch_status", [rid_frame], deadline),
            "query_prefetch_status",
        )
        wait = 0.02
        while count is None:
            budget = min(wait, max(0.001, deadline - time.monotonic() - 0.05))
            count = as_optional_count(
                await self._rpc(conn, "wait_prefetch_status", [rid_frame, pack(float(budget))],
                                deadline),
                "wait_prefetch_status",
            )
            wait = min(wait * 2, 0.5)
        return count

    async def _lookup_locked(self, seq: _Seq, deadline: float) -> int:
        """Send lookup, await its ack, consume the result. Returns hit chunks.

        ``seq`` records how far we got, for the release steps.
        """
        C = self._chunk_size
        key = seq.enc.encode(prefix_len=seq.n, start=0, end=seq.n, request_id=seq.rid,
                             worker_id=None)
        seq.lookup_sent = True
        await self._rpc(seq.conn, "lookup", [key, pack(self.layout.world_size)], deadline)
        hit = await self._prefetch_result(seq.conn, seq.rid, deadline)
        if hit > seq.n // C:
            seq.hit = seq.n // C
            raise ProtocolError(f"server reports {hit} hit chunks for {seq.n // C} looked up",
                                op="query_prefetch_status", server=self.url)
        seq.hit = hit
        return hit

    async def _release_lookup(self, seq: _Seq, *, free_hit: bool) -> None:
        """Release steps of a lookup: consume, free the hit's locks, end the session."""
        if not seq.lookup_sent:
            return
        hit = seq.hit
        if hit is None:
            # The lookup may still run on the server; consume its result so we know
            # what it locked. If our query had consumed it already (its reply was lost),
            # the wait says 0: a bounded free (0.5.6) may then free the whole range,
            # since the server limits it to the hit it recorded for this session.
            raw = await self._cleanup_rpc(seq, "wait_prefetch_status", [pack(seq.rid), pack(1.0)])
            try:
                hit = as_optional_count(raw, "wait_prefetch_status") or 0
            except ProtocolError:
                hit = 0
            if self.dialect.bounded_free:
                hit = seq.n // self._chunk_size
            free_hit = True
        if free_hit and hit:
            key = seq.enc.encode(prefix_len=seq.n, start=0, end=hit * self._chunk_size,
                                 request_id=seq.rid, worker_id=None)
            await self._cleanup_rpc(seq, "free_lookup_locks", [key, pack(self.layout.world_size)])
        await self._cleanup_rpc(seq, "end_session", [pack(seq.rid)])

    async def lookup(self, tokens: Tokens, *, cache_salt: str = "",
                     timeout: float | None = None) -> int:
        """Length in tokens of the longest cached prefix of ``tokens``.

        A multiple of :attr:`chunk_size`; 0 on a miss or when ``tokens`` is
        shorter than one chunk. Moves no data and leaves no lock behind.
        """
        toks = check_tokens(tokens)
        salt = check_salt(cache_salt)
        deadline = self._deadline(timeout)
        self._check_open()
        n = len(toks) // self._chunk_size * self._chunk_size
        if n == 0:
            return 0

        async def op(state: _OpState) -> int:
            await self._ensure_registered(deadline)
            seq = self._seq("lookup", toks, salt, n)
            try:
                return await self._lookup_locked(seq, deadline) * self._chunk_size
            finally:
                self._release_later(self._release_lookup(seq, free_hit=True))

        return await self._run(op)

    # ------------------------------------------------------------------ retrieve
    async def retrieve(
        self,
        tokens: Tokens,
        *,
        out: torch.Tensor | None = None,
        cache_salt: str = "",
        timeout: float | None = None,
    ) -> torch.Tensor | None:
        """The KV of the longest cached prefix of ``tokens``, or None on a miss.

        Returns a ``[P, L, n, D]`` tensor with ``n`` the hit length in tokens (a
        multiple of :attr:`chunk_size`). With ``out`` (a ``[P, L, >=T, D]`` CPU
        tensor of the layout's dtype, ``T`` the full-chunk length of ``tokens``)
        the data is written into it and the view ``out[:, :, :n]`` is returned.
        Without it the result comes from :data:`lmkv_async.buffers.output_pool`:
        anonymous memory advised for transparent huge pages and pre-faulted, and
        reused once an earlier result is freed, so steady-state retrieves do not
        pay the 4 KiB page-fault cliff (``LMKV_OUTPUT_POOL_BYTES`` caps the pool).
        If the call is cancelled, ``out`` may have been partly written.
        """
        toks = check_tokens(tokens)
        salt = check_salt(cache_salt)
        deadline = self._deadline(timeout)
        C = self._chunk_size
        n = len(toks) // C * C
        if out is not None:
            check_out(out, self.layout, n)
        self._check_open()
        if n == 0:
            return None
        layout = self.layout
        result: list[torch.Tensor] = []

        def sink(hit: int, chunks: list[tuple[int, int]], region: kcopy.RegionArg) -> None:
            dst = out if out is not None else output_pool.empty(
                (layout.planes, layout.num_layers, hit * C, layout.hidden_dim), layout.dtype)
            view = dst[:, :, : hit * C]
            kcopy.chunks_to_dense(view, chunks, chunk_tokens=C, region=region)
            result.append(view)

        hit = await self._run(lambda state: self._retrieve_seq(state, toks, n, salt, sink,
                                                               deadline))
        return result[0] if hit else None

    async def retrieve_blocks(
        self,
        tokens: Tokens,
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int] | torch.Tensor,
        *,
        cache_salt: str = "",
        timeout: float | None = None,
    ) -> int:
        """Retrieve the cached prefix of ``tokens`` straight into a paged engine cache.

        ``kv_caches`` is one HND tensor ``[NB, P, NH, BS, HS]`` per layer and
        ``block_ids[j]`` the block holding tokens ``[j*BS, (j+1)*BS)``. Chunk
        objects are copied into the blocks in one pass (no intermediate
        ``[P, L, T, D]`` tensor). Returns the hit length in tokens; blocks past
        it are untouched.
        """
        toks = check_tokens(tokens)
        salt = check_salt(cache_salt)
        deadline = self._deadline(timeout)
        C = self._chunk_size
        n = len(toks) // C * C
        bids = check_paged(kv_caches, block_ids, self.layout, n)
        self._check_open()
        if n == 0:
            return 0
        dtype = self.layout.dtype

        def sink(hit: int, chunks: list[tuple[int, int]], region: kcopy.RegionArg) -> None:
            kcopy.chunks_to_paged(chunks, kv_caches, bids, num_tokens=hit * C, chunk_tokens=C,
                                  dtype=dtype, region=region)

        hit = await self._run(lambda state: self._retrieve_seq(state, toks, n, salt, sink,
                                                               deadline))
        return hit * C

    async def _retrieve_seq(
        self, state: _OpState, toks: list[int], n: int, salt: str, sink: _Sink, deadline: float,
    ) -> int:
        """lookup -> prepare_retrieve -> sink(chunks) -> commit_retrieve; returns hit chunks."""
        await self._ensure_registered(deadline)
        C = self._chunk_size
        seq = self._seq("retrieve", toks, salt, n)
        # "none": prepare not sent; "sent": sent, no reply; "shm"/"pickle": reply in hand
        prepared = "none"
        spec, pool = self._slot_spec, self._pool
        try:
            hit = await self._lookup_locked(seq, deadline)
            if hit == 0 or state.abandoned:
                return 0
            key = seq.enc.encode(prefix_len=hit * C, start=0, end=hit * C, request_id=seq.rid,
                                 worker_id=0)
            if spec is not None:
                gate = seq.enc.identity(hit * C)
                await self._read_gates.acquire(gate, deadline, self.url)
                seq.read_gate = gate
            seq.retrieve_key = key
            prepared = "sent"
            raw = await self._rpc(seq.conn, "prepare_retrieve", [key, pack(self.instance_id)],
                                  deadline)
            if spec is None and _has_slots(raw):
                # An SHM server serves retrieves only through its pool, which this
                # client could not map; commit_retrieve (cleanup) releases the read.
                prepared = "shm"
                raise TransportUnavailableError(
                    "the server serves retrieves only through its SHM pool, which this "
                    f"client could not map (shm_dir={self._shm_dir!r})"
                )
            reply = parse_prepare_retrieve(raw, spec, hit)
            prepared = "shm" if reply.shm else "pickle"
            if not reply.success:
                # An object went missing under our locks (0.5.2 peers can strip them).
                log.warning("prepare_retrieve failed for %d chunks; reporting a miss", hit)
                prepared = "failed"
                return 0
            if state.abandoned:
                return 0
            nbytes = hit * C * self.layout.token_bytes()
            if reply.shm:
                assert pool is not None  # spec is set only together with a pool
                chunks = [(i, pool.address + s.offset) for i, s in enumerate(reply.slots)]
                await kcopy.run_copy(sink, hit, chunks, pool.region, nbytes=nbytes)
            else:
                tensors = await _maybe_thread(loads_tensors, reply.data, nbytes=nbytes)
                self._check_chunk_tensors(tensors, hit)
                chunks, regions = kcopy.tensor_placements(tensors)
                await kcopy.run_copy(sink, hit, chunks, regions, nbytes=nbytes)
            return hit
        finally:
            self._release_later(self._release_retrieve(seq, prepared))

    async def _release_retrieve(self, seq: _Seq, prepared: str) -> None:
        try:
            if prepared in ("shm", "sent") and seq.retrieve_key is not None:
                # commit_retrieve releases the pending read (SHM). After a lost
                # prepare reply it is sent on the same socket, so the server's
                # per-identity FIFO runs it after the prepare; a second commit is a no-op.
                await self._cleanup_rpc(seq, "commit_retrieve",
                                        [seq.retrieve_key, pack(self.instance_id)])
        finally:
            if seq.read_gate is not None:
                self._read_gates.release(seq.read_gate)
        # pickle prepare released its locks itself; "none"/"failed" still hold the lookup's.
        await self._release_lookup(seq, free_hit=prepared in ("none", "failed"))

    def _check_chunk_tensors(self, tensors: Sequence[torch.Tensor], count: int) -> None:
        shape = self.layout.chunk_shape(self._chunk_size)
        if len(tensors) != count:
            raise ProtocolError(f"pickle reply holds {len(tensors)} chunks, expected {count}",
                                server=self.url)
        for t in tensors:
            if tuple(t.shape) != shape or t.dtype != self.layout.dtype or not t.is_contiguous():
                raise ProtocolError(
                    f"pickle chunk {tuple(t.shape)} {t.dtype} does not match the layout "
                    f"{shape} {self.layout.dtype}", server=self.url)

    # ------------------------------------------------------------------ store
    async def store(
        self,
        kv: torch.Tensor,
        tokens: Tokens,
        *,
        cache_salt: str = "",
        timeout: float | None = None,
    ) -> StoreResult:
        """Store the KV of ``tokens``: ``kv`` is ``[P, L, T, D]`` with ``T = len(tokens)``.

        Only whole chunks are stored; tokens past the last full chunk are not
        (reported as ``ignored_tokens``). Chunks already cached are not sent
        again. Once the server has handed out slots, the copy and commit run to
        completion even if the caller is cancelled, so ``kv`` may still be read
        briefly after a cancellation.
        """
        toks = check_tokens(tokens)
        salt = check_salt(cache_salt)
        check_kv(kv, self.layout, len(toks))
        deadline = self._deadline(timeout)
        self._check_open()
        C = self._chunk_size
        n = len(toks) // C * C
        src = kv[:, :, :n]

        def to_chunks(chunks: list[tuple[int, int]], region: kcopy.RegionArg) -> None:
            kcopy.dense_to_chunks(src, chunks, chunk_tokens=C, region=region)

        return await self._store(toks, salt, to_chunks, lambda: src, deadline)

    async def store_blocks(
        self,
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int] | torch.Tensor,
        tokens: Tokens,
        *,
        cache_salt: str = "",
        timeout: float | None = None,
    ) -> StoreResult:
        """Store KV straight from a paged engine cache.

        ``kv_caches`` is one HND tensor ``[NB, P, NH, BS, HS]`` per layer (as
        vLLM keeps them) and ``block_ids[j]`` the block holding tokens
        ``[j*BS, (j+1)*BS)``; at least ``ceil(n / BS)`` ids are needed for the
        ``n`` full-chunk tokens. On SHM, blocks are copied into the server's
        slots in one pass. Same result and guarantees as :meth:`store`.
        """
        toks = check_tokens(tokens)
        salt = check_salt(cache_salt)
        deadline = self._deadline(timeout)
        C = self._chunk_size
        n = len(toks) // C * C
        bids = check_paged(kv_caches, block_ids, self.layout, n)
        self._check_open()
        layout = self.layout

        def to_chunks(chunks: list[tuple[int, int]], region: kcopy.RegionArg) -> None:
            kcopy.paged_to_chunks(kv_caches, bids, chunks, num_tokens=n, chunk_tokens=C,
                                  dtype=layout.dtype, region=region)

        def to_dense() -> torch.Tensor:
            dense = output_pool.empty(
                (layout.planes, layout.num_layers, n, layout.hidden_dim), layout.dtype)
            kcopy.paged_to_dense(dense, kv_caches, bids)
            return dense

        return await self._store(toks, salt, to_chunks, to_dense, deadline)

    async def _store(
        self,
        toks: list[int],
        salt: str,
        to_chunks: Callable[[list[tuple[int, int]], kcopy.RegionArg], None],
        to_dense: Callable[[], torch.Tensor],
        deadline: float,
    ) -> StoreResult:
        C = self._chunk_size
        total = len(toks) // C
        ignored = len(toks) - total * C
        if total == 0:
            return StoreResult(0, 0, C, ignored)

        async def op(state: _OpState) -> StoreResult:
            await self._ensure_registered(deadline)
            if self._mode == "shm":
                written = await self._store_shm(toks, total, salt, to_chunks, deadline)
            else:
                written = await self._store_pickle(toks, total, salt, to_dense, deadline)
            return StoreResult(total, written, C, ignored)

        return await self._run(op)

    async def _store_shm(self, toks: list[int], total: int, salt: str,
                         to_chunks: Callable[[list[tuple[int, int]], kcopy.RegionArg], None],
                         deadline: float) -> int:
        C = self._chunk_size
        n = total * C
        seq = self._seq("store", toks, salt, n)
        conn, rid = seq.conn, seq.rid
        key = seq.enc.encode(prefix_len=n, start=0, end=n, request_id=rid, worker_id=0)
        iid = pack(self.instance_id)
        pool, spec = self._pool, self._slot_spec

        async def fill_and_commit(raw: object, commit_deadline: float) -> int:
            prep = parse_prepare_store(raw, spec, total)
            if not prep.shm:
                raise ProtocolError("SHM context got a pickle-style prepare_store reply",
                                    op="prepare_store", server=self.url)
            if not prep.slots:
                return 0
            assert pool is not None
            chunks = [
                (i, pool.address + s.offset)
                for i, s in zip(prep.chunk_indices, prep.slots, strict=True)
            ]
            nbytes = len(chunks) * C * self.layout.token_bytes()
            # Every reserved slot is filled completely before commit (§6.6); the
            # sequence runs on even if the caller is cancelled.
            await kcopy.run_copy(to_chunks, chunks, pool.region, nbytes=nbytes)
            ok = as_bool(
                await self._rpc(conn, "commit_store", [key, iid, pack(b"")], commit_deadline),
                "commit_store",
            )
            return len(prep.slots) if ok else 0

        async def late_store(reply: Reply) -> None:
            # prepare_store answered after its deadline: the slots are reserved
            # anyway and an unfilled reservation could later be published (§6.6).
            try:
                await fill_and_commit(reply.result(), time.monotonic() + CLEANUP_TIMEOUT)
            except KVCacheError as exc:
                log.warning("completing a late prepare_store failed: %s", exc)
            finally:
                await self._cleanup_rpc(seq, "end_session", [pack(rid)])

        def on_late(reply: Reply) -> None:
            self._track(asyncio.create_task(late_store(reply)))

        try:
            raw = await self._rpc(conn, "prepare_store", [key, iid], deadline, on_late=on_late)
            return await fill_and_commit(raw, deadline)
        finally:
            self._release_later(self._cleanup_rpc_none(seq, "end_session", [pack(rid)]))

    async def _store_pickle(self, toks: list[int], total: int, salt: str,
                            to_dense: Callable[[], torch.Tensor], deadline: float) -> int:
        C = self._chunk_size
        n = total * C
        # Skip the cached prefix: the pickle commit cannot report what it wrote, and
        # not pickling cached chunks saves most of the cost of a re-store.
        before = await self._cached_prefix(toks, salt, n, deadline)
        if before >= total:
            return 0
        seq = self._seq("store", toks, salt, n)
        key = seq.enc.encode(prefix_len=n, start=before * C, end=n, request_id=seq.rid,
                             worker_id=0)
        nbytes = (total - before) * C * self.layout.token_bytes()

        def encode() -> bytes:
            kv = to_dense()
            return dumps_tensors(
                [kv[:, :, i * C:(i + 1) * C].contiguous() for i in range(before, total)])

        try:
            data = await _maybe_thread(encode, nbytes=nbytes)
            ok = as_bool(
                await self._rpc(seq.conn, "commit_store",
                                [key, pack(self.instance_id), pack(data)], deadline),
                "commit_store",
            )
        finally:
            self._release_later(self._cleanup_rpc_none(seq, "end_session", [pack(seq.rid)]))
        if ok:
            return total - before
        # Some chunks hit out-of-memory: count what is there now.
        after = await self._cached_prefix(toks, salt, n, deadline)
        return max(0, after - before)

    async def _cached_prefix(self, toks: Sequence[int], salt: str, n: int,
                             deadline: float) -> int:
        seq = self._seq("probe", toks, salt, n)
        try:
            return await self._lookup_locked(seq, deadline)
        finally:
            self._release_later(self._release_lookup(seq, free_hit=True))

    # ------------------------------------------------------------------ fan-out
    async def lookup_many(
        self,
        token_lists: Sequence[Tokens],
        *,
        cache_salt: str = "",
        max_in_flight: int = 32,
        timeout: float | None = None,
    ) -> list[ItemResult[int]]:
        """:meth:`lookup` for many sequences, at most ``max_in_flight`` at once.

        Returns one :class:`ItemResult` per input, in input order; ``value`` is
        the cached prefix length in tokens, or ``error`` holds that item's error.
        """
        return await run_bounded(
            token_lists,
            lambda toks: self.lookup(toks, cache_salt=cache_salt, timeout=timeout),
            max_in_flight,
        )

    async def retrieve_many(
        self,
        token_lists: Sequence[Tokens],
        *,
        outs: Sequence[torch.Tensor | None] | None = None,
        cache_salt: str = "",
        max_in_flight: int = 32,
        timeout: float | None = None,
    ) -> list[ItemResult[torch.Tensor | None]]:
        """:meth:`retrieve` for many sequences (``outs[i]`` is item i's buffer, or None).

        One :class:`ItemResult` per input, in order; ``value`` is the tensor, or
        None on a miss; ``error`` holds that item's error.
        """
        if outs is not None and len(outs) != len(token_lists):
            raise InvalidInputError(f"{len(outs)} outs for {len(token_lists)} token lists")
        pairs = list(zip(token_lists, outs or [None] * len(token_lists), strict=True))
        return await run_bounded(
            pairs,
            lambda p: self.retrieve(p[0], out=p[1], cache_salt=cache_salt, timeout=timeout),
            max_in_flight,
        )

    async def store_many(
        self,
        items: Sequence[tuple[torch.Tensor, Tokens]],
        *,
        cache_salt: str = "",
        max_in_flight: int = 32,
        timeout: float | None = None,
    ) -> list[ItemResult[StoreResult]]:
        """:meth:`store` for many ``(kv, tokens)`` pairs; one :class:`ItemResult` each."""
        return await run_bounded(
            items,
            lambda it: self.store(it[0], it[1], cache_salt=cache_salt, timeout=timeout),
            max_in_flight,
        )

    # ------------------------------------------------------------------ maintenance
    async def status(self) -> dict[str, Any]:
        """The server's ``/status`` (locks, sessions, registrations).

        Raises:
            ClosedError: the context is closed.
        """
        self._check_open()
        return await self._http.status()


def _has_slots(raw: object) -> bool:
    context = raw.get("context") if isinstance(raw, dict) else None
    return isinstance(context, dict) and "slots" in context


async def _maybe_thread(fn: Callable[..., T], *args: Any, nbytes: int) -> T:
    """Run CPU-heavy work (pickling, unpickling) off the event loop when it is big."""
    if nbytes >= kcopy.INLINE_LIMIT:
        return await anyio.to_thread.run_sync(functools.partial(fn, *args))
    return fn(*args)


class _Connecting:
    """``connect(...)`` result: await it, or use it as ``async with``."""

    def __init__(self, factory: Callable[[], Awaitable[AsyncKVContext]]) -> None:
        self._factory = factory
        self._ctx: AsyncKVContext | None = None

    def __await__(self) -> Generator[Any, None, AsyncKVContext]:
        return self._factory().__await__()

    async def __aenter__(self) -> AsyncKVContext:
        self._ctx = await self._factory()
        return self._ctx

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._ctx is not None:
            await self._ctx.aclose()


def connect(
    url: str,
    http_url: str,
    model_name: str,
    *,
    layout: KVLayout | None = None,
    timeout: float = 10.0,
    transport: TransportMode = "auto",
    sockets: int = 1,
    shm_dir: str = "/dev/shm",
    heartbeat_interval: float | None = None,
    prefault: bool = True,
) -> _Connecting:
    """Connect to an LMCache MP server and register a context for ``model_name``.

    Use as ``async with connect(...) as ctx:`` or ``ctx = await connect(...)``
    followed by ``await ctx.aclose()``.

    Args:
        url: the server's ZMQ endpoint, e.g. ``"tcp://127.0.0.1:5555"``
            (a bare ``host:port`` gets ``tcp://``).
        http_url: the server's HTTP API, e.g. ``"http://127.0.0.1:8080"``.
        model_name: the server-side model namespace.
        layout: explicit geometry; ``None`` discovers it from ``/status``
            (``cache_context_meta``, as registered by an inference engine).
        timeout: default deadline in seconds for each operation.
        transport: ``"auto"`` (SHM when the server offers it and the segment
            can be mapped, else pickle), ``"shm"`` (raise
            :class:`TransportUnavailableError` instead of degrading) or ``"pickle"``.
        sockets: DEALER sockets to spread operations over (useful with a server
            started with ``--max-gpu-workers N``).
        shm_dir: where the server's SHM segments are visible.
        heartbeat_interval: seconds between ``ping`` heartbeats; ``None`` picks
            ``min(10, reap_timeout / 4)``; ``0`` disables them.
        prefault: pre-fault the SHM pool's pages once at connect.

    Raises:
        InvalidInputError: bad arguments (nothing is sent).
        UnsupportedServerError: an unsupported version, or a server in
            ``lmcache_driven`` mode (the message names the flag to change).
        LayoutNotFoundError: ``layout=None`` and no engine registered one.
        TransportUnavailableError: ``transport="shm"`` without usable SHM.
        ServerTimeoutError, ServerUnavailableError: the server did not answer.
    """
    if not isinstance(url, str) or not url:
        raise InvalidInputError("url must be a non-empty string")
    if "://" not in url:
        url = f"tcp://{url}"
    if not isinstance(http_url, str) or not http_url.startswith(("http://", "https://")):
        raise InvalidInputError(f"http_url must be an http(s) URL, got {http_url!r}")
    if not isinstance(model_name, str) or not model_name or "@" in model_name:
        raise InvalidInputError("model_name must be a non-empty string without '@'")
    if layout is not None and not isinstance(layout, KVLayout):
        raise InvalidInputError("layout must be a KVLayout or None")
    if transport not in ("auto", "shm", "pickle"):
        raise InvalidInputError(f"transport must be 'auto', 'shm' or 'pickle', got {transport!r}")
    if isinstance(sockets, bool) or not isinstance(sockets, int) or sockets < 1:
        raise InvalidInputError("sockets must be a positive int")
    timeout = check_timeout(timeout, 10.0)
    if heartbeat_interval is not None and (
        isinstance(heartbeat_interval, bool)
        or not isinstance(heartbeat_interval, (int, float))
        or not heartbeat_interval >= 0
    ):
        raise InvalidInputError(
            f"heartbeat_interval must be None, 0 (off) or a positive number of seconds, "
            f"got {heartbeat_interval!r}"
        )

    async def factory() -> AsyncKVContext:
        ctx = AsyncKVContext(
            url, http_url, model_name, layout=layout, timeout=timeout, transport=transport,
            sockets=sockets, shm_dir=shm_dir, heartbeat_interval=heartbeat_interval,
            prefault=prefault,
        )
        await ctx._open()
        return ctx

    return _Connecting(factory)
