"""Event-loop lag while pre-faulting output memory: mmap.madvise vs ctypes madvise.

``lmkv_async.memory`` pre-faults pooled output memory in a worker thread. CPython's
``mmap.madvise`` holds the GIL for the whole call, so the event loop stalls anyway;
ctypes releases the GIL around foreign calls. Both are measured side by side, in one run,
with a 1 ms ticker on the loop.

    python benchmarks/bench_prefault.py
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import time
from collections.abc import Callable

from _common import LoopTicker

from lmkv_async.memory import MADV_POPULATE_WRITE, madvise

SIZE = 512 << 20


def via_mmap() -> None:
    mm = mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(MADV_POPULATE_WRITE)
    mm.close()


def via_ctypes() -> None:
    mm = mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(view)
    del view
    madvise(address, SIZE, MADV_POPULATE_WRITE)
    mm.close()


async def lag(fn: Callable[[], None]) -> tuple[float, float]:
    """(max tick gap, pre-fault time) in ms, pre-fault run in a worker thread."""
    async with LoopTicker() as ticker:
        t0 = time.perf_counter()
        await asyncio.to_thread(fn)
        elapsed = time.perf_counter() - t0
    return ticker.max_gap * 1e3, elapsed * 1e3


async def main() -> None:
    print(f"pre-fault {SIZE >> 20} MiB in a worker thread, 1 ms ticker on the loop")
    for _ in range(3):
        for name, fn in (("mmap.madvise", via_mmap), ("ctypes madvise", via_ctypes)):
            gap, took = await lag(fn)
            print(f"  {name:15s} {took:7.1f} ms, loop max gap {gap:7.1f} ms")
    print("reproduce: python benchmarks/bench_prefault.py")


if __name__ == "__main__":
    asyncio.run(main())
