"""Prefix-index benchmark: the fleet's index at router scale, before and after, one run.

Builds a synthetic fleet in one process, no server: every simulated server holds
8-chunk prompts (chunk 256) whose first chunk is one of 50 shared ones and whose 7
others are its own (token ids: windows of one random sequence over a 131,072-token
vocabulary), fed as ``KVStored`` records (token ids as a list, as decoded from an
event) through ``PrefixIndex.add_event`` with real BLAKE3 hashes
(``wire.hashing.chunk_hashes``, computed outside the timed calls), the entry point
the fleet's event streams use. The curve runs at 16, 64 and 256 servers holding
10,000 (server, chunk) entries each (1,422 prompts); the 256-server point is the one
the targets are read at. For each point it measures, in a fresh child process:

* memory: the RSS delta of the build and, in a second child, the bytes tracemalloc
  sees; per (server, chunk) entry, entries being what ``size()`` counts;
* ingestion: entries per second inside ``add_event`` (and ``add_own``, the fleet's
  own stores, which hash the tokens themselves, on a sample);
* ``longest`` over every server (what ``Fleet.best`` asks for synced members):
  p50 / p99 / max over queries that hit a prompt fully or partly, share only the
  first chunk, or miss;
* ``remove`` (one prompt's 7 own hashes per call) and ``discard(server)`` (a tenth
  of the servers), per entry removed.

The index before the rewrite (``git show fb4a8d3:lmkv_async/_index.py``, loaded
into a temporary module for this comparison only) runs at the same points where
its estimated peak memory fits ``--before-max-gib`` (6 GiB: all three; about 1.6
KiB per entry); both answer the same queries, and the run checks that their
answers are identical. Results go to ``benchmarks/results/index.json``.

    python benchmarks/bench_index.py            # the curve, before and after (~10 min)
    python benchmarks/bench_index.py --quick    # 40 prompts per server (~1 min)
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
try:
    import lmkv_async  # noqa: F401  (installed, e.g. in the nox bench session)
except ImportError:  # a source checkout
    sys.path.insert(0, str(ROOT))

from lmkv_async.wire.hashing import chunk_hashes  # noqa: E402
from lmkv_async.wire.keys import token_bytes  # noqa: E402

C = 256              # tokens per chunk
CHUNKS = 8           # chunks per prompt
SHARED = 50          # shared first chunks
BEFORE = "fb4a8d3"   # main before the rewrite
TARGET_ENTRIES = 10_000
#: prompts per server for 10,000 entries each: 7 own chunks per prompt plus the 50 shared
TARGET_PROMPTS = -(-(TARGET_ENTRIES - SHARED) // (CHUNKS - 1))
#: peak RSS per entry of the index before, in its tracemalloc child, with margin
#: (measured: 1.43 GiB for 640,256 entries, 5.04 GiB for 2,561,024, interpreter and
#: imports included); its RSS child peaks lower
BEFORE_PEAK = 2_400
GOALS = {"bytes_per_entry": 256.0, "longest_p99_us": 1000.0, "ingest_entries_per_s": 100_000.0}


# ----------------------------------------------------------------------------- workload
VOCAB = 1 << 17      # token ids drawn from a vocabulary of this size
_FIRST = [[1_000_000 + i * C + t for t in range(C)] for i in range(SHARED)]
_pool: list[int] = []


def make_pool(prompts: int, seed: int) -> None:
    """The tokens every prompt's own part is a window of: one random sequence over a
    vocabulary, so a prompt is two list slices (no int is made per token: under
    tracemalloc, making 2,048 ints per prompt was most of a point's wall time).
    Prompt ``g`` owns the window starting at ``g``; two windows of a random sequence
    are equal with negligible probability, so every own chunk is distinct."""
    vocab = list(range(VOCAB))
    _pool[:] = random.Random(seed + 0x5EED).choices(vocab, k=prompts + (CHUNKS - 1) * C)


def first_chunk(i: int) -> list[int]:
    return _FIRST[i]


def prompt(server: int, j: int, per_server: int) -> list[int]:
    """Prompt ``j`` of ``server``: a shared first chunk, then 7 chunks of its own."""
    g = server * per_server + j
    return _FIRST[j % SHARED] + _pool[g:g + (CHUNKS - 1) * C]


def load_index(impl: str, source: str | None) -> type:
    if impl == "after":
        from lmkv_async._index import PrefixIndex
        return PrefixIndex
    assert source is not None
    mod = types.ModuleType("lmkv_async._index_before")
    mod.__package__ = "lmkv_async"  # its relative imports (.wire.hashing) resolve
    exec(compile(Path(source).read_text(), f"{BEFORE}:lmkv_async/_index.py", "exec"), mod.__dict__)
    cls: type = mod.PrefixIndex
    return cls


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))]


def build(index: Any, servers: int, per_server: int, names: list[str]) -> tuple[float, int]:
    """Feed every prompt as one KVStored record; (seconds inside add_event, entries told)."""
    spent, told = 0.0, 0
    for j in range(per_server):
        for s in range(servers):  # interleaved, as streams of many servers arrive
            toks = prompt(s, j, per_server)
            hs = chunk_hashes(toks, C)
            t0 = time.perf_counter()
            index.add_event(names[s], hs, None, toks)
            spent += time.perf_counter() - t0
            told += len(hs)
    return spent, told


def queries(servers: int, per_server: int, n: int, rng: random.Random
            ) -> list[tuple[bytes, int, str, int]]:
    """(packed tokens, chunks, expected holder or "", its expected prefix in chunks)."""
    out = []
    for q in range(n):
        kind = q % 10
        s, j = rng.randrange(servers), rng.randrange(per_server)
        toks = prompt(s, j, per_server)
        if kind < 6:  # the whole prompt, or a prefix of it
            k = CHUNKS if kind < 3 else rng.randint(1, CHUNKS)
            out.append((token_bytes(toks[: k * C]), k, f"s{s}", k))
        elif kind < 8:  # a shared first chunk, then tokens nobody stored
            toks = first_chunk(rng.randrange(min(SHARED, per_server))) + [
                rng.randrange(2**31) for _ in range(C)]
            out.append((token_bytes(toks), 2, "", 1))
        else:  # a miss from the first chunk
            out.append((token_bytes([rng.randrange(2**31) for _ in range(2 * C)]), 2, "", 0))
    return out


def child(spec: dict[str, Any]) -> dict[str, Any]:
    impl, servers, per_server = spec["impl"], spec["servers"], spec["per_server"]
    rng = random.Random(spec["seed"])
    cls = load_index(impl, spec.get("source"))
    names = [f"s{i}" for i in range(servers)]
    sample = max(20, per_server // 10)  # add_own calls, on prompts after the fleet's
    make_pool(servers * per_server + sample, spec["seed"])
    qs = queries(servers, per_server, spec["queries"], rng)
    chunk_hashes(prompt(0, 0, 1), C)  # warm the hash path
    index = cls(C)
    if spec["trace"]:  # tracemalloc only: its own process, nothing timed
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        build(index, servers, per_server, names)
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        entries = index.size()
        return {"traced_bytes": traced, "entries": entries,
                "traced_bytes_per_entry": traced / entries, "peak_rss_bytes": peak_rss()}
    gc.collect()
    before = rss()
    spent, told = build(index, servers, per_server, names)
    gc.collect()
    grown = rss() - before
    entries = index.size()
    out: dict[str, Any] = {
        "entries": entries, "edges": index.edges, "told": told,
        "rss_delta_bytes": grown, "rss_bytes_per_entry": grown / entries,
        "ingest_s": spent, "ingest_entries_per_s": told / spent,
    }
    # add_own: the fleet's own stores (it hashes the tokens itself), on a sample
    t_own, own_told = 0.0, 0
    for j in range(sample):
        toks = prompt(servers, j, per_server)
        t0 = time.perf_counter()
        index.add_own(names[j % servers], toks, "", CHUNKS)
        t_own += time.perf_counter() - t0
        own_told += CHUNKS
    out["add_own_entries_per_s"] = own_told / t_own
    # longest over every server, as Fleet.best asks it
    lat, wrong, answers = [], 0, hashlib.sha256()
    for packed, k, holder, want in qs:
        t0 = time.perf_counter_ns()
        res = index.longest(packed, k, "", names)
        lat.append((time.perf_counter_ns() - t0) / 1e3)
        got = res.get(holder, 0) if holder else max(res.values())
        wrong += got != want
        answers.update(json.dumps(sorted(res.items())).encode())
    out["longest_us"] = {"n": len(lat), "p50": pct(lat, 0.5), "p99": pct(lat, 0.99),
                         "max": max(lat)}
    out["wrong_answers"] = wrong
    out["answers_sha256"] = answers.hexdigest()
    # remove: one prompt's own hashes per call (chunk 0 is shared)
    picks = rng.sample([(s, j) for s in range(servers) for j in range(per_server)],
                       min(spec["removes"], servers * per_server))
    per_call, removed, t_rm = [], 0, 0.0
    for s, j in picks:
        hs = chunk_hashes(prompt(s, j, per_server), C)[1:]
        n0 = index.size(names[s])
        t0 = time.perf_counter()
        index.remove(names[s], hs)
        dt = time.perf_counter() - t0
        gone = n0 - index.size(names[s])
        t_rm += dt
        removed += gone
        per_call.append(dt / gone * 1e6)
    out["remove_us_per_entry"] = t_rm / removed * 1e6
    out["remove_us_per_entry_p50"] = pct(per_call, 0.5)
    out["removed"] = removed
    # discard whole servers (a tenth of them, at least 3): time against entries dropped
    per_server_us, sizes, t_dc = [], [], 0.0
    for s in range(max(3, servers // 10)):
        n0 = index.size(names[s])
        t0 = time.perf_counter()
        index.discard(names[s])
        dt = time.perf_counter() - t0
        t_dc += dt
        sizes.append(n0 - index.size(names[s]))
        per_server_us.append(dt / sizes[-1] * 1e6)
    out["discard_us_per_entry"] = t_dc / sum(sizes) * 1e6
    out["discard_us_per_entry_p50"] = pct(per_server_us, 0.5)
    out["discarded"] = sum(sizes)
    out["discard_ms_per_server"] = t_dc / len(sizes) * 1e3
    out["peak_rss_bytes"] = peak_rss()
    return out


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"child {spec} failed:\n{proc.stderr}")
    res: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return res


def point(impl: str, servers: int, per_server: int, args: argparse.Namespace,
          source: str | None) -> dict[str, Any]:
    spec = {"impl": impl, "servers": servers, "per_server": per_server, "seed": args.seed,
            "queries": args.queries, "removes": args.removes, "source": source, "trace": False}
    t0 = time.monotonic()
    res = run_child(spec)
    res.update(impl=impl, servers=servers, prompts_per_server=per_server)
    if not args.no_trace:
        tr = run_child({**spec, "trace": True})
        assert tr["entries"] == res["entries"], (tr, res)
        res["traced_bytes"], res["traced_bytes_per_entry"] = (tr["traced_bytes"],
                                                             tr["traced_bytes_per_entry"])
        res["trace_peak_rss_bytes"] = tr["peak_rss_bytes"]
    res["wall_s"] = time.monotonic() - t0
    lat = res["longest_us"]
    print(f"{impl:6s} {servers:4d} x {per_server:5d} prompts: {res['entries']:>9,} entries, "
          f"{res['rss_bytes_per_entry']:7.0f} B/entry RSS"
          + (f", {res['traced_bytes_per_entry']:6.0f} traced" if "traced_bytes" in res else "")
          + f", ingest {res['ingest_entries_per_s']:>9,.0f}/s, longest p50/p99 "
          f"{lat['p50']:.0f}/{lat['p99']:.0f} us, remove {res['remove_us_per_entry_p50']:.2f} "
          f"us/entry, discard {res['discard_us_per_entry_p50']:.2f} us/entry (p50) "
          f"({res['wall_s']:.0f} s)", flush=True)
    return res


def before_source() -> str | None:
    try:
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{BEFORE}:lmkv_async/_index.py"],
                              capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    fd, path = tempfile.mkstemp(prefix="index_before_", suffix=".py")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def before_fits(servers: int, per_server: int, max_gib: float) -> bool:
    """Whether the index before the rewrite can be measured at this point: its
    tracemalloc child peaks at about BEFORE_PEAK bytes per entry."""
    entries = servers * (per_server * (CHUNKS - 1) + min(SHARED, per_server))
    return entries * BEFORE_PEAK <= max_gib * 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="curve at 40 prompts per server (a minute)")
    ap.add_argument("--servers", type=int, nargs="*", default=[16, 64, 256])
    ap.add_argument("--prompts", type=int, default=None,
                    help=f"prompts per server (default {TARGET_PROMPTS}: 10,000 entries)")
    ap.add_argument("--no-before", action="store_true", help=f"skip the index of {BEFORE}")
    ap.add_argument("--before-max-gib", type=float, default=6.0,
                    help="measure the index before only where its estimated peak fits")
    ap.add_argument("--no-trace", action="store_true", help="skip the tracemalloc children")
    ap.add_argument("--queries", type=int, default=None, help="longest() calls (2000)")
    ap.add_argument("--removes", type=int, default=400, help="remove() calls")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "index.json"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child))))
        return
    per_server = args.prompts or (40 if args.quick else TARGET_PROMPTS)
    args.queries = args.queries or (500 if args.quick else 2000)
    t_start = time.monotonic()
    source = None if args.no_before else before_source()
    if source is None and not args.no_before:
        print(f"note: git show {BEFORE} failed; the index before the rewrite is not measured")
    curve: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    try:
        for servers in args.servers:
            after = point("after", servers, per_server, args, None)
            curve.append(after)
            if source is None:
                continue
            if not before_fits(servers, per_server, args.before_max_gib):
                skipped.append({"impl": "before", "servers": servers,
                                "prompts_per_server": per_server,
                                "reason": f"estimated peak over {args.before_max_gib:g} GiB"})
                print(f"before {servers:4d} x {per_server:5d} prompts: skipped "
                      f"({skipped[-1]['reason']})", flush=True)
                continue
            before = point("before", servers, per_server, args, source)
            before["same_answers"] = after["same_answers"] = (
                before["answers_sha256"] == after["answers_sha256"])
            curve.append(before)
    finally:
        if source is not None:
            os.unlink(source)
    # the targets hold at 256 servers x 10,000 entries each: the curve's last point
    target = next((c for c in curve if c["impl"] == "after" and c["servers"] == 256
                   and c["prompts_per_server"] == TARGET_PROMPTS), None)
    targets = []
    if target is not None:
        for name, value, goal, higher in (
                ("bytes per entry (RSS) at 256 x 10,000", target["rss_bytes_per_entry"],
                 GOALS["bytes_per_entry"], False),
                ("longest p99 at 256 x 10,000", target["longest_us"]["p99"],
                 GOALS["longest_p99_us"], False),
                ("ingestion from events at 256 x 10,000", target["ingest_entries_per_s"],
                 GOALS["ingest_entries_per_s"], True)):
            targets.append({"target": name, "value": value, "goal": goal,
                            "unit": {False: "B" if "bytes" in name else "us", True: "1/s"}[higher],
                            "higher_is_better": higher,
                            "met": value >= goal if higher else value <= goal})
    doc = {
        "kind": "index",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "python benchmarks/bench_index.py " + " ".join(sys.argv[1:]),
        "workload": {"chunk": C, "chunks_per_prompt": CHUNKS, "shared_first_chunks": SHARED,
                     "vocab": VOCAB, "curve_prompts_per_server": per_server,
                     "queries": args.queries, "removes": args.removes, "seed": args.seed,
                     "before": BEFORE},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform(), "loadavg_after": list(os.getloadavg())},
        "curve": curve,
        "skipped": skipped,
        "target_point": target,
        "targets": targets,
        "wall_s": time.monotonic() - t_start,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
