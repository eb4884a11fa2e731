"""Fleet: one async object over many LMCache servers, for routers.

The question a router asks for every request is *which backend holds the
longest cached prefix of this prompt?* :class:`Fleet` answers it three ways:

* **direct fan-out** (:meth:`Fleet.lookup`, :meth:`Fleet.best`): a lookup on every
  server at once under one deadline. A member is *light*: an HTTP client and one
  DEALER socket, no SHM mapping and, where the server already has a registration
  for the model (the engine's), no registration of its own (measured: a lookup
  needs *some* registration for ``(model, world_size)`` on the server and answers 0
  without one, even for cached objects; docs/fleet.md).
* **the event-fed prefix index** (:mod:`._index`): each member follows its server's
  KV-event stream (0.5.6+); with the fleet's own stores (which emit no event) it
  answers :meth:`Fleet.best` with no RPC at all. A member is answered from the
  index only while it is *synced*: its stream is complete (no lost range since
  the start of the server's incarnation) and ``/status kv_events.unbound_stores``
  shows no engine-driven stores but the fleet's own. Otherwise it falls back to a
  direct lookup.
* **LMCache's coordinator** (``coordinator_url``, 0.5.7): see
  :mod:`lmkv_async.coordinator`.

Health: a member whose lookups fail (a disconnect at once, timeouts after
:data:`DOWN_AFTER` in a row) is marked down and answered at once with a typed
error until a background probe (with backoff) sees it answer again. Members
that follow events are also audited over HTTP every ``audit_interval`` seconds,
which is how a frozen server (no RPC goes to it in index mode) is noticed.

Data path: ``fleet[name]`` is a :class:`FleetMember`; its ``retrieve``/``store``
open a full :class:`~lmkv_async.AsyncKVContext` (registration, SHM) on first use.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal

import torch

from . import _ops
from ._index import PrefixIndex
from ._session import Session
from .context import AsyncKVContext, connect
from .errors import (
    ClosedError,
    InvalidInputError,
    KVCacheError,
    ServerError,
    ServerTimeoutError,
    ServerUnavailableError,
    UnsupportedOperationError,
)
from .events import KVEventStream, require_kv_events
from .http import ApiKey, resolve_api_key
from .layout import KVLayout
from .results import StoreResult
from .validate import Tokens, check_salt, check_timeout, check_tokens
from .wire import requests
from .wire.dialect import CAP_KV_EVENTS
from .wire.events import KVRemoved, KVResync, KVStored
from .wire.hashing import HAVE_NATIVE_BLAKE3, chunk_hashes
from .wire.keys import RegisterPayload, token_bytes
from .wire.replies import parse_register

__all__ = ["DOWN_AFTER", "Fleet", "FleetLookup", "FleetMember", "MemberState"]

log = logging.getLogger("lmkv_async.fleet")

MemberState = Literal["joining", "up", "down", "closed"]
Source = Literal["index", "lookup", "coordinator", "down"]
Registration = Literal["auto", "always", "never"]

#: Lookup timeouts in a row that mark a member down (a disconnect does at once).
DOWN_AFTER = 2
_PROBE_TIMEOUT = 0.5


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
    teardown) is the base class's."""

    def __init__(self, url: str, http_url: str, model_name: str, *, layout: KVLayout,
                 timeout: float, api_key: ApiKey | None, registration: Registration) -> None:
        super().__init__(url, http_url, model_name, layout=layout, timeout=timeout,
                         transport="auto", sockets=1, shm_dir="/dev/shm",
                         heartbeat_interval=None, prefault=False, api_key=api_key)
        self._policy = registration
        self.light_registered = False

    async def open(self) -> None:
        """Detect the server and connect; register only if needed."""
        try:
            await self._detect_server()
            self.transport.start()
            if not await self.transport.wait_connected(self.timeout):
                raise ServerUnavailableError("cannot connect to the ZMQ endpoint", server=self.url)
            if self.dialect is None:
                await self._probe_dialect()
            await self._refine_capabilities()
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
                    self._heartbeat = asyncio.create_task(self._heartbeat_loop(),
                                                          name="lmkv-fleet-heartbeat")
        except BaseException:
            await self.teardown(unregister=self._register_sent)
            raise

    async def _register_light(self, deadline: float) -> None:
        """Register the geometry (so lookups are answered) without mapping any SHM."""
        layout = self.layout
        generation = self.transport.generation
        payload = RegisterPayload(
            instance_id=self.instance_id, model_name=self.model_name,
            world_size=layout.world_size, block_size=layout.block_size,
            num_layers=layout.num_layers, hidden_dim_size=layout.hidden_dim,
            dtype_str=layout.dtype_name, use_mla=layout.use_mla,
            num_physical_slots=self.chunk_size,
        )
        self._register_sent = True
        parse_register(await self.rpc(self.transport.pick(),
                                      requests.register(self.d, payload), deadline))
        self._registered_generation = generation
        self.light_registered = True

    async def ensure_registered(self, deadline: float) -> None:
        """Wait out a reconnect (bounded); register again only if this session had."""
        if not all(c.connected for c in self.transport.connections):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not await self.transport.wait_usable(remaining):
                raise ServerUnavailableError("the server is unreachable", server=self.url)
        if not self.light_registered or self.transport.generation == self._registered_generation:
            return
        async with self._register_lock:
            if self.transport.generation != self._registered_generation:
                await self._register_light(deadline)

    async def close(self) -> None:
        """Unregister (if registered) and close everything."""
        if self.state in ("closing", "closed"):
            return
        self.state = "closing"
        await self.teardown(unregister=self.light_registered)


