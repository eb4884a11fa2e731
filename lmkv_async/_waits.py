"""Waits with a time limit that never lose the caller's cancellation.

On Python 3.10 and 3.11, ``asyncio.wait_for`` returns the inner result when the
inner awaitable finishes in the same loop iteration as the caller is cancelled:
the cancellation is dropped. A ``Task.cancel()`` (edge-triggered) is then lost
for good; and when the waiting coroutine runs under ``asyncio.gather``, the
gathered future fails with a bare ``CancelledError()`` (no message) that anyio's
cancel scope does not recognise as its own, so the cancellation of a caller's
``anyio.CancelScope`` escapes that scope and cancels the caller's whole task
(measured: tests/test_cancel_harness.py under CPU load, connect waiting for its
sockets). These helpers wait inline, without an extra task, under
``anyio.move_on_after``, which re-raises every cancellation that is not its own.
"""

from __future__ import annotations

import anyio

__all__ = ["acquire_within", "wait_event"]


async def wait_event(event: anyio.Event, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``event``; return whether it is set."""
    if event.is_set():
        return True
    with anyio.move_on_after(max(0.0, timeout)):
        await event.wait()
    return event.is_set()


async def acquire_within(lock: anyio.Lock | anyio.Semaphore, timeout: float) -> bool:
    """Acquire ``lock`` within ``timeout`` seconds; False (not held) if the time ran out."""
    with anyio.move_on_after(max(0.0, timeout)):
        await lock.acquire()
        return True
    # anyio.Lock.acquire hands a lock granted in the same iteration as our deadline
    # on to the next waiter before it raises (on both backends), so False means not held
    return False
