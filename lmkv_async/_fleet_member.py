"""One server of a :class:`~lmkv_async.fleet.Fleet`: health, a light lookup session
(registration only, no SHM mapping), its KV-event stream and index bookkeeping, and the
data-path context opened on demand.

The member reports to its fleet through :class:`._fleet_host.FleetHost`; it never
imports ``fleet.py``.

When the index may answer for a member (:attr:`FleetMember.synced`) is decided here;
docs/fleet.md states the rule. In short: only while the index provably holds
everything the server holds, that is the server's whole event history since it
started (replayed from cursor 0, nothing lost), no engine-driven store on it but
the fleet's own (``/status kv_events.unbound_stores``, which counts every model's,
since the server started), and a live stream and socket, checked by an audit no
older than two audit intervals whose event position the index has reached.

A member's background work (its health loop, its event follower, its audits, its
light session's readers and heartbeat) runs as jobs of the fleet's
:class:`~._background.Background`; closing the member cancels its jobs and waits
for them (bounded).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import torch

from . import _ops
from ._background import Background, Job
from ._fleet_host import FleetHost, MemberState, Registration
from ._fleet_sync import IndexSync, OwnReplayStream
from ._session import Session
from ._shield import Once, finish
from ._waits import wait_event
from .context import AsyncKVContext, connect
from .errors import (
    ClosedError,
    KVCacheError,
    ServerError,
    ServerTimeoutError,
    ServerUnavailableError,
)
from .events import KVEventStream, require_kv_events
from .http import ApiKey
from .layout import KVLayout
from .results import StoreResult
from .validate import Tokens, check_salt, check_timeout, check_tokens
from .wire import requests
from .wire.dialect import CAP_KV_EVENTS
from .wire.replies import parse_register

__all__ = ["DOWN_AFTER", "FleetMember", "has_registration"]

log = logging.getLogger("lmkv_async.fleet")

#: Lookup timeouts in a row that mark a member down (a disconnect does at once).
DOWN_AFTER = 2
_PROBE_TIMEOUT = 0.5
#: How long closing a member may wait for its background jobs (they are cancelled).
_TASK_STOP_BUDGET = 2.0


def has_registration(status: Mapping[str, Any], model_name: str, world_size: int) -> bool:
    """Whether ``/status`` shows any registration (engine-driven or lmcache-driven) of
    ``(model_name, world_size)``, which is what the server's lookup needs."""
    for key in ("cache_context_meta", "non_cuda_context_meta"):
        for entry in (status.get(key) or {}).values():
            if (isinstance(entry, Mapping) and entry.get("model_name") == model_name
                    and int(entry.get("world_size", 1)) == world_size):
                return True
    return False


class _LightSession(Session):
    """A :class:`Session` for lookups only: no SHM mapping, and a registration only
    where the policy asks for one. Everything else (detection, RPCs, release steps,
    teardown) is the base class's. Its jobs run in the fleet's ``background``."""

    def __init__(self, url: str, http_url: str, model_name: str, *, layout: KVLayout,
                 timeout: float, api_key: ApiKey | None, registration: Registration,
                 background: Background) -> None:
        super().__init__(url, http_url, model_name, layout=layout, timeout=timeout,
                         transport="auto", sockets=1, shm_dir="/dev/shm",
                         heartbeat_interval=None, prefault=False, api_key=api_key,
                         background=background)
        self._policy = registration
        self.light_registered = False

    async def open(self) -> None:
        """Detect the server and connect; register only if needed."""
        try:
            await self._connect()
            need = self._policy == "always"
            if self._policy == "auto":
                need = not has_registration(await self.http.status(), self.model_name,
                                            self.layout.world_size)
            if need:
                await self._register_light(time.monotonic() + self.timeout)
            self.state = "open"
            if self.light_registered:
                interval = self.heartbeat_interval = min(10.0, (self.reap_timeout or 120) / 4)
                if interval > 0:
                    self._heartbeat = self.background.start_soon(self._heartbeat_loop,
                                                                 name="lmkv-fleet-heartbeat")
        except BaseException:
            # Shielded: a caller's cancellation (the usual reason to be here) must not
            # leave the registration behind.
            await self.shutdown(unregister=self._register_sent)
            raise

    async def _register_light(self, deadline: float) -> None:
        """Register the geometry (so lookups are answered) without mapping any SHM."""
        generation = self.transport.generation
        self._register_sent = True
        req = requests.register(self.d, self._register_payload())
        parse_register(await self.rpc(self.transport.pick(), req, deadline))
        self._registered_generation = generation
        self.light_registered = True

    async def ensure_registered(self, deadline: float, since: float | None = None) -> None:
        """Wait out a reconnect (bounded); register again only if this session had."""
        if not all(c.connected for c in self.transport.connections):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not await self.transport.wait_usable(
                remaining, time.monotonic() if since is None else since
            ):
                raise ServerUnavailableError("the server is unreachable", server=self.url)
        if not self.light_registered or self.transport.generation == self._registered_generation:
            return
        async with self._register_lock:
            if self.transport.generation != self._registered_generation:
                await self._register_light(deadline)

    async def close(self) -> None:
        """Unregister (if registered) and close everything: shielded, bounded and
        idempotent (a second call waits for the first one's cleanup)."""
        await self.shutdown(unregister=self.light_registered or self._register_sent)


