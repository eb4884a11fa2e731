"""The report's charts of same-run ratios: lmkv_async vs the SDK, and the copy kernel.

Ratios are drawn on log axes (2x faster and 2x slower are the same distance from
1x) with the p10-p90 spread of the runs as error bars (see ``report.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _report_format import spread

PATHS = ["gather", "scatter", "pack", "unpack", "paged->chunks", "chunks->paged"]


class Ratio:
    """One bar of a chart: a same-run ratio (>1: lmkv_async / C faster) and its spread."""

    def __init__(self, label: str, value: float, sp: tuple[float, float] | None,
                 group: str, goal: float | None = None) -> None:
        self.label, self.value, self.spread, self.group, self.goal = label, value, sp, group, goal


def best_sdk(lk: dict[str, Any]) -> dict[str, Any]:
    """The faster of the SDK's 1- and 8-thread lookup runs (what "vs best SDK" means)."""
    runs = [lk[k] for k in ("sdk_threads_1", "sdk_threads_8") if lk.get(k, {}).get("n")]
    return max(runs, key=lambda s: s["median"]) if runs else {}


def e2e_ratios(e: dict[str, Any]) -> list[Ratio]:
    """The e2e ratios, each with the spread of its runs (latency: SDK/lmkv; rates: lmkv/SDK)."""
    r = e.get("results", {})
    goals: dict[str, float] = {}
    for t in e.get("targets", []):
        name = t.get("target", "")
        if t.get("unit") == "x" and t.get("higher_is_better"):
            goals[name] = float(t["goal"])

    def goal_for(*words: str) -> float | None:
        return next((g for n, g in goals.items() if all(w in n for w in words)), None)

    out: list[Ratio] = []
    for w in r.get("store", {}).get("rows", []):
        out.append(Ratio(f"store T={w['T']}", w["speedup"], spread(w["sdk"], w["lmkv"]),
                         "latency", goal_for("store", f"T={w['T']}")))
    for w in r.get("retrieve", {}).get("rows", []):
        out.append(Ratio(f"retrieve T={w['T']}", w["speedup"], spread(w["sdk"], w["lmkv"]),
                         "latency"))
        out.append(Ratio(f"retrieve(out=) T={w['T']}", w["speedup_out"],
                         spread(w["sdk"], w["lmkv_out"]), "latency",
                         goal_for("retrieve", f"T={w['T']}", "out=")))
    f = r.get("fanout")
    if f:
        sdk = f["sdk_sequential"]
        out.append(Ratio(f"fan-out {f['N']}x, outs=", f["ratio_with_outs"],
                         spread(f["lmkv_with_outs"], sdk), "throughput",
                         goal_for("fan-out", "caller buffers")))
        out.append(Ratio(f"fan-out {f['N']}x, no outs", f["ratio_no_outs"],
                         spread(f["lmkv_no_outs"], sdk), "throughput",
                         goal_for("fan-out", "no buffers")))
    lk = r.get("lookup")
    if lk:
        for k in (8, 64):
            out.append(Ratio(f"lookup, {k} in flight", lk[f"ratio_{k}_vs_best_sdk"],
                             spread(lk[f"lmkv_{k}"], best_sdk(lk)), "throughput"))
    sk = r.get("soak")
    if sk:
        for t in (1, 8):
            out.append(Ratio(f"mixed, vs SDK {t} thread{'s' if t > 1 else ''}",
                             sk[f"ratio_vs_sdk_{t}"],
                             spread(sk["lmkv_64"], sk[f"sdk_threads_{t}"]), "throughput"))
    return out


def _log_ratio_axis(ax: Any, values: Sequence[float], *, vertical: bool,
                    headroom: float = 1.3) -> None:
    """A log2 axis spanning ``values`` and 1x, ticks labelled as ratios."""
    import math

    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    lo = min([1.0, *values]) / 1.3
    hi = max([1.0, *values]) * headroom
    # a narrow range gets ticks at quarter or half powers of two
    step = 0.25 if hi / lo < 3 else 0.5 if hi / lo < 8 else 1.0
    k0, k1 = math.floor(math.log2(lo) / step), math.ceil(math.log2(hi) / step)
    ticks = [2.0 ** (k * step) for k in range(k0, k1 + 1)]
    axis = ax.yaxis if vertical else ax.xaxis
    (ax.set_yscale if vertical else ax.set_xscale)("log", base=2)
    (ax.set_ylim if vertical else ax.set_xlim)(lo, hi)
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_minor_locator(NullLocator())
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:.3g}x"))
    (ax.axhline if vertical else ax.axvline)(1.0, color="black", linewidth=1)


def _errors(items: Sequence[Ratio]) -> tuple[list[float], list[float]]:
    """matplotlib's asymmetric error lengths; 0 where a result file kept no samples."""
    below = [max(0.0, r.value - r.spread[0]) if r.spread else 0.0 for r in items]
    above = [max(0.0, r.spread[1] - r.value) if r.spread else 0.0 for r in items]
    return below, above


