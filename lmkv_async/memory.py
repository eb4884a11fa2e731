"""Process memory: libc mapping calls, huge-page and pre-fault advice, the output pool,
``Region`` bounds, and the one helper that offloads blocking work to a thread.

* libc calls go through ctypes, which releases the GIL around foreign calls
  (``mmap.madvise`` holds it: pre-faulting 1 GiB through it stalls the event loop
  for ~0.4 s even from a worker thread). This is the only madvise path.
* Writing into freshly allocated memory costs a page fault per 4 KiB page, which
  on this class of machine caps a copy at a few GB/s. Results of ``retrieve``
  are therefore carved from anonymous mappings advised for transparent huge
  pages and pre-faulted once; a mapping goes back to the pool as soon as the
  last tensor (or view) using it is freed. A mapping is known to be free when
  nothing but the pool refers to it: each tensor made by ``torch.frombuffer``
  holds a reference to its buffer object.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import anyio.to_thread
import torch

from ._shield import finish

__all__ = [
    "INLINE_LIMIT",
    "MADV_HUGEPAGE",
    "MADV_POPULATE_READ",
    "MADV_POPULATE_WRITE",
    "MADV_WILLNEED",
    "MAP_FAILED",
    "MAP_SHARED",
    "PROT_READ",
    "PROT_WRITE",
    "OutputPool",
    "Region",
    "RegionArg",
    "libc",
    "madvise",
    "offload",
    "output_pool",
]

T = TypeVar("T")

PROT_READ, PROT_WRITE = 1, 2
MAP_SHARED = 1
MADV_WILLNEED = 3
MADV_HUGEPAGE = 14
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23  # Linux >= 5.14
MAP_FAILED = ctypes.c_void_p(-1).value

libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = (
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
)
libc.munmap.restype = ctypes.c_int
libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
libc.madvise.restype = ctypes.c_int
libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def madvise(address: int, length: int, advice: int) -> bool:
    """``madvise(2)`` without holding the GIL; True on success."""
    return int(libc.madvise(address, length, advice)) == 0


class Region(NamedTuple):
    """A mapping ``[address, address + size)`` that chunk ranges must stay inside."""

    address: int
    size: int


#: ``region`` argument of the kernel: one mapping for all chunks, one per chunk, or
#: ``None`` (the caller vouches for the addresses, e.g. they are its own tensors).
RegionArg = Region | Sequence[Region] | None

#: Work smaller than this runs inline in :func:`offload`; a thread hop costs more
#: than copying 1 MiB.
INLINE_LIMIT = 1 << 20


async def offload(fn: Callable[..., T], *args: Any, nbytes: int, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` inline when ``nbytes < INLINE_LIMIT``, else in a worker
    thread (the C kernel and pickling release the GIL for most of their work).

    The thread is not abandoned on cancellation: a copy writes into caller
    memory (or reads a slot whose read lock the caller releases next), so the
    await only returns, or raises the cancellation, once the work has finished.
    anyio's own wait holds against cancel scopes but not against asyncio's
    ``Task.cancel``; :func:`._shield.finish` holds against both.
    """
    if nbytes < INLINE_LIMIT:
        return fn(*args, **kwargs)
    return await finish(anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs)))


_HUGE = 2 << 20
_SMALL = 1 << 20  # below this, torch.empty is as good


def _default_limit() -> int:
    env = os.environ.get("LMKV_OUTPUT_POOL_BYTES")
    if env:
        return int(env)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 16 << 30
    return min(8 << 30, total // 4)


class _Mapping:
    """One pooled mapping. Only ``self.mm`` refers to the mmap while it is free."""

    __slots__ = ("mm", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # ctypes, not mmap.madvise: the pre-fault takes a while and must not hold
        # the GIL (it would stall the event loop). A failed advice (no THP, an old
        # kernel) leaves the memory correct, just slower to fill.
        view = ctypes.c_char.from_buffer(self.mm)
        address = ctypes.addressof(view)
        del view  # release the buffer export: is_free() counts references
        madvise(address, size, MADV_HUGEPAGE)
        madvise(address, size, MADV_POPULATE_WRITE)

    def is_free(self) -> bool:
        # Free when only self.mm (+ getrefcount's own argument) refers to the mmap:
        # every tensor made by torch.frombuffer holds one more reference.
        return sys.getrefcount(self.mm) <= 2


class OutputPool:
    """Reusable pre-faulted mappings, handed out as tensors."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = _default_limit() if max_bytes is None else max_bytes
        self._maps: list[_Mapping] = []
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def pooled_bytes(self) -> int:
        """Bytes currently held by the pool (in use or free)."""
        return sum(m.size for m in self._maps)

    def _take(self, nbytes: int) -> _Mapping | None:
        fits = [m for m in self._maps if nbytes <= m.size <= 2 * nbytes + _HUGE and m.is_free()]
        return min(fits, key=lambda m: m.size) if fits else None

    def _trim(self, incoming: int) -> None:
        total = self.pooled_bytes + incoming
        for m in sorted(self._maps, key=lambda m: m.size, reverse=True):
            if total <= self.max_bytes:
                return
            if m.is_free():
                self._maps.remove(m)
                total -= m.size
                m.mm.close()

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor backed by pooled, pre-faulted memory."""
        dims = tuple(int(s) for s in shape)
        nbytes = torch.empty((), dtype=dtype).element_size()
        for d in dims:
            nbytes *= d
        if nbytes < _SMALL:
            return torch.empty(dims, dtype=dtype)
        with self._lock:
            mapping = self._take(nbytes)
            if mapping is not None:
                self.hits += 1
            else:
                self.misses += 1
                size = -(-nbytes // _HUGE) * _HUGE
                self._trim(size)
                mapping = _Mapping(size)
                if self.pooled_bytes + size <= self.max_bytes:
                    self._maps.append(mapping)
            raw = torch.frombuffer(mapping.mm, dtype=torch.uint8, count=nbytes)
        return raw.view(dtype).view(dims)

    def clear(self) -> None:
        """Drop every free mapping (mappings still in use stay valid)."""
        with self._lock:
            for m in self._maps:
                if m.is_free():
                    m.mm.close()
            self._maps = [m for m in self._maps if not m.mm.closed]


output_pool = OutputPool()
"""The process-wide pool used by ``retrieve`` without ``out=``."""
