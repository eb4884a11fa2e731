"""Fleet benchmark: best() latency and answers/s over 4 real servers, one run.

Modes, all in the same run against the same servers and queries:

* ``single``: one server's direct lookup (``FleetMember.lookup``), the reference
  for the fan-out target;
* ``fanout``: ``Fleet.best(source="lookup")``, a lookup on every server at once;
* ``index``: ``Fleet.best()`` with every member synced: the event-fed index, no RPC;
* ``coordinator``: ``Fleet.best(source="coordinator")``: one ``POST /directory/lookup``;
* ``sdk_seq``: the official SDK asking the 4 servers one after another
  (``benchmarks/sdk_fleet_peer.py`` in the server's environment).

Latency: sequential calls, median and p99. Answers/s: ``--concurrency`` calls in
flight for the same number of calls (the SDK: its sequential rate; it blocks). The
fault case repeats the modes with one server frozen (SIGSTOP); the fleet's
deadline is ``--deadline``, the SDK's RPC timeout ``--sdk-timeout``.

Geometry: L=2, NH=2, HS=64, bf16, chunk 256; 4 x lmcache 0.5.7rc2 with a
coordinator, an lmcache-driven engine registration per server (the SDK needs it);
prompts of 1-4 chunks spread over the servers, plus misses.

The vLLM-event publisher (``lmkv_async.vllm_events``) is measured on the same
fleet: LMCache ``KVStored`` records of 4-chunk stores go through
``translate`` + ``publish`` (msgpack batch, XPUB send) of a started publisher of
member s0, at the router block size 16 in both hash modes and at the chunk size
(the stream before block splitting), reported as blocks (events) per second and
microseconds per block. ``--publisher-only`` runs just that, on one server.

    python benchmarks/bench_fleet.py [--n 300] [--out benchmarks/results/fleet.json]
    python benchmarks/bench_fleet.py --publisher-only
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import statistics
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
from lmkv_async.testing.coordinator import LocalCoordinator
from lmkv_async.vllm_events import VllmEventPublisher
from lmkv_async.wire.events import KVStored
from lmkv_async.wire.hashing import HAVE_NATIVE_BLAKE3, chunk_hashes

VERSION = "0.5.7rc2"
GEOMETRY = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "dtype": "bfloat16"}
LAYOUT = lmkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                       block_size=16)
C = 256
MODEL = "lmkv-bench-fleet"
SERVERS = 4


def stats(xs: list[float]) -> dict[str, Any]:
    s = sorted(xs)
    if not s:
        return {"n": 0}
    p99 = s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]
    return {"n": len(s), "median_ms": statistics.median(s) * 1e3, "p99_ms": p99 * 1e3,
            "mean_ms": statistics.fmean(s) * 1e3}


async def timed(fn: Any, queries: list[list[int]], n: int) -> list[float]:
    out = []
    for i in range(n):
        q = queries[i % len(queries)]
        t0 = time.perf_counter()
        await fn(q)
        out.append(time.perf_counter() - t0)
    return out


async def rate(fn: Any, queries: list[list[int]], n: int, concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            await fn(queries[i % len(queries)])

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return n / (time.perf_counter() - t0)


def run_sdk(servers: list[LocalServer], queries: list[list[int]], n: int, timeout: float,
            freeze: LocalServer | None, tmp: Path) -> dict[str, Any]:
    job = {"servers": [[s.url, s.http_url] for s in servers], "model": MODEL,
           "geometry": GEOMETRY, "queries": queries, "n": n, "timeout": timeout,
           "wait_stdin": True}
    path = tmp / f"sdk-job-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(job))
    proc = subprocess.Popen([servers[0].config.python, str(ROOT / "benchmarks" /
                                                           "sdk_fleet_peer.py"), f"@{path}"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=open(tmp / "sdk.log", "ab"), env=server_env(), text=True)
    assert proc.stdout is not None and proc.stdin is not None
    line = proc.stdout.readline()
    if line.strip() != "CONNECTED":
        proc.kill()
        raise RuntimeError(f"SDK peer did not connect: {line!r}")
    if freeze is not None:
        freeze.freeze()
    try:
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out = proc.stdout.readline()
    finally:
        if freeze is not None:
            freeze.resume()
    proc.wait(timeout=120)
    res: dict[str, Any] = json.loads(out)
    return res


async def measure(fleet: lmkv.Fleet, queries: list[list[int]], n: int, concurrency: int,
                  deadline: float) -> dict[str, Any]:
    first = next(iter(fleet.members.values()))
    modes: dict[str, Any] = {
        "single": lambda q: first.lookup(q, timeout=deadline),
        "fanout": lambda q: fleet.best(q, source="lookup", timeout=deadline),
        "index": lambda q: fleet.best(q, timeout=deadline),
        "coordinator": lambda q: fleet.best(q, source="coordinator", timeout=deadline),
    }
    out: dict[str, Any] = {}
    for name, fn in modes.items():
        await timed(fn, queries, min(30, n))  # warm-up
        reps = n * (5 if name == "index" else 1)
        cpu0 = time.process_time()
        lat = await timed(fn, queries, reps)
        # This process's CPU per call: tells client overhead from waiting on servers.
        cpu_ms = (time.process_time() - cpu0) / reps * 1e3
        out[name] = {**stats(lat), "client_cpu_ms_per_call": cpu_ms,
                     "answers_per_s": await rate(fn, queries, n, concurrency)}
    res = await fleet.lookup(queries[0], timeout=deadline)
    out["index_sources"] = res.sources
    return out


async def publisher_rates(member: lmkv.FleetMember, tmp: Path, stores: int,
                          seed: int) -> dict[str, Any]:
    """Blocks/s through a started publisher's translate + publish, per configuration."""
    rng = random.Random(seed)
    out: dict[str, Any] = {}
    for label, kw in (("B16_dynamo", {"block_size": 16, "hash_mode": "dynamo"}),
                      ("B16_vllm", {"block_size": 16, "hash_mode": "vllm"}),
                      ("B256_dynamo", {"block_size": C, "hash_mode": "dynamo"})):
        # Fresh prompts per configuration (a publisher announces a chunk once).
        batches = []
        for _ in range(stores):
            toks = rng.choices(range(150_000), k=4 * C)
            hs = chunk_hashes(toks, C)
            batches.append([KVStored(0, MODEL, (h,), hs[i - 1] if i else None,
                                     tuple(toks[i * C:(i + 1) * C]), "CPU")
                            for i, h in enumerate(hs)])
        pub = VllmEventPublisher(member, endpoint=f"ipc://{tmp}/bench-pub-{label}",
                                 **kw)  # type: ignore[arg-type]
        await pub.start()
        try:
            t0 = time.perf_counter()
            for batch in batches:
                pub.publish(pub.translate(batch))
            wall = time.perf_counter() - t0
        finally:
            await pub.aclose()
        out[label] = {"blocks": pub.blocks, "batches": pub.published,
                      "blocks_per_s": pub.blocks / wall,
                      "us_per_block": 1e6 * wall / pub.blocks,
                      "us_per_chunk": 1e6 * wall / (4 * stores)}
    return out


