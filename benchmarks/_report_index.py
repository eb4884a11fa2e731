"""The report's section on the fleet's prefix index (``benchmarks/bench_index.py``).

A table of every measured point (the index now and, where the run measured it, the
index before the rewrite), the targets, and ``docs/benchmarks-index.png``: bytes per
(server, chunk) entry and ``longest`` latency against fleet size, log x axis.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _report_format import table

INDEX_PNG = "benchmarks-index.png"
#: how the page names each implementation in ``index.json``
IMPL_LABEL = {"after": "now", "before": "before"}
_COLORS = {"after": "#2e6ebe", "before": "#e68c28"}
_UNITS = {"us": "µs", "1/s": "entries/s"}


def index_points(ix: dict[str, Any]) -> list[dict[str, Any]]:
    """The measured points, the index now first, each by fleet size.

    A result file from before the curve ran at 10,000 entries per server holds the
    256-server point only as ``target_point``; it is counted once either way."""
    points = list(ix.get("curve") or [])
    tp = ix.get("target_point")
    ident = [(p["impl"], p["servers"], p["prompts_per_server"]) for p in points]
    if tp and (tp["impl"], tp["servers"], tp["prompts_per_server"]) not in ident:
        points.append(tp)
    order = {impl: i for i, impl in enumerate(IMPL_LABEL)}
    return sorted(points, key=lambda p: (order.get(p["impl"], len(order)), p["servers"]))


def _us(v: float) -> str:
    return f"{v:,.0f}" if v >= 10 else f"{v:.1f}"


def index_md(ix: dict[str, Any]) -> list[str]:
    points = index_points(ix)
    w = ix.get("workload", {})
    m = ix.get("machine", {})
    before = w.get("before", "?")
    prompts = sorted({p["prompts_per_server"] for p in points})
    lines = [
        "## Prefix index at router scale (`benchmarks/bench_index.py`)",
        "",
        f"One run on {ix.get('date', '?')}, one process per point, no server: a synthetic "
        f"fleet whose servers each hold {' or '.join(f'{n:,}' for n in prompts)} prompts of "
        f"{w.get('chunks_per_prompt', '?')} chunks of {w.get('chunk', '?')} tokens, the first "
        f"chunk one of {w.get('shared_first_chunks', '?')} shared ones, fed as `KVStored` "
        "records through `PrefixIndex.add_event` with real BLAKE3 hashes (computed outside "
        "the clock). An *entry* is one (server, chunk) pair. Memory is the RSS growth of "
        "the build and, in a second process, what tracemalloc counts; *build* is entries per "
        f"second inside `add_event`; `longest` runs over every server for {w.get('queries', '?')} "
        "queries (full and partial hits, a shared first chunk only, misses); *remove* drops "
        "one prompt's own chunks per call and *discard* a whole server (a tenth of them), both "
        "as the median per call of microseconds per entry removed. *before* is the index "
        f"of commit {before}, loaded from git for this comparison, on the same queries.",
        "",
    ]
    rows = []
    for p in points:
        lat = p["longest_us"]
        traced = p.get("traced_bytes_per_entry")
        rows.append([
            IMPL_LABEL.get(p["impl"], p["impl"]), str(p["servers"]), f"{p['entries']:,}",
            f"{p['rss_bytes_per_entry']:,.0f}", "-" if traced is None else f"{traced:,.0f}",
            f"{p['ingest_entries_per_s']:,.0f}", f"{_us(lat['p50'])} / {_us(lat['p99'])}",
            f"{p['remove_us_per_entry_p50']:.2f}", f"{p['discard_us_per_entry_p50']:.2f}"])
    lines += table(["index", "servers", "entries", "B/entry (RSS)", "B/entry (tracemalloc)",
                    "build (entries/s)", "`longest` p50 / p99 (µs)", "remove (µs/entry)",
                    "discard (µs/entry)"], rows)
    lines += comparison_md(points, before)
    for s in ix.get("skipped", []):
        lines += [f"Not measured: the index {IMPL_LABEL.get(s['impl'], s['impl'])} at "
                  f"{s['servers']} servers ({s['reason']}).", ""]
    ts = ix.get("targets", [])
    if ts:
        lines += ["### Targets", ""]
        lines += table(["target", "goal", "this run", ""], [
            [t["target"], f"{'>=' if t['higher_is_better'] else '<='} {t['goal']:,.0f} "
             f"{_UNITS.get(t['unit'], t['unit'])}",
             f"{t['value']:,.0f} {_UNITS.get(t['unit'], t['unit'])}",
             "met" if t["met"] else "**missed**"] for t in ts])
    lines += [f"Machine of the run: {m.get('cpus')} CPUs, Python {m.get('python')}, "
              f"{m.get('platform')}; wall time {ix.get('wall_s', 0):.0f} s.", "",
              f"Reproduce: `{ix.get('command', '?').strip()}`", ""]
    return lines


def comparison_md(points: list[dict[str, Any]], before: str) -> list[str]:
    """Now against before where both ran, and whether their answers agreed."""
    now = {p["servers"]: p for p in points if p["impl"] == "after"}
    old = {p["servers"]: p for p in points if p["impl"] == "before"}
    both = sorted(set(now) & set(old))
    wrong = sum(p.get("wrong_answers", 0) for p in points)
    out = [f"Answers that differ from what the workload stored: {wrong}, all points "
           "together."]
    if both:
        n, o = now[both[-1]], old[both[-1]]
        same = all(now[s].get("same_answers") for s in both)
        out[0] += (f" The index now and the index of {before} gave "
                   + ("identical answers to the same queries at every point both ran."
                      if same else "**different answers** at some point (see `same_answers`)."))
        out.append(
            f"At {both[-1]} servers the index now takes "
            f"{o['rss_bytes_per_entry'] / n['rss_bytes_per_entry']:.1f}x less memory per entry "
            f"(RSS), builds {n['ingest_entries_per_s'] / o['ingest_entries_per_s']:.2f}x as "
            f"fast and answers `longest` at p99 in "
            f"{n['longest_us']['p99'] / o['longest_us']['p99']:.2f}x the time of before.")
    return [" ".join(out), ""]


def draw_index(ix: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import (
        FixedLocator,
        FuncFormatter,
        LogLocator,
        NullFormatter,
        NullLocator,
    )

    points = index_points(ix)
    goals = {t["unit"]: t["goal"] for t in ix.get("targets", [])}
    fig, (mem, lat) = plt.subplots(1, 2, figsize=(10, 4.4), layout="constrained")
    sizes = sorted({p["servers"] for p in points})
    for impl, label in IMPL_LABEL.items():
        pts = [p for p in points if p["impl"] == impl]
        if not pts:
            continue
        xs = [p["servers"] for p in pts]
        color = _COLORS[impl]
        rss = [p["rss_bytes_per_entry"] for p in pts]
        mem.plot(xs, rss, "o-", color=color, label=f"{label}: RSS")
        traced = [(p["servers"], p["traced_bytes_per_entry"]) for p in pts
                  if "traced_bytes_per_entry" in p]
        if traced:
            mem.plot(*zip(*traced, strict=True), "s--", color=color, alpha=0.7,
                     label=f"{label}: tracemalloc")
        # the index now is the lower curve in both panels, with its p50 and tracemalloc
        # lines close under it: its labels go to the right of the points, before's above
        off, ha = ((7, 3), "left") if impl == "after" else ((0, 7), "center")
        for xv, v in zip(xs, rss, strict=True):
            mem.annotate(f"{v:,.0f}", (xv, v), textcoords="offset points", xytext=off,
                         ha=ha, fontsize=8)
        p99 = [p["longest_us"]["p99"] for p in pts]
        lat.plot(xs, p99, "o-", color=color, label=f"{label}: p99")
        lat.plot(xs, [p["longest_us"]["p50"] for p in pts], "^:", color=color, alpha=0.7,
                 label=f"{label}: p50")
        for xv, v in zip(xs, p99, strict=True):
            lat.annotate(f"{v:,.0f}", (xv, v), textcoords="offset points", xytext=off,
                         ha=ha, fontsize=8)
    for ax, unit, name in ((mem, "B", "bytes per (server, chunk) entry"),
                           (lat, "us", "`longest` over every server (µs)")):
        if unit in goals:
            ax.axhline(goals[unit], color="#c82828", linestyle="--", linewidth=1,
                       label=f"target {goals[unit]:,.0f}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(FixedLocator(sizes))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:.0f}"))
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.0f}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlim(sizes[0] / 1.5, sizes[-1] * 1.5)
        ax.set_xlabel("simulated servers (log scale)", fontsize=9)
        ax.set_title(name.replace("`", ""), fontsize=10, loc="left")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="best")
    for ax in (mem, lat):
        ax.margins(y=0.15)
    w = ix.get("workload", {})
    per = points[0]["entries"] / points[0]["servers"] if points else 0
    fig.suptitle(f"Fleet prefix index, about {per:,.0f} entries per server "
                 f"(chunk {w.get('chunk', '?')}), log axes", fontsize=10, x=0.01,
                 ha="left")
    fig.savefig(path, dpi=110)
    plt.close(fig)
