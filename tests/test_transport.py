"""The ZMQ transport below the protocol: sends refused at the high-water mark.

A request that meets a full send queue waits for room and then goes out. These
tests make the queue fill up for real: a peer that stops reading, small socket
buffers and high-water marks of 1, and megabyte payloads. No lmcache server is
involved; the peer is a bare ROUTER that answers each request with a two-frame
reply (uid, op), which is what the transport itself checks. The last test drives the
reader alone, with scripted ZMQ_EVENTS values, to pin a lost wake-up that real
sockets show only about once in 3000 connects. The transport is backend-neutral
(its reader waits on the FD through anyio), so every test runs on asyncio and trio.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import anyio
import msgpack
import pytest
import zmq
from timing import SETTLE, eventually

from lmkv_async._background import Background, Signal
from lmkv_async.transport import Connection
from lmkv_async.wire.requests import Request

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """The transport's reader is anyio's: both backends."""
    return str(request.param)

PAYLOAD = b"\0" * (1 << 20)  # 1 MiB: a few of these fill every buffer on the way


class _Peer:
    """A ROUTER in a thread that reads (and answers) only while ``reading`` is set."""

    def __init__(self) -> None:
        self.reading = threading.Event()
        self.answered = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.port = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 16 << 10)
        self.port = sock.bind_to_random_port("tcp://127.0.0.1")
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not self.reading.wait(0.01):
                    continue
                if not sock.poll(10):
                    continue
                frames = sock.recv_multipart()
                # Counted before the reply goes out: the client may see the reply (and
                # the test read this count) before this thread runs another line.
                self.answered += 1
                sock.send_multipart(frames[:3])  # identity, uid, op: a two-frame reply
        finally:
            sock.close(0)
            ctx.term()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def peer() -> Iterator[_Peer]:
    p = _Peer()
    yield p
    p.stop()


async def test_send_at_high_water_mark_waits_then_goes_out(peer: _Peer) -> None:
    """Requests that hit the high-water mark while the peer is not reading go out once
    it reads again: each is answered, and each one's ``sent`` signal fires (a
    pipelined lookup depends on it to send its query behind the lookup)."""
    ctx: zmq.Context[Any] = zmq.Context()
    conn = Connection(ctx, f"tcp://127.0.0.1:{peer.port}", 0)
    # Options before connect() apply to the pipe it makes.
    conn._sock.setsockopt(zmq.SNDHWM, 1)
    conn._sock.setsockopt(zmq.SNDBUF, 16 << 10)
    try:
        async with Background("test") as bg:
            conn.start(bg)
            assert await conn.wait_connected(SETTLE)
            n = 12
            req = Request("noop", 21, (msgpack.packb(0), PAYLOAD))
            sents = [Signal() for _ in range(n)]
            replies: list[object] = []

            async def call(sent: Signal) -> None:
                replies.append(await conn.request(req, timeout=4 * SETTLE, sent=sent))

            with anyio.fail_after(4 * SETTLE):
                async with anyio.create_task_group() as tg:
                    for s in sents:
                        tg.start_soon(call, s)
                    # With nobody reading, the queue fills and later requests are refused.
                    await eventually(lambda: conn._writable,
                                     what="a send waiting at the high-water mark")
                    assert not all(s.fired for s in sents)
                    peer.reading.set()
            assert len(replies) == n and peer.answered == n
            assert all(s.fired for s in sents), \
                "a send that waited for room never said it was sent"
            assert conn.in_flight == 0 and not conn._writable
            conn.close()
    finally:
        conn.close()
        ctx.term()


async def test_send_at_high_water_mark_times_out_cleanly(peer: _Peer) -> None:
    """A request still refused when its deadline passes fails with ServerTimeoutError
    and leaves no waiter or pending entry behind."""
    import lmkv_async as lmkv

    ctx: zmq.Context[Any] = zmq.Context()
    conn = Connection(ctx, f"tcp://127.0.0.1:{peer.port}", 0)
    conn._sock.setsockopt(zmq.SNDHWM, 1)
    conn._sock.setsockopt(zmq.SNDBUF, 16 << 10)
    try:
        async with Background("test") as bg:
            conn.start(bg)
            assert await conn.wait_connected(SETTLE)
            req = Request("noop", 21, (msgpack.packb(0), PAYLOAD))
            results: list[BaseException | object] = []

            async def call() -> None:
                try:
                    results.append(await conn.request(req, timeout=1.0))
                except Exception as exc:
                    results.append(exc)

            async with anyio.create_task_group() as tg:
                for _ in range(12):
                    tg.start_soon(call)
            assert len(results) == 12
            assert all(isinstance(r, lmkv.ServerTimeoutError) for r in results), results
            assert conn.in_flight == 0
            assert not [w for w in conn._writable if not w.is_set()]
            conn.close()
    finally:
        conn.close()
        ctx.term()


class _ScriptedEvents:
    """Stands in for the DEALER inside :meth:`Connection._drain` only: each ZMQ_EVENTS
    read returns the next scripted value, as if the socket processed a command (a pipe
    attached after the handshake) between two reads. Every value read is recorded."""

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.read: list[int] = []

    def getsockopt(self, opt: int) -> int:
        assert opt == zmq.EVENTS
        value = self.script.pop(0) if self.script else self.read[-1]
        self.read.append(value)
        return value

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        raise zmq.Again()


async def test_room_seen_by_any_events_read_wakes_the_waiting_sender() -> None:
    """Reading ZMQ_EVENTS resets the FD's signal, so no read may drop what it saw.

    The script: the first read shows nothing, the next shows room (POLLOUT). Whatever
    the reader reads, a POLLOUT among its reads must wake the sender waiting for room;
    one that read room and ignored it left the sender with no wake-up to come (the
    FD had been reset), and a first request after connect timed out.
    """
    ctx: zmq.Context[Any] = zmq.Context()
    conn = Connection(ctx, "tcp://127.0.0.1:9", 0)
    real = conn._sock
    try:
        scripted = _ScriptedEvents([0, int(zmq.POLLOUT)])
        conn._sock = scripted  # type: ignore[assignment]
        room = anyio.Event()
        conn._writable.append(room)
        conn._on_readable()  # the FD fired
        if int(zmq.POLLOUT) in scripted.read:
            assert room.is_set(), f"room read ({scripted.read}) but the sender was not woken"
        else:
            # The reader stopped after a read that showed nothing: the command that came
            # after it signals the FD again, and that call must see the room.
            conn._on_readable()
            assert room.is_set()
        assert not conn._writable
    finally:
        conn._sock = real
        conn.close()
        ctx.term()