def draw_e2e(ratios: list[Ratio], e: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    colors = {"latency": "#2e6ebe", "throughput": "#e68c28"}
    n = len(ratios)
    fig, ax = plt.subplots(figsize=(9, 0.38 * n + 1.9), layout="constrained")
    ys = list(range(n))[::-1]
    ax.barh(ys, [r.value - 1.0 for r in ratios], left=1.0, height=0.6,
            color=[colors[r.group] for r in ratios], alpha=0.35)
    below, above = _errors(ratios)
    ax.errorbar([r.value for r in ratios], ys, xerr=[below, above], fmt="o", color="black",
                ecolor="black", elinewidth=1.2, capsize=3, markersize=4, zorder=3)
    for y, r in zip(ys, ratios, strict=True):
        if r.goal:
            ax.plot([r.goal], [y], marker="|", markersize=16, markeredgewidth=2, color="#c82828",
                    zorder=4)
    spans = [v for r in ratios
             for v in (r.value, *(r.spread or ()), *((r.goal,) if r.goal else ()))]
    _log_ratio_axis(ax, spans, vertical=False, headroom=1.8)  # room for the labels
    for y, r in zip(ys, ratios, strict=True):
        right = max(r.value, r.spread[1] if r.spread else r.value, r.goal or 0.0)
        ax.text(right * 1.06, y, f"{r.value:.2f}x", va="center", fontsize=8)
    ax.set_yticks(ys, [r.label for r in ratios], fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    srv = e.get("server", {})
    g = e.get("geometry", {})
    ax.set_title(f"lmkv_async vs the official lmcache SDK, lmcache {srv.get('version', '?')}, "
                 f"L={g.get('L')} NH={g.get('NH')} HS={g.get('HS')} {g.get('dtype')}",
                 fontsize=10, loc="left")
    ax.set_xlabel("same-run ratio, log scale (> 1x: lmkv_async faster); "
                  f"bars: p10-p90 over the runs ({e.get('reps')} reps each side)", fontsize=9)
    ax.legend(handles=[
        Line2D([], [], color=colors["latency"], lw=6, alpha=0.5, label="latency: SDK / lmkv"),
        Line2D([], [], color=colors["throughput"], lw=6, alpha=0.5,
               label="throughput: lmkv / SDK"),
        Line2D([], [], color="#c82828", marker="|", lw=0, markersize=12, markeredgewidth=2,
               label="target"),
    ], loc="lower right", fontsize=8, framealpha=0.9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_kernel(k: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    results = k.get("results", [])
    Ts = [res["T"] for res in results]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.4), layout="constrained")
    width = 0.8 / max(1, len(Ts))
    cmap = plt.get_cmap("viridis")
    speedups: list[float] = []
    vs_stream: list[float] = []
    for j, res in enumerate(results):
        xs = [i + (j - (len(Ts) - 1) / 2) * width for i in range(len(PATHS))]
        color = cmap(j / max(1, len(Ts) - 1) * 0.85)
        ratio, low, high = [], [], []
        for p in PATHS:
            c, t = res.get(p, {}).get("c"), res.get(p, {}).get("torch")
            v = c / t if c and t else float("nan")
            # per-run times, when the result file has them (bench_kernel.py writes c_s/torch_s)
            sp = spread(res.get(p, {}).get("torch_s"), res.get(p, {}).get("c_s"))
            ratio.append(v)
            low.append(max(0.0, v - sp[0]) if sp else 0.0)
            high.append(max(0.0, sp[1] - v) if sp else 0.0)
        speedups += [v for v in ratio if v == v]
        # bars grow from 1x, so a ratio below 1x points down
        top.bar(xs, [v - 1.0 for v in ratio], bottom=1.0, width=width * 0.9, color=color,
                label=f"T={res['T']}")
        if any(low) or any(high):
            top.errorbar(xs, ratio, yerr=[low, high], fmt="none", ecolor="black",
                         elinewidth=1, capsize=2)
        st = [res.get(p, {}).get("c_vs_stream", float("nan")) for p in PATHS]
        runs = [res.get(p, {}).get("c_vs_stream_runs") for p in PATHS]
        lo2 = [max(0.0, v - r["p10"]) if r else 0.0 for v, r in zip(st, runs, strict=True)]
        hi2 = [max(0.0, r["p90"] - v) if r else 0.0 for v, r in zip(st, runs, strict=True)]
        vs_stream += [v for v in st if v == v]
        bottom.bar(xs, [v - 1.0 for v in st], bottom=1.0, width=width * 0.9, color=color,
                   label=f"T={res['T']}")
        if any(lo2) or any(hi2):
            bottom.errorbar(xs, st, yerr=[lo2, hi2], fmt="none", ecolor="black",
                            elinewidth=1, capsize=2)
    has_spread = any(res.get(p, {}).get("c_s") for res in results for p in PATHS)
    note = ("error bars: p10-p90 over the runs" if has_spread else
            "no error bars: this result file keeps medians only (bench_kernel.py now "
            "records every run)")
    for ax, values, title in (
            (top, speedups, "C kernel vs the torch fallback (GB/s ratio, > 1x: C faster)"),
            (bottom, vs_stream, "C kernel vs a streaming copy of the same bytes, same run "
                                "(1x: the machine's copy ceiling)")):
        _log_ratio_axis(ax, values, vertical=True)
        ax.set_xticks(range(len(PATHS)), PATHS, fontsize=9)
        ax.set_title(title, fontsize=10, loc="left")
        ax.grid(axis="y", alpha=0.3)
    top.legend(fontsize=8, ncols=len(Ts), loc="upper right")
    g = k.get("geometry", {})
    m = k.get("machine", {})
    bottom.set_xlabel(f"L={g.get('L')} NH={g.get('NH')} HS={g.get('HS')} {g.get('dtype')}, "
                      f"median of {k.get('reps')} reps, {m.get('kernel_threads')} kernel "
                      f"threads, {m.get('cpus')} CPUs; log scale\n{note}", fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)
