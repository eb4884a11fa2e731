"""Timing for tests on a loaded machine: one slack setting, polling instead of sleeping.

``SLACK`` is the lateness, in seconds, a test accepts for anything that is
scheduled (a deadline firing, a reply arriving, a release step landing). It
comes from ``$LMKV_TEST_SLACK`` (default 1.5 s, enough for 2 cores shared by
several pytest processes and servers); raise it on slower boxes instead of
editing tests. Every timing bound and every polling timeout is derived from it.

* :func:`within` -- assert a duration is ``expected`` (never early, at most
  ``SLACK`` late);
* :func:`eventually` / :func:`eventually_sync` -- poll a condition until it
  holds or fail after a timeout, instead of sleeping and hoping.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

#: Accepted lateness in seconds (``$LMKV_TEST_SLACK``).
SLACK = float(os.environ.get("LMKV_TEST_SLACK", "1.5"))
if not SLACK > 0:
    raise ValueError(f"LMKV_TEST_SLACK must be a positive number of seconds, got {SLACK}")

#: A timer may fire this much before its deadline (clock granularity).
EARLY = 0.02

#: Default time for a background condition (release steps, cleanup) to show up.
SETTLE = 5 * SLACK


def within(elapsed: float, expected: float, *, late: float | None = None,
           what: str = "") -> None:
    """Assert ``expected - EARLY <= elapsed <= expected + late`` (``late`` defaults to SLACK)."""
    late = SLACK if late is None else late
    label = f"{what}: " if what else ""
    assert elapsed >= expected - EARLY, f"{label}{elapsed:.3f}s, earlier than {expected:.3f}s"
    assert elapsed <= expected + late, (
        f"{label}{elapsed:.3f}s, later than {expected:.3f}s + {late:.2f}s slack "
        "(raise LMKV_TEST_SLACK on a slow machine)")


def fast(elapsed: float, *, limit: float | None = None, what: str = "") -> None:
    """Assert something that must not wait on any deadline took at most ``limit`` (SLACK)."""
    limit = SLACK if limit is None else limit
    label = f"{what}: " if what else ""
    assert elapsed <= limit, f"{label}took {elapsed:.3f}s, more than {limit:.2f}s"


async def eventually(cond: Callable[[], Any], timeout: float | None = None, *,
                     interval: float = 0.02, what: str | Callable[[], str] = "") -> Any:
    """Poll ``cond`` (sync or async) until it returns something truthy; return that.

    Fails with ``what`` (a string, or a function evaluated at failure time) and the
    last falsy value after ``timeout`` seconds (default :data:`SETTLE`). The event
    loop keeps running between polls.
    """
    timeout = SETTLE if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            label = what() if callable(what) else what
            raise AssertionError(f"not true after {timeout:.1f}s: {label or cond!r} "
                                 f"(last: {value!r})")
        await anyio.sleep(interval)  # either backend (asyncio or trio)


def eventually_sync(cond: Callable[[], Any], timeout: float | None = None, *,
                    interval: float = 0.05, what: str = "") -> Any:
    """:func:`eventually` for code without an event loop (blocks the thread)."""
    timeout = SETTLE if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not true after {timeout:.1f}s: {what or cond!r} "
                                 f"(last: {value!r})")
        time.sleep(interval)


async def timed(coro: Awaitable[Any]) -> tuple[Any, BaseException | None, float]:
    """``(value, exception, seconds)`` of awaiting ``coro`` (Exception subclasses only)."""
    t0 = time.monotonic()
    try:
        return await coro, None, time.monotonic() - t0
    except Exception as exc:
        return None, exc, time.monotonic() - t0
