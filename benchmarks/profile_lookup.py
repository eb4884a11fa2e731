"""Where a client's time per lookup goes: py-spy samples of sequential lookups.

    python benchmarks/profile_lookup.py [--seconds 5] [--rate 1000]

Starts a real lmcache 0.5.6 server (``$LMKV_LMCACHE_PYTHON_056``), stores one
1024-token prefix, times lookups one at a time for ``--seconds`` without a
profiler, then runs the same loop again with ``py-spy`` attached to its own pid
(``--rate`` samples per second) and sorts the event-loop thread's samples into buckets (each
sample counts once, in the first bucket its stack matches):

* ``waiting in epoll`` -- the loop has nothing to do (the server is working);
* ``receive + dispatch`` -- the socket reader, frame decoding, waking the caller;
* ``zmq send`` -- handing frames to libzmq;
* ``release steps`` -- ``free_lookup_locks`` / ``end_session`` after the call;
* ``op set-up`` -- token validation, key encoding, request ids, metrics;
* ``other lmkv_async``, ``asyncio machinery``, ``other``.

Needs ``py-spy`` on PATH (it reads this process's memory: root or ptrace rights).
Not a ``bench_*`` runner, so ``nox -s bench`` does not run it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

import torch
from _common import LAYOUT, D, L  # (same directory; puts the tree on sys.path)

import lmkv_async as lmkv
from lmkv_async.testing import LocalServer, ServerConfig, find_server_python

T = 1024
#: (bucket, pattern on a frame "path:function"), first match wins; the epoll wait first
#: (idle), then the transport's own work, then what the operation does around it.
BUCKETS = (
    ("waiting in epoll", re.compile(r"selectors\.py:.*select")),
    ("receive + dispatch", re.compile(r"transport\.py:Connection\.(_on_readable|_drain)")),
    ("zmq send", re.compile(r"zmq/sugar/socket\.py:Socket\.send")),
    ("release steps", re.compile(r"_ops\.py:_release_lookup|_session\.py:Session\._after_caller")),
    ("op set-up", re.compile(r"validate\.py:|wire/keys\.py:|_ops\.py:(_seq|_new_request_id)|"
                             r"metrics\.py:")),
    ("other lmkv_async", re.compile(r"lmkv_async/")),
    ("asyncio machinery", re.compile(r"asyncio/")),
)
FRAME = re.compile(r"(.*) \((.*?):\d+\)$")


async def lookups(ctx: lmkv.AsyncKVContext, toks: list[int], seconds: float) -> tuple[int, float]:
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        assert await ctx.lookup(toks) == T
        n += 1
    return n, time.perf_counter() - t0


def buckets(raw: str) -> tuple[collections.Counter[str], int]:
    """Samples of the main thread per bucket (py-spy ``--format raw`` lines)."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        if not frames or "Thread._bootstrap" in frames[0]:
            continue  # worker threads (none run during lookups)
        names = []
        for f in frames:
            m = FRAME.match(f)
            names.append(f"{m.group(2)}:{m.group(1)}" if m else f)
        for label, pat in BUCKETS:
            if any(pat.search(x) for x in names):
                counts[label] += int(n)
                break
        else:
            counts["other"] += int(n)
    return counts, sum(counts.values())


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="profiled seconds")
    ap.add_argument("--rate", type=int, default=1000, help="py-spy samples per second")
    args = ap.parse_args()
    spy = shutil.which("py-spy")
    python = find_server_python("0.5.6")
    if spy is None or python is None:
        print("needs py-spy on PATH and LMKV_LMCACHE_PYTHON_056", file=sys.stderr)
        return 2
    srv = LocalServer(ServerConfig(version="0.5.6", python=python, l1_size_gb=1.0))
    srv.start()
    try:
        async with lmkv.connect(srv.url, srv.http_url, "profile-lookup", layout=LAYOUT) as ctx:
            toks = [random.randrange(150_000) for _ in range(T)]
            kv = torch.zeros(2, L, T, D, dtype=LAYOUT.dtype)
            await ctx.store(kv, toks)
            await lookups(ctx, toks, 1.0)  # warm-up
            n, dt = await lookups(ctx, toks, args.seconds)
            print(f"unprofiled: {n / dt:.0f} lookups/s ({dt / n * 1e3:.3f} ms each)")
            with tempfile.NamedTemporaryFile(suffix=".txt", prefix="lmkv-lookup-profile-",
                                             delete=False) as f:
                out = f.name
            proc = subprocess.Popen(
                [spy, "record", "-r", str(args.rate), "-d", f"{args.seconds:g}",
                 "--format", "raw", "-o", out, "--pid", str(os.getpid())],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            await asyncio.sleep(0.5)  # attached
            n, dt = await lookups(ctx, toks, args.seconds - 1.0)
            await asyncio.to_thread(proc.wait)
            print(f"profiled:   {n / dt:.0f} lookups/s (py-spy stops the process to sample)")
    finally:
        srv.stop()
    if proc.returncode != 0 or not os.path.exists(out):
        print(f"py-spy failed: {proc.stderr.read() if proc.stderr else ''}", file=sys.stderr)
        return 1
    with open(out) as f:
        counts, total = buckets(f.read())
    os.unlink(out)
    busy = total - counts["waiting in epoll"]
    print(f"\nevent-loop thread, {total} samples ({busy} busy):")
    for label, _ in (*BUCKETS, ("other", None)):
        c = counts[label]
        share = "" if label == "waiting in epoll" else f"  {c / max(busy, 1) * 100:5.1f}% of busy"
        print(f"  {label:<20} {c / max(total, 1) * 100:5.1f}% of samples{share}")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
