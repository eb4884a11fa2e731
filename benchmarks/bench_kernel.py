"""Copy-kernel benchmark: every lmkv_async.copy path, C kernel vs torch fallback.

Geometry: L=32 layers, NH=8 KV heads, HS=128, bf16, block size 16, chunk 256
tokens, T in {256, 1024, 4096, 16384}.  For each T and path it reports GB/s
(payload bytes / median time over >= 7 reps, destinations preallocated and
pre-touched), the ratio to ``stream_copy`` of the same byte count (the
2-thread streaming-store ceiling; median of per-rep ratios, each rep running
the reference right before the path) and the speed-up over the torch backend.
Results go to ``benchmarks/results/kernel.json``.

Run from the repo root after ``python setup.py build_ext --inplace``::

    python benchmarks/bench_kernel.py            # full run
    python benchmarks/bench_kernel.py --quick    # T in {256, 1024}, 5 reps
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

import torch  # noqa: E402
from _common import summarize  # noqa: E402  (same directory)

from lmkv_async import kernel as kc  # noqa: E402
from lmkv_async.memory import output_pool  # noqa: E402

L, NH, HS, BS, C = 32, 8, 128, 16, 256
DTYPE = torch.bfloat16
D = NH * HS
PATHS = ["gather", "scatter", "pack", "unpack", "paged->chunks", "chunks->paged"]


def _time(fn: Callable[[], None], reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after one warm-up run."""
    fn()  # warm-up: first touch, thread-pool start
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _paired(fn: Callable[[], None], ref: Callable[[], None],
            reps: int) -> tuple[list[float], list[float]]:
    """(seconds of each run of ``fn``, per-rep speed ratios ``fn`` vs ``ref``).

    Each rep runs the reference right before the path, so a ratio compares two
    runs made under the same conditions; on a shared VM the memory bandwidth
    drifts by 2x within seconds, which would swamp ratios of separate medians.
    """
    fn()
    ref()
    times, ratios = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        ref()
        t1 = time.perf_counter()
        fn()
        t2 = time.perf_counter()
        times.append(t2 - t1)
        ratios.append((t1 - t0) / (t2 - t1))
    return times, ratios