async def publisher_only(args: argparse.Namespace) -> dict[str, Any]:
    python = find_server_python(VERSION)
    if python is None:
        raise SystemExit(f"set LMKV_LMCACHE_PYTHON_057RC2 to the lmcache {VERSION} interpreter")
    tmp = Path(tempfile.mkdtemp(prefix="lmkv-bench-pub-"))
    srv = LocalServer(ServerConfig(version=VERSION, python=python, l1_size_gb=0.1),
                      log_path=tmp / "s0.log")
    srv.start()
    try:
        async with lmkv.Fleet({"s0": (srv.url, srv.http_url)}, model_name=MODEL,
                              layout=LAYOUT) as fleet:
            return await publisher_rates(fleet["s0"], tmp, args.publisher_stores, args.seed)
    finally:
        srv.stop()


def print_publisher(res: dict[str, Any]) -> None:
    print(f"{'publisher':<12} {'blocks/s':>10} {'us/block':>9} {'us/chunk':>9}")
    for label, r in res.items():
        print(f"{label:<12} {r['blocks_per_s']:>10.0f} {r['us_per_block']:>9.2f} "
              f"{r['us_per_chunk']:>9.1f}")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    python = find_server_python(VERSION)
    if python is None:
        raise SystemExit(f"set LMKV_LMCACHE_PYTHON_057RC2 to the lmcache {VERSION} interpreter")
    tmp = Path(tempfile.mkdtemp(prefix="lmkv-bench-fleet-"))
    coord = LocalCoordinator(python, log_path=tmp / "coordinator.log")
    coord.start()
    servers: list[LocalServer] = []
    with contextlib.ExitStack() as stack:
        try:
            for i in range(SERVERS):
                cfg = ServerConfig(version=VERSION, python=python, l1_size_gb=0.1,
                                   extra_args=coord.server_args(instance_id=f"s{i}"))
                srv = LocalServer(cfg, log_path=tmp / f"s{i}.log")
                srv.start()
                servers.append(srv)
                stack.enter_context(registered_engine(srv, model=MODEL, num_blocks=16,
                                                      log_dir=tmp))
            rng = random.Random(args.seed)
            prompts = [rng.choices(range(150_000), k=k * C + 17) for k in (4, 3, 2, 1) * 2]
            misses = [rng.choices(range(150_000), k=2 * C) for _ in range(4)]
            queries = prompts + misses
            names = [f"s{i}" for i in range(SERVERS)]
            fleet = lmkv.Fleet({n: (s.url, s.http_url) for n, s in zip(names, servers,
                                                                          strict=True)},
                               model_name=MODEL, layout=LAYOUT, coordinator_url=coord.url,
                               timeout=args.deadline, probe_backoff=(0.2, 1.0))
            async with fleet:
                for i, p in enumerate(prompts):
                    member = fleet[names[i % SERVERS]]
                    await member.store(torch.zeros(2, 2, len(p), 128, dtype=torch.bfloat16), p)
                t0 = time.monotonic()
                while not all(m.synced for m in fleet.members.values()):
                    if time.monotonic() - t0 > 30:
                        raise RuntimeError("members did not sync")
                    await asyncio.sleep(0.1)
                # The directory is fed by event flushes: wait until it agrees.
                for q in queries:
                    for _ in range(100):
                        co = await fleet.lookup(q, source="coordinator", timeout=2.0)
                        if dict(co) == dict(await fleet.lookup(q, source="lookup")):
                            break
                        await asyncio.sleep(0.1)
                healthy = await measure(fleet, queries, args.n, args.concurrency, args.deadline)
                sdk = await asyncio.to_thread(run_sdk, servers, queries, args.n,
                                              args.sdk_timeout, None, tmp)
                healthy["sdk_seq"] = {**stats(sdk["samples"]),
                                      "answers_per_s": len(sdk["samples"]) / sdk["wall_s"]}
                # Fault case: one server frozen.
                frozen = servers[-1]
                frozen.freeze()
                try:
                    fault = await measure(fleet, queries, args.n, args.concurrency,
                                          args.deadline)
                finally:
                    frozen.resume()
                publisher = await publisher_rates(fleet["s0"], tmp, args.publisher_stores,
                                                  args.seed)
                sdk_f = await asyncio.to_thread(run_sdk, servers, queries, args.fault_sdk_n,
                                                args.sdk_timeout, frozen, tmp)
                fault["sdk_seq"] = {**stats(sdk_f["samples"]),
                                    "answers_per_s": len(sdk_f["samples"]) / sdk_f["wall_s"],
                                    "errors": sdk_f["errors"]}
        finally:
            for srv in servers:
                srv.stop()
            coord.stop()
    return {"healthy": healthy, "one_frozen": fault, "publisher": publisher}


