"""Cancel an operation at its k-th await point, for k = 1, 2, ... (the injection harness).

An *await point* is a place where a task yields to the event loop. While an
operation runs, a task factory wraps every new task's coroutine (the operation's
own task, its release steps, its fan-out) so that each of their yields is
counted together with the caller's; at the k-th yield the *caller's* scope is
cancelled, in one of three ways users really do it:

* ``task_cancel``: ``Task.cancel()`` on the caller's task (asyncio's native,
  edge-triggered cancellation: ``TaskGroup``, ``wait_for``);
* ``asyncio_timeout``: an ``asyncio.timeout`` around the call that expires now;
* ``anyio_scope``: ``CancelScope.cancel()`` on an anyio scope around the call
  (level-triggered: Starlette's cancel-on-disconnect, ``move_on_after``).

Under trio (:data:`TRIO_MODES`) the library runs natively in the trio run; a
trio instrument counts every step of the caller's task and of each task started
while the operation runs (its job, release steps, fan-out), and at the k-th step
the caller's *trio* scope is cut:

* ``trio_scope``: ``trio.CancelScope.cancel()`` on a scope around the call;
* ``trio_fail_after``: a ``trio.fail_after`` around the call whose deadline passes
  now (the caller sees ``trio.TooSlowError``).

:func:`cancel_at` returns whether the cancellation fired before the operation
completed, and checks that a fired one surfaced to the caller as that
cancellation (not swallowed, not turned into another error).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio

MODES = ("task_cancel", "asyncio_timeout", "anyio_scope")
TRIO_MODES = ("trio_scope", "trio_fail_after")


@dataclass
class _Counter:
    k: int
    #: cancels the caller; returns False when there was nothing left to cancel
    trigger: Callable[[], bool] | None = None
    yields: int = 0
    fired: bool = False
    active: bool = True

    def tick(self) -> None:
        if not self.active:
            return
        self.yields += 1
        if self.yields == self.k and self.trigger is not None:
            # The k-th point may come from a release step that runs after the caller's
            # scope has closed (nothing left to cancel): the trigger must not raise
            # into that task, which is not the one being tested.
            try:
                self.fired = self.trigger()
            except RuntimeError:
                self.fired = False


class _Counted:
    """Awaits a coroutine, counting each of its yields to the loop."""

    def __init__(self, coro: Coroutine[Any, Any, Any], counter: _Counter) -> None:
        self._coro = coro
        self._counter = counter

    def __await__(self) -> Generator[Any, Any, Any]:
        it = self._coro.__await__()
        value: Any = None
        exc: BaseException | None = None
        while True:
            try:
                y = it.send(value) if exc is None else it.throw(exc)
            except StopIteration as stop:
                return stop.value
            self._counter.tick()
            try:
                value, exc = (yield y), None
            except BaseException as e:
                value, exc = None, e


async def _counted(coro: Coroutine[Any, Any, Any], counter: _Counter) -> Any:
    return await _Counted(coro, counter)


@dataclass
class Outcome:
    fired: bool
    surfaced: bool
    result: Any = None
    error: BaseException | None = field(default=None)
    #: await points counted until the operation ended (or was cancelled)
    yields: int = 0


def _counting_factory(counter: _Counter) -> Callable[..., asyncio.Task[Any]]:
    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        if counter.active and asyncio.iscoroutine(coro):
            inner, coro = coro, _counted(coro, counter)
            task = asyncio.Task(coro, loop=loop, **kwargs)
            # A task cancelled before its first step never starts the wrapper, so the
            # wrapper never awaits ``inner``: close it (a no-op once it has run), or
            # Python warns "coroutine ... was never awaited" about the library's code.
            task.add_done_callback(lambda _t: inner.close())
            return task
        return asyncio.Task(coro, loop=loop, **kwargs)

    return factory


@contextlib.contextmanager
def _counting(loop: asyncio.AbstractEventLoop, counter: _Counter) -> Iterator[None]:
    """Count the yields of every task ``loop`` creates meanwhile (see :func:`cancel_at`)."""
    old_factory = loop.get_task_factory()
    loop.set_task_factory(_counting_factory(counter))
    try:
        yield
    finally:
        counter.active = False
        loop.set_task_factory(old_factory)


async def cancel_at(k: int, mode: str, op: Callable[[], Awaitable[Any]]) -> Outcome:
    """Run ``op()`` and cancel the caller's scope at the k-th await point (see module)."""
    if mode in TRIO_MODES:
        return await _trio_cancel_at(k, mode, op)
    loop = asyncio.get_running_loop()
    counter = _Counter(k)

    async def caller() -> Any:
        return await _Counted(op(), counter)  # type: ignore[arg-type]

    out = Outcome(False, False)
    with _counting(loop, counter):
        try:
            if mode == "task_cancel":
                task = asyncio.Task(caller())
                counter.trigger = task.cancel
                try:
                    out.result = await task
                except asyncio.CancelledError:
                    if not task.cancelled():
                        raise
                    out.surfaced = True
            elif mode == "asyncio_timeout":

                async def timed() -> Any:
                    async with asyncio.timeout(None) as tm:

                        def expire() -> bool:
                            tm.reschedule(loop.time())
                            return True

                        counter.trigger = expire
                        return await caller()

                try:
                    out.result = await asyncio.Task(timed())
                except TimeoutError:
                    out.surfaced = True
            elif mode == "anyio_scope":

                async def scoped() -> tuple[bool, Any]:
                    with anyio.CancelScope() as scope:

                        def cancel() -> bool:
                            scope.cancel()
                            return True

                        counter.trigger = cancel
                        return False, await caller()
                    return scope.cancelled_caught, None

                caught, out.result = await asyncio.Task(scoped())
                out.surfaced = caught
            else:
                raise ValueError(mode)
        except Exception as exc:
            out.error = exc
    out.fired = counter.fired
    out.yields = counter.yields
    return out


