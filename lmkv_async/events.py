"""One server's KV-event stream: an async iterator over ``subscribe_kv_events``.

:class:`KVEventStream` owns its own DEALER socket, so a slow consumer never
delays data-path requests, and a subscription id of its own (a second
subscription with the same id would end the first, compat.md §14.5).

Flow control: a batch is acknowledged when it is received, before its records
are handed out, so the server prepares the next batch while the consumer works
through this one; the socket is not read again until the consumer has taken
every record. At most one batch waits in the socket: the server never runs
ahead of the consumer by more than that (backpressure), and the replay log
(``--kv-event-log-size``) absorbs the rest. A consumer that falls more than the
log behind gets a :class:`~lmkv_async.wire.events.KVResync` with reason
``"lost"``.

Liveness: the server reaps a subscription whose id has not pinged for its reap
timeout (120 s by default), so the stream pings with its id every
``heartbeat_interval`` seconds. When the connection drops (a socket monitor sees
it) the stream yields ``KVResync("disconnected")``, waits for the server to come
back, and resubscribes from its cursor; a new incarnation (a restart) is
answered with a fresh subscription from cursor 0 and ``KVResync("restart")``.

Ending: :meth:`KVEventStream.aclose` (also ``async with``, breaking out of
``async for``, or cancelling the consumer) sends the ``cancel`` control frame
and closes the socket. Nothing here blocks the event loop.

Backend-neutral (asyncio and trio, through anyio): the stream's sockets are
plain ZMQ sockets whose file descriptors the consumer's own task waits on
(``anyio.wait_readable``), so the stream starts no task of its own: everything
happens inside :meth:`KVEventStream.next`, in the task that calls it. Call it
from one task at a time (trio allows one waiter per descriptor).
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, Literal

import anyio
import anyio.lowlevel
import zmq
from zmq.utils.monitor import parse_monitor_message

from . import _zsock
from .errors import (
    ClosedError,
    InvalidInputError,
    ProtocolError,
    ServerTimeoutError,
    UnsupportedOperationError,
)
from .wire import requests
from .wire.dialect import CAP_KV_EVENTS, Dialect
from .wire.events import (
    EventBatch,
    KVEvent,
    KVRemoved,
    KVResync,
    KVStored,
    control_frames,
    decode_batch,
    is_stream_end,
)
from .wire.frames import encode_request, pack

__all__ = ["KVEventStream", "KVRemoved", "KVResync", "KVStored", "require_kv_events"]

log = logging.getLogger("lmkv_async.events")

_MONITOR = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
#: After the server ends a stream by itself, wait this long before resubscribing
#: (doubling up to the max), so a server that keeps ending it is not hammered.
_RESUBSCRIBE_BACKOFF = (0.05, 2.0)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)


async def _poll(sock: zmq.Socket[bytes], timeout: float) -> bool:
    """Whether ``sock`` has a message, waiting up to ``timeout`` seconds for one.

    ZMQ's descriptor is edge-triggered: reading ``ZMQ_EVENTS`` processes the
    socket's pending commands (and resets the signal), so the wait comes right
    after that read, with no other use of the socket in between.
    """
    if int(sock.getsockopt(_EVENTS)) & _POLLIN:
        return True
    with anyio.move_on_after(max(0.0, timeout)):
        await anyio.wait_readable(int(sock.getsockopt(zmq.FD)))
    return bool(int(sock.getsockopt(_EVENTS)) & _POLLIN)


def _close(sock: zmq.Socket[bytes]) -> None:
    """Wake a task waiting on the socket's FD (it gets ``ClosedResourceError``), then
    close with the socket's own linger (:func:`._zsock.close` forces 0, which would
    drop the cancel frame still queued)."""
    if sock.closed:
        return
    try:
        anyio.notify_closing(int(sock.getsockopt(zmq.FD)))
    except (zmq.ZMQError, RuntimeError):
        pass  # no event loop (interpreter exit), or no descriptor: nobody is waiting
    sock.close()


def require_kv_events(dialect: Dialect, capabilities: frozenset[str], server: str,
                      version: str) -> None:
    """Raise :class:`UnsupportedOperationError` unless the server has the stream.

    Decided from the version (and 0.5.6's ``get_experimental``), never by sending
    the op: a string op name kills a <= 0.5.5 server's request loop.
    """
    if CAP_KV_EVENTS not in capabilities or not dialect.has_op("subscribe_kv_events"):
        raise UnsupportedOperationError(
            f"kv_events() needs the KV-event stream (lmcache >= 0.5.6), which lmcache "
            f"{version or dialect.name} does not have", op="subscribe_kv_events", server=server)


class KVEventStream:
    """Typed events from one server's KV-event log (see the module docstring).

    Iterate with ``async for ev in stream``; each item is a
    :class:`~lmkv_async.wire.events.KVStored`, :class:`~lmkv_async.wire.events.KVRemoved`
    or :class:`~lmkv_async.wire.events.KVResync`. The first item is always a
    ``KVResync`` with reason ``"start"``.

    Raises (from iteration):
        UnsupportedOperationError: the server records no events
            (``--kv-event-log-size 0``).
        ServerTimeoutError: the first batch did not come within ``timeout``.
        ProtocolError: a batch that does not decode.
    """

    def __init__(
        self,
        url: str,
        dialect: Dialect,
        model_name: str,
        *,
        cursor: int = 0,
        max_events: int = 256,
        timeout: float = 10.0,
        heartbeat_interval: float = 10.0,
        resume: bool = True,
        zmq_context: zmq.Context[Any] | None = None,
    ) -> None:
        if isinstance(cursor, bool) or not isinstance(cursor, int) or cursor < 0:
            raise InvalidInputError("cursor must be an int >= 0")
        if isinstance(max_events, bool) or not isinstance(max_events, int) or not (
            1 <= max_events <= 1024
        ):
            raise InvalidInputError("max_events must be an int in 1..1024")
        if not dialect.has_op("subscribe_kv_events"):
            raise UnsupportedOperationError(
                f"the {dialect.name} dialect has no subscribe_kv_events",
                op="subscribe_kv_events", server=url)
        self.url = url
        self.model_name = model_name
        self._d = dialect
        self._max_events = max_events
        self._timeout = timeout
        self._heartbeat = heartbeat_interval
        self._resume = resume
        # The process-wide context (the transport's too): no context of ours to terminate.
        self._ctx: zmq.Context[Any] = zmq_context or zmq.Context.instance()
        self._sock: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._uids = itertools.count(1)
        self._stream_uid: bytes | None = None
        self._stream_uid_int = 0
        self._batch_cursor: int | None = None
        self._sub_id = secrets.randbits(62)
        self._pending: deque[KVEvent] = deque()
        #: resume point: the batch cursor once all of it was handed out, else the
        #: seq of the last record handed out
        self._cursor = cursor
        self._incarnation: int | None = None
        self._connected = False
        self._was_connected = False
        self._disconnect_seen = False
        self._started = False
        self._closed = False
        self._last_ping = 0.0
        self.batches = 0
        #: records handed out, for diagnostics
        self.records = 0

    def __repr__(self) -> str:
        return (f"<KVEventStream {self.model_name!r} at {self.url} cursor={self._cursor} "
                f"incarnation={self._incarnation} {'closed' if self._closed else 'open'}>")

    # ------------------------------------------------------------------ properties
    @property
    def cursor(self) -> int:
        """Where a new subscription would resume (the ``cursor`` argument of
        ``kv_events()``), valid within :attr:`incarnation`."""
        return self._cursor

    @property
    def incarnation(self) -> int | None:
        """The server's log incarnation (its start time in ns), once known."""
        return self._incarnation

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` ran."""
        return self._closed

    # ------------------------------------------------------------------ iteration
    def __aiter__(self) -> AsyncIterator[KVEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[KVEvent]:
        # An async generator: leaving ``async for`` early (break, an exception, a
        # cancellation) finalises it, and the finally sends cancel.
        try:
            while True:
                yield await self.next()
        finally:
            await self.aclose()

    async def __aenter__(self) -> KVEventStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def next(self) -> KVEvent:
        """The next event (waits for one; cancellation-safe).

        Raises :class:`~lmkv_async.errors.ClosedError` once the stream is closed,
        also when :meth:`aclose` is called from another task while this one waits.
        """
        if self._closed:
            raise ClosedError("the KV-event stream is closed")
        try:
            if not self._pending:
                # A checkpoint before going to the socket (at most one a batch): the
                # reply may already be there, and a caller's scope cancelled meanwhile
                # must still be seen (trio's rule: every async call is a checkpoint).
                await anyio.lowlevel.checkpoint()
            while not self._pending:
                if not self._started:
                    self._open_socket()
                    self._started = True
                    await self._subscribe()
                    continue
                await self._receive_next()
        except (anyio.ClosedResourceError, zmq.ZMQError):
            if not self._closed:
                raise
            # aclose() from another task closed the sockets under our wait
            raise ClosedError("the KV-event stream was closed") from None
        ev = self._pending.popleft()
        if isinstance(ev, (KVStored, KVRemoved)):
            self.records += 1
            self._cursor = ev.seq
        if not self._pending and self._batch_cursor is not None:
            # All of the batch is out: its cursor also covers the other models'
            # records the server skipped.
            self._cursor, self._batch_cursor = self._batch_cursor, None
        return ev

    # ------------------------------------------------------------------ internals
    def _open_socket(self) -> None:
        # Plain sockets (zmq.Socket(ctx, ...), never ctx.socket(): a zmq.asyncio
        # context passed in would make asyncio sockets), awaited through anyio.
        sock: zmq.Socket[bytes] = zmq.Socket(self._ctx, zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 500)  # lets the cancel frame out after close
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        monitor_addr = f"inproc://lmkv-events-monitor-{id(self):x}-{self._sub_id:x}"
        sock.monitor(monitor_addr, _MONITOR)
        monitor: zmq.Socket[bytes] = zmq.Socket(self._ctx, zmq.PAIR)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(monitor_addr)
        self._monitor = monitor
        sock.connect(self.url)
        self._sock = sock

    def _poll_monitor(self) -> None:
        """Apply connect/disconnect events that have arrived (non-blocking)."""
        assert self._monitor is not None
        while True:
            try:
                frames = self._monitor.recv_multipart(_NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_CONNECTED:
                self._connected = True
                self._was_connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                self._connected = False
                self._disconnect_seen = True

    def _live(self) -> zmq.Socket[bytes]:
        """The stream's socket; :class:`ClosedError` once :meth:`aclose` ran (it may
        run in another task while this one waits)."""
        if self._closed or self._sock is None:
            raise ClosedError("the KV-event stream was closed")
        return self._sock

    async def _send(self, frames: list[bytes]) -> None:
        await _zsock.send_multipart(self._live(), frames)

    async def _subscribe(self) -> None:
        """Open a subscription from the cursor and queue what its first batch says."""
        first = self._incarnation is None
        uid = self._stream_uid_int = next(self._uids)
        self._stream_uid = pack(uid)
        req = requests.subscribe_kv_events(self._d, self._sub_id, self.model_name,
                                           self._cursor, self._max_events)
        await self._send(encode_request(uid, req.op_id, req.payloads))
        batch = await self._await_batch(first_timeout=self._timeout)
        if batch is None:
            # Ended at once or the connection went away: let _receive_next retry.
            self._stream_uid = None
            return
        if not batch.enabled:
            await self.aclose()
            raise UnsupportedOperationError(
                "the server records no KV events (started with --kv-event-log-size 0, or "
                "observability disabled)", op="subscribe_kv_events", server=self.url)
        known = self._incarnation
        if known is not None and batch.incarnation != known and self._cursor != 0:
            # A restarted server: our cursor means nothing in its new log. Start over
            # from 0 so no record of the new incarnation is skipped.
            self._cancel_stream()
            self._cursor = 0
            self._incarnation = batch.incarnation
            await self._subscribe_fresh_after_restart()
            return
        self._incarnation = batch.incarnation
        if first:
            reason: Literal["start", "restart", "lost", "resumed"] = "start"
            discard, complete = True, not batch.lost
        elif known is not None and batch.incarnation != known:
            reason, discard, complete = "restart", True, not batch.lost
        elif batch.lost:
            reason, discard, complete = "lost", True, False
        else:
            reason, discard, complete = "resumed", False, True
        self._queue(batch, KVResync(reason, batch.incarnation, batch.next_cursor, discard,
                                    complete))

    async def _subscribe_fresh_after_restart(self) -> None:
        uid = self._stream_uid_int = next(self._uids)
        self._stream_uid = pack(uid)
        req = requests.subscribe_kv_events(self._d, self._sub_id, self.model_name, 0,
                                           self._max_events)
        await self._send(encode_request(uid, req.op_id, req.payloads))
        batch = await self._await_batch(first_timeout=self._timeout)
        if batch is None:
            self._stream_uid = None
            return
        self._incarnation = batch.incarnation
        self._queue(batch, KVResync("restart", batch.incarnation, batch.next_cursor, True,
                                    not batch.lost))

    def _queue(self, batch: EventBatch, head: KVResync | None) -> None:
        """Hand out ``batch`` (after ``head``); ack it first so the next one is prepared."""
        self.batches += 1
        if head is not None:
            self._pending.append(head)
        elif batch.lost:
            self._pending.append(KVResync("lost", batch.incarnation, batch.next_cursor,
                                          True, False))
        self._pending.extend(batch.records)
        self._batch_cursor = batch.next_cursor
        if self._stream_uid is not None:
            self._send_now(control_frames(self._stream_uid_int, "ack"))

    def _send_now(self, frames: list[bytes]) -> None:
        """A small non-blocking send (ack, cancel, ping); dropped if the queue is full."""
        if self._sock is None:
            return
        try:
            self._sock.send_multipart(frames, _NOBLOCK)
        except zmq.ZMQError as exc:  # pragma: no cover - a DEALER with room always sends
            log.debug("control frame not sent: %s", exc)

    async def _await_batch(self, *, first_timeout: float | None) -> EventBatch | None:
        """Wait for the next frame set on the stream uid (pinging meanwhile).

        Returns None when the stream ended or the connection was lost.
        """
        deadline = None if first_timeout is None else time.monotonic() + first_timeout
        while True:
            sock = self._live()
            self._poll_monitor()
            if self._disconnect_seen:
                return None
            now = time.monotonic()
            if self._heartbeat > 0 and now - self._last_ping >= self._heartbeat \
                    and self._connected:
                self._last_ping = now
                ping = requests.ping(self._d, self._sub_id)
                self._send_now(encode_request(next(self._uids), ping.op_id, ping.payloads))
            wait = 0.25 if self._heartbeat <= 0 else min(0.25, self._heartbeat)
            if deadline is not None:
                left = deadline - now
                if left <= 0:
                    raise ServerTimeoutError("no KV-event batch", op="subscribe_kv_events",
                                             server=self.url, timeout=first_timeout)
                wait = min(wait, left)
            if not await _poll(sock, wait):
                continue
            try:
                frames = sock.recv_multipart(_NOBLOCK)
            except zmq.Again:
                continue
            if not frames or bytes(frames[0]) != self._stream_uid:
                continue  # a ping reply, or a reply to an earlier subscription
            if is_stream_end(frames):
                return None
            if len(frames) != 3:
                raise ProtocolError(f"KV-event reply has {len(frames)} frames",
                                    op="subscribe_kv_events", server=self.url)
            try:
                return decode_batch(bytes(frames[2]))
            except ProtocolError as exc:
                raise ProtocolError(exc.message, op="subscribe_kv_events",
                                    server=self.url) from None

    async def _receive_next(self) -> None:
        """Wait for the next batch of a running subscription (or re-establish one)."""
        if self._stream_uid is not None and not self._disconnect_seen:
            batch = await self._await_batch(first_timeout=None)
            if batch is not None:
                if not batch.enabled:
                    await self.aclose()
                    raise UnsupportedOperationError(
                        "the server turned KV events off", op="subscribe_kv_events",
                        server=self.url)
                if batch.incarnation != self._incarnation:  # pragma: no cover - defensive
                    self._stream_uid = None
                    return
                self._queue(batch, None)
                return
            self._stream_uid = None
            if not self._disconnect_seen:
                # The server ended the stream (it was reaped, or is shutting down).
                if not self._resume:
                    await self.aclose()
                    raise ClosedError("the server ended the KV-event stream")
                await anyio.sleep(_RESUBSCRIBE_BACKOFF[0])
                await self._subscribe()
                return
        if self._disconnect_seen:
            self._disconnect_seen = False
            self._stream_uid = None
            if not self._resume:
                await self.aclose()
                raise ClosedError("the KV-event stream's connection was lost")
            if self._incarnation is not None:
                # Hand this out now; the next call waits for the server and resubscribes.
                self._pending.append(KVResync("disconnected", self._incarnation, self._cursor,
                                              False, False))
                return
        # No subscription (e.g. the first one found the server gone): wait, retry.
        await self._wait_reconnected()
        await self._subscribe()

    async def _wait_reconnected(self) -> None:
        """Block until the socket is connected again (pending events are kept)."""
        delay = _RESUBSCRIBE_BACKOFF[0]
        while True:
            self._live()
            self._poll_monitor()
            if self._connected and not self._disconnect_seen:
                return
            self._disconnect_seen = False
            mon = self._monitor
            assert mon is not None
            await _poll(mon, delay)
            delay = min(delay * 2, _RESUBSCRIBE_BACKOFF[1])

    def _cancel_stream(self) -> None:
        if self._stream_uid is not None:
            self._send_now(control_frames(self._stream_uid_int, "cancel"))
        self._stream_uid = None

    async def aclose(self) -> None:
        """Cancel the subscription and close the socket (idempotent, never blocks).

        The close itself is synchronous, so a cancelled caller still closes
        everything; then, like trio's own ``aclose()``, it is a checkpoint: a
        cancellation of the caller is raised once the stream is closed.
        """
        try:
            self._close_now()
        finally:
            await anyio.lowlevel.checkpoint()

    def _close_now(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._cancel_stream()
        self._pending.clear()
        if self._sock is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            if self._monitor is not None:
                _close(self._monitor)
            _close(self._sock)  # linger: the cancel frame still goes out
            self._sock = None
