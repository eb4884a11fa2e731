"""ZMQ transport: DEALER sockets, a reader job per socket, uid-matched reply slots.

Knows frames, not operations. Every request has a deadline; a request that times
out or is cancelled is removed from the pending map at once. When the peer goes
away (a socket monitor reports the disconnect) every pending request fails with
:class:`ServerUnavailableError` right away instead of waiting out its deadline.

A lost connection gets one reconnect grace (:data:`RECONNECT_GRACE`) per
operation, counted from the moment the loss was seen, or from the operation's
start if it began later (``grace_from``): every request of an operation that was
under way, and every later step of it, fails once the grace since the disconnect
has passed. The grace does not restart per request or per step.

Requests are :class:`~lmkv_async.wire.requests.Request` objects built in
``wire/``; this module adds the uid and moves frames. A second transport (gRPC)
would take the same objects.

The server runs prepare/commit of one socket identity on one worker thread in
FIFO order, so a context may hold a small pool of sockets (``Transport``) and
run each operation's RPC sequence on one of them (``Connection``).

Backend-neutral: the reader waits on the socket's file descriptor through
``anyio.wait_readable``, replies land in reply slots of the running backend
(:mod:`._prims`: anyio's own event and scope cost several times more per
request on asyncio), and the reader and monitor are jobs of the owner's
:class:`~lmkv_async._background.Background`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import zmq
from zmq.utils.monitor import parse_monitor_message

from . import _zsock
from ._background import Background, Job
from ._prims import Slot, new_slot, unwatch, watch_readable
from ._waits import wait_event
from .errors import (
    ClosedError,
    ProtocolError,
    ServerTimeoutError,
    ServerUnavailableError,
    from_zmq_error,
    with_context,
)
from .wire.frames import Reply, decode_reply, encode_request
from .wire.requests import Request

__all__ = ["Connection", "Transport"]

log = logging.getLogger("lmkv_async.transport")

_MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
# Plain ints for the per-request hot path (pyzmq's enum flags cost a Python call each).
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)


def _send_frames(sock: zmq.Socket[bytes], frames: Sequence[bytes]) -> None:
    """``send_multipart(frames, NOBLOCK, copy=False)`` without its per-frame flag enums.

    A multipart message is admitted whole or not at all, so ``zmq.Again`` can only
    come from the first frame and nothing is left half-sent.
    """
    send = sock.send
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        send(frame, _NOBLOCK_MORE if i < last else _NOBLOCK, copy=False)

#: How long a request waits for a lost connection to come back before failing
#: with ServerUnavailableError: a ZMQ reconnect attempt happens at least every
#: RECONNECT_IVL_MAX (1 s), so a live server is back within this.
RECONNECT_GRACE = 2.0


LateHandler = Callable[[Reply], None]


class Settable(Protocol):
    """What ``request(sent=...)`` sets once the request is on the socket."""

    def set(self) -> None: ...


@dataclass
class _Pending:
    slot: Slot
    op_frame: bytes
    op: str
    started: float
    #: set once the request timed out but its reply is still wanted (see request())
    late: LateHandler | None = None


class Connection:
    """One DEALER socket with its reader and monitor jobs."""

    def __init__(self, ctx: zmq.Context[Any], url: str, index: int) -> None:
        self.url = url
        self.index = index
        # A plain (sync) socket whose FD a reader job waits on: zmq.asyncio's per-call
        # futures and poller dominated the client's cost of small requests (and need
        # an asyncio loop).
        self._sock: zmq.Socket[bytes] = zmq.Socket(ctx, zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        # Queue only on live connections: without this, a request sent in the moment
        # between a server's death and our monitor seeing it waits in the pipe and is
        # delivered to the *restarted* server, opening a session nobody ends.
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        monitor_addr = f"inproc://lmkv-monitor-{id(self):x}-{index}"
        self._sock.monitor(monitor_addr, _MONITOR_EVENTS)
        self._monitor: zmq.Socket[bytes] = zmq.Socket(ctx, zmq.PAIR)
        self._monitor.connect(monitor_addr)
        self._pending: dict[bytes, _Pending] = {}
        self._uids = itertools.count(1)
        self._connected = anyio.Event()
        self._closed = False
        #: monotonic time since when the socket has had no live connection (set at
        #: start and at each disconnect); the reconnect grace counts from here.
        self._down_since = time.monotonic()
        #: incremented on every (re)connect; a change means the peer may be new.
        self.generation = 0
        self._bg: Background | None = None
        self._fd = -1
        #: senders waiting for room below the high-water mark (woken by the reader)
        self._writable: list[anyio.Event] = []
        self._jobs: list[Job[None]] = []
        self._recheck: Job[None] | None = None

    @property
    def in_flight(self) -> int:
        """Number of requests waiting for a reply."""
        return len(self._pending)

    @property
    def late_pending(self) -> int:
        """Timed-out requests whose late reply is still awaited."""
        return sum(1 for p in self._pending.values() if p.late is not None)

    @property
    def connected(self) -> bool:
        """Whether the socket currently has a live TCP connection."""
        return self._connected.is_set()

    def grace_left(self, since: float | None = None) -> float:
        """Seconds of reconnect grace left (0 when connected or when it ran out).

        The grace counts from the loss, or from ``since`` (an operation's start) when
        that is later: an operation that began after the loss gets one grace too.
        """
        if self._connected.is_set():
            return 0.0
        anchor = self._down_since if since is None else max(self._down_since, since)
        return max(0.0, RECONNECT_GRACE - (time.monotonic() - anchor))

    async def wait_usable(self, timeout: float, since: float | None = None) -> bool:
        """Connected, or waits for a reconnect within both ``timeout`` and what is
        left of the grace (see :meth:`grace_left`)."""
        if self._connected.is_set():
            return True
        left = min(timeout, self.grace_left(since))
        return left > 0 and await self.wait_connected(left)

    def start(self, background: Background) -> None:
        """Connect, and start the reader and the monitor as jobs of ``background``."""
        self._down_since = time.monotonic()
        self._sock.connect(self.url)
        self._bg = background
        self._fd = int(self._sock.getsockopt(zmq.FD))
        self._jobs = [
            background.start_soon(self._read_loop, name=f"lmkv-reader-{self.index}"),
            background.start_soon(self._watch_loop, name=f"lmkv-monitor-{self.index}"),
        ]

    async def wait_connected(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for a live connection; return whether there is one."""
        return await wait_event(self._connected, timeout)

    async def _watch_loop(self) -> None:
        try:
            while True:
                frames = await _zsock.recv_multipart(self._monitor)
                event = parse_monitor_message(frames)["event"]
                if event == zmq.EVENT_CONNECTED:
                    self.generation += 1
                    self._connected.set()
                elif event == zmq.EVENT_DISCONNECTED:
                    if self._connected.is_set():
                        self._down_since = time.monotonic()
                        self._connected = anyio.Event()  # anyio events do not clear
                    self._fail_all(ServerUnavailableError, "server disconnected")
        except (anyio.ClosedResourceError, zmq.ZMQError):
            return

    async def _read_loop(self) -> None:
        """Drain whenever the FD signals; it is edge-triggered: see :meth:`_drain`."""
        try:
            await watch_readable(self._fd, self._on_readable)
        except OSError:
            return

    def _on_readable(self) -> None:
        if self._closed:
            return
        try:
            self._drain()
        except zmq.ZMQError:
            return

    def _drain(self) -> None:
        """Dispatch every reply that has arrived and wake senders waiting for room.

        Every read of ZMQ_EVENTS (and every send or recv) may process the socket's
        queued commands and so reset the FD's signal, so each value read is acted on in
        full: POLLOUT wakes the senders, POLLIN reads a reply, and the loop ends only on
        a value showing no reply. A second read whose POLLOUT went unheeded (a pipe
        attached after the connect handshake, say) left a sender waiting with no wake-up
        to come: a first request after connect then timed out, about once in 3000.
        """
        sock = self._sock
        while True:
            events = int(sock.getsockopt(_EVENTS))
            if events & _POLLOUT and self._writable:
                for room in self._writable:
                    room.set()
                self._writable.clear()
            if not events & _POLLIN:
                return
            try:
                frames = sock.recv_multipart(_NOBLOCK)
            except zmq.Again:
                # EVENTS was stale: look again on the next loop pass, not in a tight loop
                # here, and not never (that could strand a reply as above).
                self._look_again()
                return
            self._dispatch(frames)

    def _look_again(self) -> None:
        """Drain once more after a checkpoint (one such job at a time)."""
        bg = self._bg
        if bg is None or not bg.running or (self._recheck is not None
                                            and not self._recheck.done()):
            return
        self._recheck = bg.start_soon(self._drain_after_checkpoint, name="lmkv-recheck")

    async def _drain_after_checkpoint(self) -> None:
        await anyio.lowlevel.checkpoint()
        self._on_readable()

    def _dispatch(self, frames: Sequence[bytes]) -> None:
        if not frames:
            return
        pending = self._pending.get(bytes(frames[0]))
        if pending is None:
            # A reply to a request that timed out or was cancelled, or a stray uid.
            log.debug("dropping reply with unknown uid frame %s", bytes(frames[0])[:16].hex())
            return
        if pending.late is not None:
            del self._pending[bytes(frames[0])]
            try:
                reply = decode_reply(frames, expected_op=pending.op_frame)
            except ProtocolError as exc:
                log.warning("malformed late reply to %s: %s", pending.op, exc)
                return
            pending.late(reply)
            return
        if pending.slot.done():
            return
        try:
            reply = decode_reply(frames, expected_op=pending.op_frame)
        except ProtocolError as exc:
            pending.slot.set_exception(ProtocolError(exc.message, op=pending.op,
                                                     server=self.url))
            return
        pending.slot.set_result(reply)

    def fail_pending(self, message: str) -> None:
        """Fail every request awaiting a reply with :class:`ClosedError` (the socket stays)."""
        self._fail_all(ClosedError, message)

    def _fail_all(self, kind: type[ServerUnavailableError | ClosedError], message: str) -> None:
        """Fail every pending request, each with its own error naming its op."""
        for key, pending in list(self._pending.items()):
            if pending.late is not None:
                del self._pending[key]  # the peer that owed this reply is gone
            elif not pending.slot.done():
                exc = (kind(message) if kind is ClosedError
                       else ServerUnavailableError(message, op=pending.op, server=self.url))
                pending.slot.set_exception(exc)
        # senders waiting for room look at their slots again (now failed)
        for room in self._writable:
            room.set()
        self._writable.clear()

    async def request(
        self,
        req: Request,
        *,
        timeout: float,
        on_late: LateHandler | None = None,
        late_window: float = 0.0,
        request_id: str | None = None,
        grace_from: float | None = None,
        sent: Settable | None = None,
    ) -> Reply:
        """Send one request and await its reply within ``timeout`` seconds.

        ``sent``, if given, is set once the request is on the socket (so a
        caller can send a dependent request right behind it, in order).

        With ``on_late``, a request that times out stays registered for
        ``late_window`` more seconds and a reply arriving then is handed to
        ``on_late``: a ``prepare_store`` answered late has reserved slots that
        must still be filled and committed. ``request_id`` only labels errors.
        ``grace_from`` is when the request's operation began (see :meth:`grace_left`;
        None: this request is an operation of its own).
        """
        op = req.op
        if self._closed:
            raise ClosedError("transport is closed")
        started = time.monotonic()
        if not self._connected.is_set() and not await self.wait_usable(
            timeout, started if grace_from is None else grace_from
        ):
            raise ServerUnavailableError("not connected to the server (reconnect grace over)",
                                         op=op, server=self.url, request_id=request_id)
        uid = next(self._uids)
        frames = encode_request(uid, req.op_id, req.payloads)
        slot = new_slot()
        key = frames[0]
        self._pending[key] = _Pending(slot, frames[1], op, started)
        give_up = started + timeout
        keep_for_late = False
        try:
            try:
                _send_frames(self._sock, frames)
                went_out = True
            except zmq.Again:
                if not self._connected.is_set():  # no live connection (IMMEDIATE)
                    raise ServerUnavailableError(
                        "not connected to the server", op=op, server=self.url,
                        request_id=request_id) from None
                # high-water mark reached: wait for room, within the deadline
                went_out = await self._send_when_writable(frames, slot, give_up)
            except zmq.ZMQError as exc:
                raise from_zmq_error(exc, op=op, server=self.url) from None
            answered = slot.done()
            if went_out and not answered:
                if sent is not None:
                    sent.set()
                # A send through the sync view can consume the socket's edge-triggered
                # readiness signal, so the reader might not wake: check for replies here.
                self._drain()
                answered = await slot.wait(give_up - time.monotonic())
            if not answered:  # the deadline passed first
                keep_for_late = on_late is not None and late_window > 0
                raise ServerTimeoutError(
                    "no reply", op=op, server=self.url, request_id=request_id,
                    timeout=timeout, elapsed=time.monotonic() - started,
                )
            reply: Reply = slot.get()
            return reply
        except ServerUnavailableError as exc:
            raise with_context(exc, op=op, request_id=request_id) from None
        finally:
            if keep_for_late and key in self._pending:
                self._pending[key].late = on_late
                self._forget_later(key, late_window)
            else:
                self._pending.pop(key, None)
            slot.discard()

    def _forget_later(self, key: bytes, delay: float) -> None:
        """Stop waiting for a late reply after ``delay`` seconds."""
        bg = self._bg
        if bg is None or not bg.running:
            self._pending.pop(key, None)
            return

        async def forget() -> None:
            await anyio.sleep(delay)
            self._pending.pop(key, None)

        bg.start_soon(forget, name="lmkv-late-window")

    async def _send_when_writable(self, frames: list[bytes], reply: Slot, give_up: float
                                  ) -> bool:
        """Retry a send refused at the high-water mark until it goes out (True), or the
        reply slot is settled first (a disconnect) or the deadline passes (False)."""
        with anyio.move_on_after(max(0.0, give_up - time.monotonic())):  # the rare path
            while not reply.done():
                room = anyio.Event()
                self._writable.append(room)
                # the FD may not signal again if room appeared before we registered
                self._look_again()
                try:
                    await room.wait()
                finally:
                    if not room.is_set() and room in self._writable:  # deadline, cancel
                        self._writable.remove(room)
                if reply.done():
                    return False
                try:
                    _send_frames(self._sock, frames)
                    return True
                except zmq.Again:
                    continue
        return False

    async def probe(self, req: Request, *, timeout: float) -> object:
        """Send a detection request and return its decoded result."""
        reply = await self.request(req, timeout=timeout)
        return reply.result()

    def close(self) -> None:
        """Fail pending requests, stop the jobs, close the sockets."""
        if self._closed:
            return
        self._closed = True
        self._fail_all(ClosedError, "transport closed")
        for room in self._writable:
            room.set()
        self._writable.clear()
        for job in self._jobs:
            job.cancel()
        if self._fd >= 0:
            unwatch(self._fd)  # now, before the socket (and its FD) is closed
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        _zsock.close(self._monitor)
        _zsock.close(self._sock)


class Transport:
    """A small pool of :class:`Connection` objects to one server."""

    def __init__(self, url: str, *, sockets: int = 1) -> None:
        if sockets < 1:
            raise ValueError("sockets must be >= 1")
        self.url = url
        # The process-wide context: one I/O thread for every transport, and no context
        # of ours to terminate. (A context dropped unclosed in a reference cycle would
        # block the event loop forever in its __del__ -> term().)
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._conns = [Connection(self._ctx, url, i) for i in range(sockets)]
        self._rr = itertools.count()

    @property
    def zmq_context(self) -> zmq.Context[Any]:
        """The ZMQ context the sockets live in (for short-lived probe sockets)."""
        return self._ctx

    @property
    def connections(self) -> Sequence[Connection]:
        """All connections of the pool."""
        return self._conns

    @property
    def generation(self) -> int:
        """Sum of reconnect generations; changes whenever any socket reconnects."""
        return sum(c.generation for c in self._conns)

    def start(self, background: Background) -> None:
        """Connect every socket; their readers and monitors are jobs of ``background``."""
        for conn in self._conns:
            conn.start(background)

    async def wait_connected(self, timeout: float) -> bool:
        """Wait until every socket is connected."""
        # One after the other on one deadline (they connect in parallel anyway): no
        # gather, whose bare CancelledError would escape a caller's anyio scope.
        give_up = time.monotonic() + timeout
        for c in self._conns:
            if not await c.wait_connected(give_up - time.monotonic()):
                return False
        return True

    async def wait_usable(self, timeout: float, since: float | None = None) -> bool:
        """Every socket connected, waiting at most ``timeout`` and each one's grace."""
        give_up = time.monotonic() + timeout
        for c in self._conns:
            if not await c.wait_usable(give_up - time.monotonic(), since):
                return False
        return True

    def pick(self) -> Connection:
        """The least busy connected socket (round-robin among ties)."""
        if len(self._conns) == 1:
            return self._conns[0]
        start = next(self._rr)
        n = len(self._conns)
        order = [self._conns[(start + i) % n] for i in range(n)]
        return min(order, key=lambda c: (not c.connected, c.in_flight))

    def close(self) -> None:
        """Close every socket (the shared ZMQ context stays)."""
        for conn in self._conns:
            conn.close()
        # our sockets are closed (linger 0); the shared context stays