async def _trio_cancel_at(k: int, mode: str, op: Callable[[], Awaitable[Any]]) -> Outcome:
    import trio

    counter = _Counter(k)
    watched = {trio.lowlevel.current_task()}

    class Steps(trio.abc.Instrument):
        """Counts each step of the caller's task and of every task started meanwhile
        (the operation's job, its release steps, its fan-out): a step is one resumption
        after an await point, the trio counterpart of the asyncio wrapper's yields."""

        def task_spawned(self, task: trio.lowlevel.Task) -> None:
            if counter.active:
                watched.add(task)

        def before_task_step(self, task: trio.lowlevel.Task) -> None:
            if task in watched:
                counter.tick()

    out = Outcome(False, False)
    steps = Steps()
    trio.lowlevel.add_instrument(steps)
    try:
        try:
            if mode == "trio_scope":
                with trio.CancelScope() as scope:

                    def cancel() -> bool:
                        scope.cancel()
                        return True

                    counter.trigger = cancel
                    out.result = await op()
                    counter.active = False
                out.surfaced = scope.cancelled_caught
            elif mode == "trio_fail_after":
                try:
                    with trio.fail_after(3600) as deadline_scope:

                        def expire() -> bool:
                            deadline_scope.deadline = -math.inf  # fail_after: TooSlowError
                            return True

                        counter.trigger = expire
                        out.result = await op()
                        counter.active = False
                except trio.TooSlowError:
                    out.surfaced = True
            else:
                raise ValueError(mode)
        except Exception as exc:
            out.error = exc
    finally:
        counter.active = False
        trio.lowlevel.remove_instrument(steps)
    out.fired = counter.fired
    out.yields = counter.yields
    return out


def points(total: int, limit: int, seed: int) -> list[int]:
    """Which k to try once an operation is known to yield ``total`` times: all of
    them up to ``limit``, else the first and last few and a seeded sample between."""
    import random

    ks = list(range(1, total + 2))  # total + 1: the run that completes
    if len(ks) <= limit:
        return ks
    rng = random.Random(seed)
    edge = ks[: limit // 4] + ks[-limit // 4 :]
    middle = [k for k in ks if k not in edge]
    return sorted(edge + rng.sample(middle, limit - len(edge)))


async def count_points(op: Callable[[], Awaitable[Any]], mode: str = "task_cancel") -> int:
    """How many await points ``op()`` passes with no cancellation (counted as ``mode``
    counts them: task yields on asyncio, task steps on trio)."""
    out = await cancel_at(10**9, mode, op)
    assert not out.fired and out.error is None, out.error
    return out.yields
