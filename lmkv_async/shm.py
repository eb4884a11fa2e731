"""The server's SHM pool, mapped into this process, and its bounds.

The server creates ``/dev/shm/<name>`` (mode 0600, same UID only) and names it
in the registration reply. We map all of it read-write with ``MAP_SHARED`` and
never unlink it. Pages are pre-faulted once (``MADV_POPULATE_WRITE`` where the
kernel has it, which faults pages in without changing their contents) so the
first transfer does not pay ~2 µs per 4 KiB page.
"""

from __future__ import annotations

import ctypes
import logging
import os

from .memory import (
    MADV_POPULATE_READ,
    MADV_POPULATE_WRITE,
    MADV_WILLNEED,
    MAP_FAILED,
    MAP_SHARED,
    PROT_READ,
    PROT_WRITE,
    Region,
    libc,
    madvise,
)

__all__ = ["PoolMapping"]

log = logging.getLogger("lmkv_async.shm")

class PoolMapping:
    """A read-write mapping of the server's whole SHM pool."""

    def __init__(self, name: str, size: int, *, shm_dir: str = "/dev/shm") -> None:
        """Open and map ``<shm_dir>/<name>``; raises ``OSError`` if that is impossible."""
        if not name or "/" in name or size <= 0:
            raise OSError(f"invalid SHM segment {name!r} of {size} bytes")
        self.name = name
        self.path = os.path.join(shm_dir, name)
        fd = os.open(self.path, os.O_RDWR)
        try:
            info = os.fstat(fd)
            actual = info.st_size
            self.inode = (info.st_dev, info.st_ino)
            if actual < size:
                raise OSError(f"SHM segment {self.path} has {actual} bytes, server said {size}")
            addr = libc.mmap(None, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
            if addr is None or addr == MAP_FAILED:
                err = ctypes.get_errno()
                raise OSError(err, f"mmap of {self.path} failed: {os.strerror(err)}")
        finally:
            os.close(fd)
        self.address: int = int(addr)
        self.size = size
        self._closed = False

    def is_current(self, name: str, size: int) -> bool:
        """Whether ``name`` still is the very segment we mapped (not a new one)."""
        if self._closed or name != self.name or size != self.size:
            return False
        try:
            info = os.stat(self.path)
        except OSError:
            return False
        return (info.st_dev, info.st_ino) == self.inode

    @property
    def region(self) -> Region:
        """Bounds that every slot range must stay inside."""
        return Region(self.address, self.size)

    def populate(self) -> str:
        """Pre-fault the mapping's pages (blocking); returns the method that worked."""
        for advice, label in ((MADV_POPULATE_WRITE, "populate-write"),
                              (MADV_POPULATE_READ, "populate-read")):
            if madvise(self.address, self.size, advice):
                return label
        # Old kernels: hint readahead, then touch one byte per page.
        madvise(self.address, self.size, MADV_WILLNEED)
        page = os.sysconf("SC_PAGE_SIZE")
        buf = (ctypes.c_char * self.size).from_address(self.address)
        view = memoryview(buf).cast("B")
        _ = sum(view[::page])
        return "touch"

    def close(self) -> None:
        """Unmap (never unlink: the segment belongs to the server)."""
        if not self._closed:
            self._closed = True
            libc.munmap(self.address, self.size)

    def __del__(self) -> None:  # pragma: no cover - safety net only
        try:
            self.close()
        except Exception:
            pass