class FleetMember:
    """One server of a :class:`Fleet`: health, a light lookup session, its event
    stream, and (on first use) a full data-path context."""

    def __init__(self, fleet: FleetHost, name: str, url: str, http_url: str) -> None:
        self.fleet = fleet
        self.name = name
        self.url = url if "://" in url else f"tcp://{url}"
        self.http_url = http_url
        self.state: MemberState = "joining"
        #: why the member is down (or failed to join)
        self.error: KVCacheError | None = None
        #: operations through this member (lookups, retrieves, stores) in flight
        self.in_flight = 0
        self.session: _LightSession | None = None
        self._ctx: AsyncKVContext | None = None
        self._ctx_lock = anyio.Lock()
        self._failures = 0
        self._health: Job[None] | None = None
        self._follower: Job[None] | None = None
        #: wakes the health loop (an anyio.Event cannot be cleared: the loop replaces it)
        self._wake = anyio.Event()
        self._closer = Once()
        #: the index bookkeeping: stream, audits, the fleet's own stores
        self.sync = IndexSync(fleet, self)

    def __repr__(self) -> str:
        return (f"<FleetMember {self.name!r} {self.url} {self.state}"
                f"{' synced' if self.synced else ''}>")

    # ------------------------------------------------------------------ properties
    @property
    def server_version(self) -> str:
        """The server's ``/version`` (empty until joined)."""
        return self.session.server_version if self.session else ""

    @property
    def capabilities(self) -> frozenset[str]:
        """The server's capabilities (empty until joined)."""
        return self.session.capabilities if self.session else frozenset()

    @property
    def chunk_size(self) -> int:
        """The server's chunk size (0 until joined)."""
        return self.session.chunk_size if self.session else 0

    @property
    def connected(self) -> bool:
        """Whether the member's lookup socket has a live connection right now."""
        s = self.session
        return s is not None and s.transport.connections[0].connected

    @property
    def synced(self) -> bool:
        """Whether :meth:`Fleet.best` may answer for this member from the index
        (docs/fleet.md, "When the index answers")."""
        return self.sync.synced

    @property
    def exact(self) -> bool:
        """False once the server showed engine-driven stores the fleet did not make
        (since the server started, any model): the index cannot know their objects."""
        return self.sync.exact

    @property
    def stream_complete(self) -> bool:
        """The event stream replayed the server's whole log and lost nothing since."""
        return self.sync.stream_complete

    @property
    def has_events(self) -> bool:
        """The member follows its server's KV-event stream."""
        return self.sync.has_events

    # ------------------------------------------------------------------ lifecycle
    async def _open_session(self) -> None:
        f = self.fleet
        session = _LightSession(self.url, self.http_url, f.model_name, layout=f.layout,
                                timeout=f.connect_timeout, api_key=f.api_key,
                                registration=f.registration, background=f.background)
        await session.open()
        # No await between the open and this: a cancellation cannot lose the session.
        self.session = session
        if self._is_closed():  # closed while joining: the teardown missed it
            await finish(session.close())
            raise ClosedError(f"fleet member {self.name} is closed")
        session.timeout = f.timeout
        f._adopt_chunk_size(session.chunk_size)
        if session.chunk_size != f.chunk_size:
            log.warning("%s has chunk size %d, the fleet %d: lookups only", self.name,
                        session.chunk_size, f.chunk_size)

    async def _join(self) -> None:
        try:
            await self._open_session()
        except KVCacheError as exc:
            self._mark_down(exc)
        else:
            self._mark_up()
        if self.state != "closed":
            self._health = self._start(self._health_loop, name=f"lmkv-fleet-{self.name}")

    def _start(self, fn: Callable[..., Awaitable[None]], *args: Any,
               name: str) -> Job[None] | None:
        """A job of the fleet's group; None once the group is closing (so is the member)."""
        bg = self.fleet.background
        if not bg.running:
            return None
        return bg.start_soon(fn, *args, name=name)

    def _wake_up(self) -> None:
        """Wake the health loop (an audit now, or the close)."""
        self._wake.set()

    def _is_closed(self) -> bool:
        # A method, not an inline test: the state changes across awaits.
        return self.state == "closed"

    def _mark_up(self) -> None:
        if self.state == "closed":
            return
        if self.state != "up":
            log.info("fleet member %s is up (lmcache %s)", self.name, self.server_version)
        self.state, self.error, self._failures = "up", None, 0
        s = self.session
        if self.fleet.events and s is not None and self._follower is None:
            if CAP_KV_EVENTS in s.capabilities:
                self._follower = self._start(self.sync.follow, self._wake_up,
                                             name=f"lmkv-events-{self.name}")
            else:
                self.sync.no_events = True

    def _mark_down(self, exc: KVCacheError) -> None:
        if self.state == "closed":
            return
        if self.state != "down":
            log.warning("fleet member %s is down: %s", self.name, exc)
        self.state, self.error = "down", exc
        self._wake.set()

    def _note_timeout(self, exc: KVCacheError) -> None:
        self._failures += 1
        if self._failures >= DOWN_AFTER:
            self._mark_down(exc)

    def _down_error(self) -> KVCacheError:
        return ServerUnavailableError(f"marked down ({self.error})", op="lookup",
                                      server=self.url)

    async def _health_loop(self) -> None:
        """Probe a down member with backoff; audit an up member that follows events."""
        f = self.fleet
        delay = f.probe_backoff[0]
        while self.state != "closed":
            if self.state == "down":
                await anyio.sleep(delay)
                delay = min(delay * 2, f.probe_backoff[1])
                try:
                    if self.session is None:
                        await self._open_session()
                    else:
                        await self.session.ensure_registered(time.monotonic() + _PROBE_TIMEOUT)
                        await self.session.rpc(self.session.transport.pick(),
                                               requests.noop(self.session.d),
                                               time.monotonic() + _PROBE_TIMEOUT)
                except KVCacheError as exc:
                    self.error = exc
                    continue
                delay = f.probe_backoff[0]
                self._mark_up()
                continue
            # A fresh event (an anyio.Event cannot be cleared): a wake-up before this
            # point is dropped, as clear() did.
            self._wake = anyio.Event()
            await wait_event(self._wake, f.audit_interval)
            if self.state == "up" and self._follower is not None:
                await self.sync.audit()

    async def aclose(self) -> None:
        """Stop the member's jobs, close the data-path context and the light session.

        Shielded, bounded and idempotent: the caller's cancellation (a task's
        ``cancel()``, ``asyncio.timeout``, an anyio scope) does not cut the cleanup
        short, and a second call waits for the first one's cleanup.
        """
        await self._closer.run(self._teardown)

    async def _teardown(self) -> None:
        self.state = "closed"
        self._wake.set()
        jobs = {j for j in (self._health, self._follower, *self.sync.tasks()) if j is not None}
        for job in jobs:
            job.cancel()
        if jobs:
            # Bounded: a job that ignores its cancellation is left to the fleet's group
            # (whose end cancels it again and waits), not awaited here.
            await self.fleet.background.drain(jobs, _TASK_STOP_BUDGET)
        if self._ctx is not None:
            with contextlib.suppress(Exception):
                await self._ctx.aclose()
        if self.session is not None:
            with contextlib.suppress(Exception):
                await self.session.close()

    # ------------------------------------------------------------------ lookups
    async def _direct(self, toks: list[int], salt: str, n: int, deadline: float,
                      release_gate: anyio.Event | None = None
                      ) -> int | KVCacheError:
        """One lookup RPC sequence; failures are returned as values and update health."""
        s = self.session
        if self.state != "up" or s is None:
            return self._down_error()
        if not s.transport.connections[0].connected:
            exc = ServerUnavailableError("not connected", op="lookup", server=self.url)
            self._mark_down(exc)
            return exc
        self.in_flight += 1
        try:
            hit = await _ops.lookup(s, toks, salt, n, deadline, release_gate)
        except ServerTimeoutError as exc:
            self._note_timeout(exc)
            return exc
        except (ServerUnavailableError, ClosedError) as exc:
            self._mark_down(exc)
            return exc
        except ServerError as exc:
            return exc
        finally:
            self.in_flight -= 1
        self._failures = 0
        return hit

    async def lookup(self, tokens: Tokens, *, cache_salt: str = "",
                     timeout: float | None = None) -> int:
        """A direct lookup on this server (raises instead of returning the error)."""
        toks = check_tokens(tokens)
        salt = check_salt(cache_salt)
        t = check_timeout(timeout, self.fleet.timeout)
        C = self.chunk_size or self.fleet.chunk_size
        n = len(toks) // C * C if C else 0
        if n == 0:
            return 0
        result = await self._direct(toks, salt, n, time.monotonic() + t)
        if isinstance(result, KVCacheError):
            raise result
        return result

    # ------------------------------------------------------------------ data path
    async def context(self) -> AsyncKVContext:
        """The full per-server :class:`AsyncKVContext` (opened on first call)."""
        if self.state == "closed":
            raise ClosedError(f"fleet member {self.name} is closed")
        async with self._ctx_lock:
            if self._ctx is None or self._ctx.closed:
                f = self.fleet
                key = f.api_key
                # in the fleet's group, like the member's other work: the fleet's
                # close ends it, and under ``async with Fleet`` it lives in the caller's
                ctx = await connect(self.url, self.http_url, f.model_name,
                                    layout=f.layout, timeout=f.data_timeout,
                                    api_key=key.reveal() if key is not None else None
                                    ).within(f.background)
                if self._is_closed():  # closed while connecting
                    await finish(ctx.aclose())
                    raise ClosedError(f"fleet member {self.name} is closed")
                self._ctx = ctx
            return self._ctx

    async def retrieve(self, tokens: Tokens, *, out: torch.Tensor | None = None,
                       cache_salt: str = "", timeout: float | None = None
                       ) -> torch.Tensor | None:
        """:meth:`AsyncKVContext.retrieve` on this server."""
        ctx = await self.context()
        self.in_flight += 1
        try:
            return await ctx.retrieve(tokens, out=out, cache_salt=cache_salt, timeout=timeout)
        finally:
            self.in_flight -= 1

    async def store(self, kv: torch.Tensor, tokens: Tokens, *, cache_salt: str = "",
                    timeout: float | None = None) -> StoreResult:
        """:meth:`AsyncKVContext.store` on this server, recorded in the fleet's index.

        Engine-driven stores emit no event, so the fleet records them itself: after
        the store it looks up what the server now holds of ``tokens`` and enters
        that prefix, with ``cache_salt``. On a server without an event stream nothing
        is recorded (the index is never read for it) and no lookup is made.
        """
        toks = check_tokens(tokens)
        ctx = await self.context()
        total = len(toks) // ctx.chunk_size
        sync = self.sync
        self.in_flight += 1
        sync.own_inflight += total
        try:
            res = await ctx.store(kv, toks, cache_salt=cache_salt, timeout=timeout)
            sync.own_written += res.written_chunks
        finally:
            sync.own_inflight -= total
            self.in_flight -= 1
        if total and sync.indexable:
            try:
                hit = await ctx.lookup(toks, cache_salt=cache_salt, timeout=timeout)
            except KVCacheError as exc:
                # The store itself succeeded; the index just does not learn it (a miss
                # at worst, never a false hit).
                log.info("%s: no lookup after a store (%s); not indexed", self.name, exc)
                return res
            chunks = hit // ctx.chunk_size
            if chunks:
                hashes = await self.fleet._note_store(self.name, toks, cache_salt, chunks)
                sync.note_own(toks, cache_salt, hashes)
        return res

    def kv_events(self, *, cursor: int = 0, max_events: int = 256) -> KVEventStream:
        """This server's KV-event stream (a subscription of its own; close it).

        After a resync that discards (its start, a lost range; not a restart) it also
        hands out the stores made through the fleet that the server still holds, as
        ``KVStored`` records with ``seq`` 0: they emit no LMCache event.
        """
        s = self.session
        if s is None:
            raise ServerUnavailableError("the member has not joined", server=self.url)
        require_kv_events(s.d, s.capabilities, self.url, s.server_version)
        return OwnReplayStream(self.sync, self.url, s.d, self.fleet.model_name, cursor=cursor,
                               max_events=max_events, timeout=self.fleet.connect_timeout)