def main() -> int:
    p = argparse.ArgumentParser(description="Fleet best() benchmark (4 servers, one run)")
    p.add_argument("--n", type=int, default=300, help="calls per mode (index: 5x)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--deadline", type=float, default=0.25, help="fleet deadline, seconds")
    p.add_argument("--sdk-timeout", type=float, default=1.0)
    p.add_argument("--fault-sdk-n", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fleet.json"))
    p.add_argument("--publisher-stores", type=int, default=500,
                   help="4-chunk stores per publisher configuration")
    p.add_argument("--publisher-only", action="store_true",
                   help="only the vLLM-event publisher rates (one server; prints, no file)")
    args = p.parse_args()
    if args.publisher_only:
        print_publisher(asyncio.run(publisher_only(args)))
        return 0
    res = asyncio.run(main_async(args))
    command = "python benchmarks/bench_fleet.py " + " ".join(sys.argv[1:])
    h = res["healthy"]
    targets = {
        "index_p99_below_1ms": h["index"]["p99_ms"] < 1.0,
        "fanout_p99_below_2x_single_p99": h["fanout"]["p99_ms"] < 2 * h["single"]["p99_ms"],
        "publisher_B16_below_5us_per_block": res["publisher"]["B16_dynamo"]["us_per_block"] < 5,
    }
    load = os.getloadavg()
    doc = {"command": command.strip(), "lmcache": VERSION, "servers": SERVERS,
           "loadavg_after": load,
           "python": platform.python_version(), "cpus": os.cpu_count(),
           "native_blake3": HAVE_NATIVE_BLAKE3, "deadline_s": args.deadline,
           "results": res, "targets": targets}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{'case':<11} {'mode':<12} {'median ms':>10} {'p99 ms':>9} {'answers/s':>10} "
          f"{'client cpu ms':>14}")
    for case, modes in res.items():
        if case == "publisher":
            continue
        for mode in ("single", "fanout", "index", "coordinator", "sdk_seq"):
            r = modes[mode]
            cpu = r.get("client_cpu_ms_per_call")
            print(f"{case:<11} {mode:<12} {r['median_ms']:>10.3f} {r['p99_ms']:>9.3f} "
                  f"{r['answers_per_s']:>10.0f} {'' if cpu is None else f'{cpu:.3f}':>14}")
    print_publisher(res["publisher"])
    print("targets:", targets)
    print(f"reproduce: {doc['command']}   (results: {args.out})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
