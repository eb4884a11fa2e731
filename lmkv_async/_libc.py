"""libc memory calls through ctypes, which releases the GIL around foreign calls.

(``mmap.madvise`` holds the GIL: pre-faulting 1 GiB through it stalls the event
loop for ~0.4 s even when called from a worker thread.)
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["MADV_HUGEPAGE", "MADV_POPULATE_READ", "MADV_POPULATE_WRITE", "MADV_WILLNEED",
           "MAP_FAILED", "MAP_SHARED", "PROT_READ", "PROT_WRITE", "libc", "madvise"]

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
