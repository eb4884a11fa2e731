"""A fleet member's index bookkeeping: its event stream, its ``/status`` audits, the
proof that the index holds everything its server holds, and the fleet's own stores.

What the server tells (lmcache 0.5.6 and 0.5.7, measured; compat.md §14.5):

* the event log numbers records from 1 in each incarnation (a server start); a
  subscription from cursor 0 replays every record still in the log and says
  ``lost`` if the first ones are gone (``--kv-event-log-size``, 32768 records);
* lmcache-driven stores (vLLM's adapter) log ``stored``; evictions and clears log
  ``removed``, for every object, however it was stored;
* engine-driven stores (this library, the official SDK) log nothing: they only
  count up ``/status kv_events.unbound_stores``, one a chunk, for every model
  together, from 0 at the server's start.

So the index knows a server's whole content exactly when its stream replayed the
log from cursor 0 with nothing lost, and ``unbound_stores`` never exceeded the
chunks the fleet itself wrote there (each of which the fleet indexed). That is
what :attr:`IndexSync.synced` checks, at an audit no older than two audit
intervals, whose log position the index has already applied. Anything else:
the member is asked directly.

Audits and re-indexing run as jobs of the fleet's :class:`~._background.Background`;
the member's close cancels them (:meth:`IndexSync.tasks`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import anyio

from . import _ops
from ._background import Job
from ._fleet_host import FleetHost, MemberState
from ._session import Session
from .errors import (
    KVCacheError,
    ServerTimeoutError,
    ServerUnavailableError,
    UnsupportedOperationError,
)
from .events import KVEventStream, require_kv_events
from .wire.dialect import CAP_KV_EVENTS
from .wire.events import KVEvent, KVRemoved, KVResync, KVStored

__all__ = ["IndexSync", "OwnReplayStream"]

log = logging.getLogger("lmkv_async.fleet")

#: Stores through the fleet remembered per member, to re-announce after a resync
#: (the oldest are forgotten first: a miss at worst, never a false hit).
OWN_RECORDS = 1024
#: Deadline of one ``/status`` audit and of each re-verifying lookup.
AUDIT_TIMEOUT = 0.5
#: When the log has not moved for this long, an idle stream has applied all of it
#: that concerns its model (records of other models send no batch).
STABLE_AFTER = 1.0

OwnKey = tuple[bytes, str]
OwnRecord = tuple[tuple[int, ...], str, tuple[bytes, ...]]


class _Member(Protocol):
    """What the bookkeeping needs of its member."""

    @property
    def name(self) -> str: ...
    @property
    def url(self) -> str: ...
    @property
    def state(self) -> MemberState: ...
    @property
    def session(self) -> Session | None: ...
    @property
    def connected(self) -> bool: ...

    def _mark_down(self, exc: KVCacheError) -> None: ...


class IndexSync:
    """One member's side of the fleet's prefix index (see the module docstring)."""

    def __init__(self, fleet: FleetHost, member: _Member) -> None:
        self.fleet = fleet
        self.member = member
        #: the server streams KV events (set by the follower)
        self.has_events = False
        #: the server has no stream (0.5.2, ``--kv-event-log-size 0``): nothing is indexed
        self.no_events = False
        self.stream: KVEventStream | None = None
        #: the stream is subscribed and its socket connected
        self.stream_live = False
        #: the stream replayed this incarnation's log from its start, nothing lost since
        self.stream_complete = False
        self.incarnation: int | None = None
        self.audited_incarnation: int | None = None
        #: monotonic time of the last audit that proved something (0: none yet)
        self.audited_at = 0.0
        #: when that audit's ``/status`` request was sent
        self.proof_started = 0.0
        self._audit_task: Job[None] | None = None
        self._audit_task_started = 0.0
        #: when ``audit_seq`` was first seen (the log has not moved since)
        self._seq_since = 0.0
        #: the server's last logged seq at that audit: the index must have applied it
        self.audit_seq = 0
        #: no engine-driven store on the server but the fleet's own, ever (this incarnation)
        self.exact = True
        #: engine-driven chunks the fleet did not store (the last audit's count)
        self.foreign_stores = 0
        #: engine-driven stores before the fleet attached (``allow_stale_index`` only)
        self.unbound_baseline = 0
        self.own_written = 0
        self.own_inflight = 0
        self._own: OrderedDict[OwnKey, OwnRecord] = OrderedDict()
        self._verifying = 0
        self._removed_while_verifying: set[bytes] = set()
        self._tasks: set[Job[None]] = set()

    # ------------------------------------------------------------------ the rule
    def _chunk_ok(self) -> bool:
        s = self.member.session
        return s is not None and s.chunk_size == self.fleet.chunk_size

    @property
    def indexable(self) -> bool:
        """Whether the fleet's stores on this member are worth indexing (it streams events)."""
        s = self.member.session
        return (self.fleet.events and not self.no_events and s is not None
                and CAP_KV_EVENTS in s.capabilities and self._chunk_ok())

    @property
    def candidate(self) -> bool:
        """Everything :attr:`synced` needs but a recent audit: worth proving now."""
        m = self.member
        if not (m.state == "up" and m.connected and self.has_events and self.stream_live
                and self.stream is not None and self.incarnation is not None
                and not self._verifying and self._chunk_ok()):
            return False
        return self.fleet.allow_stale_index or (self.stream_complete and self.exact)

    @property
    def synced(self) -> bool:
        """Whether the index held everything the server holds at the last audit, and
        that audit is recent (docs/fleet.md, "When the index answers")."""
        stream = self.stream
        return (self.candidate and stream is not None
                and self.audited_incarnation == self.incarnation
                and self._caught_up(stream)
                and time.monotonic() - self.audited_at
                <= 2 * self.fleet.audit_interval + AUDIT_TIMEOUT)

    async def prove(self, since: float, deadline: float) -> bool:
        """Whether the index may answer for this member in a call that started at
        ``since``: :attr:`synced` with an audit sent at or after ``since`` (one audit
        is shared by the calls waiting for it). ``allow_stale_index``: the last audit
        will do. False when no such audit finished by ``deadline``."""
        if self.fleet.allow_stale_index or (self.proof_started >= since and self.synced):
            return self.synced
        if not self.candidate:
            return False
        task = self._audit_task
        if task is None or task.done() or self._audit_task_started < since:
            self._audit_task_started = time.monotonic()
            task = self._audit_task = self._spawn(self.audit, name="lmkv-fleet-audit")
            if task is None:
                return False  # the fleet is closing
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        # A job of the fleet's: one caller's timeout (or cancellation) ends its wait,
        # never the audit others wait for.
        done = await task.wait_within(left)
        return done and self.proof_started >= since and self.synced

    def _caught_up(self, stream: KVEventStream) -> bool:
        """Whether the index applied every record the server had logged at the last audit.

        The cursor passes the audit's seq once a batch reaches it; records of other
        models send no batch, so when the log did not move between two audits an idle
        stream (nothing received but not yet applied) counts as caught up.
        """
        if stream.cursor >= self.audit_seq:
            return True
        # A batch of ours logged before the audit has long arrived by now.
        return (isinstance(stream, _FollowStream) and stream.idle and self._seq_since > 0
                and time.monotonic() - self._seq_since >= STABLE_AFTER)

    def why_not(self) -> str:
        """Why :attr:`synced` is False (for error messages and logs)."""
        m = self.member
        if m.state != "up" or not m.connected:
            return f"member {m.state}{'' if m.connected else ', not connected'}"
        if not self.has_events:
            return "no KV-event stream"
        if not self.stream_live:
            return "event stream not live"
        if self.audited_incarnation is None or self.audited_incarnation != self.incarnation:
            return "not audited yet"
        if not self.fleet.allow_stale_index and not self.stream_complete:
            return "events were lost (until the server restarts)"
        if not self.fleet.allow_stale_index and not self.exact:
            return (f"{self.foreign_stores} engine-driven chunk stores the index cannot "
                    "know (until the server restarts)")
        return "the index has not caught up with the last audit"

    # ------------------------------------------------------------------ audits
    async def audit(self) -> None:
        """``GET /status``: liveness, the log position, and engine-driven stores."""
        s = self.member.session
        if s is None:
            return
        started = time.monotonic()
        try:
            status = await s.http.get_json("/status", timeout=AUDIT_TIMEOUT)
        except (ServerTimeoutError, ServerUnavailableError) as exc:
            self.member._mark_down(exc)
            return
        except KVCacheError as exc:
            log.debug("audit of %s failed: %s", self.member.name, exc)
            return
        self.apply_status(status, started)

    def apply_status(self, status: Any, started: float | None = None) -> None:
        """Update the proof from one ``/status`` body."""
        kv = status.get("kv_events") if isinstance(status, dict) else None
        if not isinstance(kv, dict) or kv.get("incarnation") != self.incarnation:
            return  # not ours yet (the stream has not seen this incarnation)
        try:
            unbound = int(kv.get("unbound_stores", 0))
            next_seq = int(kv.get("next_seq", 1))
        except (TypeError, ValueError):
            return
        # The fleet's stores in flight may already be counted by the server; a
        # foreign store hidden by them shows at the next audit after they finish.
        foreign = unbound - self.own_written - self.own_inflight
        if self.audited_incarnation != self.incarnation:
            self.unbound_baseline = max(0, foreign)
        self.foreign_stores = max(0, foreign)
        if foreign > 0 and self.exact:
            log.info("%s: %d engine-driven chunk stores the fleet did not make (any model, "
                     "since the server started); asking it directly until it restarts",
                     self.member.name, foreign)
            self.exact = False
        now = time.monotonic()
        if not (self.audited_incarnation == self.incarnation
                and next_seq - 1 == self.audit_seq):
            self._seq_since = now
        self.audit_seq = next_seq - 1
        self.audited_incarnation = self.incarnation
        self.audited_at = now
        self.proof_started = now if started is None else started

    # ------------------------------------------------------------------ the stream
    async def follow(self, wake: Callable[[], None]) -> None:
        """Feed the index from this server's KV-event stream, resubscribing on errors.

        A new subscription always starts at cursor 0 (the whole log: what the
        server did before the fleet attached counts too). ``wake()`` asks the
        member's health loop for an audit now (a new incarnation).
        """
        f = self.fleet
        s = self.member.session
        assert s is not None
        try:
            require_kv_events(s.d, s.capabilities, self.member.url, s.server_version)
        except UnsupportedOperationError:
            self._no_stream()
            return
        self.has_events = True
        delay = f.probe_backoff[0]
        while self.member.state != "closed":
            stream = _FollowStream(self.member.url, s.d, f.model_name, max_events=1024,
                                   timeout=f.connect_timeout,
                                   heartbeat_interval=min(10.0, (s.reap_timeout or 120) / 4))
            self.stream = stream
            try:
                while True:
                    self.apply(await stream.next(), wake)
                    delay = f.probe_backoff[0]
            except UnsupportedOperationError as exc:
                log.info("%s records no KV events (%s): lookups only", self.member.name, exc)
                self._no_stream()
                return
            except KVCacheError as exc:
                log.debug("%s event stream failed: %s", self.member.name, exc)
            finally:
                self.stream_live = self.stream_complete = False
                await finish_close(stream)
            await anyio.sleep(delay)
            delay = min(delay * 2, f.probe_backoff[1])

    def _no_stream(self) -> None:
        self.has_events, self.no_events = False, True
        self.fleet.index.discard(self.member.name)  # never read for this member
        self._own.clear()

    def apply(self, ev: KVEvent, wake: Callable[[], None] | None = None) -> None:
        """Apply one stream event to the index and the proof."""
        index = self.fleet.index
        name = self.member.name
        if isinstance(ev, KVStored):
            if ev.medium == "CPU":
                index.add_event(name, ev.block_hashes, ev.parent_block_hash, ev.token_ids)
            return
        if isinstance(ev, KVRemoved):
            index.remove(name, ev.block_hashes)
            if self._verifying:
                self._removed_while_verifying.update(ev.block_hashes)
            return
        if ev.reason == "disconnected":
            self.stream_live = False  # asked directly until the stream is back
            return
        self.stream_live = True
        if ev.discard:
            index.discard(name)
        if ev.reason == "restart" or (ev.incarnation != self.incarnation
                                      and self.incarnation is not None):
            # A new server process: new counters, an empty CPU tier.
            self.own_written, self.unbound_baseline, self.exact = 0, 0, True
            self.foreign_stores = 0
            self._own.clear()
        elif ev.discard and self._own:
            self._spawn(self._reindex_own, name="lmkv-fleet-reindex")
        if ev.incarnation != self.incarnation:
            self.incarnation = ev.incarnation
            self.audited_incarnation = None
            if wake is not None:
                wake()  # audit now, not at the next interval
        if ev.reason in ("start", "restart") or not ev.complete:
            self.stream_complete = ev.complete
        # "resumed": nothing missed; completeness stays what it was

    # ------------------------------------------------------------------ own stores
    def note_own(self, toks: list[int], salt: str, hashes: list[bytes]) -> None:
        """Remember a store through the fleet (bounded), for re-announcing."""
        if not hashes:
            return
        C = self.fleet.chunk_size
        key = (hashes[-1], salt)
        self._own[key] = (tuple(toks[: len(hashes) * C]), salt, tuple(hashes))
        self._own.move_to_end(key)
        while len(self._own) > OWN_RECORDS:
            self._own.popitem(last=False)

    async def verified_own(self) -> list[OwnRecord]:
        """The fleet's remembered stores, each cut to the prefix the server still holds
        (a direct lookup each; records the server no longer holds are dropped)."""
        s = self.member.session
        C = self.fleet.chunk_size
        out: list[OwnRecord] = []
        if s is None or not C:
            return out
        for key, (toks, salt, hashes) in list(self._own.items()):
            try:
                hit = await _ops.lookup(s, list(toks), salt, len(toks),
                                        time.monotonic() + AUDIT_TIMEOUT)
            except KVCacheError as exc:
                log.debug("%s: cannot re-verify an own store: %s", self.member.name, exc)
                continue
            n = min(hit // C, len(hashes))
            if n == 0:
                self._own.pop(key, None)
                continue
            out.append((toks[: n * C], salt, hashes[:n]))
        return out

    async def _reindex_own(self) -> None:
        """After a resync that discarded the index: put back the fleet's own stores the
        server still holds (they emit no event, so no replay brings them back)."""
        self._verifying += 1
        try:
            records = await self.verified_own()
            gone = self._removed_while_verifying
            for toks, salt, hashes in records:
                keep = next((i for i, h in enumerate(hashes) if h in gone), len(hashes))
                if keep:
                    self.fleet.index.add_own(self.member.name, list(toks), salt, keep,
                                             hashes=hashes[:keep])
        finally:
            self._verifying -= 1
            if not self._verifying:
                self._removed_while_verifying = set()

    # ------------------------------------------------------------------ jobs
    def _spawn(self, fn: Callable[[], Awaitable[None]], *, name: str) -> Job[None] | None:
        """A job of the fleet's group that the member's close stops; None once the
        group is closing (nothing would own it)."""
        bg = self.fleet.background
        if not bg.running:
            return None
        job = bg.start_soon(fn, name=f"{name}-{self.member.name}")
        self._tasks.add(job)
        job.add_done_callback(self._tasks.discard)
        return job

    def tasks(self) -> list[Job[None]]:
        """Background jobs to stop when the member closes."""
        return list(self._tasks)


async def finish_close(stream: KVEventStream) -> None:
    """Close a stream even when the follower is being cancelled (its cancel frame
    ends the server's subscription): shielded, so the follower ends only once it is
    closed (the close is bounded)."""
    with contextlib.suppress(Exception), anyio.CancelScope(shield=True):
        await stream.aclose()


class _FollowStream(KVEventStream):
    """The follower's stream; it can tell whether it holds records not yet handed out."""

    @property
    def idle(self) -> bool:
        """Nothing received is waiting to be handed out."""
        return not self._pending


class OwnReplayStream(KVEventStream):
    """A member's :meth:`~lmkv_async.fleet.FleetMember.kv_events` stream: after a resync
    that discards (a start, a lost range, but not a restart), it also hands out the
    fleet's own stores that the server still holds, as ``KVStored`` records with
    ``seq`` 0 (they emit no LMCache event, so a consumer that dropped what it knew
    would never hear of them again)."""

    def __init__(self, sync: IndexSync, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._owner = sync
        self._replay: list[KVStored] = []

    async def next(self) -> KVEvent:
        if self._replay:
            return self._replay.pop(0)
        ev = await super().next()
        if isinstance(ev, KVResync) and ev.discard and ev.reason != "restart":
            C = self._owner.fleet.chunk_size
            for toks, _salt, hashes in await self._owner.verified_own():
                parent: bytes | None = None
                for i, h in enumerate(hashes):
                    self._replay.append(KVStored(0, self.model_name, (h,), parent,
                                                 toks[i * C:(i + 1) * C], "CPU"))
                    parent = h
        return ev
