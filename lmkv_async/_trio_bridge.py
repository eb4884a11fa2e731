"""Running the public API under trio: every call hops to the client loop.

The transport, the release steps and the background work are asyncio's. Under
trio, a public coroutine (decorated with :func:`hop` or :func:`hop_cleanup`)
runs as an asyncio task on the process's client loop (:mod:`._loop_thread`, the
loop the blocking facade uses too) while the trio task waits on a
:class:`trio.Event` that the task's completion sets through the run's
:class:`trio.lowlevel.TrioToken`. On asyncio the decorators add one check of the
running loop and nothing else.

Cancellation keeps asyncio's guarantees:

- an operation (:func:`hop`) cut by a trio cancel scope is cancelled on the
  client loop, where its shielded release steps run; the trio task waits
  (shielded) until they have run, then raises ``Cancelled``. An operation that
  finished in the meantime returns its result: trio cancellation is
  level-triggered, so the caller's next checkpoint raises ``Cancelled``, and the
  ``async with`` that owns the result (a context, a view) closes it;
- a cleanup (:func:`hop_cleanup`: ``aclose``, ``__aexit__``) is not cancelled:
  the trio task waits for it to end (each cleanup is bounded), then raises.

Objects made this way (contexts, fleets) live on the client loop; those still
open at interpreter exit are closed there (see :func:`._loop_thread.stop`).
"""

from __future__ import annotations

import contextvars
import functools
from asyncio import Task, _get_running_loop
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

from . import _loop_thread
from .errors import ClosedError, KVCacheError

__all__ = ["hop", "hop_cleanup", "on_trio"]

P = ParamSpec("P")
T = TypeVar("T")


def on_trio() -> bool:
    """True when called from a trio task (and not from an asyncio loop)."""
    if _get_running_loop() is not None:
        return False
    try:
        import trio
    except ImportError:
        return False
    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        return False
    return True


def hop(fn: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """Run ``fn`` on the client loop when called under trio; cancellable there."""
    return _wrap(fn, cleanup=False)


def hop_cleanup(fn: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """As :func:`hop`, for a cleanup: a trio cancellation waits for it to finish."""
    return _wrap(fn, cleanup=True)


def _wrap(fn: Callable[P, Awaitable[T]], *, cleanup: bool
          ) -> Callable[P, Coroutine[Any, Any, T]]:
    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        if _get_running_loop() is not None:  # asyncio (also the client loop itself)
            return await fn(*args, **kwargs)
        return await _run_on_loop(fn, args, kwargs, cleanup=cleanup)

    return wrapper


async def _run_on_loop(fn: Callable[..., Awaitable[T]], args: tuple[Any, ...],
                       kwargs: dict[str, Any], *, cleanup: bool) -> T:
    try:
        import trio

        token = trio.lowlevel.current_trio_token()
    except (ImportError, RuntimeError):
        raise KVCacheError(
            f"{getattr(fn, '__qualname__', fn)}() needs a running asyncio or trio event "
            "loop (asyncio.run, trio.run, or anyio.run with either backend)") from None

    loop = _loop_thread.loop()
    done = trio.Event()
    tasks: list[Task[T]] = []

    def notify(_: object) -> None:
        try:
            token.run_sync_soon(done.set)
        except trio.RunFinishedError:
            pass  # the trio run ended: nobody waits for this any more

    async def call() -> T:
        return await fn(*args, **kwargs)

    def start() -> None:
        task = loop.create_task(call())
        tasks.append(task)
        task.add_done_callback(notify)

    def cancel() -> None:
        # start() was queued first on the same loop, so the task exists
        tasks[0].cancel()

    # A fresh contextvars context: the caller's holds trio's own variables (sniffio's
    # "current async library" among them), which would make httpx and anyio inside the
    # asyncio task believe they run on trio.
    loop.call_soon_threadsafe(start, context=contextvars.Context())
    try:
        await done.wait()
    except trio.Cancelled:
        if not cleanup:
            loop.call_soon_threadsafe(cancel, context=contextvars.Context())
        with trio.CancelScope(shield=True):
            await done.wait()
        task = tasks[0]
        if task.cancelled() or task.exception() is not None:
            raise
        # It finished before the cancellation reached it: hand the result over; the
        # caller's next checkpoint raises Cancelled (trio's cancellation is
        # level-triggered), and whatever owns the result closes it then.
        return task.result()
    task = tasks[0]
    if task.cancelled():
        raise ClosedError("the client event loop stopped (lmkv_async.sync.shutdown() or "
                          "interpreter exit) before the operation finished")
    return task.result()
