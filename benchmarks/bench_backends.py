"""asyncio before/after the trio bridge, and the same workload under trio, in one run.

    python benchmarks/bench_backends.py OLD_TREE [ROUNDS]

Sides, alternating within each round (each round starting with the next side),
each as a child process with one fresh
real 0.5.6 SHM server: ``asyncio-before`` (``OLD_TREE``: a checkout from before
the bridge, its C kernel built in place), ``asyncio-after`` and ``trio`` (this
tree). The child (``_backends_child.py``) drives one workload through
``anyio.run`` on the side's backend: lookups one at a time and 64 in flight at
T=1024, then store and retrieve(out=) at T=256/1024/4096, bit-checked. Prints
medians of the per-round medians and the ratios to ``asyncio-before``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ROWS = [("lookup", "one"), ("lookup", "64 in flight")] + [
    (str(T), op) for T in (256, 1024, 4096) for op in ("store", "retrieve_out")]


def main() -> int:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    old = str(Path(sys.argv[1]).resolve())
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    sys.path.insert(0, str(ROOT))
    from lmkv_async.testing import LocalServer, ServerConfig, find_server_python

    python = find_server_python("0.5.6")
    if python is None:
        sys.exit("set LMKV_LMCACHE_PYTHON_056 (nox -s bench exports it)")
    srv = LocalServer(ServerConfig(version="0.5.6", python=python, shm=True, l1_size_gb=4.0))
    sides = {"asyncio-before": (old, "asyncio"), "asyncio-after": (str(ROOT), "asyncio"),
             "trio": (str(ROOT), "trio")}
    got: dict[str, list[dict[str, dict[str, float]]]] = {k: [] for k in sides}
    names = list(sides)
    for rnd in range(rounds):
        # Each round starts with another side: run in a fixed order, a later side met a
        # machine (page cache, free huge pages) the earlier ones had left, every time.
        for name in names[rnd % 3:] + names[:rnd % 3]:
            tree, backend = sides[name]
            srv.start()
            try:
                out = subprocess.run(
                    [sys.executable, str(HERE / "_backends_child.py"), srv.url, srv.http_url,
                     f"bk{rnd}{backend}{len(got[name])}", backend],
                    env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True,
                    timeout=900, cwd=tree)
            finally:
                srv.stop()
            if out.returncode:
                print(f"{name}: child failed\n{out.stderr[-3000:]}")
                return 1
            got[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'':22s}" + "".join(f"{n:>16s}" for n in sides) + "   after/before  trio/before")
    for key, op in ROWS:
        med = {n: statistics.median(r[key][op] for r in rs) for n, rs in got.items()}
        unit, scale = ("us", 1e6) if key == "lookup" else ("ms", 1e3)
        label = f"lookup {op}" if key == "lookup" else f"T={key} {op}"
        cells = "".join(f"{med[n] * scale:13.1f} {unit}" for n in sides)
        print(f"{label:22s}{cells}   {med['asyncio-after'] / med['asyncio-before']:12.3f}"
              f"  {med['trio'] / med['asyncio-before']:11.3f}")
    print(f"(lookup: per lookup; 64 in flight: wall time / 64. {rounds} rounds; "
          f"reproduce: python benchmarks/bench_backends.py {sys.argv[1]} {rounds})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
