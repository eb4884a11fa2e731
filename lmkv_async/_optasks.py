"""Operations in tasks of their own, release steps in the background, all tracked.

A public operation runs in a task that its caller awaits through
``asyncio.shield``: the caller's cancellation abandons the wait, not the
sequence, which goes on to its release steps. Release steps run in background
tasks after the caller has its answer. Every such task is tracked, so that the
session's close can wait for them (bounded) before it unregisters.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from .errors import ClosedError, ServerError, with_context

__all__ = ["OpState", "TaskKeeper"]

T = TypeVar("T")


class OpState:
    """Shared between a caller and its operation task."""

    __slots__ = ("abandoned",)

    def __init__(self) -> None:
        self.abandoned = False


class TaskKeeper:
    """The tracked tasks of one session (a base of :class:`._session.Session`)."""

    url: str

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def release_later(self, steps: Coroutine[Any, Any, None]) -> None:
        """Run release steps in the background: the caller has its answer already.

        They are ordered after everything the operation did on the same socket,
        and close waits for them (bounded) before unregistering.
        """
        self.track(asyncio.create_task(self._after_caller(steps)))

    #: loop iterations a release step waits before its first send (see _after_caller)
    release_yields = 3

    async def _after_caller(self, steps: Coroutine[Any, Any, None]) -> None:
        # Let the operation's caller resume first: it has its answer, and the release
        # step's send (a syscall that wakes ZMQ's I/O thread: 0.1-0.4 ms on a loaded
        # machine) would otherwise run before it. Three iterations cover the operation
        # task's completion, the shield's hand-over and the caller's wake-up.
        try:
            for _ in range(self.release_yields):
                await asyncio.sleep(0)
        except BaseException:
            steps.close()
            raise
        await steps

    async def run(self, op: Callable[[OpState], Coroutine[Any, Any, T]]) -> T:
        """Run an operation in its own task; shield it from the caller's cancellation."""
        state = OpState()
        task = self.track(asyncio.create_task(op(state)))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and (current is None or not current.cancelling()):
                # aclose() gave up on the operation; its caller was not cancelled
                raise ClosedError("the context was closed while the operation was in "
                                  "flight") from None
            state.abandoned = True
            raise
        except ServerError as exc:  # errors from reply parsing name the server too
            raise with_context(exc, server=self.url) from None

    def track(self, task: asyncio.Task[T]) -> asyncio.Task[T]:
        """Keep a background task until it ends; close waits for all of them."""
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved, so an abandoned task's error is not reported lost
