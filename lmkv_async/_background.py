"""Where a context's or a fleet's background work runs: an anyio task group it owns.

Readers, monitors, heartbeats, release steps, operations whose caller stopped
waiting, probes and audits all run as :class:`Job` objects in one
:class:`Background`. Nothing is started with a bare ``create_task``, so nothing
outlives the object that owns it: closing the owner cancels what is left and
waits until every job has ended.

Two ways to own the task group, the same on asyncio and trio:

* ``async with connect(...)`` (and ``async with Fleet(...)``) enters the group
  in the caller's task (:meth:`Background.enter`): the background work lives in
  the caller's own structure, under its cancel scopes;
* ``ctx = await connect(...)`` (no ``async with``) hosts the group in a task of
  its own (:meth:`Background.host`): a plain asyncio task, or a trio *system*
  task (trio has no other way to start a task without a nursery). ``aclose()``
  closes it the same way.

A job never raises into the group: its outcome (result, error, cancellation)
stays on the :class:`Job` for whoever waits for it, so one failed heartbeat
cannot cancel a caller's task group. Every job runs in a *shielded* cancel
scope that only its owner cancels (:meth:`Job.cancel`,
:meth:`Background.cancel_all`): a caller's scope around ``async with`` that is
cancelled must not stop the reader that the context's own close still needs,
nor a release step half way. The owner's close ends them in order, and the
group's exit (or the host's) cancels whatever is left, so a context that was
never closed cannot hang ``asyncio.run``'s or trio's shutdown either.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Generic, TypeVar

import anyio
from anyio.abc import TaskGroup

from ._prims import new_event
from ._shield import on_asyncio
from .errors import KVCacheError

__all__ = ["Background", "Job", "JobCancelled", "Signal", "require_event_loop"]

log = logging.getLogger("lmkv_async")

T = TypeVar("T")

_PENDING, _DONE, _FAILED, _CANCELLED = range(4)


def require_event_loop(what: str) -> None:
    """Raise a typed :class:`KVCacheError` unless an asyncio loop or a trio run is
    running here: a bare coroutine driver would otherwise fail deep inside, with
    ``RuntimeError`` or sniffio's error, and after some of the work was done."""
    if on_asyncio():
        return
    try:
        import trio

        trio.lowlevel.current_trio_token()
        return
    except (ImportError, RuntimeError):
        pass
    raise KVCacheError(f"{what}() needs a running asyncio or trio event loop (asyncio.run, "
                       "trio.run, or anyio.run with either backend)")


