"""The two primitives on the per-request path, native to the running backend.

anyio's ``Event`` and ``move_on_after`` work on both backends, but on asyncio they
cost far more than what they wrap (measured on the 2-core CI machine: an
``anyio.Event`` made, set and waited 6.8 us against 0.6 us for ``asyncio.Event``;
a ``move_on_after`` entered and left 8.1 us against 1.9 us for a
``call_later`` timer). A lookup makes several of each, so the transport uses
these instead:

* :func:`new_event`: ``asyncio.Event`` on asyncio, ``trio.Event`` on trio (what
  ``anyio.Event`` would pick, without the dispatch);
* :func:`new_slot`: where one reply lands, with a wait bounded by a timeout
  (a future and a ``call_later`` timer on asyncio; a ``trio.Event`` under
  ``trio.move_on_after`` on trio).

Both are cancelled like anything else on their backend: an anyio or trio cancel
scope, or asyncio's ``Task.cancel``, interrupts their waits.
"""

from __future__ import annotations

import asyncio
from asyncio import _get_running_loop
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["Flag", "Slot", "new_event", "new_slot", "unwatch", "watch_readable"]


class Flag(Protocol):
    """What :func:`new_event` returns (``asyncio.Event`` or ``trio.Event``)."""

    def set(self) -> None: ...

    def is_set(self) -> bool: ...

    async def wait(self) -> Any: ...


class Slot(Protocol):
    """One request's reply: settled once, waited for with a timeout."""

    def done(self) -> bool: ...

    def set_result(self, value: Any) -> None: ...

    def set_exception(self, error: BaseException) -> None: ...

    async def wait(self, timeout: float) -> bool:
        """Wait until settled (True) or ``timeout`` seconds passed (False)."""
        ...

    def get(self) -> Any:
        """The value, or raise the error (only once settled)."""
        ...

    def discard(self) -> None:
        """Nobody will read the outcome (marks a stored error as seen)."""
        ...


def new_event() -> Flag:
    """A one-shot event of the running backend."""
    if _get_running_loop() is not None:
        return asyncio.Event()
    import trio

    return trio.Event()


def new_slot() -> Slot:
    """A reply slot of the running backend."""
    loop = _get_running_loop()
    if loop is not None:
        return _AsyncioSlot(loop)
    return _TrioSlot()


class _Expired(Exception):
    pass


class _AsyncioSlot:
    __slots__ = ("_fut", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._fut: asyncio.Future[Any] = loop.create_future()

    def done(self) -> bool:
        return self._fut.done()

    def set_result(self, value: Any) -> None:
        if not self._fut.done():
            self._fut.set_result(value)

    def set_exception(self, error: BaseException) -> None:
        if not self._fut.done():
            self._fut.set_exception(error)

    def _expire(self) -> None:
        if not self._fut.done():
            self._fut.set_exception(_Expired())

    async def wait(self, timeout: float) -> bool:
        fut = self._fut
        if not fut.done():
            timer = self._loop.call_later(max(0.0, timeout), self._expire)
            try:
                await fut
            except _Expired:
                return False
            except Exception:
                pass  # settled with an error: get() raises it
            finally:
                timer.cancel()
        return True

    def get(self) -> Any:
        return self._fut.result()

    def discard(self) -> None:
        fut = self._fut
        if fut.done() and not fut.cancelled():
            fut.exception()


class _TrioSlot:
    __slots__ = ("_error", "_event", "_value")

    def __init__(self) -> None:
        import trio

        self._event = trio.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def set_result(self, value: Any) -> None:
        if not self._event.is_set():
            self._value = value
            self._event.set()

    def set_exception(self, error: BaseException) -> None:
        if not self._event.is_set():
            self._error = error
            self._event.set()

    async def wait(self, timeout: float) -> bool:
        import trio

        if not self._event.is_set():
            with trio.move_on_after(max(0.0, timeout)):
                await self._event.wait()
        return self._event.is_set()

    def get(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value

    def discard(self) -> None:
        pass


async def watch_readable(fd: int, on_readable: Callable[[], None]) -> None:
    """Call ``on_readable()`` whenever ``fd`` is readable, until cancelled or
    :func:`unwatch` (the socket closes).

    On asyncio a reader callback stays registered with the loop for the whole
    time (``loop.add_reader``), so a reply is dispatched in the loop iteration
    that saw it; anyio's ``wait_readable`` would register and remove the reader
    around every wait and wake a task first (measured: lookups about 8% slower).
    On trio the task waits with ``wait_readable`` and calls ``on_readable``.
    """
    loop = _get_running_loop()
    if loop is not None:
        loop.add_reader(fd, on_readable)
        try:
            await asyncio.Event().wait()  # until cancelled
        finally:
            unwatch(fd)
        return
    import trio

    try:
        while True:
            await trio.lowlevel.wait_readable(fd)
            on_readable()
    except trio.ClosedResourceError:
        return


def unwatch(fd: int) -> None:
    """Stop watching ``fd`` now (before it is closed: a registration left on a
    closed descriptor could catch a new socket that reuses its number)."""
    loop = _get_running_loop()
    if loop is not None:
        if not loop.is_closed():
            loop.remove_reader(fd)
        return
    try:
        import trio

        trio.lowlevel.notify_closing(fd)
    except (ImportError, RuntimeError):
        pass
