"""Pooled, pre-faulted output memory for ``retrieve`` without ``out=``.

Writing into freshly allocated memory costs a page fault per 4 KiB page, which on
this class of machine caps a copy at a few GB/s, far below memcpy speed. Results
of ``retrieve`` are therefore carved from anonymous mappings that are advised for
transparent huge pages and pre-faulted once, and a mapping goes back to the pool
as soon as the last tensor (or view) using it is freed, so steady-state retrieves
write into memory that is already mapped.

A mapping is known to be free when nothing but the pool refers to it: each
tensor made by ``torch.frombuffer`` holds a reference to its buffer object.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
from collections.abc import Sequence

import torch

from ._libc import MADV_HUGEPAGE, MADV_POPULATE_WRITE, madvise

__all__ = ["OutputPool", "output_pool"]

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
