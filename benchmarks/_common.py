"""Helpers shared by the benchmark runners: machine facts, the loop-lag ticker, summaries.
(The lmcache-driven registration is :func:`lmkv_async.testing.registered_engine`.)

Runners import it as ``from _common import ...`` (it sits next to them) before they
import ``lmkv_async``: importing it puts the source tree on ``sys.path`` when
``lmkv_async`` is not installed (a checkout, with ``_copy`` built in place).
"""

from __future__ import annotations

import asyncio
import math
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
try:
    import lmkv_async  # noqa: F401  (installed, e.g. in the nox bench session)
except ImportError:  # a source checkout
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import lmkv_async as lmkv  # noqa: E402

SDK_PEER = ROOT / "benchmarks" / "sdk_peer.py"

# The store/retrieve geometry of bench_e2e and bench_small (an 8B-class model):
# 32 layers, 8 KV heads of 128, bf16 -- 128 KiB per token, 32 MiB per 256-token chunk.
L, NH, HS, BS, C = 32, 8, 128, 16, 256
D = NH * HS
DTYPE = torch.bfloat16
TOKEN_BYTES = 2 * L * D * 2  # K and V, bf16
LAYOUT = lmkv.KVLayout(num_layers=L, num_kv_heads=NH, head_dim=HS, dtype=DTYPE, block_size=BS)
GEOMETRY = {"num_layers": L, "num_kv_heads": NH, "head_dim": HS, "dtype": "bfloat16"}
VOCAB = 150_000

__all__ = [
    "BS",
    "DTYPE",
    "GEOMETRY",
    "HS",
    "LAYOUT",
    "NH",
    "ROOT",
    "SDK_PEER",
    "TOKEN_BYTES",
    "VOCAB",
    "C",
    "D",
    "L",
    "LoopTicker",
    "cpu_model",
    "drain",
    "summarize",
]


async def drain(ctx: lmkv.AsyncKVContext | None) -> None:
    """Wait for a context's background release steps (private; benchmarks only)."""
    if ctx is None:
        return
    s = ctx._s
    while s._tasks:  # a release step may start another while we wait
        await s.background.drain(s._tasks, math.inf)


def cpu_model() -> str:
    """The CPU's model name, for result files."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def summarize(samples: Sequence[float]) -> dict[str, Any]:
    """Median and p10/p90 (linear interpolation) of a list of samples."""
    xs = sorted(float(x) for x in samples)
    if not xs:
        return {"n": 0}

    def pct(p: float) -> float:
        k = (len(xs) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    return {"n": len(xs), "median": statistics.median(xs), "p10": pct(0.10), "p90": pct(0.90),
            "min": xs[0], "max": xs[-1], "samples": xs}


class LoopTicker:
    """A 1 ms ticker on the event loop; ``gaps`` holds the seconds between its wake-ups.

    ``async with LoopTicker() as t: ...`` starts it (after a short settle) and stops it
    on exit; ``t.max_gap`` is the largest stall the loop suffered meanwhile.
    """

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.gaps: list[float] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            await asyncio.sleep(self.period)
            now = time.perf_counter()
            self.gaps.append(now - last)
            last = now

    async def __aenter__(self) -> LoopTicker:
        self._task = asyncio.create_task(self._tick())
        await asyncio.sleep(0.02)
        self.gaps.clear()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await asyncio.sleep(0.005)
        self._stop.set()
        if self._task is not None:
            await self._task

    @property
    def max_gap(self) -> float:
        """The largest gap seen, in seconds (0 if none)."""
        return max(self.gaps, default=0.0)
