"""KV straight into GPU memory: retrieve into / store from CUDA tensors, against dense
pinned copies of the same bytes measured in the same run.

    python benchmarks/bench_gpu.py [--mib 512] [--reps 5] [--out results/gpu.json]

* reference: one dense pinned host->device (and device->host) ``copy_`` of the same
  number of bytes, ``non_blocking`` + synchronize (the PCIe ceiling);
* ``retrieve(out=<cuda>)`` of the whole prefix (lookup, prefetch status,
  prepare_retrieve, the copies, their completion) and ``store(<cuda>)`` (prepare,
  copies, commit_store), each timed as the caller sees it;
* the event loop's largest tick gap (1 ms ticker) during each call;
* the same through the pinned staging ring (``LMKV_CUDA_REGISTER=0``), and
  ``retrieve_blocks`` into paged GPU caches, for information.

The server is ``tests/fake_lmcache.FakeLMCache`` (a ZMQ + HTTP server in a thread of
this process that keeps chunk objects in a real POSIX SHM segment in lmcache 0.5.6's
slot layout), because the GPU machine this runs on has no lmcache server; the RPCs it
answers cost about what a local server's do, minus the server's own work.
Without CUDA it prints that and exits 0 (``nox -s bench`` runs every runner).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from _common import LoopTicker  # noqa: E402  (same directory)

import lmkv_async as lmkv  # noqa: E402

L, NH, HS, C, BS = 32, 4, 128, 256, 16  # fp32: 128 KiB per token, 32 MiB per chunk object


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def ref_copy(nbytes: int, reps: int) -> dict[str, float]:
    """Dense pinned H2D and D2H of ``nbytes``: seconds, median of ``reps``."""
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d, d2h = [], []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        pinned.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        h2d.append(t1 - t0)
        d2h.append(t2 - t1)
    return {"h2d_s": med(h2d[1:]), "d2h_s": med(d2h[1:])}


_T0: list[float] = []


async def timed(coro_fn: Any) -> tuple[float, float, Any]:
    """(seconds, max loop gap in seconds, result) of one awaited call."""
    async with LoopTicker() as ticker:
        t0 = time.perf_counter()
        _T0[:] = [t0]
        result = await coro_fn()
        elapsed = time.perf_counter() - t0
    return elapsed, ticker.max_gap, result


def phases(last: dict[str, float], total_s: float) -> dict[str, float]:
    """The call split into: before the copy (RPCs, checks), enqueue, wait, after."""
    before = (last["began"] - _T0[0]) * 1e3
    return {"before_copy": before, "enqueue": last["enqueue_ms"], "wait": last["wait_ms"],
            "gpu": last["gpu_ms"],
            "after_copy": total_s * 1e3 - before - last["enqueue_ms"] - last["wait_ms"]}


def fresh(toks: list[int], rep: int) -> list[int]:
    """Another token sequence of the same length (a real server cannot be reset)."""
    return [t + (rep + 1) * 10_000_000 for t in toks]


async def run_path(fake: Any, layout: lmkv.KVLayout, toks: list[int], kv_cpu: torch.Tensor,
                   reps: int, *, paged: bool, tag: str) -> dict[str, Any]:
    """``fake`` is a FakeLMCache (reset between stores) or a real LocalServer."""
    real = not hasattr(fake, "reset")
    async with lmkv.connect(fake.url, fake.http_url, f"bench-gpu-{os.getpid()}-{tag}",
                            layout=layout, heartbeat_interval=0, timeout=120) as ctx:
        if not real:
            fake.reset()
        assert ctx.transport == "shm"
        assert (await ctx.store(kv_cpu, toks)).written_chunks == len(toks) // C
        out = torch.empty(kv_cpu.shape, dtype=kv_cpu.dtype, device="cuda")
        res: dict[str, Any] = {}
        r_t, r_gap, r_phase = [], [], []
        for i in range(reps + 1):
            t, gap, view = await timed(lambda: ctx.retrieve(toks, out=out))
            assert view is not None
            if i:  # the first call registers the pool and warms the allocator
                r_t.append(t)
                r_gap.append(gap)
                r_phase.append(phases(ctx.stats()["gpu"]["last"], t))
        torch.cuda.synchronize()
        res["retrieve_exact"] = bool(torch.equal(out.cpu(), kv_cpu))
        res["retrieve_s"], res["retrieve_gap_max_s"] = med(r_t), max(r_gap)
        res["retrieve_phase_ms"] = {k: med([p[k] for p in r_phase]) for k in r_phase[0]}
        s_t, s_gap, s_phase = [], [], []
        for i in range(reps + 1):
            if real:
                stoks = fresh(toks, i)
            else:
                stoks = toks
                fake.reset()  # forget the chunks, so every store writes all of them
            t, gap, sr = await timed(lambda st=stoks: ctx.store(out, st))
            assert sr.written_chunks == len(toks) // C
            if i:
                s_t.append(t)
                s_gap.append(gap)
                s_phase.append(phases(ctx.stats()["gpu"]["last"], t))
        back = await ctx.retrieve(stoks)
        res["store_exact"] = back is not None and bool(torch.equal(back, kv_cpu))
        res["store_s"], res["store_gap_max_s"] = med(s_t), max(s_gap)
        res["store_phase_ms"] = {k: med([p[k] for p in s_phase]) for k in s_phase[0]}
        lk = []
        for _ in range(reps):
            t, _, hit = await timed(lambda: ctx.lookup(toks))
            lk.append(t * 1e3)
        res["lookup_ms"] = med(lk)  # the RPC floor: lookup + prefetch status
        if paged:
            n = len(toks)
            nb = n // BS
            caches = [torch.empty((nb + 8, 2, NH, BS, HS), dtype=kv_cpu.dtype, device="cuda")
                      for _ in range(L)]
            ids = list(reversed(range(4, 4 + nb)))
            p_t, p_gap = [], []
            for i in range(reps + 1):
                t, gap, hit = await timed(lambda: ctx.retrieve_blocks(toks, caches, ids))
                assert hit == n
                if i:
                    p_t.append(t)
                    p_gap.append(gap)
            res["retrieve_blocks_s"], res["retrieve_blocks_gap_max_s"] = med(p_t), max(p_gap)
        res["gpu_stats"] = ctx.stats()["gpu"]
    return res


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="bytes per transfer, MiB")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu.json"))
    ap.add_argument("--real", action="store_true",
                    help="a real lmcache 0.5.6 server (LMKV_LMCACHE_PYTHON_056), not the fake")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; nothing measured")
        return 0
    import fake_lmcache as fl

    layout = lmkv.KVLayout(num_layers=L, num_kv_heads=NH, head_dim=HS, dtype=torch.float32,
                           block_size=BS)
    chunk = C * layout.token_bytes()
    chunks = (args.mib << 20) // chunk
    if args.real:
        from lmkv_async.testing import LocalServer, ServerConfig, find_server_python

        python = find_server_python("0.5.6")
        if python is None:
            print("bench_gpu --real: no lmcache 0.5.6 server (LMKV_LMCACHE_PYTHON_056)")
            return 1
        log_path = Path(args.out).with_suffix(".server.log")
        fake = LocalServer(ServerConfig(version="0.5.6", python=python, chunk_size=C,
                                        l1_size_gb=6.0), log_path=log_path)
        fake.start()
        server_name = f"lmcache 0.5.6 ({fake.url})"
    else:
        # the fake's slot size and descriptor shape are module constants of its layout
        fl.SLOT, fl.SHAPE, fl.GUARD = chunk, (2, L, C, NH * HS), chunk
        fake = fl.FakeLMCache(pool_size=(chunks + 2) * chunk).start()
        server_name = ("tests/fake_lmcache.FakeLMCache (real SHM segment, lmcache 0.5.6 "
                       "slot layout)")
    try:
        toks = list(range(1, chunks * C + 1))
        g = torch.Generator().manual_seed(0)
        kv_cpu = torch.randn((2, L, chunks * C, NH * HS), generator=g)
        nbytes = kv_cpu.numel() * kv_cpu.element_size()
        ref = ref_copy(nbytes, args.reps)
        reg = await run_path(fake, layout, toks, kv_cpu, args.reps, paged=True, tag="registered")
        os.environ["LMKV_CUDA_REGISTER"] = "0"
        staged = await run_path(fake, layout, toks, kv_cpu, max(2, args.reps // 2),
                                paged=False, tag="staging")
        del os.environ["LMKV_CUDA_REGISTER"]
    finally:
        fake.stop()
    gbps = lambda s: round(nbytes / s / 1e9, 2)  # noqa: E731
    summary = {
        "bytes": nbytes,
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "server": server_name,
        "command": "python benchmarks/bench_gpu.py " + " ".join(sys.argv[1:]),
        "ref_pinned_h2d_gbps": gbps(ref["h2d_s"]),
        "ref_pinned_d2h_gbps": gbps(ref["d2h_s"]),
        "registered": {
            "retrieve_gbps": gbps(reg["retrieve_s"]),
            "retrieve_ratio": round(ref["h2d_s"] / reg["retrieve_s"], 3),
            "retrieve_copy_ratio": round(ref["h2d_s"] * 1e3 / reg["retrieve_phase_ms"]["gpu"], 3),
            "store_gbps": gbps(reg["store_s"]),
            "store_ratio": round(ref["d2h_s"] / reg["store_s"], 3),
            "store_copy_ratio": round(ref["d2h_s"] * 1e3 / reg["store_phase_ms"]["gpu"], 3),
            "retrieve_blocks_gbps": gbps(reg["retrieve_blocks_s"]),
            "lookup_ms": reg["lookup_ms"],
            "loop_gap_max_ms": round(1e3 * max(reg["retrieve_gap_max_s"],
                                               reg["store_gap_max_s"]), 2),
            "loop_gap_max_ms_retrieve_blocks": round(1e3 * reg["retrieve_blocks_gap_max_s"], 2),
            **{k: reg[k] for k in ("retrieve_exact", "store_exact", "retrieve_phase_ms",
                                   "store_phase_ms", "gpu_stats")},
        },
        "staging": {
            "retrieve_gbps": gbps(staged["retrieve_s"]),
            "retrieve_ratio": round(ref["h2d_s"] / staged["retrieve_s"], 3),
            "store_gbps": gbps(staged["store_s"]),
            "store_ratio": round(ref["d2h_s"] / staged["store_s"], 3),
            "loop_gap_max_ms": round(1e3 * max(staged["retrieve_gap_max_s"],
                                               staged["store_gap_max_s"]), 2),
            **{k: staged[k] for k in ("retrieve_exact", "store_exact", "gpu_stats")},
        },
    }
    text = json.dumps(summary, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
