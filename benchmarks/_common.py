"""Helpers shared by the benchmark runners: machine facts, the loop-lag ticker, the
lmcache-driven registration (with its stdout pump), summaries.

Runners import it as ``from _common import ...`` (it sits next to them) before they
import ``lmkv_async``: importing it puts the source tree on ``sys.path`` when
``lmkv_async`` is not installed (a checkout, with ``_copy`` built in place).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import platform
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
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
from lmkv_async.testing import LocalServer, server_env, unlink_engine_segments  # noqa: E402

REGISTER_SCRIPT = ROOT / "tests" / "server_scripts" / "register_cpu_engine.py"
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
    "REGISTER_SCRIPT",
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
    "registered_engine",
    "summarize",
]


async def drain(ctx: lmkv.AsyncKVContext | None) -> None:
    """Wait for a context's background release steps (private; benchmarks only)."""
    if ctx is None:
        return
    tasks = ctx._s._tasks
    while tasks:
        await asyncio.wait(list(tasks))


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


# ----------------------------------------------------------------------------- registration
@contextlib.contextmanager
def registered_engine(
    server: LocalServer,
    log_dir: Path,
    *,
    model: str,
    geometry: tuple[int, int, int, int],
) -> Iterator[dict[str, Any]]:
    """lmcache-driven CPU registration of a geometry ``(L, NH, HS, BS)``, bf16 (what the
    SDK needs to discover its layout).

    Same as ``tests/servers.py::registered_engine`` (which needs pytest): runs
    ``tests/server_scripts/register_cpu_engine.py`` with the server's Python,
    waits for ``READY``, and on exit closes its stdin so it unregisters.
    """
    log_path = log_dir / f"register-{server.zmq_port}.log"
    layers, heads, head_dim, block = geometry
    argv = [
        server.config.python, str(REGISTER_SCRIPT), "--url", server.url, "--model", model,
        "--num-layers", str(layers), "--num-kv-heads", str(heads), "--head-dim", str(head_dim),
        "--block-size", str(block), "--num-blocks", "16", "--dtype", "bfloat16",
        "--heartbeat-interval", "5",
    ]  # fmt: skip
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=logf, env=server_env())
    unlink_engine_segments(proc.pid)  # stale ones of an earlier holder of this pid
    lines: queue.Queue[bytes | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        info: dict[str, Any] | None = None
        while info is None and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            text = line.decode("utf-8", "replace").strip()
            if text.startswith("READY "):
                info = json.loads(text[len("READY "):])
        if info is None:
            tail = log_path.read_text("utf-8", "replace")[-3000:]
            raise RuntimeError(f"register_cpu_engine.py did not print READY:\n{tail}")
        yield info
    finally:
        if proc.poll() is None and proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        unlink_engine_segments(proc.pid)


