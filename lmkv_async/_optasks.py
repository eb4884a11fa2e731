"""Operations in jobs of their own, release steps in the background, all owned.

A public operation runs as a :class:`~._background.Job` of the session's
:class:`~._background.Background`, and its caller waits for the job's answer:
the caller's cancellation (an anyio or trio cancel scope, ``asyncio.timeout``,
``Task.cancel``) abandons the wait, not the sequence, which goes on to its
release steps. The release steps an operation queues run in the same job once
its answer is out (one job per operation: starting an anyio task costs about
three times an asyncio ``create_task``, measured); those queued outside an
operation get a job of their own. The session's close waits for them (bounded)
before it unregisters, then cancels what is left; nothing outlives the
session's task group.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import anyio
import anyio.lowlevel

from ._background import Background, Job, Signal
from .errors import ClosedError, ServerError, with_context

__all__ = ["OpState", "TaskKeeper"]

T = TypeVar("T")


class OpState:
    """Shared between a caller and its operation job."""

    __slots__ = ("abandoned", "releases")

    def __init__(self) -> None:
        self.abandoned = False
        #: release steps the operation queued; its job runs them after the answer
        self.releases: list[Coroutine[Any, Any, None]] = []


#: the operation whose job is running here (release_later queues onto it)
_current_op: contextvars.ContextVar[OpState | None] = contextvars.ContextVar(
    "lmkv_current_op", default=None)


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
        op = _current_op.get()
        if op is not None:
            op.releases.append(steps)  # the operation's job runs it after the answer
            return
        self.release_now(steps)

    def release_now(self, steps: Coroutine[Any, Any, None]) -> None:
        """Run release steps in a job of their own, not after the operation's answer:
        for a sequence nested in an operation (a store's probe of the cached prefix),
        whose locks should not wait for the rest of the operation."""
        if not self.background.running:
            steps.close()
            return
        self.spawn(self._after_caller, [steps], name="lmkv-release")

    #: loop iterations a release step waits before its first send (see _after_caller)
    release_yields = 3

    async def _after_caller(self, steps: list[Coroutine[Any, Any, None]]) -> None:
        # Let the operation's caller resume first: it has its answer, and the release
        # step's send (a syscall that wakes ZMQ's I/O thread: 0.1-0.4 ms on a loaded
        # machine) would otherwise run before it. Three iterations cover the answer's
        # hand-over, the caller's wake-up and its return. The steps run one after the
        # other (each has its own deadline); one that fails does not stop the next.
        try:
            for _ in range(self.release_yields):
                await anyio.lowlevel.checkpoint()
        except BaseException:
            for step in steps:
                step.close()
            raise
        for i, step in enumerate(steps):
            try:
                await step
            except BaseException:
                for rest in steps[i + 1:]:
                    rest.close()
                raise

    async def run(self, op: Callable[[OpState], Coroutine[Any, Any, T]]) -> T:
        """Run an operation as a job of its own; the caller's cancellation abandons the
        wait, not the operation."""
        state = OpState()
        if not self.background.running:
            raise ClosedError("the context is closed")
        answer = Signal()
        job = self.spawn(self._op_job, op, state, answer, name="lmkv-op")
        try:
            await answer.wait_or(job)
        except BaseException:
            state.abandoned = True
            raise
        if not answer.fired:
            if job.cancelled():
                # aclose() gave up on the operation; its caller was not cancelled
                raise ClosedError("the context was closed while the operation was in "
                                  "flight")
            job.result()  # raises what ended the job without an answer
            raise ClosedError("the operation ended without an answer")  # (unreachable)
        ok, value = answer.value
        if ok:
            return value  # type: ignore[no-any-return]
        if isinstance(value, ServerError):  # errors from reply parsing name the server too
            raise with_context(value, server=self.url) from None
        raise value

    async def _op_job(self, op: Callable[[OpState], Coroutine[Any, Any, T]], state: OpState,
                      answer: Signal) -> None:
        """The operation, its answer handed over, then its release steps."""
        _current_op.set(state)  # this job's own context (a copy): release_later queues here
        try:
            try:
                value = await op(state)
            except Exception as exc:
                answer.set((False, exc))
            else:
                answer.set((True, value))
        finally:
            _current_op.set(None)  # steps queued by the release steps get jobs of their own
            if state.releases:
                steps, state.releases = state.releases, []
                await self._after_caller(steps)
