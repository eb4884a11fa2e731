"""Run timing-sensitive test modules N times in a row under CPU load; count the outcomes.

The proof that the suite survives a loaded 2-core machine (docs/testing.md):

    python tests/repeat.py --runs 10 --load 2 tests/test_faults.py tests/test_dead_server.py

``--load K`` keeps K busy-looping processes running for the whole loop (a
``stress``-like load: on 2 cores, K=2 halves what the tests get). Each run is a
fresh ``pytest`` process; the summary line of each is kept, and the exit code is
non-zero unless every run passed. Results go to ``--out`` (a JSON file outside
the repository by default).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _burn() -> None:  # pragma: no cover - runs in a child process
    while True:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("modules", nargs="+", help="test files or node ids")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--load", type=int, default=2, help="busy-loop processes during the runs")
    ap.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "lmkv-repeat.json"))
    ap.add_argument("pytest_args", nargs=argparse.REMAINDER,
                    help="after --: extra pytest arguments")
    args = ap.parse_args()
    burners = [mp.Process(target=_burn, daemon=True) for _ in range(args.load)]
    for b in burners:
        b.start()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    runs: list[dict[str, object]] = []
    try:
        for i in range(args.runs):
            t0 = time.monotonic()
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                 *args.modules, *[a for a in args.pytest_args if a != "--"]],
                cwd=ROOT, env=env, capture_output=True, text=True)
            tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
            failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M)
            runs.append({"run": i + 1, "rc": proc.returncode, "summary": tail,
                         "failed": failed, "wall_s": round(time.monotonic() - t0, 1)})
            log = Path(args.out).with_suffix(f".run{i + 1}.log")
            log.write_text(proc.stdout + proc.stderr)
            print(f"run {i + 1}/{args.runs}: rc={proc.returncode} {tail}"
                  + (f" failed: {' '.join(failed)}" if failed else ""), flush=True)
    finally:
        for b in burners:
            b.terminate()
    green = sum(1 for r in runs if r["rc"] == 0)
    result = {"modules": args.modules, "load_processes": args.load, "cpus": os.cpu_count(),
              "runs": runs, "green": green, "total": len(runs)}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{green}/{len(runs)} runs green under load {args.load} (results: {args.out})")
    return 0 if green == len(runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
