"""Baseline for bench_fleet.py: the official SDK asking N servers one after another.

Runs INSIDE an lmcache server environment (it imports ``lmcache`` through
``sdk_peer.py``'s :class:`Peer`, one SDK context per server). For each of ``n``
queries it looks the tokens up on every server in sequence (the SDK's lookup
path, then ``free_lookup_locks`` and ``end_session``) and picks the longest: what a
router without lmkv_async writes. Job (argv[1], JSON or ``@path``)::

    {"servers": [["tcp://..", "http://.."], ...], "model": "m", "geometry": {...},
     "queries": [[tok, ...], ...], "n": 200, "timeout": 60, ["wait_stdin": true]}

With ``wait_stdin`` it prints ``CONNECTED`` once its contexts are open and starts
when a line arrives on stdin.

Output: one JSON line ``{"ok": true, "samples": [s, ...], "wall_s": s, "errors": k}``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any


def main(argv: list[str]) -> int:
    raw = argv[1]
    if raw.startswith("@"):
        raw = Path(raw[1:]).read_text()
    job: dict[str, Any] = json.loads(raw)
    spec = importlib.util.spec_from_file_location(
        "sdk_peer", Path(__file__).resolve().parent / "sdk_peer.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    peers = [mod.Peer({"url": url, "http_url": http, "model": job["model"],
                       "geometry": job["geometry"], "timeout": job.get("timeout", 60)})
             for url, http in job["servers"]]
    if job.get("wait_stdin"):
        # The fault case: connect while every server answers, then let the caller
        # freeze one before the clock starts.
        print("CONNECTED", flush=True)
        sys.stdin.readline()
    queries = job["queries"]
    samples: list[float] = []
    errors = 0
    wall0 = time.perf_counter()
    for i in range(int(job["n"])):
        toks = queries[i % len(queries)]
        t0 = time.perf_counter()
        best = (-1, -1)
        for k, peer in enumerate(peers):
            try:
                _, hit = peer.lookup(toks)
            except Exception:  # a frozen server: the SDK waits out its timeout
                errors += 1
                continue
            best = max(best, (hit, -k))
        samples.append(time.perf_counter() - t0)
    wall = time.perf_counter() - wall0
    for peer in peers:
        peer.close()
    print(json.dumps({"ok": True, "samples": samples, "wall_s": wall, "errors": errors}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
