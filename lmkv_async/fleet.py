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
  KV-event stream (0.5.6+) from cursor 0; with the fleet's own stores (which emit
  no event) it answers :meth:`Fleet.best` with no RPC at all. By default a member is
  answered from the index only while the index provably holds everything its
  server holds (:attr:`FleetMember.synced`; docs/fleet.md, "When the index
  answers"): never a count the server would contradict. ``allow_stale_index=True``
  trades that for speed.
* **LMCache's coordinator** (``coordinator_url``, 0.5.7): see
  :mod:`lmkv_async.coordinator`.

Health: a member whose lookups fail (a disconnect at once, timeouts after
:data:`DOWN_AFTER` in a row) is marked down and answered at once with a typed
error until a background probe (with backoff) sees it answer again. Members
that follow events are also audited over HTTP every ``audit_interval`` seconds,
which is how a frozen server (no RPC goes to it in index mode) is noticed.

Data path: ``fleet[name]`` is a :class:`FleetMember`; its ``retrieve``/``store``
open a full :class:`~lmkv_async.AsyncKVContext` (registration, SHM) on first use.

Background work (joins, health probes and audits, event followers, the light
sessions' readers and heartbeats, direct lookups whose caller stopped waiting)
runs in the fleet's own task group (:class:`~._background.Background`), the same
on asyncio and trio: ``async with Fleet(...)`` enters it in the caller's task,
``await fleet.open()`` hosts it in a task of its own, and :meth:`Fleet.aclose`
ends it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping
from types import TracebackType
from typing import Any, Literal, TypeVar

import anyio

from . import _loop_thread
from ._background import Background, Job, require_event_loop
from ._fleet_host import MemberState, OwnStoreListener, Registration, Source
from ._fleet_member import (  # noqa: F401  (re-exported)
    DOWN_AFTER,
    FleetMember,
    _LightSession,
    has_registration,
)
from ._index import PrefixIndex
from ._shield import Once
from .coordinator import FleetCoordinator, attach_coordinator
from .errors import (
    ClosedError,
    InvalidInputError,
    KVCacheError,
    ServerTimeoutError,
    ServerUnavailableError,
    UnsupportedOperationError,
)
from .http import ApiKey, resolve_api_key
from .layout import KVLayout
from .validate import Tokens, check_salt, check_timeout, check_tokens
from .wire.keys import token_bytes

__all__ = ["DOWN_AFTER", "Fleet", "FleetLookup", "FleetMember", "MemberState"]

log = logging.getLogger("lmkv_async.fleet")

T = TypeVar("T")


async def _gather(calls: list[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run ``calls`` concurrently in a task group of the caller's; their results in order.

    Like ``asyncio.gather`` without ``return_exceptions``: the first error (in time) is
    raised, as it is (never wrapped in an ExceptionGroup), but only once every call
    has ended (a failed call does not cancel the others). The caller's cancellation
    cancels them all.
    """
    results: list[Any] = [None] * len(calls)
    errors: list[Exception] = []

    async def one(i: int, call: Callable[[], Awaitable[T]]) -> None:
        try:
            results[i] = await call()
        except Exception as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        for i, call in enumerate(calls):
            tg.start_soon(one, i, call)
    if errors:
        raise errors[0]
    return results


async def _run_all(calls: list[Callable[[], Awaitable[object]]]) -> None:
    """Run ``calls`` concurrently to their ends, their errors dropped (``asyncio.gather``
    with ``return_exceptions=True``, results unused)."""

    async def one(call: Callable[[], Awaitable[object]]) -> None:
        try:
            await call()
        except Exception:
            log.debug("fleet cleanup step failed", exc_info=True)

    async with anyio.create_task_group() as tg:
        for call in calls:
            tg.start_soon(one, call)


class FleetLookup(dict[str, "int | KVCacheError"]):
    """One fleet-wide lookup: ``name -> cached prefix in tokens``, or the error that
    says why that server has no answer (never a silent 0).

    ``sources[name]`` says where each answer came from (docs/fleet.md states what
    each guarantees): ``"index"`` (no RPC; by default only for a member whose index
    provably holds all its server holds), ``"lookup"`` (a direct RPC),
    ``"coordinator"`` (the coordinator's directory) or ``"down"`` (marked down: an
    error value, no RPC).
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
            :mod:`lmkv_async.coordinator`. It maps the configured servers to its
            instances; it adds servers only as ``discover`` allows.
        discover: which servers the coordinator lists may join the fleet (and so get
            its API key and a data path): ``False`` (the default) none, ``True`` every
            one, or a collection of allowed instance ids and ``"host:port"`` HTTP
            addresses.
        timeout: default deadline of :meth:`lookup` / :meth:`best`, seconds.
        connect_timeout: deadline of a member's join (and of each re-join probe).
        data_timeout: default deadline of the data-path contexts.
        events: follow KV-event streams and keep the prefix index.
        registration: ``"auto"`` registers a member's light session only on servers
            with no registration for the model (a lookup needs one);
            ``"always"`` / ``"never"``.
        audit_interval: seconds between ``/status`` audits of event-following members
            (the index answers for a member only with an audit at most two intervals old).
        allow_stale_index: trade staleness for speed: answer every member that follows
            its events from the index, even when its server holds objects the index
            cannot know (engine-driven stores by others, before or after the fleet
            attached; a lost range of events). Such answers may be too low. By
            default (False) those members are asked directly.
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
        allow_stale_index: bool = False,
        discover: bool | Collection[str] = False,
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
        self.allow_stale_index = bool(allow_stale_index)
        if isinstance(discover, str) or not (
                isinstance(discover, bool) or (isinstance(discover, Collection)
                                               and all(isinstance(d, str) for d in discover))):
            raise InvalidInputError("discover must be a bool or a collection of instance ids "
                                    "and host:port addresses")
        if not servers and discover is False:
            raise InvalidInputError("a fleet with no servers needs discover=True or an "
                                    "allowlist to take its servers from the coordinator")
        self.discover: bool | frozenset[str] = (
            discover if isinstance(discover, bool) else frozenset(discover))
        # Held in an ApiKey: never in a repr, a log line or a message.
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
        self._own_store_listeners: list[OwnStoreListener] = []
        self._state: Literal["new", "open", "closed"] = "new"
        #: the fleet's task group: entered by ``async with``, else hosted by open()
        self._background = Background(f"fleet {model_name}")
        self._hosts_background = False
        self._entered = False
        #: members' joins still running (open's and add_member's)
        self._joins: set[Job[None]] = set()
        self._closer = Once()
        self.coordinator: FleetCoordinator | None = None

    def __repr__(self) -> str:
        up = sum(1 for m in self._members.values() if m.state == "up")
        return f"<Fleet {self.model_name!r} {up}/{len(self._members)} up, {self._state}>"

    # ------------------------------------------------------------------ lifecycle
    @property
    def background(self) -> Background:
        """The fleet's task group (members, their sessions and the coordinator view run
        their background work in it)."""
        return self._background

    async def open(self) -> Fleet:
        """Join every member concurrently (each within ``connect_timeout``).

        Members that cannot be reached are marked down and keep being probed;
        this only fails for bad arguments. Without ``async with``, the fleet's
        task group is hosted in a task of its own (a trio system task under trio)
        until :meth:`aclose`.
        """
        if self._state != "new":
            return self
        require_event_loop("Fleet.open")
        _loop_thread.track_if_on_loop(self)  # opened for the blocking facade: closed at exit
        try:
            if not self._background.running:
                # Set first: a host that a cancellation interrupted is still ended by aclose.
                self._hosts_background = True
                await self._background.host()
            if self.coordinator_url:
                # Before the state is "open": members it adds are joined below, once.
                self.coordinator = await attach_coordinator(self, self.coordinator_url,
                                                            self.discover)
            self._state = "open"
            await _gather([m._join for m in self._members.values()])
        except BaseException:
            # Cancelled while opening (``async with`` then never calls __aexit__):
            # close what joined, shielded.
            await self.aclose()
            raise
        return self

    @property
    def api_key(self) -> ApiKey | None:
        """The HTTP API key (an :class:`~lmkv_async.http.ApiKey`: it never shows itself)."""
        return self._api_key

    async def aclose(self) -> None:
        """Close every member: no lock, session or registration stays on any server.

        Shielded, bounded and idempotent: the caller's cancellation (``Task.cancel``,
        ``asyncio.timeout``, ``wait_for``, an anyio cancel scope) does not cut the
        cleanup short; it runs to its end and the cancellation is raised after. A
        second call (also after a cut-short first one) waits for the same cleanup.
        """
        await self._closer.run(self._teardown)

    async def _teardown(self) -> None:
        self._state = "closed"
        for member in self._members.values():
            member.state = "closed"  # joins still running stop at their next step
        joins = set(self._joins)
        for job in joins:
            job.cancel()
        if joins:
            # Bounded: a join that ignores its cancellation is left to the group's end.
            await self._background.drain(joins, self.connect_timeout)
        if self.coordinator is not None:
            await _run_all([self.coordinator.aclose])
        await _run_all([m.aclose for m in self._members.values()])
        if self._hosts_background:
            # Cancels what is left (nothing, normally) and waits until the host ended.
            await self._background.aclose()

    async def __aenter__(self) -> Fleet:
        """Enter the fleet's task group in the caller's task, then :meth:`open`."""
        if self._state != "new" or self._background.running:
            return await self.open()  # already open (or closed): no group of ours to enter
        await self._background.__aenter__()
        self._entered = True
        try:
            return await self.open()
        except BaseException as exc:
            # open() closed what it had joined; the group has nothing left but to end
            self._entered = False
            await self._background.__aexit__(type(exc), exc, exc.__traceback__)
            raise

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            await self.aclose()
        finally:
            if self._entered:
                self._entered = False
                await self._background.__aexit__(exc_type, exc, tb)

    def add_member(self, name: str, url: str, http_url: str) -> FleetMember:
        """Add a server (before :meth:`open`, or later: it then joins in the background)."""
        if name in self._members:
            raise InvalidInputError(f"fleet already has a member named {name!r}")
        if self._state == "closed":
            raise ClosedError("fleet is closed")
        member = FleetMember(self, name, url, http_url)
        self._members[name] = member
        if self._state == "open":
            job = self._background.start_soon(member._join, name=f"lmkv-fleet-join-{name}")
            self._joins.add(job)
            job.add_done_callback(self._joins.discard)
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

        ``source="auto"`` answers synced members (:attr:`FleetMember.synced`: by
        default, only those whose index provably holds everything their server
        holds) from the index and the others with a direct lookup; ``"lookup"`` asks
        every server; ``"index"`` answers only from the index (unsynced members get an
        error value); ``"coordinator"`` asks the coordinator's directory for the
        members it knows (within half the time left) and answers the rest, or all
        of them when it fails, as ``"auto"`` does; after a failure it is skipped for
        a second.
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
        started = time.monotonic()
        deadline = started + t
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
        # Direct lookups run as jobs of the fleet's group: the deadline (or the caller's
        # cancellation) abandons the wait for one, not the sequence, which goes on to
        # its release steps (_ops).
        direct: dict[str, Job[int | KVCacheError]] = {}
        # Release steps of the direct lookups wait until all of them are answered.
        release_gate = anyio.Event()
        candidates = []
        for name, member in self._members.items():
            if name in out:
                continue  # answered by the coordinator
            if member.state != "up":
                out[name], out.sources[name] = member._down_error(), "down"
            elif n == 0:
                out[name], out.sources[name] = 0, "lookup"
            elif source in ("auto", "index") and member.sync.candidate:
                candidates.append(name)
            elif source == "index":
                out[name] = UnsupportedOperationError(
                    f"the index cannot answer for it: {member.sync.why_not()}",
                    server=member.url)
                out.sources[name] = "index"
            else:
                direct[name] = self._direct_job(member, toks, salt, n, deadline, release_gate)
        synced = []
        if candidates:
            # By default the index answers only with proof from an audit sent during
            # this call (shared by concurrent calls), within half the time left: a
            # member it cannot prove is then asked directly.
            prove_by = time.monotonic() + max(0.0, deadline - time.monotonic()) / 2
            try:
                proofs = await _gather([functools.partial(self._members[k].sync.prove,
                                                          started, prove_by)
                                        for k in candidates])
            except BaseException:
                self._abandon(direct, release_gate)
                raise
            for name, ok in zip(candidates, proofs, strict=True):
                member = self._members[name]
                if ok and member.connected:
                    synced.append(name)
                elif source == "index":
                    out[name] = UnsupportedOperationError(
                        f"the index cannot answer for it: {member.sync.why_not()}",
                        server=member.url)
                    out.sources[name] = "index"
                else:
                    direct[name] = self._direct_job(member, toks, salt, n, deadline,
                                                    release_gate)
        if synced:
            packed = token_bytes(toks[:n])
            for name, chunks in self._index.longest(packed, n // C, salt, synced).items():
                out[name], out.sources[name] = chunks * C, "index"
        if direct:
            try:
                with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                    for job in direct.values():
                        await job.wait()
            except BaseException:
                self._abandon(direct, release_gate)
                raise
            release_gate.set()
            for name, job in direct.items():
                out.sources[name] = "lookup"
                if job.done():
                    if job.cancelled():  # the fleet's close ended it
                        raise ClosedError("the fleet was closed while the lookup was in flight")
                    out[name] = job.result()
                else:
                    job.cancel()  # the sequence's release steps still run (_ops)
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

    def _direct_job(self, member: FleetMember, toks: list[int], salt: str, n: int,
                    deadline: float, release_gate: anyio.Event) -> Job[int | KVCacheError]:
        return self._background.start_soon(member._direct, toks, salt, n, deadline,
                                           release_gate, name=f"lmkv-fleet-lookup-{member.name}")

    @staticmethod
    def _abandon(direct: Mapping[str, Job[int | KVCacheError]],
                 release_gate: anyio.Event) -> None:
        """The caller was cancelled: stop waiting for the direct lookups (their release
        steps still run, in _ops) and let those release steps go."""
        for job in direct.values():
            job.cancel()
        release_gate.set()

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

    def _adopt_chunk_size(self, chunk_size: int) -> None:
        if self.chunk_size == 0:
            self.chunk_size = chunk_size
            self._index = PrefixIndex(chunk_size)

    async def _note_store(self, name: str, toks: list[int], salt: str,
                          chunks: int) -> list[bytes]:
        C = self.chunk_size
        hashes = self._index.add_own(name, toks, salt, chunks)  # blake3: ~2 us a chunk
        for listener in list(self._own_store_listeners):
            try:
                listener(name, hashes, toks[: chunks * C])
            except Exception:  # a listener's bug must not fail the caller's store
                log.exception("own-store listener failed")
        return hashes

    @property
    def index(self) -> PrefixIndex:
        """The event-fed prefix index (for inspection)."""
        return self._index
