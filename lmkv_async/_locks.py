"""A lock per key, for serialising SHM retrieves of one prefix within a context."""

from __future__ import annotations

import asyncio
import time

from ._waits import acquire_within
from .errors import ServerTimeoutError

__all__ = ["KeyedLock"]


class KeyedLock:
    """One asyncio lock per key, dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[bytes, tuple[asyncio.Lock, int]] = {}

    async def acquire(self, key: bytes, deadline: float, server: str) -> None:
        """Wait for ``key`` until ``deadline``; a timeout is a ServerTimeoutError."""
        lock, users = self._locks.get(key, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
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