class Job(Generic[T]):
    """One unit of background work: awaitable for its outcome, cancellable on its own."""

    __slots__ = ("_callbacks", "_done", "_error", "_result", "_scope", "_state", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._done = new_event()  # (anyio.Event costs 10x more on asyncio: _prims)
        self._scope = anyio.CancelScope(shield=True)
        self._state = _PENDING
        self._result: T | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Job[T]], None]] | None = None

    def done(self) -> bool:
        """True once the job has ended (finished, failed or cancelled)."""
        return self._state != _PENDING

    def cancelled(self) -> bool:
        """True if the job ended by cancellation."""
        return self._state == _CANCELLED

    def cancel(self) -> None:
        """Cancel the job (level-triggered: every later await in it raises).

        The only way in: the job's scope shields it from every outer scope.
        """
        self._scope.cancel()

    async def wait(self) -> None:
        """Wait until the job has ended (does not raise its error)."""
        await self._done.wait()

    async def wait_within(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; return whether the job has ended.

        A ``timeout`` of 0 or less does not wait at all: a scope with a deadline already
        passed still lets the loop run once, and a fast job could end in that turn, so
        "the deadline had passed" would depend on how fast the server answered.
        """
        if self._state == _PENDING and timeout > 0:
            with anyio.move_on_after(max(0.0, timeout)):
                await self._done.wait()
        return self._state != _PENDING

    def result(self) -> T:
        """The job's result; raises its error, or :class:`JobCancelled`."""
        if self._state == _DONE:
            return self._result  # type: ignore[return-value]
        if self._state == _FAILED:
            assert self._error is not None
            raise self._error
        if self._state == _CANCELLED:
            raise JobCancelled(self.name)
        raise RuntimeError(f"job {self.name} has not finished")

    def exception(self) -> BaseException | None:
        """The job's error, if it failed."""
        return self._error if self._state == _FAILED else None

    def add_done_callback(self, fn: Callable[[Job[T]], None]) -> None:
        """Call ``fn(job)`` when the job ends (at once if it has)."""
        if self._state != _PENDING:
            fn(self)
            return
        if self._callbacks is None:
            self._callbacks = []
        self._callbacks.append(fn)

    def _settle(self, state: int) -> None:
        self._state = state
        self._done.set()
        callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            fn(self)

    async def _run(self, fn: Callable[..., Awaitable[T]], args: tuple[Any, ...]) -> None:
        state = _CANCELLED
        try:
            with self._scope:
                self._result = await fn(*args)
                state = _DONE
        except anyio.get_cancelled_exc_class():
            raise  # not ours (ours is caught by the scope): e.g. the loop shutting down
        except Exception as exc:
            self._error = exc
            state = _FAILED
        finally:
            self._settle(state)


class JobCancelled(Exception):
    """Raised by :meth:`Job.result` for a job that was cancelled."""


class Background:
    """The task group of one owner (a session, a fleet member, an event stream...)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tg: TaskGroup | None = None
        self._cm: TaskGroup | None = None
        self._host_done: anyio.Event | None = None
        self._stop: anyio.Event | None = None
        self._closed = False
        self.jobs: set[Job[Any]] = set()

    @property
    def running(self) -> bool:
        """True while jobs can be started."""
        return self._tg is not None and not self._closed

    def start_soon(self, fn: Callable[..., Awaitable[T]], *args: Any,
                   name: str | None = None) -> Job[T]:
        """Start ``fn(*args)`` as a job of this group."""
        if self._tg is None or self._closed:
            raise RuntimeError(f"background of {self.name} is not running")
        job: Job[T] = Job(name or str(getattr(fn, "__qualname__", "job")))
        self.jobs.add(job)
        job.add_done_callback(self.jobs.discard)
        self._tg.start_soon(job._run, fn, args, name=job.name)
        return job

    # -------------------------------------------------------------- owning the group
    async def __aenter__(self) -> Background:
        """Enter the task group in the current task (the ``async with`` form)."""
        cm = anyio.create_task_group()
        self._tg = await cm.__aenter__()
        self._cm = cm
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> bool | None:
        assert self._cm is not None
        self._closed = True
        self.cancel_all()  # what the owner's close left behind
        # The body's exception is not the group's business: handed to the group it would
        # come out wrapped in an ExceptionGroup (trio's strict nurseries, anyio 4), and
        # ``pytest.raises(InvalidInputError)`` around an ``async with connect()`` would
        # no longer match. The jobs never raise, and waiting for the cancelled ones is
        # shielded, so the group exits cleanly and the body's exception goes on as it is.
        self._cm.cancel_scope.shield = True
        await self._cm.__aexit__(None, None, None)
        return None

    async def host(self) -> None:
        """Host the task group in a task of its own (the ``await connect()`` form)."""
        started = anyio.Event()
        self._stop = anyio.Event()
        self._host_done = anyio.Event()

        async def body() -> None:
            try:
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    started.set()
                    assert self._stop is not None
                    try:
                        await self._stop.wait()
                    finally:  # also when the loop cancels the host at its shutdown
                        self.cancel_all()
            except Exception:  # never into trio's system nursery: that would end the run
                log.warning("background work of %s ended with an error", self.name,
                            exc_info=True)
            finally:
                started.set()
                assert self._host_done is not None
                self._host_done.set()

        if on_asyncio():
            import asyncio

            task = asyncio.get_running_loop().create_task(body(),
                                                          name=f"lmkv-background-{self.name}")
            _hosts.add(task)
            task.add_done_callback(_hosts.discard)
        else:
            import trio

            trio.lowlevel.spawn_system_task(body, name=f"lmkv-background-{self.name}")
        await started.wait()

    async def aclose(self) -> None:
        """Cancel whatever is still running and wait for it to end (hosted form).

        In the ``async with`` form this only cancels; the group's exit waits.
        """
        self._closed = True
        self.cancel_all()
        if self._stop is not None:
            self._stop.set()
            assert self._host_done is not None
            with anyio.CancelScope(shield=True):
                await self._host_done.wait()

    def cancel_all(self) -> None:
        """Cancel every job still running."""
        for job in list(self.jobs):
            job.cancel()

    async def drain(self, jobs: set[Job[Any]] | None, timeout: float) -> bool:
        """Wait up to ``timeout`` for ``jobs`` (default: all of them); True if all ended."""
        pending = set(self.jobs if jobs is None else jobs)
        with anyio.move_on_after(max(0.0, timeout)):
            for job in pending:
                await job.wait()
        return all(j.done() for j in pending)


#: hosted groups on asyncio: a reference, so the loop does not drop a running host
_hosts: set[Any] = set()


class Signal:
    """A one-shot flag with an optional value; :meth:`wait_or` also wakes when a job
    ends (``asyncio.wait(..., FIRST_COMPLETED)`` without asyncio)."""

    __slots__ = ("_wake", "cancelled", "fired", "value")

    def __init__(self) -> None:
        self.fired = False
        self.cancelled = False
        self.value: Any = None
        self._wake = new_event()

    def set(self, value: Any = None) -> None:
        """Fire (first call wins; ignored once cancelled)."""
        if self.fired or self.cancelled:
            return
        self.fired = True
        self.value = value
        self._wake.set()

    def cancel(self) -> None:
        """Nobody wants the value any more: a later :meth:`set` is ignored."""
        self.cancelled = True
        self._wake.set()

    def done(self) -> bool:
        return self.fired or self.cancelled

    async def wait_or(self, job: Job[Any]) -> None:
        """Wait until this fires (or is cancelled) or ``job`` has ended."""
        if self.done() or job.done():
            return
        job.add_done_callback(lambda _: self._wake.set())
        await self._wake.wait()
