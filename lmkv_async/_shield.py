"""Work that the caller's cancellation cannot cut short: cleanup, copies into caller memory.

Two kinds of cancellation reach a coroutine of this library:

* anyio's cancel scopes (``move_on_after``, a task group whose child failed,
  Starlette's cancel-on-disconnect). They are level-triggered: every later
  await inside a cancelled scope raises again. ``anyio.CancelScope(shield=True)``
  stops them, on asyncio and on trio.
* asyncio's native ``Task.cancel()`` (``asyncio.timeout``, ``wait_for``,
  ``TaskGroup``). It is edge-triggered (one ``CancelledError`` per call) and goes
  through anyio's shields.

:func:`finish` runs an awaitable to its end under both: the work runs in a task
of its own (asyncio) or inline under a shield (trio, where the shield is
enough), the caller keeps waiting for it whatever it is sent meanwhile, and the
caller's cancellation is raised again once the work is done, so
``asyncio.timeout`` still turns it into ``TimeoutError`` and the scope that
cancelled still sees it. The work itself must be bounded: this waits for it.

:class:`Once` makes a close idempotent on top of it: the first ``aclose()``
starts the cleanup, every later one (including one after a cut-short first
call) waits for that same cleanup to finish.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import anyio

__all__ = ["Once", "finish", "on_asyncio", "wait_finished"]

T = TypeVar("T")


def on_asyncio() -> bool:
    """True when the running event loop is asyncio's (anyio also runs on trio)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def wait_finished(fut: asyncio.Future[T]) -> T:
    """Wait for ``fut`` to finish even if this task is cancelled meanwhile (asyncio only).

    A cancellation that arrives while waiting is remembered and raised again once
    ``fut`` is done; ``fut`` itself is never cancelled from here. If ``fut`` was
    cancelled by someone else, that ``CancelledError`` propagates.
    """
    caught: BaseException | None = None
    with anyio.CancelScope(shield=True):  # anyio scopes: no re-delivery while we wait
        while not fut.done():
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError as exc:
                # Ours (Task.cancel / asyncio.timeout), or fut itself was cancelled:
                # either way it is raised once fut is done. It is kept even when fut
                # finished in the same iteration: dropping it would lose an
                # edge-triggered Task.cancel() and make asyncio.gather above us fail
                # with a bare CancelledError that escapes a caller's anyio scope.
                caught = exc
            except BaseException:
                break  # the work failed: fut holds the error
    if caught is not None:
        if not fut.cancelled():
            fut.exception()  # retrieved: the caller's cancellation wins
        raise caught
    return fut.result()


async def finish(work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` to its end whatever cancels the caller (see the module docstring)."""
    if on_asyncio():
        return await wait_finished(asyncio.ensure_future(work))
    with anyio.CancelScope(shield=True):
        return await work
    raise AssertionError("unreachable: a shielded scope that nobody cancels")  # for mypy


class Once:
    """A cleanup that runs once; every caller waits for it (shielded) to finish.

    ``await once.run(teardown)``: the first call starts ``teardown()``; a second
    call, concurrent or after the first was cancelled, waits for the same run
    instead of returning early or running it again.
    """

    __slots__ = ("_done", "_fut", "_started")

    def __init__(self) -> None:
        self._started = False
        self._fut: asyncio.Future[None] | None = None
        self._done: anyio.Event | None = None

    @property
    def started(self) -> bool:
        """True once a run was started (it may still be running)."""
        return self._started

    async def run(self, teardown: Callable[[], Awaitable[None]]) -> None:
        if on_asyncio():
            if self._fut is None:
                self._started = True
                self._fut = asyncio.ensure_future(teardown())
            await wait_finished(self._fut)
            return
        # trio: the first caller runs it inline under a shield; later ones wait for it
        if self._done is None:
            self._started = True
            self._done = anyio.Event()
            try:
                with anyio.CancelScope(shield=True):
                    await teardown()
            finally:
                self._done.set()
            return
        with anyio.CancelScope(shield=True):
            await self._done.wait()
