# ruff: noqa: E501  (the child script below is kept verbatim as a string)
"""Before/after of two source trees in one run: store and retrieve(out=) medians at
T=256/1024/4096, and one-at-a-time lookup latency at T=1024.

    python benchmarks/compare_trees.py OLD_TREE NEW_TREE [ROUNDS]

One fresh real 0.5.6 SHM server per side per round (no evictions inside a
measurement), the two trees alternating as child processes; prints medians of the
per-round medians and the after/before ratio. Each tree needs its C kernel built
in place (``python setup.py build_ext --inplace``). Used for the House refactor
(3627f85 vs main).
"""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r'''
"""One side of the House before/after comparison: store + retrieve(out=) medians."""
import asyncio, json, statistics, sys, time
import torch
import lmkv_async as lmkv

url, http_url, model, reps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
L, NH, HS = 32, 8, 128
LAYOUT = lmkv.KVLayout(num_layers=L, num_kv_heads=NH, head_dim=HS, dtype=torch.bfloat16, block_size=16)

async def main():
    res = {}
    async with lmkv.connect(url, http_url, model, layout=LAYOUT, timeout=60) as ctx:
        for T in (256, 1024, 4096):
            kv = torch.randint(-2**14, 2**14, (2, L, T, NH * HS), dtype=torch.int16).view(torch.bfloat16)
            out = torch.empty_like(kv); out.view(torch.int16).fill_(0)
            st, rt = [], []
            for r in range(reps):
                toks = torch.randint(0, 2**31, (T,)).tolist()
                t0 = time.perf_counter(); w = await ctx.store(kv, toks); st.append(time.perf_counter() - t0)
                assert w.written_chunks == T // 256
                t0 = time.perf_counter(); v = await ctx.retrieve(toks, out=out); rt.append(time.perf_counter() - t0)
                assert v is not None and torch.equal(v.view(torch.int16), kv.view(torch.int16))
            res[T] = {"store": statistics.median(st), "retrieve_out": statistics.median(rt)}
            if T == 1024:  # lookups one at a time (release steps drained after each)
                lt = []
                for r in range(50):
                    t0 = time.perf_counter(); n = await ctx.lookup(toks); lt.append(time.perf_counter() - t0)
                    assert n == T
                    while ctx._s._tasks: await asyncio.wait(list(ctx._s._tasks))
                res["lookup"] = {"lookup": statistics.median(lt)}
    print(json.dumps(res))

asyncio.run(main())
'''


def main() -> int:
    old, new = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from lmkv_async.testing import LocalServer, ServerConfig, find_server_python

    python = find_server_python("0.5.6")
    if python is None:
        sys.exit("set LMKV_LMCACHE_PYTHON_056 (nox -s bench exports it)")
    srv = LocalServer(ServerConfig(version="0.5.6", python=python, shm=True, l1_size_gb=4.0))
    trees = {"before": old, "after": new}
    rows: dict[str, list[dict[str, dict[str, float]]]] = {k: [] for k in trees}
    for rnd in range(rounds):
        for name, tree in trees.items():
            srv.start()
            try:
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, srv.url, srv.http_url, f"cmp{rnd}{name}", "5"],
                    env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True,
                    timeout=900)
            finally:
                srv.stop()
            if out.returncode:
                print(out.stderr[-2000:])
                return 1
            rows[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    for T, ops in (("256", ("store", "retrieve_out")), ("1024", ("store", "retrieve_out")),
                   ("4096", ("store", "retrieve_out")), ("lookup", ("lookup",))):
        for op in ops:
            med = {n: statistics.median(r[T][op] for r in rs) * 1e3 for n, rs in rows.items()}
            print(f"T={T:5s} {op:13s} before {med['before']:8.1f} ms  after "
                  f"{med['after']:8.1f} ms  after/before {med['after'] / med['before']:5.2f}")
    print(f"reproduce: python benchmarks/compare_trees.py {old} {new} {rounds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
