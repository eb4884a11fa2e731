"""Bounded fan-out: run many operations at once, one result per item, in input order."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import anyio

from .errors import InvalidInputError

__all__ = ["ItemResult", "run_bounded"]

T = TypeVar("T")
U = TypeVar("U")


@dataclass(frozen=True)
class ItemResult(Generic[T]):
    """The outcome of one item of a ``*_many`` call.

    Exactly one of ``value`` / ``error`` is meaningful: ``error`` is None on
    success (and ``value`` may itself be None, e.g. a retrieve miss), otherwise
    it holds the exception that item raised (usually a ``KVCacheError``).
    """

    value: T | None = None
    error: Exception | None = None

    @property
    def ok(self) -> bool:
        """True when the item succeeded."""
        return self.error is None

    def unwrap(self) -> T | None:
        """The value, or raise the item's error."""
        if self.error is not None:
            raise self.error
        return self.value


async def run_bounded(
    items: Sequence[U], fn: Callable[[U], Awaitable[T]], max_in_flight: int
) -> list[ItemResult[T]]:
    """Apply ``fn`` to every item with at most ``max_in_flight`` running at once.

    A failing item is reported in its own :class:`ItemResult`; it does not
    cancel the others. Cancelling the caller cancels every item (each
    operation then runs its own release steps). An item that raises something
    other than an :class:`Exception` (``KeyboardInterrupt``, ``SystemExit``)
    cancels the rest, and that exception is raised as it is (not in a group).
    """
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
        raise InvalidInputError(f"max_in_flight must be a positive int, got {max_in_flight!r}")
    results: list[ItemResult[T]] = [ItemResult() for _ in items]
    if not items:
        return results
    gate = anyio.Semaphore(max_in_flight)
    #: the first item's non-Exception error: raised once every item has ended
    fatal: list[BaseException] = []
    cancelled = anyio.get_cancelled_exc_class()

    async def one(index: int, item: U, scope: anyio.CancelScope) -> None:
        async with gate:
            try:
                results[index] = ItemResult(value=await fn(item))
            except Exception as exc:
                results[index] = ItemResult(error=exc)
            except cancelled:
                raise
            except BaseException as exc:
                # No child raises into the group but a cancellation: the caller gets
                # this error itself (asyncio.gather's behaviour), not an ExceptionGroup.
                if not fatal:
                    fatal.append(exc)
                scope.cancel()

    async with anyio.create_task_group() as tg:
        for i, item in enumerate(items):
            tg.start_soon(one, i, item, tg.cancel_scope)
    if fatal:
        raise fatal[0]
    return results
