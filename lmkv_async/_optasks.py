"""Operations in jobs of their own, release steps in the background, all owned.

A public operation runs as a :class:`~._background.Job` of the session's
:class:`~._background.Background`, and its caller waits for the job to end: the
caller's cancellation (an anyio or trio cancel scope, ``asyncio.timeout``,
``Task.cancel``) abandons the wait, not the sequence, which goes on to its
release steps. Release steps run as jobs after the caller has its answer. The
session's close waits for them (bounded) before it unregisters, then cancels
what is left; nothing outlives the session's task group.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import anyio
import anyio.lowlevel

from ._background import Background, Job
from .errors import ClosedError, ServerError, with_context

__all__ = ["OpState", "TaskKeeper"]

T = TypeVar("T")


class OpState:
    """Shared between a caller and its operation job."""

    __slots__ = ("abandoned",)

    def __init__(self) -> None:
        self.abandoned = False


class TaskKeeper:
    """The owned jobs of one session (a base of :class:`._session.Session`)."""

    url: str

    def __init__(self, background: Background) -> None:
        self.background = background
        #: operations and release steps still running (not the readers and monitors)
        self._tasks: set[Job[Any]] = set()

    def spawn(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any,
              name: str) -> Job[T]:
        """Start a job that close waits for (bounded) before unregistering."""
        job = self.background.start_soon(fn, *args, name=name)
        self._tasks.add(job)
        job.add_done_callback(self._tasks.discard)
        return job

    def release_later(self, steps: Coroutine[Any, Any, None]) -> None:
        """Run release steps in the background: the caller has its answer already.

        They are ordered after everything the operation did on the same socket,
        and close waits for them (bounded) before unregistering.
        """
        if not self.background.running:
            # Only after the close ended the group: the registration is gone and the
            # server dropped what it held with it, so there is nothing left to release.
            steps.close()
            return
        self.spawn(self._after_caller, steps, name="lmkv-release")

    #: loop iterations a release step waits before its first send (see _after_caller)
    release_yields = 3

    async def _after_caller(self, steps: Coroutine[Any, Any, None]) -> None:
        # Let the operation's caller resume first: it has its answer, and the release
        # step's send (a syscall that wakes ZMQ's I/O thread: 0.1-0.4 ms on a loaded
        # machine) would otherwise run before it. Three iterations cover the operation
        # job's completion, the caller's wake-up and its return.
        try:
            for _ in range(self.release_yields):
                await anyio.lowlevel.checkpoint()
        except BaseException:
            steps.close()
            raise
        await steps

    async def run(self, op: Callable[[OpState], Coroutine[Any, Any, T]]) -> T:
        """Run an operation as a job of its own; the caller's cancellation abandons the
        wait, not the operation."""
        state = OpState()
        if not self.background.running:
            raise ClosedError("the context is closed")
        job = self.spawn(op, state, name="lmkv-op")
        try:
            await job.wait()
        except BaseException:
            state.abandoned = True
            raise
        if job.cancelled():
            # aclose() gave up on the operation; its caller was not cancelled
            raise ClosedError("the context was closed while the operation was in flight")
        try:
            return job.result()
        except ServerError as exc:  # errors from reply parsing name the server too
            raise with_context(exc, server=self.url) from None
