"""The operation sequences: lookup, retrieve, store, over one :class:`~._session.Session`.

Each operation is a fixed sequence of RPCs (protocol reference §6.4)::

    store    : prepare_store -> copy into slots (SHM) / inline data -> commit_store
               -> end_session
    lookup   : lookup -> prefetch status -> free_lookup_locks (on a hit) -> end_session
    retrieve : lookup -> prefetch status -> prepare_retrieve -> copy out -> commit_retrieve
               -> end_session
    view     : the retrieve sequence, with the caller's ``async with`` block in place of
               the copy (the sequence's job waits for the block to end)

What each step reserved on the server is released on every exit path, by the
rules in :mod:`._release`. A sequence runs as a job of its own that the
caller waits for (:meth:`Session.run`): if the caller is cancelled, the job
goes on to its release steps, and a store whose slots were
handed out still fills and commits them, because an unfilled reservation can
later be published as a garbage entry (protocol reference §6.6).
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field

import anyio
import torch

from . import _logctx, _session, kernel
from ._background import Job, Signal
from ._release import Prepared, lookup_release, retrieve_release
from ._session import OpState, Session
from .cuda import DeviceCopy
from .errors import (
    ClosedError,
    KVCacheError,
    ProtocolError,
    ServerError,
    ServerTimeoutError,
    TransportUnavailableError,
    with_context,
)
from .memory import Region, RegionArg, offload
from .transport import Connection
from .wire import requests
from .wire.frames import Reply
from .wire.keys import KeyEncoder
from .wire.replies import (
    as_bool,
    as_optional_count,
    check_chunk_tensors,
    has_slots,
    parse_prepare_retrieve,
    parse_prepare_store,
)
from .wire.tensors import decode_inline, encode_inline

__all__ = ["Sink", "ViewHold", "lookup", "open_view", "retrieve", "store"]

log = logging.getLogger("lmkv_async")

#: Copies chunk objects (placements, bounds) into the caller's destination for ``hit`` chunks.
Sink = Callable[[int, list[tuple[int, int]], RegionArg], None]
#: Copies the caller's source into chunk objects at the given placements.
ToChunks = Callable[[list[tuple[int, int]], RegionArg], None]
#: What a retrieve does with its chunk objects (hit, placements, bounds, bytes) while
#: the read is held: a copy (:data:`Sink` in a thread), or a view's whole block.
Consume = Callable[[int, list[tuple[int, int]], RegionArg, int], Awaitable[None]]


async def _copy(fn: Callable[..., None] | DeviceCopy, *args: object, nbytes: int) -> None:
    """Run a sink or source: a GPU copy (:mod:`.cuda`) queues its DMA and awaits its
    completion on the loop; a CPU copy is offloaded. Either way it has finished
    (cancelled or not) before the release steps that follow can run."""
    if isinstance(fn, DeviceCopy):
        await fn.run(*args, nbytes=nbytes)
    else:
        await offload(fn, *args, nbytes=nbytes)


def _new_request_id(kind: str) -> str:
    # Fresh per sequence: the server caches chunk hashes per request_id (§5.3).
    return f"lmkv-{kind}-{uuid.uuid4().hex}"


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
    #: when the operation began: its one reconnect grace counts from here or the loss
    started: float = field(default_factory=time.monotonic)


def _seq(s: Session, kind: str, toks: list[int], salt: str, n: int) -> _Seq:
    conn = s.transport.pick()
    rid = _new_request_id(kind)
    # The operation's task (Session.run) and the release tasks it starts log with these.
    _logctx.bind(op=kind, server=s.url, request_id=rid)
    return _Seq(conn, conn.generation, s.key_encoder(toks, salt), rid, n)


async def _cleanup(s: Session, seq: _Seq, req: requests.Request) -> object:
    return await s.cleanup_rpc(seq.conn, seq.generation, req, request_id=seq.rid)


async def _end_session(s: Session, seq: _Seq) -> None:
    await _cleanup(s, seq, requests.end_session(s.d, seq.rid))


# ---------------------------------------------------------------------- lookup
async def _prefetch_result(s: Session, seq: _Seq, deadline: float) -> int:
    """Consume the lookup result (exactly once), awaiting it without sleep-polling.

    L1 prefetches finish at once, so one query nearly always answers; if not,
    short server-side waits (bounded, since a wait occupies one of the server's
    normal-pool threads) take over.
    """
    count = as_optional_count(
        await s.rpc(seq.conn, requests.query_prefetch_status(s.d, seq.rid), deadline,
                    request_id=seq.rid, grace_from=seq.started),
        "query_prefetch_status",
    )
    wait = 0.02
    while count is None:
        budget = min(wait, max(0.001, deadline - time.monotonic() - 0.05))
        count = as_optional_count(
            await s.rpc(seq.conn, requests.wait_prefetch_status(s.d, seq.rid, budget), deadline,
                        request_id=seq.rid, grace_from=seq.started),
            "wait_prefetch_status",
        )
        wait = min(wait * 2, 0.5)
    return count


async def _lookup_locked(s: Session, seq: _Seq, deadline: float) -> int:
    """Send lookup (``start=0``, compat.md §14.4), consume its result; returns hit chunks.

    ``seq`` records how far we got, for the release steps.
    """
    C = s.chunk_size
    key = seq.enc.encode(prefix_len=seq.n, start=0, end=seq.n, request_id=seq.rid,
                         worker_id=None)
    seq.lookup_sent = True
    req = requests.lookup(s.d, key, s.layout.world_size)
    if s.pipelines_lookup_query and seq.conn.connected:
        # Pipelined: the query goes right behind the lookup (one round trip, not two).
        # Safe only because one server thread runs both in order (see Session), and
        # only where free_lookup_locks is bounded by the recorded hit (0.5.6+): a
        # frozen server makes the query's reply late more often, and once our lost
        # query has consumed the result a 0.5.2 server's anonymous free cannot be
        # aimed (it would leave the locks until their TTL).
        sent = Signal()
        ack = s.spawn(functools.partial(s.rpc, seq.conn, req, deadline, request_id=seq.rid,
                                        grace_from=seq.started, sent=sent), name="lmkv-ack")
        try:
            await sent.wait_or(ack)
            if not sent.fired:
                await ack.wait()
                ack.result()  # failed before it was sent: raises
                raise ProtocolError("lookup was not sent", op="lookup", server=s.url)
            hit = await _prefetch_result(s, seq, deadline)
            seq.hit = min(hit, seq.n // C)  # consumed: the release frees it even if ack fails
            await ack.wait()
            ack.result()
        finally:
            if not ack.done():
                ack.cancel()  # we are failing or cancelled: the release steps take over
                with anyio.CancelScope(shield=True):
                    await ack.wait()
    else:
        await s.rpc(seq.conn, req, deadline, request_id=seq.rid, grace_from=seq.started)
        hit = await _prefetch_result(s, seq, deadline)
    if hit > seq.n // C:
        seq.hit = seq.n // C
        raise ProtocolError(f"server reports {hit} hit chunks for {seq.n // C} looked up",
                            op="query_prefetch_status", server=s.url, request_id=seq.rid)
    seq.hit = hit
    return hit


async def _release_lookup(s: Session, seq: _Seq, *, free_hit: bool) -> None:
    """Release steps of a lookup (see :func:`._release.lookup_release`)."""
    C = s.chunk_size
    plan = lookup_release(lookup_sent=seq.lookup_sent, hit=seq.hit, free_hit=free_hit,
                          bounded_free=s.d.bounded_free, looked_up_chunks=seq.n // C)
    free = plan.free
    if plan.consume:
        raw = await _cleanup(s, seq, requests.wait_prefetch_status(s.d, seq.rid, 1.0))
        try:
            learned = as_optional_count(raw, "wait_prefetch_status") or 0
        except ProtocolError:
            learned = 0
        if free == "learned":
            free = learned
    if isinstance(free, int) and free > 0:
        key = seq.enc.encode(prefix_len=seq.n, start=0, end=free * C, request_id=seq.rid,
                             worker_id=None)
        await _cleanup(s, seq, requests.free_lookup_locks(s.d, key, s.layout.world_size))
    if plan.end_session:
        await _end_session(s, seq)


async def _after(gate: anyio.Event, deadline: float,
                 steps: Callable[[], Coroutine[object, object, None]]) -> None:
    """Run the release ``steps`` once ``gate`` is done (or the deadline passed).

    ``steps`` is a factory, so a task closed before it starts leaves no coroutine
    that was never awaited.
    """
    try:
        if not gate.is_set():
            with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                await gate.wait()
    finally:
        await steps()


async def lookup(s: Session, toks: list[int], salt: str, n: int, deadline: float,
                 release_gate: anyio.Event | None = None) -> int:
    """Cached prefix of ``toks[:n]`` in tokens; leaves no lock behind.

    ``release_gate``: hold the release steps back until it is set (at the latest
    until the deadline). A fan-out passes one it resolves when every server has
    answered, so one server's release steps do not compete with the lookups still
    in flight on the others, on this event loop and on shared CPUs.
    """

    async def op(state: OpState) -> int:
        await s.ensure_registered(deadline)
        seq = _seq(s, "lookup", toks, salt, n)
        try:
            return await _lookup_locked(s, seq, deadline) * s.chunk_size
        finally:
            if release_gate is None:
                s.release_later(_release_lookup(s, seq, free_hit=True))
            else:
                s.release_later(_after(release_gate, deadline,
                                       lambda: _release_lookup(s, seq, free_hit=True)))

    return await s.run(op)


async def cached_prefix(s: Session, toks: list[int], salt: str, n: int, deadline: float) -> int:
    """Hit chunks of ``toks[:n]``, inside an operation (no task of its own)."""
    seq = _seq(s, "probe", toks, salt, n)
    try:
        return await _lookup_locked(s, seq, deadline)
    finally:
        s.release_now(_release_lookup(s, seq, free_hit=True))


# ---------------------------------------------------------------------- retrieve
async def retrieve(s: Session, toks: list[int], n: int, salt: str, sink: Sink | DeviceCopy,
                   deadline: float) -> int:
    """lookup -> prepare_retrieve -> sink(chunks) -> commit_retrieve; returns hit chunks."""

    async def consume(hit: int, chunks: list[tuple[int, int]], region: RegionArg,
                      nbytes: int) -> None:
        await _copy(sink, hit, chunks, region, nbytes=nbytes)

    return await s.run(lambda state: _retrieve_seq(s, state, toks, n, salt, consume, deadline))


async def _retrieve_seq(s: Session, state: OpState, toks: list[int], n: int, salt: str,
                        consume: Consume, deadline: float) -> int:
    await s.ensure_registered(deadline)
    C = s.chunk_size
    seq = _seq(s, "retrieve", toks, salt, n)
    prepared = Prepared.NONE
    spec, pool = s.slot_spec, s.pool
    try:
        hit = await _lookup_locked(s, seq, deadline)
        if hit == 0 or state.abandoned:
            return 0
        key = seq.enc.encode(prefix_len=hit * C, start=0, end=hit * C, request_id=seq.rid,
                             worker_id=0)
        if spec is not None:
            gate = seq.enc.identity(hit * C)
            await s.read_gates.acquire(gate, deadline, s.url)
            seq.read_gate = gate
        seq.retrieve_key = key
        # SENT only once the request is on the socket: a prepare that never went out
        # (its deadline used up at the read gate) leaves the locks with the lookup.
        sent = Signal()
        try:
            raw = await s.rpc(seq.conn, requests.prepare_retrieve(s.d, key, s.instance_id),
                              deadline, request_id=seq.rid, grace_from=seq.started,
                              sent=sent)
        finally:
            prepared = Prepared.SENT if sent.fired else Prepared.NONE
        if spec is None and has_slots(raw):
            # An SHM server serves retrieves only through its pool, which this
            # client could not map; commit_retrieve (cleanup) releases the read.
            prepared = Prepared.SHM
            raise TransportUnavailableError(
                "the server serves retrieves only through its SHM pool, which this "
                f"client could not map (shm_dir={s.shm_dir!r})"
            )
        reply = parse_prepare_retrieve(raw, spec, hit)
        prepared = Prepared.SHM if reply.shm else Prepared.INLINE
        if not reply.success:
            # An object went missing under our locks (0.5.2 peers can strip them).
            log.warning("prepare_retrieve failed for %d chunks; reporting a miss", hit)
            prepared = Prepared.FAILED
            return 0
        if state.abandoned:
            return 0
        nbytes = hit * C * s.layout.token_bytes()
        if reply.shm:
            assert pool is not None  # spec is set only together with a pool
            chunks = [(i, pool.address + sl.offset) for i, sl in enumerate(reply.slots)]
            await consume(hit, chunks, pool.region, nbytes)
        else:
            tensors = await offload(decode_inline, s.d, reply.data, nbytes=nbytes)
            check_chunk_tensors(tensors, hit, s.layout.chunk_shape(C), s.layout.dtype)
            chunks, regions = kernel.tensor_placements(tensors)
            await consume(hit, chunks, regions, nbytes)
        return hit
    finally:
        s.release_later(_release_retrieve(s, seq, prepared))


async def _release_retrieve(s: Session, seq: _Seq, prepared: Prepared) -> None:
    plan = retrieve_release(prepared)
    try:
        if plan.commit_retrieve and seq.retrieve_key is not None:
            await _cleanup(s, seq, requests.commit_retrieve(s.d, seq.retrieve_key,
                                                            s.instance_id))
    finally:
        if seq.read_gate is not None:
            s.read_gates.release(seq.read_gate)
    await _release_lookup(s, seq, free_hit=plan.lookup_holds_locks)


# ---------------------------------------------------------------------- views
class ViewHold:
    """A retrieve whose job holds the read while the caller's block runs.

    ``ready`` fires with the chunk placements once the slots are handed out;
    the job then waits for :meth:`release` and goes on to the retrieve's
    release steps. The session owns the job like any operation.
    """

    def __init__(self, task: Job[int], ready: Signal, done: anyio.Event, state: OpState,
                 started: float) -> None:
        self.task = task
        self.ready = ready
        self._done = done
        self._state = state
        #: when the lookup was sent: the server's read lock is younger than this
        self.started = started
        #: called once the hold ends for any reason (also when aclose() gives up on it
        #: and cancels the job, just before the pool is unmapped)
        self.on_end: list[Callable[[], None]] = []

    def release(self) -> None:
        """End the hold: the job sends the release steps in the background."""
        self._state.abandoned = True
        self._done.set()

    def end(self) -> None:
        """End the hold from outside the block (the context is closing)."""
        for cb in self.on_end:
            cb()
        self.release()


async def open_view(s: Session, toks: list[int], n: int, salt: str,
                    deadline: float) -> tuple[ViewHold, list[tuple[int, int]], Region]:
    """Run the retrieve sequence up to the copy and hold it there (SHM only).

    Returns the hold, the placements (empty on a miss) and the bounds of the pool
    they lie in (the pool of the registration that handed them out). If the caller is
    cancelled while waiting, the hold is released and the job releases
    whatever the sequence got (the same rules as a retrieve).
    """
    ready = Signal()
    done = anyio.Event()
    state = OpState()
    started = time.monotonic()

    async def consume(hit: int, chunks: list[tuple[int, int]], region: RegionArg,
                      nbytes: int) -> None:
        if not ready.done():  # the caller gave up already: release at once
            ready.set((chunks, region))
            s.open_views.add(hold.end)
            try:
                await done.wait()
            finally:
                s.open_views.discard(hold.end)
                for cb in hold.on_end:
                    cb()

    task = s.spawn(_retrieve_seq, s, state, toks, n, salt, consume, deadline,
                   name="lmkv-view")
    hold = ViewHold(task, ready, done, state, started)
    try:
        await ready.wait_or(task)
    except BaseException:  # the caller's cancellation: the job releases what it got
        ready.cancel()
        hold.release()
        raise
    if ready.fired:
        chunks, region = ready.value
        assert isinstance(region, Region)  # SHM: one pool
        return hold, chunks, region
    ready.cancel()
    hold.release()
    if task.cancelled():
        raise ClosedError("the context was closed while the view was opening")
    try:
        task.result()  # a miss returns 0; an error is the caller's error
    except ServerError as exc:
        raise with_context(exc, server=s.url) from None
    return hold, [], Region(0, 0)


# ---------------------------------------------------------------------- store
async def store(s: Session, toks: list[int], total: int, salt: str,
                to_chunks: ToChunks | DeviceCopy,
                to_dense: Callable[[], torch.Tensor], deadline: float) -> int:
    """Store ``total`` whole chunks of ``toks``; returns the chunks newly written."""

    async def op(state: OpState) -> int:
        await s.ensure_registered(deadline)
        if s.mode == "shm":
            return await _store_shm(s, toks, total, salt, to_chunks, deadline)
        return await _store_inline(s, toks, total, salt, to_dense, deadline)

    return await s.run(op)


async def _store_shm(s: Session, toks: list[int], total: int, salt: str,
                     to_chunks: ToChunks | DeviceCopy, deadline: float) -> int:
    C = s.chunk_size
    n = total * C
    seq = _seq(s, "store", toks, salt, n)
    conn, rid = seq.conn, seq.rid
    key = seq.enc.encode(prefix_len=n, start=0, end=n, request_id=rid, worker_id=0)
    pool, spec = s.pool, s.slot_spec

    async def fill_and_commit(raw: object, commit_deadline: float) -> int:
        prep = parse_prepare_store(raw, spec, total)
        if not prep.shm:
            raise ProtocolError("SHM context got an inline-style prepare_store reply",
                                op="prepare_store", server=s.url, request_id=rid)
        if not prep.slots:
            return 0
        assert pool is not None
        chunks = [
            (i, pool.address + sl.offset)
            for i, sl in zip(prep.chunk_indices, prep.slots, strict=True)
        ]
        nbytes = len(chunks) * C * s.layout.token_bytes()
        # Every reserved slot is filled completely before commit (§6.6); the
        # sequence runs on even if the caller is cancelled.
        await _copy(to_chunks, chunks, pool.region, nbytes=nbytes)
        # The server now holds our write locks: the commit gets a budget of its own
        # and goes out even when the copy ended past the caller's deadline. The
        # caller waits for it until that deadline; past it the commit completes in
        # a tracked task (close waits for it) and the caller gets the timeout.
        commit = s.spawn(functools.partial(
            s.rpc, conn, requests.commit_store(s.d, key, s.instance_id),
            max(commit_deadline, time.monotonic() + _session.CLEANUP_TIMEOUT),
            request_id=rid, grace_from=seq.started), name="lmkv-commit")
        await commit.wait_within(commit_deadline - time.monotonic())
        if not commit.done():
            raise ServerTimeoutError(
                "commit_store was not answered within the deadline; it goes on in the "
                "background (the chunks are published once the server answers)",
                op="commit_store", server=s.url, request_id=rid,
                timeout=max(0.0, commit_deadline - seq.started))
        ok = as_bool(commit.result(), "commit_store")
        return len(prep.slots) if ok else 0

    async def late_store(reply: Reply) -> None:
        # prepare_store answered after its deadline: the slots are reserved
        # anyway and an unfilled reservation could later be published (§6.6).
        try:
            await fill_and_commit(reply.result(), time.monotonic() + _session.CLEANUP_TIMEOUT)
        except KVCacheError as exc:
            log.warning("completing a late prepare_store failed: %s", exc)
        finally:
            await _end_session(s, seq)

    def on_late(reply: Reply) -> None:
        if s.background.running:
            s.spawn(late_store, reply, name="lmkv-late-store")
        else:
            log.warning("a late prepare_store reply came after close; its slots stay "
                        "reserved until the server drops the session")

    try:
        raw = await s.rpc(conn, requests.prepare_store(s.d, key, s.instance_id), deadline,
                          on_late=on_late, request_id=rid, grace_from=seq.started)
        return await fill_and_commit(raw, deadline)
    finally:
        s.release_later(_end_session(s, seq))


async def _store_inline(s: Session, toks: list[int], total: int, salt: str,
                        to_dense: Callable[[], torch.Tensor], deadline: float) -> int:
    C = s.chunk_size
    n = total * C
    # Skip the cached prefix: an inline commit cannot report what it wrote, and not
    # encoding cached chunks saves most of the cost of a re-store. (0.5.7 also needs
    # a tensor for every chunk of [start, end), so start is where the misses begin.)
    before = await cached_prefix(s, toks, salt, n, deadline)
    if before >= total:
        return 0
    seq = _seq(s, "store", toks, salt, n)
    key = seq.enc.encode(prefix_len=n, start=before * C, end=n, request_id=seq.rid,
                         worker_id=0)
    nbytes = (total - before) * C * s.layout.token_bytes()
    d = s.d
    shape = s.layout.chunk_shape(C)  # [2, L, C, D], or [L, C, D] for MLA (no plane axis)

    def encode() -> bytes:
        kv = to_dense()
        return encode_inline(
            d, [kv[:, :, i * C:(i + 1) * C].reshape(shape).contiguous()
                for i in range(before, total)])

    try:
        data = await offload(encode, nbytes=nbytes)
        ok = as_bool(
            await s.rpc(seq.conn, requests.commit_store(d, key, s.instance_id, data), deadline,
                        request_id=seq.rid, grace_from=seq.started),
            "commit_store",
        )
    finally:
        s.release_later(_end_session(s, seq))
    if ok:
        return total - before
    # Some chunks hit out-of-memory: count what is there now.
    after = await cached_prefix(s, toks, salt, n, deadline)
    return max(0, after - before)
