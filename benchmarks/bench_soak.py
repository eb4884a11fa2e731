"""Soak comparison: 10,000 mixed operations, lmkv_async at 64 in flight vs the official SDK.

One run, one lmcache 0.5.6 server with SHM: the same mixed workload (30% store of fresh
tokens, 40% retrieve and 30% lookup of stored prefixes, T=512 tokens, L=2 NH=2 HS=64 bf16)
done by lmkv_async (one context, 64 in flight) and by lmcache's official synchronous SDK
(``benchmarks/sdk_peer.py`` in the server's Python; 1 thread, then 8 threads with a context
each). Prints ops/s side by side, lmkv's client RSS at start and end, and the server's
lock/session counters afterwards; writes ``benchmarks/results/soak_compare.json``.

    python benchmarks/bench_soak.py [--ops 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import ROOT  # (same directory; it puts a checkout on sys.path)

import lmkv_async as lmkv
from lmkv_async.testing import (
    LocalServer,
    ServerConfig,
    find_server_python,
    registered_engine,
    server_env,
)

MODEL = "soak-bench"
GEOMETRY = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "dtype": "bfloat16"}
LAYOUT = lmkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                       block_size=16)
T = 512
SDK_PEER = ROOT / "benchmarks" / "sdk_peer.py"


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def sdk_soak(server: LocalServer, ops: int, threads: int) -> dict[str, Any]:
    job = {"url": server.url, "http_url": server.http_url, "model": MODEL, "geometry": GEOMETRY,
           "seed": 1, "timeout": 60,
           "workloads": [{"op": "mixed_soak", "ops": ops, "T": T, "threads": threads}]}
    out = subprocess.run([server.config.python, str(SDK_PEER), json.dumps(job)],
                         capture_output=True, text=True, env=server_env(), timeout=1800)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    if not result.get("ok"):
        raise RuntimeError(f"sdk soak failed: {result}\n{out.stderr[-2000:]}")
    wall = float(result["results"][0]["wall_s"])
    return {"threads": threads, "ops": ops, "wall_s": wall, "ops_per_s": ops / wall}


async def lmkv_soak(server: LocalServer, ops: int, in_flight: int) -> dict[str, Any]:
    rng = random.Random(7)
    kinds = rng.choices(["store", "retrieve", "lookup"], weights=[3, 4, 3], k=ops)
    picks = [rng.random() for _ in range(ops)]
    g = torch.Generator().manual_seed(3)
    kv = torch.randint(-(2**15), 2**15, (2, 2, T, 128), generator=g,
                       dtype=torch.int16).view(torch.bfloat16)
    out_of_order = 0
    async with lmkv.connect(server.url, server.http_url, MODEL, layout=LAYOUT,
                            timeout=30) as ctx:
        stored = [[rng.randrange(2**31) for _ in range(T)] for _ in range(4)]
        for toks in stored:
            await ctx.store(kv, toks)
        fresh = [[rng.randrange(2**31) for _ in range(T)] for _ in range(ops)]
        gate = asyncio.Semaphore(in_flight)
        rss_start = rss_mib()

        async def one(i: int) -> None:
            nonlocal out_of_order
            async with gate:
                kind = kinds[i]
                if kind == "store":
                    await ctx.store(kv, fresh[i])
                    stored.append(fresh[i])
                    return
                toks = stored[int(picks[i] * len(stored))]
                if kind == "retrieve":
                    got = await ctx.retrieve(toks)
                    if got is None or not torch.equal(got.view(torch.int16),
                                                      kv.view(torch.int16)):
                        out_of_order += 1
                elif await ctx.lookup(toks) != T:
                    out_of_order += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(ops)))
        wall = time.perf_counter() - t0
        rss_end = rss_mib()
    status = server.status()
    l1 = status["storage_manager"]["l1_manager"]
    return {"ops": ops, "in_flight": in_flight, "wall_s": wall, "ops_per_s": ops / wall,
            "wrong_or_missing": out_of_order, "rss_mib_start": rss_start,
            "rss_mib_end": rss_end,
            "server_after": {"active_sessions": status["active_sessions"],
                             "read_locked": l1["read_locked_count"],
                             "write_locked": l1["write_locked_count"]}}


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=10_000)
    ap.add_argument("--quick", action="store_true", help="2,000 operations")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak_compare.json"))
    args, _ = ap.parse_known_args()
    ops = 2000 if args.quick else args.ops
    python = find_server_python("0.5.6")
    if python is None:
        print("no lmcache 0.5.6 server environment (run: nox -s bench)", file=sys.stderr)
        return 2
    cfg = ServerConfig(version="0.5.6", python=python, shm=True, l1_size_gb=6.0)
    with (tempfile.TemporaryDirectory() as tmp, LocalServer(cfg) as server,
          registered_engine(server, model=MODEL, num_blocks=16, log_dir=Path(tmp))):
        mine = await lmkv_soak(server, ops, 64)
        sdk = [sdk_soak(server, ops, threads) for threads in (1, 8)]
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "workload": {"T": T, "geometry": GEOMETRY, "mix": "30% store / 40% retrieve / "
                           "30% lookup", "ops": ops},
              "lmkv": mine, "sdk": sdk,
              "command": "python benchmarks/bench_soak.py" + (" --quick" if args.quick else "")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nsoak, {ops} mixed ops (T={T}, L=2, D=128, bf16), lmcache 0.5.6 SHM, same run")
    print(f"  lmkv_async, 64 in flight : {mine['ops_per_s']:8.1f} ops/s  "
          f"(wrong/missing {mine['wrong_or_missing']}, RSS {mine['rss_mib_start']:.0f} -> "
          f"{mine['rss_mib_end']:.0f} MiB, server after: {mine['server_after']})")
    for s in sdk:
        print(f"  official SDK, {s['threads']} thread(s) : {s['ops_per_s']:8.1f} ops/s  "
              f"-> lmkv_async {mine['ops_per_s'] / s['ops_per_s']:.2f}x")
    print(f"  reproduce: {result['command']}")
    return 0 if mine["wrong_or_missing"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
