"""Turn benchmark results into ``docs/benchmarks.md`` and its charts.

Reads whichever of ``benchmarks/results/kernel.json`` (``bench_kernel.py``),
``e2e.json`` (``bench_e2e.py``), ``small.json`` (``bench_small.py``) and
``index.json`` (``bench_index.py``) exist, and writes the page with matplotlib
charts next to it (extra ``lmkv_async[bench]``)::

    docs/benchmarks-e2e.png      lmkv_async vs the official SDK, same-run ratios
    docs/benchmarks-kernel.png   the C copy kernel vs the torch fallback and vs a streaming copy
    docs/benchmarks-index.png    the fleet's prefix index: bytes per entry and p99 by fleet size

Ratios are drawn on log axes (2x faster and 2x slower are the same distance from
1x) with the spread of the runs as p10-p90 error bars: for a ratio of two
measured quantities that is the p10/p90 of every ratio of one run of each (the
result files keep the samples), so the bar shows how far the ratio moves when a
single pair of runs is compared; the marker is the ratio of the medians, the
number the tables print.

This module writes the page and the sections of ``bench_e2e``, ``bench_small`` and
``bench_kernel``; ``_report_format.py`` holds the number and table formatting,
``_report_charts.py`` the ratio charts, ``_report_index.py`` the index section.

    python benchmarks/report.py [--results DIR] [--md PATH] [--charts DIR]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# (same directory; _common puts the source tree on sys.path for lmkv_async)
from _common import cpu_model  # noqa: E402
from _report_charts import best_sdk, draw_e2e, draw_kernel, e2e_ratios  # noqa: E402
from _report_format import load, ms, num, spread, table, x  # noqa: E402
from _report_index import INDEX_PNG, draw_index, index_md  # noqa: E402

__all__ = ["e2e_md", "e2e_ratios", "kernel_md", "main", "small_md", "spread", "x"]

E2E_PNG = "benchmarks-e2e.png"
KERNEL_PNG = "benchmarks-kernel.png"

# ----------------------------------------------------------------------------- markdown


def kernel_md(k: dict[str, Any]) -> list[str]:
    g = k.get("geometry", {})
    m = k.get("machine", {})
    lines = [
        "## Copy kernel (`benchmarks/bench_kernel.py`)",
        "",
        f"Geometry L={g.get('L')} NH={g.get('NH')} HS={g.get('HS')} {g.get('dtype')} "
        f"BS={g.get('BS')} chunk={g.get('C')}; median of {k.get('reps')} reps; "
        f"{m.get('kernel_threads')} kernel threads, torch {m.get('torch')}, "
        f"{m.get('cpus')} CPUs. GB/s = payload bytes / median time (destinations "
        "pre-touched). `c/stream` compares with a same-run `stream_copy` of the same "
        "bytes (the machine's streaming ceiling); `c/torch` is the speed-up over the "
        "torch fallback.",
        "",
    ]
    paths = ["gather", "scatter", "pack", "unpack", "paged->chunks", "chunks->paged"]
    rows = []
    for r in k.get("results", []):
        ref = r.get("stream_copy")
        rows.append([str(r["T"]), f"{r['bytes'] / 2**20:.0f}", "stream_copy",
                     f"{ref:.2f}", "", "1.00", ""])
        for p in paths:
            c, t = r.get(p, {}).get("c"), r.get(p, {}).get("torch")
            rows.append([str(r["T"]), f"{r['bytes'] / 2**20:.0f}", p,
                         "-" if c is None else f"{c:.2f}", "-" if t is None else f"{t:.2f}",
                         "-" if c is None or not ref else f"{c / ref:.2f}",
                         "-" if c is None or not t else x(c / t)])
    lines += table(["T", "MiB", "path", "C GB/s", "torch GB/s", "c/stream", "c/torch"], rows)
    cliff = k.get("alloc_cliff")
    if cliff:
        lines += [f"Allocate + copy into fresh memory (T={cliff['T']}): "
                  + ", ".join(f"`{n}` {v:.2f} GB/s" for n, v in cliff["GBps"].items()), ""]
    lines += [f"Command: `{k.get('command', '?')}`", ""]
    return lines


def e2e_md(e: dict[str, Any]) -> list[str]:
    r = e.get("results", {})
    g = e.get("geometry", {})
    srv = e.get("server", {})
    sdk = e.get("sdk", {})
    lines = [
        "## End to end: lmkv_async vs the official lmcache SDK (`benchmarks/bench_e2e.py`)",
        "",
        f"One run on {e.get('date')}: lmcache {srv.get('version')} server "
        f"({srv.get('flags')}, L1 {srv.get('l1_size_gb')} GiB), lmcache-driven registration "
        f"of L={g.get('L')} NH={g.get('NH')} HS={g.get('HS')} {g.get('dtype')} BS={g.get('BS')}, "
        f"chunk {g.get('C')} tokens ({g.get('token_bytes', 0) // 1024} KiB of KV per token: "
        "T=4096 is 512 MiB, T=16384 is 2 GiB). Both clients move the same bytes: "
        "`[2, L, T, D]` bf16. SDK: lmcache "
        f"{sdk.get('lmcache_version')} `lmcache.sdk.kvcache`, driven by "
        "`benchmarks/sdk_peer.py` in the server's Python, one job per section, while "
        f"lmkv_async is idle. Median of {e.get('reps')} reps (p10-p90 in brackets); "
        "ratios are same-run medians. Quick run: "
        f"{'yes' if e.get('quick') else 'no'}.",
        "",
        "Method notes: the SDK process gets its SHM pool mapping pre-faulted once at "
        "connect (what lmkv_async does at connect, and where a long-lived SDK process "
        "ends up); the *SDK cold* rows show a fresh SDK process without it. lmkv_async's "
        "latencies exclude its background release steps (it answers before "
        "`end_session`); the throughput sections wait for them inside the clock. lmkv "
        "samples are split before/after each SDK job so load drift hits both.",
        "",
    ]
    if "store" in r:
        lines += ["### Store latency (ms)", ""]
        rows = [[str(w["T"]), f"{w['bytes'] / 2**20:.0f}", ms(w["sdk"]), ms(w["lmkv"]),
                 x(w["speedup"], spread(w["sdk"], w["lmkv"]))] for w in r["store"]["rows"]]
        lines += table(["T", "MiB", "SDK `store`", "lmkv `store`", "SDK / lmkv"], rows)
    if "retrieve" in r:
        lines += ["### Retrieve latency (ms)", ""]
        rows = [[str(w["T"]), f"{w['bytes'] / 2**20:.0f}", ms(w["sdk"]), ms(w["lmkv"]),
                 ms(w["lmkv_out"]), x(w["speedup"], spread(w["sdk"], w["lmkv"])),
                 x(w["speedup_out"], spread(w["sdk"], w["lmkv_out"]))]
                for w in r["retrieve"]["rows"]]
        lines += table(["T", "MiB", "SDK `retrieve`", "lmkv `retrieve`",
                        "lmkv `retrieve(out=)`", "SDK / lmkv", "SDK / lmkv out="], rows)
        be = r["retrieve"].get("bit_exact", {})
        lines += [f"Bit-exact (lmkv retrieve == stored tensor): "
                  f"{'all' if be and all(be.values()) else 'NO'} of {len(be)} checks.", ""]
    if "sdk_cold" in r:
        c = r["sdk_cold"]
        lines += [f"SDK cold (fresh process, no pre-faulted mapping), T={c['T']}: store "
                  f"{ms(c.get('sdk_cold_store'))} ms, retrieve {ms(c.get('sdk_cold_retrieve'))} "
                  "ms.", ""]
    if "fanout" in r:
        f = r["fanout"]
        lines += [f"### Fan-out: {f['N']} distinct prefixes of T={f['T']} (prefixes/s)", ""]
        lines += table(["client", "prefixes/s", "vs SDK"], [
            ["SDK, one after another", num(f["sdk_sequential"]), "1.00x"],
            [f"lmkv `retrieve_many`, {f['N']} in flight, caller buffers (`outs=`)",
             num(f["lmkv_with_outs"]),
             x(f["ratio_with_outs"], spread(f["lmkv_with_outs"], f["sdk_sequential"]))],
            [f"lmkv `retrieve_many`, {f['N']} in flight, no buffers",
             num(f["lmkv_no_outs"]),
             x(f["ratio_no_outs"], spread(f["lmkv_no_outs"], f["sdk_sequential"]))],
            ["lmkv one after another, caller buffers", num(f["lmkv_sequential"]),
             x(f["ratio_sequential"], spread(f["lmkv_sequential"], f["sdk_sequential"]))],
        ])
    if "lookup" in r:
        lk = r["lookup"]
        lines += [f"### Lookup throughput, T={lk['T']} hit (lookups/s)", ""]
        rows = [[f"SDK, {t} thread(s)", num(lk[f"sdk_threads_{t}"]), ""] for t in (1, 8)]
        rows += [[f"lmkv, {k} in flight on one context", num(lk[f"lmkv_{k}"]),
                  x(lk[f"ratio_{k}_vs_best_sdk"], spread(lk[f"lmkv_{k}"], best_sdk(lk)))]
                 for k in (1, 8, 64)]
        lines += table(["client", "lookups/s", "vs best SDK"], rows)
    if "soak" in r:
        sk = r["soak"]
        mix = sk.get("mix", {})
        lines += [f"### Mixed soak, T={sk['T']}, {sk['ops_per_rep']} ops per rep "
                  f"({mix.get('store')} store / {mix.get('retrieve')} retrieve / "
                  f"{mix.get('lookup')} lookup) (ops/s)", ""]
        lines += table(["client", "ops/s", "lmkv / this"], [
            ["lmkv, 64 in flight, one context", num(sk["lmkv_64"]), ""],
            ["SDK, 1 thread", num(sk["sdk_threads_1"]),
             x(sk["ratio_vs_sdk_1"], spread(sk["lmkv_64"], sk["sdk_threads_1"]))],
            ["SDK, 8 threads (a context each)", num(sk["sdk_threads_8"]),
             x(sk["ratio_vs_sdk_8"], spread(sk["lmkv_64"], sk["sdk_threads_8"]))],
        ])
        lines += ["Retrieves of the same prefix in this mix are serialised by lmkv_async "
                  "itself (lmcache 0.5.6 keys pending SHM reads by a key that ignores the "
                  "request id, so two in flight on one context would leak read locks); the "
                  "SDK threads each have their own context.", ""]
    if "looplag" in r:
        ll = r["looplag"]
        i = ll["idle"]
        lines += ["### Event-loop lag while awaiting a retrieve (1 ms ticker, ms)", "",
                  f"Idle ticker on this machine: max gap {ms(i['max'])} ms "
                  f"(worst {i['worst'] * 1e3:.2f} ms, p99 {i['p99'] * 1e3:.2f} ms).", ""]
        rows = []
        for w in ll["rows"]:
            rows.append([str(w["T"]), f"{w['bytes'] / 2**20:.0f}",
                         w["variant"] + (" (diagnostic)" if w.get("diagnostic") else ""),
                         ms(w["retrieve_s"]),
                         f"{w['max']['median'] * 1e3:.2f}", f"{w['worst'] * 1e3:.2f}",
                         f"{w['p99'] * 1e3:.2f}"])
        lines += table(["T", "MiB", "variant", "retrieve ms", "max gap (median of reps)",
                        "max gap (worst rep)", "p99 gap"], rows)
    if "sockets" in r:
        sc = r["sockets"]
        lines += ["### Socket pool: 32 in flight (16 retrieves + 16 stores, T=1024), ops/s", ""]
        rows = []
        for w in sc["rows"]:
            rows.append([w["server"]] + [
                f"{num(w[f'sockets_{s}'])} ({w[f'ratio_{s}_vs_1']:.2f}x)" for s in (1, 2, 4)])
        lines += table(["server", "sockets=1", "sockets=2", "sockets=4"], rows)
    ts = e.get("targets", [])
    if ts:
        lines += ["### Targets", ""]
        rows = []
        for t in ts:
            op = ">=" if t["higher_is_better"] else "<="
            v = "-" if t["value"] is None else f"{t['value']:.2f} {t['unit']}"
            verdict = {True: "met", False: "**missed**", None: "not run"}[t["met"]]
            rows.append([t["target"], f"{op} {t['goal']:g} {t['unit']}", v, verdict])
        lines += table(["target", "goal", "this run", ""], rows)
    lines += notes_md(r)
    locks = {k: v.get("server_read_locks_after") for k, v in r.items()
             if isinstance(v, dict) and "server_read_locks_after" in v}
    if locks:
        lines += ["L1 objects still read-locked on the server after each section (leak "
                  "check): " + ", ".join(f"{k} {v}" for k, v in locks.items()) + ".", ""]
    if e.get("errors"):
        lines += ["Sections that failed: " + ", ".join(
            f"`{k}`: {v}" for k, v in e["errors"].items()), ""]
    m = e.get("machine", {})
    lines += [f"Machine of the run: {m.get('nproc')} CPUs, {m.get('cpu_model')}, "
              f"{m.get('platform')}, torch {m.get('torch')}, Python {m.get('python')}; "
              f"wall time {e.get('wall_s', 0):.0f} s.", "",
              f"Reproduce: `cd {e.get('cwd', ROOT)} && {e.get('command', '?')}`", ""]
    return lines


def small_md(sm: dict[str, Any]) -> list[str]:
    """Small transfers, the zero-copy view, lookups and loop lag (bench_small.py)."""
    r = sm["results"]
    srv = sm.get("server", {})
    g = sm.get("geometry", {})
    lines = [
        "## Small transfers, views and lookups (`benchmarks/bench_small.py`)",
        "",
        f"lmcache {srv.get('version', '?')} with SHM, L={g.get('L', '?')} NH={g.get('NH', '?')} "
        f"HS={g.get('HS', '?')} {g.get('dtype', '?')}, chunk {g.get('C', '?')}, "
        f"{sm.get('reps', '?')} reps, {sm.get('date', '')}. A *bare floor* is a blocking "
        "pyzmq client in the same process sending the same RPCs (and, for store and "
        "retrieve, running the same C kernel copy) with nothing around them: what the "
        "protocol and the server cost by themselves.",
        "",
    ]
    cp = r.get("copy", {}).get("rows", [])
    if cp:
        lines += ["### Store and retrieve(out=) against a copy of the same bytes", "",
                  "Times in ms; a ratio is the copy's time over the operation's, against "
                  "torch `copy_` / against the kernel's `stream_copy` (goal: 0.8 for both).",
                  ""]

        def two(w: dict[str, Any], op: str) -> str:
            a, b = w.get(f"{op}_vs_copy_"), w.get(f"{op}_vs_stream_copy")
            return "-" if a is None or b is None else f"**{a:.2f}** / {b:.2f}"

        rows = []
        for w in cp:
            rows.append([f"{w['T']} ({w['bytes'] >> 20} MiB)", ms(w["copy_"]),
                         ms(w["stream_copy"]), ms(w["store"]), two(w, "store"),
                         ms(w.get("floor_store")), two(w, "floor_store"),
                         ms(w["retrieve_out"]), two(w, "retrieve_out"),
                         ms(w.get("floor_retrieve_out")), two(w, "floor_retrieve_out")])
        lines += table(["T", "torch copy_", "stream_copy", "store", "ratios", "bare floor",
                        "ratios", "retrieve(out=)", "ratios", "bare floor", "ratios"], rows)
    v = r.get("view")
    if v and v.get("rows"):
        lines += ["### `retrieve_view` latency (ms)", ""]
        lines += table(["T", "MiB", "retrieve_view", "bare RPC floor", "view / floor"],
                       [[str(w["T"]), str(w["bytes"] >> 20), ms(w["view"]), ms(w.get("floor")),
                         f"{w['view_over_floor']:.2f}" if "view_over_floor" in w else "-"]
                        for w in v["rows"]])
        if "floor_max_over_min" in v:
            lines += [f"Largest over smallest median: the view {v['max_over_min']:.2f}, the "
                      f"bare floor {v['floor_max_over_min']:.2f} (the server's per-chunk "
                      "lookup and prepare work grows with T).", ""]
    lk = r.get("lookup")
    if lk:
        lines += [f"### Lookups, T={lk['T']} hit (lookups/s)", ""]
        rows = [["one at a time", num(lk["seq_lmkv"], "{:.0f}"), num(lk["seq_floor"], "{:.0f}"),
                 "-"]]
        if "lmkv_64" in lk:
            rows.append(["64 in flight", num(lk["lmkv_64"], "{:.0f}"),
                         num(lk.get("floor_64"), "{:.0f}"),
                         num(lk.get("sdk_threads_8"), "{:.0f}")])
        lines += table(["mode", "lmkv_async", "bare floor", "SDK, 8 threads"], rows)
        lines += ["Where the client's time per lookup goes: `python benchmarks/profile_lookup.py` "
                  "(py-spy samples of the event-loop thread, sorted into send, receive, release "
                  "steps, op set-up and idle).", ""]
    lag = r.get("looplag", {}).get("rows", [])
    if lag:
        idle = r["looplag"].get("idle_max_gap")
        lines += ["### Event-loop lag during a 512 MiB retrieve (1 ms ticker, largest gap, ms)",
                  ""]
        if idle:
            lines += [f"The ticker alone, idle: largest gap {ms(idle)} ms (median, p10-p90 "
                      "of reps).", ""]
        lines += table(["variant", "retrieve ms", "largest gap ms (median of reps)"],
                       [[w["variant"], ms(w.get("retrieve_s")),
                         f"{w['max_gap']['median'] * 1e3:.2f}"] for w in lag])
    tg = sm.get("targets", [])
    if tg:
        lines += ["### Targets", ""]
        lines += table(["target", "goal", "this run", ""],
                       [[t["target"], (">= " if t["higher_is_better"] else "<= ")
                         + f"{t['goal']:g}", "-" if t["value"] is None else f"{t['value']:.2f}",
                         "met" if t["met"] else "**missed**"] for t in tg])
    return lines


def notes_md(r: dict[str, Any]) -> list[str]:
    """How to read the run: what bounds each comparison (numbers from the run)."""
    out = ["### Reading these numbers", ""]
    st = {w["T"]: w for w in r.get("store", {}).get("rows", [])}
    cold = r.get("sdk_cold")
    if 4096 in st:
        w = st[4096]
        line = (f"* Store is copy-bound for both clients. The SDK fills SHM slots with torch "
                f"`copy_`, which on this machine runs at about the same memory bandwidth as "
                f"lmkv_async's C kernel, so a warm SDK process stays close "
                f"({w['sdk']['median'] * 1e3:.0f} ms vs {w['lmkv']['median'] * 1e3:.0f} ms "
                f"at T=4096); lmkv_async saves a round trip (`end_session` runs after it "
                f"answers) and some Python per chunk.")
        if cold and cold.get("sdk_cold_store"):
            line += (f" A fresh SDK process without a warm mapping took "
                     f"{cold['sdk_cold_store']['median'] * 1e3:.0f} ms; in other runs on "
                     "this shared machine SDK store times moved 2-4x with load, and the "
                     "store ratio with them.")
        out.append(line)
    if r.get("retrieve"):
        out.append("* Retrieve: the SDK returns `torch.cat` of the slot views, i.e. it "
                   "allocates a fresh tensor per call and pays a 4 KiB page fault per page "
                   "(slow on this VM); lmkv_async copies into pre-faulted memory (its output "
                   "pool, or `out=`), so the ratio grows with T.")
    lag = [w for w in r.get("looplag", {}).get("rows", [])]
    miss = [w for w in lag if "pool miss" in w["variant"]]
    one = [w for w in lag if "1 copy thread" in w["variant"]]
    if lag:
        idle = r["looplag"]["idle"]["max"]["median"] * 1e3
        line = (f"* Loop lag: a 1 ms ticker alone already sees {idle:.1f} ms max gaps here; "
                "during a big copy the kernel's two threads share two cores with the event "
                "loop, so its thread waits for a time slice")
        if one:
            line += (" (with one copy thread: "
                     + ", ".join(f"T={w['T']} {w['max']['median'] * 1e3:.1f} ms" for w in one)
                     + ")")
        out.append(line + ".")
    if miss:
        warm = {w["T"]: w["max"]["median"] for w in lag if w["variant"] == "no out"}
        figures = ", ".join(f"T={w['T']} {w['max']['median'] * 1e3:.1f} ms (worst "
                            f"{w['worst'] * 1e3:.0f} ms)" for w in miss)
        # Say what the figures show instead of a fixed story: the pre-fault moved off
        # the GIL (lmkv_async/memory.py, ctypes madvise) after the first runs of this table.
        blocked = any(w["max"]["median"] > 2 * warm.get(w["T"], float("inf")) for w in miss)
        out.append("* `no out, pool miss` (first retrieve of a size, or after the output pool "
                   "was emptied; the new mapping is pre-faulted on a worker thread with "
                   "`madvise(MADV_POPULATE_WRITE)` through ctypes, which releases the GIL, "
                   "`lmkv_async/memory.py`): " + figures
                   + ("; more than twice the warm pool's gap, so something still holds the "
                      "loop during a pool miss." if blocked else
                      "; within twice the warm pool's gap: the pre-fault does not stall "
                      "the loop."))
    if r.get("sockets"):
        best = max(w[f"ratio_{k}_vs_1"] for w in r["sockets"]["rows"] for k in (2, 4))
        verdict = ("buy nothing measurable" if best < 1.1 else f"help at most {best:.2f}x")
        out.append(f"* Socket pool: on {os.cpu_count()} cores more sockets {verdict} "
                   "(best sockets=2/4 ratio over sockets=1: "
                   f"{best:.2f}x); the server's Python threads and the client's copies "
                   "already share the cores.")
    return [*out, ""]


# ----------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--md", default=str(ROOT / "docs" / "benchmarks.md"))
    ap.add_argument("--charts", default=None,
                    help="directory of the PNGs (default: next to --md)")
    args = ap.parse_args()
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("report.py draws with matplotlib: pip install 'lmkv_async[bench]'"
                         ) from None
    matplotlib.use("Agg")  # files only, no display
    res = Path(args.results)
    kernel = load(res / "kernel.json")
    e2e = load(res / "e2e.json")
    small = load(res / "small.json")
    index = load(res / "index.json")
    if kernel is None and e2e is None:
        raise SystemExit(f"no kernel.json or e2e.json under {res}")
    md_path = Path(args.md)
    charts = Path(args.charts) if args.charts else md_path.parent
    charts.mkdir(parents=True, exist_ok=True)
    md_path.parent.mkdir(parents=True, exist_ok=True)

    def img(name: str, alt: str) -> list[str]:
        return [f"![{alt}]({os.path.relpath(charts / name, md_path.parent)})", ""]

    lines = [
        "# Benchmarks",
        "",
        f"Generated {time.strftime('%Y-%m-%d %H:%M:%S %Z')} by `python benchmarks/report.py` "
        f"on a machine with `nproc` = {os.cpu_count()} ({cpu_model()}). The numbers come "
        "from the result files below; on a small, shared machine absolute numbers move "
        "from run to run, so read the same-run ratios. The charts draw them on log axes; "
        "an error bar spans the p10-p90 of the ratio over every pair of one run of each side "
        "(in the tables, the same spread follows a ratio in brackets).",
        "",
    ]
    written = []
    if e2e is not None:
        ratios = e2e_ratios(e2e)
        body = e2e_md(e2e)
        lines += body[:2] + img(E2E_PNG, "lmkv_async vs the official SDK: same-run ratios") \
            + body[2:]
        draw_e2e(ratios, e2e, charts / E2E_PNG)
        written.append(charts / E2E_PNG)
    if small is not None:
        lines += small_md(small)
    if kernel is not None:
        body = kernel_md(kernel)
        lines += body[:2] + img(KERNEL_PNG, "copy kernel: C vs torch and vs a streaming copy") \
            + body[2:]
        draw_kernel(kernel, charts / KERNEL_PNG)
        written.append(charts / KERNEL_PNG)
    if index is not None and (index.get("curve") or index.get("target_point")):
        body = index_md(index)
        lines += body[:2] + img(INDEX_PNG, "prefix index: bytes per entry and p99 by fleet "
                                "size") + body[2:]
        draw_index(index, charts / INDEX_PNG)
        written.append(charts / INDEX_PNG)
    md_path.write_text("\n".join(lines).rstrip() + "\n")
    print(f"wrote {md_path} and " + ", ".join(str(p) for p in written))


if __name__ == "__main__":
    main()