class FleetLookup(dict[str, "int | KVCacheError"]):
    """One fleet-wide lookup: ``name -> cached prefix in tokens``, or the error that
    says why that server has no answer (never a silent 0).

    ``sources[name]`` says where each answer came from: ``"index"`` (no RPC),
    ``"lookup"`` (a direct RPC), ``"coordinator"`` or ``"down"`` (marked down: no RPC).
    """

    def __init__(self) -> None:
        super().__init__()
        self.sources: dict[str, Source] = {}

    @property
    def hits(self) -> dict[str, int]:
        """The servers that answered, with their prefix lengths."""
        return {k: v for k, v in self.items() if isinstance(v, int)}

    @property
    def errors(self) -> dict[str, KVCacheError]:
        """The servers that did not answer, with why."""
        return {k: v for k, v in self.items() if not isinstance(v, int)}


class FleetMember:
    """One server of a :class:`Fleet`: health, a light lookup session, its event
    stream, and (on first use) a full data-path context."""

    def __init__(self, fleet: Fleet, name: str, url: str, http_url: str) -> None:
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
        self._ctx_lock = asyncio.Lock()
        self._failures = 0
        self._health: asyncio.Task[None] | None = None
        self._follower: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        # ---- event-index bookkeeping (see Fleet docstring)
        self.stream: KVEventStream | None = None
        self.stream_complete = False
        self.incarnation: int | None = None
        self.audited_incarnation: int | None = None
        self.exact = True
        self.own_written = 0
        self._own_inflight = 0
        #: engine-driven stores on the server before the fleet attached (this incarnation)
        self.unbound_baseline = 0
        self.has_events = False

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
        """Whether :meth:`Fleet.best` may answer for this member from the index."""
        return (self.state == "up" and self.has_events and self.stream_complete and self.exact
                and self.incarnation is not None and self.audited_incarnation == self.incarnation
                and self.chunk_size == self.fleet.chunk_size)

    # ------------------------------------------------------------------ lifecycle
    async def _open_session(self) -> None:
        f = self.fleet
        session = _LightSession(self.url, self.http_url, f.model_name, layout=f.layout,
                                timeout=f.connect_timeout, api_key=f._api_key,
                                registration=f.registration)
        await session.open()
        session.timeout = f.timeout
        self.session = session
        if f.chunk_size == 0:
            f.chunk_size = session.chunk_size
            f._index = PrefixIndex(session.chunk_size)
        elif session.chunk_size != f.chunk_size:
            log.warning("%s has chunk size %d, the fleet %d: lookups only", self.name,
                        session.chunk_size, f.chunk_size)

    async def _join(self) -> None:
        try:
            await self._open_session()
        except KVCacheError as exc:
            self._mark_down(exc)
        else:
            self._mark_up()
        self._health = asyncio.create_task(self._health_loop(), name=f"lmkv-fleet-{self.name}")

    def _mark_up(self) -> None:
        if self.state != "up":
            log.info("fleet member %s is up (lmcache %s)", self.name, self.server_version)
        self.state, self.error, self._failures = "up", None, 0
        s = self.session
        if (self.fleet.events and s is not None and self._follower is None
                and CAP_KV_EVENTS in s.capabilities):
            self._follower = asyncio.create_task(self._follow(), name=f"lmkv-events-{self.name}")

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
                await asyncio.sleep(delay)
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
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), f.audit_interval)
            if self.state == "up" and self._follower is not None:
                await self._audit()

    async def _audit(self) -> None:
        """``/status``: liveness, and whether someone else stored engine-driven objects
        (they emit no event, so the index cannot know them)."""
        s = self.session
        assert s is not None
        try:
            status = await s.http.get_json("/status", timeout=_PROBE_TIMEOUT)
        except (ServerTimeoutError, ServerUnavailableError) as exc:
            self._mark_down(exc)
            return
        except KVCacheError as exc:
            log.debug("audit of %s failed: %s", self.name, exc)
            return
        kv = status.get("kv_events") if isinstance(status, dict) else None
        if not isinstance(kv, dict) or kv.get("incarnation") != self.incarnation:
            return  # not ours yet (the stream has not seen this incarnation)
        unbound = int(kv.get("unbound_stores", 0))
        if self.audited_incarnation != self.incarnation:
            # First audit of this incarnation: engine-driven stores made before the
            # fleet attached are invisible to the index (the counter is server-wide,
            # every model). strict_index refuses to answer from the index after any.
            self.unbound_baseline = unbound - self.own_written - self._own_inflight
            if self.fleet.strict_index and self.unbound_baseline > 0:
                self.exact = False
        foreign = unbound - self.unbound_baseline - self.own_written - self._own_inflight
        if foreign > 0 and self.exact:
            log.info("%s: %d engine-driven stores the fleet did not make (any model); "
                     "answering it with lookups until the server restarts", self.name,
                     foreign)
            self.exact = False
        self.audited_incarnation = self.incarnation

    async def _follow(self) -> None:
        """Feed the index from this server's KV-event stream, resubscribing on errors."""
        f = self.fleet
        s = self.session
        assert s is not None
        try:
            require_kv_events(s.d, s.capabilities, self.url, s.server_version)
        except UnsupportedOperationError:
            return
        self.has_events = True
        delay = f.probe_backoff[0]
        while self.state != "closed":
            stream = KVEventStream(self.url, s.d, f.model_name, max_events=1024,
                                   timeout=f.connect_timeout,
                                   heartbeat_interval=min(10.0, (s.reap_timeout or 120) / 4))
            self.stream = stream
            try:
                while True:
                    self._apply(await stream.next())
                    delay = f.probe_backoff[0]
            except UnsupportedOperationError as exc:
                log.info("%s records no KV events (%s): lookups only", self.name, exc)
                self.has_events = False
                return
            except KVCacheError as exc:
                log.debug("%s event stream failed: %s", self.name, exc)
                self.stream_complete = False
            finally:
                await stream.aclose()
            await asyncio.sleep(delay)
            delay = min(delay * 2, f.probe_backoff[1])

    def _apply(self, ev: KVStored | KVRemoved | KVResync) -> None:
        index = self.fleet._index
        if isinstance(ev, KVStored):
            if ev.medium == "CPU":
                index.add_event(self.name, ev.block_hashes, ev.parent_block_hash, ev.token_ids)
        elif isinstance(ev, KVRemoved):
            index.remove(self.name, ev.block_hashes)
        else:
            if ev.discard:
                index.discard(self.name)
            if ev.reason == "restart":
                self.own_written, self.unbound_baseline, self.exact = 0, 0, True
            if ev.incarnation != self.incarnation:
                self.incarnation = ev.incarnation
                self._wake.set()  # audit now, not at the next interval
            self.stream_complete = ev.complete

    async def aclose(self) -> None:
        """Stop the tasks, close the data-path context and the light session."""
        self.state = "closed"
        self._wake.set()
        for task in (self._health, self._follower):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (self._health, self._follower) if t is not None),
                             return_exceptions=True)
        if self._ctx is not None:
            await self._ctx.aclose()
        if self.session is not None:
            await self.session.close()

    # ------------------------------------------------------------------ lookups
    async def _direct(self, toks: list[int], salt: str, n: int, deadline: float
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
            hit = await _ops.lookup(s, toks, salt, n, deadline)
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
                self._ctx = await connect(self.url, self.http_url, f.model_name,
                                          layout=f.layout, timeout=f.data_timeout,
                                          api_key=f._api_key_arg)
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
        that prefix, with ``cache_salt``.
        """
        toks = check_tokens(tokens)
        ctx = await self.context()
        total = len(toks) // ctx.chunk_size
        self.in_flight += 1
        self._own_inflight += total
        try:
            res = await ctx.store(kv, toks, cache_salt=cache_salt, timeout=timeout)
            self.own_written += res.written_chunks
        finally:
            self._own_inflight -= total
            self.in_flight -= 1
        if total and self.fleet.events and self.chunk_size == self.fleet.chunk_size:
            try:
                hit = await ctx.lookup(toks, cache_salt=cache_salt, timeout=timeout)
            except KVCacheError as exc:
                # The store itself succeeded; the index just does not learn it (a miss
                # at worst, never a false hit).
                log.info("%s: no lookup after a store (%s); not indexed", self.name, exc)
                return res
            chunks = hit // ctx.chunk_size
            if chunks:
                await self.fleet._note_store(self.name, toks, cache_salt, chunks)
        return res

    def kv_events(self, *, cursor: int = 0, max_events: int = 256) -> KVEventStream:
        """This server's KV-event stream (a subscription of its own; close it)."""
        s = self.session
        if s is None:
            raise ServerUnavailableError("the member has not joined", server=self.url)
        require_kv_events(s.d, s.capabilities, self.url, s.server_version)
        return KVEventStream(self.url, s.d, self.fleet.model_name, cursor=cursor,
                             max_events=max_events, timeout=self.fleet.connect_timeout)


class Fleet:
    """Many LMCache servers as one async object (see the module docstring).

    Args:
        servers: ``{name: (zmq_url, http_url)}``. May be empty with
            ``coordinator_url``, which then names the servers.
        model_name: the model namespace on every server.
        layout: the KV geometry (its ``world_size`` is part of every lookup key).
        api_key: HTTP API key for every server (lmcache >= 0.5.7), resolved like
            :func:`~lmkv_async.connect`'s.
        coordinator_url: LMCache's coordinator (0.5.7); see
            :mod:`lmkv_async.coordinator`.
        timeout: default deadline of :meth:`lookup` / :meth:`best`, seconds.
        connect_timeout: deadline of a member's join (and of each re-join probe).
        data_timeout: default deadline of the data-path contexts.
        events: follow KV-event streams and keep the prefix index.
        registration: ``"auto"`` registers a member's light session only on servers
            with no registration for the model (a lookup needs one);
            ``"always"`` / ``"never"``.
        audit_interval: seconds between ``/status`` audits of event-following members.
        strict_index: answer a member from the index only if its server had no
            engine-driven store at all before the fleet attached (the server counts
            them for every model together; their objects emit no event). By default
            those earlier stores are assumed gone or of other models; stores that
            happen while the fleet is attached always switch the member to lookups.
        probe_backoff: first and longest delay between probes of a down member.
    """

    def __init__(
        self,
        servers: Mapping[str, tuple[str, str]] | None = None,
        *,
        model_name: str,
        layout: KVLayout,
        api_key: str | None = None,
        coordinator_url: str | None = None,
        timeout: float = 0.5,
        connect_timeout: float = 5.0,
        data_timeout: float = 10.0,
        events: bool = True,
        registration: Registration = "auto",
        audit_interval: float = 1.0,
        probe_backoff: tuple[float, float] = (0.1, 5.0),
        strict_index: bool = False,
    ) -> None:
        if servers is None:
            servers = {}
        if not isinstance(servers, Mapping) or not all(
            isinstance(k, str) and k and isinstance(v, tuple) and len(v) == 2
            and all(isinstance(u, str) for u in v) for k, v in servers.items()
        ):
            raise InvalidInputError("servers must map names to (zmq_url, http_url) pairs")
        if not servers and not coordinator_url:
            raise InvalidInputError("a fleet needs servers or a coordinator_url")
        if not isinstance(model_name, str) or not model_name or "@" in model_name:
            raise InvalidInputError("model_name must be a non-empty string without '@'")
        if not isinstance(layout, KVLayout):
            raise InvalidInputError("layout must be a KVLayout")
        if registration not in ("auto", "always", "never"):
            raise InvalidInputError("registration must be 'auto', 'always' or 'never'")
        self.model_name = model_name
        self.layout = layout
        self.timeout = check_timeout(timeout, 0.5)
        self.connect_timeout = check_timeout(connect_timeout, 5.0)
        self.data_timeout = check_timeout(data_timeout, 10.0)
        self.events = bool(events)
        self.registration: Registration = registration
        self.audit_interval = check_timeout(audit_interval, 1.0)
        self.probe_backoff = probe_backoff
        self.strict_index = bool(strict_index)
        self._api_key_arg = api_key
        self._api_key = resolve_api_key(api_key)
        self.coordinator_url = coordinator_url
        self.chunk_size = 0
        self._index = PrefixIndex(256)
        self._members: dict[str, FleetMember] = {
            name: FleetMember(self, name, zmq, http) for name, (zmq, http) in servers.items()
        }
        self._rr = itertools.count()
        #: called as ``f(member_name, hashes, tokens)`` after a store through the fleet
        #: (the vLLM-event publisher announces them: they emit no LMCache event)
        self._own_store_listeners: list[Callable[[str, Sequence[bytes], Sequence[int]], None]] = []
        self._state: Literal["new", "open", "closed"] = "new"
        self._late_joins: set[asyncio.Task[None]] = set()
        self.coordinator: Any = None

    def __repr__(self) -> str:
        up = sum(1 for m in self._members.values() if m.state == "up")
        return f"<Fleet {self.model_name!r} {up}/{len(self._members)} up, {self._state}>"

    # ------------------------------------------------------------------ lifecycle
    async def open(self) -> Fleet:
        """Join every member concurrently (each within ``connect_timeout``).

        Members that cannot be reached are marked down and keep being probed;
        this only fails for bad arguments.
        """
        if self._state != "new":
            return self
        if self.coordinator_url:
            from .coordinator import attach_coordinator

            # Before the state is "open": members it adds are joined below, once.
            await attach_coordinator(self)
        self._state = "open"
        await asyncio.gather(*(m._join() for m in self._members.values()))
        return self

    async def aclose(self) -> None:
        """Close every member: no lock, session or registration stays on any server."""
        if self._state == "closed":
            return
        self._state = "closed"
        for task in list(self._late_joins):
            task.cancel()
        await asyncio.gather(*self._late_joins, return_exceptions=True)
        if self.coordinator is not None:
            await self.coordinator.aclose()
        await asyncio.gather(*(m.aclose() for m in self._members.values()),
                             return_exceptions=True)

    async def __aenter__(self) -> Fleet:
        return await self.open()

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    def add_member(self, name: str, url: str, http_url: str) -> FleetMember:
        """Add a server (before :meth:`open`, or later: it then joins in the background)."""
        if name in self._members:
            raise InvalidInputError(f"fleet already has a member named {name!r}")
        member = FleetMember(self, name, url, http_url)
        self._members[name] = member
        if self._state == "open":
            task = asyncio.get_running_loop().create_task(member._join())
            self._late_joins.add(task)
            task.add_done_callback(self._late_joins.discard)
        return member

    # ------------------------------------------------------------------ members
    @property
    def members(self) -> Mapping[str, FleetMember]:
        """All members by name."""
        return self._members

    def __getitem__(self, name: str) -> FleetMember:
        return self._members[name]

    def __contains__(self, name: object) -> bool:
        return name in self._members

    def __iter__(self) -> Iterator[str]:
        return iter(self._members)

    def __len__(self) -> int:
        return len(self._members)

    # ------------------------------------------------------------------ lookups
    async def lookup(self, tokens: Tokens, *, cache_salt: str = "",
                     timeout: float | None = None,
                     source: Literal["auto", "lookup", "index", "coordinator"] = "auto",
                     ) -> FleetLookup:
        """The cached prefix of ``tokens`` on every member, under one deadline.

        ``source="auto"`` answers synced members from the index and the others with
        a direct lookup; ``"lookup"`` asks every server; ``"index"`` answers only
        from the index (unsynced members get an error value); ``"coordinator"`` asks
        the coordinator's directory for the members it knows (within half the time
        left) and answers the rest, or all of them when it fails, as ``"auto"`` does;
        after a failure it is skipped for a second.
        A member that did not answer within the deadline gets a
        :class:`ServerTimeoutError` value; a member marked down gets a
        :class:`ServerUnavailableError` value at once.

        Raises:
            InvalidInputError: bad tokens, salt or timeout (nothing is sent).
            ClosedError: the fleet is not open.
        """
        toks = check_tokens(tokens)
        salt = check_salt(cache_salt)
        t = check_timeout(timeout, self.timeout)
        if source not in ("auto", "lookup", "index", "coordinator"):
            raise InvalidInputError(f"unknown source {source!r}")
        if self._state != "open":
            raise ClosedError(f"fleet is {self._state}")
        deadline = time.monotonic() + t
        out = FleetLookup()
        C = self.chunk_size
        n = len(toks) // C * C if C else 0
        if source == "coordinator" and self.coordinator is not None:
            coord = self.coordinator
            mapped = coord.mapped()
            if coord.usable() and n > 0 and any(
                    self._members[k].state == "up" for k in mapped):
                # At most half the time left: a frozen coordinator must still leave
                # time for the direct lookups that replace it.
                budget = time.monotonic() + max(0.0, deadline - time.monotonic()) / 2
                try:
                    answers = await coord.lookup(toks, salt, budget)
                except KVCacheError as exc:
                    log.info("coordinator lookup failed (%s); asking the servers", exc)
                else:
                    for name in mapped:
                        if self._members[name].state == "up":
                            out[name], out.sources[name] = answers.get(name, 0), "coordinator"
            coord.remap_soon()  # members the coordinator did not know yet
            source = "auto"  # the rest: as usual (a member the directory cannot speak for)
        direct: dict[str, asyncio.Task[int | KVCacheError]] = {}
        synced = []
        for name, member in self._members.items():
            if name in out:
                continue  # answered by the coordinator
            if member.state != "up":
                out[name], out.sources[name] = member._down_error(), "down"
            elif n == 0:
                out[name], out.sources[name] = 0, "lookup"
            elif source in ("auto", "index") and member.synced and member.connected:
                synced.append(name)
            elif source == "index":
                out[name] = UnsupportedOperationError("not synced with its event stream",
                                                      server=member.url)
                out.sources[name] = "index"
            else:
                direct[name] = asyncio.ensure_future(member._direct(toks, salt, n, deadline))
        if synced:
            packed = token_bytes(toks[:n])
            for name, chunks in self._index.longest(packed, n // C, salt, synced).items():
                out[name], out.sources[name] = chunks * C, "index"
        if direct:
            try:
                done, _ = await asyncio.wait(direct.values(),
                                             timeout=max(0.0, deadline - time.monotonic()))
            except asyncio.CancelledError:
                for task in direct.values():
                    task.cancel()  # their release steps still run (shielded in _ops)
                raise
            for name, task in direct.items():
                out.sources[name] = "lookup"
                if task in done:
                    out[name] = task.result()
                else:
                    task.cancel()  # the sequence's release steps still run (shielded)
                    late = ServerTimeoutError("no answer within the fleet deadline",
                                              op="lookup", server=self._members[name].url,
                                              timeout=t)
                    self._members[name]._note_timeout(late)
                    out[name] = late
        # keep the members' order
        ordered = FleetLookup()
        for name in self._members:
            ordered[name] = out[name]
            ordered.sources[name] = out.sources[name]
        return ordered

    async def best(self, tokens: Tokens, *, cache_salt: str = "",
                   timeout: float | None = None,
                   source: Literal["auto", "lookup", "index", "coordinator"] = "auto",
                   ) -> tuple[str, int]:
        """The member holding the longest cached prefix of ``tokens``: ``(name, tokens)``.

        Uses whatever answered by the deadline; ties go to the member with the
        fewest operations in flight through this fleet, then round-robin.

        Raises:
            ServerUnavailableError: no member answered (its message lists why).
            InvalidInputError, ClosedError: as :meth:`lookup`.
        """
        res = await self.lookup(tokens, cache_salt=cache_salt, timeout=timeout, source=source)
        hits = res.hits
        if not hits:
            why = "; ".join(f"{k}: {v}" for k, v in res.errors.items())
            raise ServerUnavailableError(f"no fleet member answered ({why})", op="best")
        top = max(hits.values())
        names = [k for k, v in hits.items() if v == top]
        if len(names) > 1:
            turn = next(self._rr)
            order = names[turn % len(names):] + names[:turn % len(names)]
            names = sorted(order, key=lambda k: self._members[k].in_flight)
        return names[0], top

    async def _note_store(self, name: str, toks: list[int], salt: str, chunks: int) -> None:
        C = self.chunk_size
        if HAVE_NATIVE_BLAKE3:
            hashes = self._index.add_own(name, toks, salt, chunks)  # ~6 us a chunk
        else:
            # Pure-Python BLAKE3 takes milliseconds a chunk: keep it off the loop.
            hashes = await asyncio.to_thread(chunk_hashes, toks[: chunks * C], C)
            self._index.add_own(name, toks, salt, chunks, hashes=hashes)
        for listener in list(self._own_store_listeners):
            try:
                listener(name, hashes, toks[: chunks * C])
            except Exception:  # a listener's bug must not fail the caller's store
                log.exception("own-store listener failed")

    @property
    def index(self) -> PrefixIndex:
        """The event-fed prefix index (for inspection)."""
        return self._index