def mem_available() -> int:
    """MemAvailable from /proc/meminfo in bytes (large if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def bench_t(T: int, reps: int, rng: torch.Generator) -> dict[str, Any]:
    """Measure every path for one token count; returns {path: {backend: GB/s}}.

    Three payload-sized buffers only (dense, paged caches, chunk pool): every
    path moves the same data around, so each one's output is the next one's
    valid input.
    """
    nbytes = 2 * L * T * D * 2
    nblk = -(-T // BS)
    nchunks = -(-T // C)
    chunk_bytes = 2 * L * C * D * 2
    dense = torch.randint(-(2**15), 2**15, (2, L, T, D), dtype=torch.int16, generator=rng)
    dense = dense.view(DTYPE)
    # paged caches: NB = blocks needed, a random permutation as the block table
    caches = [torch.zeros((nblk, 2, NH, BS, HS), dtype=DTYPE) for _ in range(L)]
    bt = torch.randperm(nblk, generator=rng)
    # a pool with the chunks in shuffled slots (slot-aligned, as SHM slots are)
    pool = torch.zeros(nchunks * chunk_bytes, dtype=torch.uint8)
    region = kc.Region(pool.data_ptr(), pool.numel())
    slots = torch.randperm(nchunks, generator=rng).tolist()
    chunks = [(k, pool.data_ptr() + s * chunk_bytes) for k, s in enumerate(slots)]
    kc.dense_to_chunks(dense, chunks, chunk_tokens=C, region=region)
    kc.dense_to_paged(dense, caches, bt)
    probe = dense[:, :, : min(T, 64)].clone()

    flat_dense, flat_pool = dense.view(-1), pool[:nbytes].view(DTYPE)
    out: dict[str, Any] = {"T": T, "bytes": nbytes}

    def ops(b: str) -> dict[str, Callable[[], None]]:
        return {
            "gather": lambda: kc.chunks_to_dense(
                dense, chunks, chunk_tokens=C, region=region, backend=b
            ),
            "scatter": lambda: kc.dense_to_chunks(
                dense, chunks, chunk_tokens=C, region=region, backend=b
            ),
            "pack": lambda: kc.paged_to_dense(dense, caches, bt, backend=b),
            "unpack": lambda: kc.dense_to_paged(dense, caches, bt, backend=b),
            "paged->chunks": lambda: kc.paged_to_chunks(
                caches, bt, chunks, num_tokens=T, chunk_tokens=C, dtype=DTYPE,
                region=region, backend=b,
            ),
            "chunks->paged": lambda: kc.chunks_to_paged(
                chunks, caches, bt, num_tokens=T, chunk_tokens=C, dtype=DTYPE,
                region=region, backend=b,
            ),
        }  # fmt: skip

    backends = ["c", "torch"] if kc.kernel_available() else ["torch"]
    # sanity first: one round of every path must hand the data on unchanged
    # (the timing below interleaves stream_copy into the pool, which garbles it)
    for b in backends:
        for fn in ops(b).values():
            fn()
        if not torch.equal(
            dense[:, :, : probe.shape[2]].view(torch.int16), probe.view(torch.int16)
        ):
            raise SystemExit(f"benchmark sanity check failed for backend {b}")

    # the reference: a contiguous streaming copy of the same byte count
    def ref() -> None:
        kc.stream_copy(flat_pool, flat_dense)

    out["stream_copy"] = nbytes / _time(ref, reps) / 1e9
    for b in backends:
        for name, fn in ops(b).items():
            times, ratios = _paired(fn, ref, reps)
            out.setdefault(name, {})[b] = nbytes / statistics.median(times) / 1e9
            out[name][f"{b}_vs_stream"] = statistics.median(ratios)
            # every run, so report.py can draw the spread of c/torch and c/stream
            out[name][f"{b}_s"] = summarize(times)
            out[name][f"{b}_vs_stream_runs"] = summarize(ratios)
    return out


def alloc_cliff(T: int, reps: int) -> dict[str, float]:
    """GB/s of a copy into fresh memory: torch.empty vs the output pool (incl. allocation).

    ``output pool`` is the steady state of ``retrieve`` without ``out=``: the mapping is
    reused, pre-faulted, once the previous result is freed."""
    shape = (2, L, T, D)
    nbytes = 2 * L * T * D * 2
    src = torch.ones(shape, dtype=DTYPE)
    res = {}
    for name, alloc in (
        ("torch.empty", lambda: torch.empty(shape, dtype=DTYPE)),
        ("output pool", lambda: output_pool.empty(shape, DTYPE)),
    ):

        def run(alloc: Callable[[], torch.Tensor] = alloc) -> None:
            out = alloc()
            kc.stream_copy(out, src)
            del out

        res[name] = nbytes / _time(run, reps) / 1e9
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="T in {256, 1024}, 5 reps")
    ap.add_argument("--reps", type=int, default=None, help="reps per measurement (default 7)")
    ap.add_argument("--tokens", type=int, nargs="*", help="token counts to run")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kernel.json"))
    args = ap.parse_args()
    reps = args.reps or (5 if args.quick else 7)
    tokens = args.tokens or ([256, 1024] if args.quick else [256, 1024, 4096, 16384])
    rng = torch.Generator().manual_seed(0)
    print(
        f"lmkv_async copy kernel: L={L} NH={NH} HS={HS} bf16 BS={BS} C={C}; "
        f"C kernel {'built' if kc.kernel_available() else 'MISSING'}, "
        f"{kc.num_threads()} kernel threads, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads); median of {reps}"
    )
    results = []
    hdr = (
        f"{'T':>6} {'MiB':>6} {'path':<14} {'c GB/s':>8} {'torch':>8} "
        f"{'c/stream':>9} {'c/torch':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    for T in tokens:
        need = 3.3 * 2 * L * T * D * 2  # dense + caches + pool + torch scratch
        if need > 0.8 * mem_available():
            print(f"{T:>6}  skipped: needs ~{need / 2**30:.1f} GiB, too little memory available")
            continue
        r = bench_t(T, reps, rng)
        results.append(r)
        ref = r["stream_copy"]
        mib = r["bytes"] / 2**20
        print(f"{T:>6} {mib:>6.0f} {'stream_copy':<14} {ref:>8.2f} {'':>8} {'1.00':>9}")
        for name in PATHS:
            c, t = r[name].get("c"), r[name]["torch"]
            cs = f"{c:>8.2f}" if c else f"{'-':>8}"
            ratio = f"{r[name]['c_vs_stream']:>9.2f}" if c else f"{'-':>9}"
            speed = f"{c / t:>8.2f}" if c else f"{'-':>8}"
            print(f"{T:>6} {mib:>6.0f} {name:<14} {cs} {t:>8.2f} {ratio} {speed}")
        sys.stdout.flush()
    cliff_t = 1024 if args.quick else 4096
    cliff = alloc_cliff(cliff_t, reps)
    print(f"\nallocate + stream_copy into fresh memory, T={cliff_t}:")
    for name, gbs in cliff.items():
        print(f"  {name:<30} {gbs:6.2f} GB/s")
    doc = {
        "geometry": {"L": L, "NH": NH, "HS": HS, "BS": BS, "C": C, "dtype": "bfloat16"},
        "reps": reps,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "kernel_threads": kc.num_threads(),
            "torch": torch.__version__,
        },
        "results": results,
        "alloc_cliff": {"T": cliff_t, "GBps": cliff},
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\nwrote {out}")
    print(f"reproduce: cd {ROOT} && {doc['command']}")


if __name__ == "__main__":
    main()
