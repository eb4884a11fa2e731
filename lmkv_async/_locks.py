"""A lock per key, for serialising SHM retrieves of one prefix within a context.

Each key's lock is an ``anyio.Semaphore(1)``, not an ``anyio.Lock``: the retrieve
job takes it and its release step (another job) gives it back, and an anyio lock
may only be released by the task that holds it.
"""

from __future__ import annotations

import time

import anyio

from ._waits import acquire_within
from .errors import ServerTimeoutError

__all__ = ["KeyedLock"]


class KeyedLock:
    """One lock per key, dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[bytes, tuple[anyio.Semaphore, int]] = {}

    async def acquire(self, key: bytes, deadline: float, server: str) -> None:
        """Wait for ``key`` until ``deadline``; a timeout is a ServerTimeoutError."""
        lock, users = self._locks.get(key, (None, 0))
        if lock is None:
            lock = anyio.Semaphore(1)
        self._locks[key] = (lock, users + 1)
        try:
            held = await acquire_within(lock, deadline - time.monotonic())
        except BaseException:
            self._drop(key)
            raise
        if not held:
            self._drop(key)
            raise ServerTimeoutError(
                "deadline expired waiting for a concurrent retrieve of the same prefix",
                op="prepare_retrieve", server=server)

    def release(self, key: bytes) -> None:
        """Release ``key`` (held by the caller)."""
        self._locks[key][0].release()
        self._drop(key)

    def _drop(self, key: bytes) -> None:
        lock, users = self._locks[key]
        if users <= 1:
            del self._locks[key]
        else:
            self._locks[key] = (lock, users - 1)
