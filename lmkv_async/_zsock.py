"""Plain ZMQ sockets awaited through anyio: the same on asyncio and trio.

``zmq.asyncio`` sockets need an asyncio loop. These helpers drive a plain
(sync) socket in non-blocking mode instead and, when it has nothing, wait on
its ``ZMQ_FD`` with ``anyio.wait_readable``. That descriptor is edge-triggered
("the socket's events may have changed"), so every wait comes right after an
attempt that found nothing (which also processes the socket's pending
commands), never after a stale look.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import zmq

__all__ = ["close", "recv_multipart", "send_multipart"]

_NOBLOCK = int(zmq.NOBLOCK)

#: how often a send refused at the high-water mark is retried (these sockets carry
#: events and monitor messages, rarely full; a reader may be waiting on the FD, and
#: trio allows one waiter per descriptor)
_SEND_RETRY = 0.005


async def recv_multipart(sock: zmq.Socket[bytes]) -> list[bytes]:
    """The next message; waits on the socket's FD while there is none."""
    fd = int(sock.getsockopt(zmq.FD))
    while True:
        try:
            return sock.recv_multipart(_NOBLOCK)
        except zmq.Again:
            await anyio.wait_readable(fd)


async def send_multipart(sock: zmq.Socket[bytes], frames: Sequence[bytes]) -> None:
    """Send a message, retrying while the socket is at its high-water mark."""
    while True:
        try:
            sock.send_multipart(frames, _NOBLOCK)
            return
        except zmq.Again:
            await anyio.sleep(_SEND_RETRY)


def close(sock: zmq.Socket[bytes]) -> None:
    """Wake any task waiting on the socket's FD (it gets ClosedResourceError), then
    close the socket: closing a descriptor someone waits on is an error on trio and a
    stale registration on asyncio."""
    if sock.closed:
        return
    try:
        fd = int(sock.getsockopt(zmq.FD))
    except zmq.ZMQError:
        fd = -1
    if fd >= 0:
        try:
            anyio.notify_closing(fd)
        except RuntimeError:
            pass  # no event loop any more (interpreter exit): nobody is waiting
    sock.close(linger=0)
