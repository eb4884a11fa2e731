"""Turn benchmark results into ``docs/benchmarks.md`` and ``docs/benchmarks.png``.

Reads whichever of ``benchmarks/results/kernel.json`` (``bench_kernel.py``) and
``benchmarks/results/e2e.json`` (``bench_e2e.py``) exist. The PNG is drawn by a
tiny built-in rasteriser (5x7 bitmap font, zlib-compressed RGB), so the report
needs nothing beyond the standard library::

    python benchmarks/report.py [--results DIR] [--md PATH] [--png PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import time
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# ----------------------------------------------------------------------------- helpers


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data


def ms(s: dict[str, Any] | None) -> str:
    if not s or not s.get("n"):
        return "-"
    return f"{s['median'] * 1e3:.1f} ({s['p10'] * 1e3:.1f}-{s['p90'] * 1e3:.1f})"


def num(s: dict[str, Any] | None, fmt: str = "{:.1f}") -> str:
    if not s or not s.get("n"):
        return "-"
    return f"{fmt.format(s['median'])} ({fmt.format(s['p10'])}-{fmt.format(s['p90'])})"


def x(v: float | None) -> str:
    return "-" if v is None else f"**{v:.2f}x**"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---:" if i else ":---" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return [*out, ""]


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
                 x(w["speedup"])] for w in r["store"]["rows"]]
        lines += table(["T", "MiB", "SDK `store`", "lmkv `store`", "SDK / lmkv"], rows)
    if "retrieve" in r:
        lines += ["### Retrieve latency (ms)", ""]
        rows = [[str(w["T"]), f"{w['bytes'] / 2**20:.0f}", ms(w["sdk"]), ms(w["lmkv"]),
                 ms(w["lmkv_out"]), x(w["speedup"]), x(w["speedup_out"])]
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
             num(f["lmkv_with_outs"]), x(f["ratio_with_outs"])],
            [f"lmkv `retrieve_many`, {f['N']} in flight, no buffers",
             num(f["lmkv_no_outs"]), x(f["ratio_no_outs"])],
            ["lmkv one after another, caller buffers", num(f["lmkv_sequential"]),
             x(f["ratio_sequential"])],
        ])
    if "lookup" in r:
        lk = r["lookup"]
        lines += [f"### Lookup throughput, T={lk['T']} hit (lookups/s)", ""]
        rows = [[f"SDK, {t} thread(s)", num(lk[f"sdk_threads_{t}"]), ""] for t in (1, 8)]
        rows += [[f"lmkv, {k} in flight on one context", num(lk[f"lmkv_{k}"]),
                  x(lk[f"ratio_{k}_vs_best_sdk"])] for k in (1, 8, 64)]
        lines += table(["client", "lookups/s", "vs best SDK"], rows)
    if "soak" in r:
        sk = r["soak"]
        mix = sk.get("mix", {})
        lines += [f"### Mixed soak, T={sk['T']}, {sk['ops_per_rep']} ops per rep "
                  f"({mix.get('store')} store / {mix.get('retrieve')} retrieve / "
                  f"{mix.get('lookup')} lookup) (ops/s)", ""]
        lines += table(["client", "ops/s", "lmkv / this"], [
            ["lmkv, 64 in flight, one context", num(sk["lmkv_64"]), ""],
            ["SDK, 1 thread", num(sk["sdk_threads_1"]), x(sk["ratio_vs_sdk_1"])],
            ["SDK, 8 threads (a context each)", num(sk["sdk_threads_8"]),
             x(sk["ratio_vs_sdk_8"])],
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
        out.append("* `no out, pool miss` (first retrieve of a size, or after the output pool "
                   "was emptied) blocks the loop for the whole pre-fault of the new mapping: "
                   + ", ".join(f"T={w['T']} {w['max']['median'] * 1e3:.0f} ms (worst "
                               f"{w['worst'] * 1e3:.0f} ms)" for w in miss)
                   + ". `lmkv_async/buffers.py` pre-faults with `mmap.madvise("
                   "MADV_POPULATE_WRITE)`, and CPython's `mmap.madvise` does not release the "
                   "GIL, so the worker thread holds it while the kernel faults the pages in.")
    if r.get("sockets"):
        best = max(w[f"ratio_{k}_vs_1"] for w in r["sockets"]["rows"] for k in (2, 4))
        verdict = ("buy nothing measurable" if best < 1.1 else f"help at most {best:.2f}x")
        out.append(f"* Socket pool: on {os.cpu_count()} cores more sockets {verdict} "
                   "(best sockets=2/4 ratio over sockets=1: "
                   f"{best:.2f}x); the server's Python threads and the client's copies "
                   "already share the cores.")
    return [*out, ""]


# ----------------------------------------------------------------------------- PNG

_GLYPHS = """
A .###. #...# #...# ##### #...# #...# #...#
B ####. #...# #...# ####. #...# #...# ####.
C .#### #.... #.... #.... #.... #.... .####
D ####. #...# #...# #...# #...# #...# ####.
E ##### #.... #.... ####. #.... #.... #####
F ##### #.... #.... ####. #.... #.... #....
G .#### #.... #.... #.### #...# #...# .####
H #...# #...# #...# ##### #...# #...# #...#
I .###. ..#.. ..#.. ..#.. ..#.. ..#.. .###.
J ..### ...#. ...#. ...#. ...#. #..#. .##..
K #...# #..#. #.#.. ##... #.#.. #..#. #...#
L #.... #.... #.... #.... #.... #.... #####
M #...# ##.## #.#.# #.#.# #...# #...# #...#
N #...# ##..# #.#.# #..## #...# #...# #...#
O .###. #...# #...# #...# #...# #...# .###.
P ####. #...# #...# ####. #.... #.... #....
Q .###. #...# #...# #...# #.#.# #..#. .##.#
R ####. #...# #...# ####. #.#.. #..#. #...#
S .#### #.... #.... .###. ....# ....# ####.
T ##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#..
U #...# #...# #...# #...# #...# #...# .###.
V #...# #...# #...# #...# #...# .#.#. ..#..
W #...# #...# #...# #.#.# #.#.# #.#.# .#.#.
X #...# #...# .#.#. ..#.. .#.#. #...# #...#
Y #...# #...# .#.#. ..#.. ..#.. ..#.. ..#..
Z ##### ....# ...#. ..#.. .#... #.... #####
0 .###. #...# #..## #.#.# ##..# #...# .###.
1 ..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.
2 .###. #...# ....# ...#. ..#.. .#... #####
3 ##### ...#. ..#.. ...#. ....# #...# .###.
4 ...#. ..##. .#.#. #..#. ##### ...#. ...#.
5 ##### #.... ####. ....# ....# #...# .###.
6 ..##. .#... #.... ####. #...# #...# .###.
7 ##### ....# ...#. ..#.. .#... .#... .#...
8 .###. #...# #...# .###. #...# #...# .###.
9 .###. #...# #...# .#### ....# ...#. .##..
. ..... ..... ..... ..... ..... .##.. .##..
, ..... ..... ..... ..... .##.. ..#.. .#...
- ..... ..... ..... ##### ..... ..... .....
+ ..... ..#.. ..#.. ##### ..#.. ..#.. .....
= ..... ..... ##### ..... ##### ..... .....
/ ....# ....# ...#. ..#.. .#... #.... #....
: ..... .##.. .##.. ..... .##.. .##.. .....
( ...#. ..#.. .#... .#... .#... ..#.. ...#.
) .#... ..#.. ...#. ...#. ...#. ..#.. .#...
> .#... ..#.. ...#. ....# ...#. ..#.. .#...
< ...#. ..#.. .#... #.... .#... ..#.. ...#.
% ##..# ##.#. ...#. ..#.. .#... .#.## #..##
_ ..... ..... ..... ..... ..... ..... #####
[ .###. .#... .#... .#... .#... .#... .###.
] .###. ...#. ...#. ...#. ...#. ...#. .###.
' ..#.. ..#.. .#... ..... ..... ..... .....
? .###. #...# ....# ...#. ..#.. ..... ..#..
* ..... #.#.# .###. ##### .###. #.#.# .....
x ..... ..... #...# .#.#. ..#.. .#.#. #...#
; ..... .##.. .##.. ..... .##.. ..#.. .#...
! ..#.. ..#.. ..#.. ..#.. ..#.. ..... ..#..
"""
_FONT: dict[str, list[str]] = {" ": ["....."] * 7}
for _line in _GLYPHS.strip().splitlines():
    _ch, *_rows = _line.split(" ")
    assert len(_rows) == 7 and all(len(r) == 5 for r in _rows), _line
    _FONT[_ch] = _rows


class Canvas:
    def __init__(self, w: int, h: int, bg: tuple[int, int, int] = (255, 255, 255)) -> None:
        self.w, self.h = w, h
        self.px = bytearray(bytes(bg) * (w * h))

    def rect(self, x0: int, y0: int, x1: int, y1: int, c: tuple[int, int, int]) -> None:
        x0, x1 = max(0, min(x0, x1)), min(self.w, max(x0, x1))
        y0, y1 = max(0, min(y0, y1)), min(self.h, max(y0, y1))
        if x0 >= x1:
            return
        line = bytes(c) * (x1 - x0)
        for y in range(y0, y1):
            o = (y * self.w + x0) * 3
            self.px[o:o + len(line)] = line

    def text(self, x0: int, y0: int, s: str, c: tuple[int, int, int], scale: int = 2) -> int:
        """Draw ``s``; returns the x after the last glyph."""
        x = x0
        for ch in s:
            glyph = _FONT.get(ch) or _FONT.get(ch.upper()) or _FONT["?"]
            for gy, row in enumerate(glyph):
                for gx, bit in enumerate(row):
                    if bit == "#":
                        self.rect(x + gx * scale, y0 + gy * scale,
                                  x + (gx + 1) * scale, y0 + (gy + 1) * scale, c)
            x += 6 * scale
        return x

    @staticmethod
    def text_width(s: str, scale: int = 2) -> int:
        return len(s) * 6 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[y * self.w * 3:(y + 1) * self.w * 3])
                       for y in range(self.h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return (struct.pack(">I", len(data)) + kind + data
                    + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

        ihdr = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


BLUE, ORANGE, GREY, RED, BLACK, GREEN = ((46, 110, 190), (230, 140, 40), (150, 150, 150),
                                         (200, 40, 40), (20, 20, 20), (40, 150, 70))


def bar_panel(cv: Canvas, y: int, title: str, note: str,
              rows: list[tuple[str, float, float | None, tuple[int, int, int], str]]) -> int:
    """Horizontal bars on a log2 axis (1x marked); returns the next y."""
    left = 360
    right = cv.w - 20 - max((Canvas.text_width(r[4]) for r in rows), default=0) - 8
    cv.text(20, y, title, BLACK, 2)
    y += 22
    cv.text(20, y, note, GREY, 1)
    y += 16
    if not rows:
        cv.text(20, y, "(no data)", GREY, 2)
        return y + 30
    import math

    vals = [r[1] for r in rows] + [r[2] for r in rows if r[2]]
    lo = min(0.5, min(vals) / 1.2)
    hi = max(2.0, max(vals) * 1.15)
    llo, lhi = math.log2(lo), math.log2(hi)

    def px(v: float) -> int:
        return int(left + (math.log2(max(v, lo)) - llo) / (lhi - llo) * (right - left))

    top = y
    row_h = 22
    for label, v, goal, color, txt in rows:
        cv.text(20, y + 4, label[:28], BLACK, 2)
        x1 = px(1.0)
        xv = px(v)
        cv.rect(min(x1, xv), y + 3, max(x1, xv) + 1, y + row_h - 3, color)
        if goal:
            xg = px(goal)
            cv.rect(xg - 1, y, xg + 2, y + row_h, RED)
        cv.text(max(x1, xv, px(goal) if goal else 0) + 6, y + 4, txt, BLACK, 2)
        y += row_h
    # axis: ticks at powers of two, 1x emphasised
    cv.rect(px(1.0), top - 4, px(1.0) + 2, y + 2, BLACK)
    k = math.ceil(llo)
    while k <= lhi:
        xt = px(2.0**k)
        cv.rect(xt, y + 2, xt + 1, y + 8, GREY)
        lab = f"{2.0**k:g}x"
        cv.text(xt - Canvas.text_width(lab, 1) // 2, y + 10, lab, GREY, 1)
        k += 1
    return y + 30


def draw_png(kernel: dict[str, Any] | None, e2e: dict[str, Any] | None) -> bytes:
    e2e_rows: list[tuple[str, float, float | None, tuple[int, int, int], str]] = []
    targets: dict[str, float] = {}
    if e2e:
        r = e2e.get("results", {})
        targets = {"store4096": 2.0, "retrieve_out4096": 6.0, "fan_outs": 8.0, "fan_no": 3.0}
        for w in r.get("store", {}).get("rows", []):
            e2e_rows.append((f"store T={w['T']}", w["speedup"],
                             targets["store4096"] if w["T"] == 4096 else None, BLUE,
                             f"{w['speedup']:.1f}x"))
        for w in r.get("retrieve", {}).get("rows", []):
            e2e_rows.append((f"retrieve T={w['T']}", w["speedup"], None, BLUE,
                             f"{w['speedup']:.1f}x"))
            e2e_rows.append((f"retrieve out= T={w['T']}", w["speedup_out"],
                             targets["retrieve_out4096"] if w["T"] == 4096 else None, GREEN,
                             f"{w['speedup_out']:.1f}x"))
        f = r.get("fanout")
        if f:
            e2e_rows.append(("fan-out 32 outs=", f["ratio_with_outs"], targets["fan_outs"],
                             ORANGE, f"{f['ratio_with_outs']:.1f}x"))
            e2e_rows.append(("fan-out 32 no outs", f["ratio_no_outs"], targets["fan_no"],
                             ORANGE, f"{f['ratio_no_outs']:.1f}x"))
        lk = r.get("lookup")
        if lk:
            e2e_rows.append(("lookup 64 vs best SDK", lk["ratio_64_vs_best_sdk"], None, ORANGE,
                             f"{lk['ratio_64_vs_best_sdk']:.1f}x"))
        sk = r.get("soak")
        if sk:
            e2e_rows.append(("soak vs SDK 8 threads", sk["ratio_vs_sdk_8"], None, ORANGE,
                             f"{sk['ratio_vs_sdk_8']:.1f}x"))
            e2e_rows.append(("soak vs SDK 1 thread", sk["ratio_vs_sdk_1"], None, ORANGE,
                             f"{sk['ratio_vs_sdk_1']:.1f}x"))
    k_rows: list[tuple[str, float, float | None, tuple[int, int, int], str]] = []
    if kernel:
        for res in kernel.get("results", []):
            for p in ("gather", "scatter", "pack", "unpack", "paged->chunks", "chunks->paged"):
                c, t = res.get(p, {}).get("c"), res.get(p, {}).get("torch")
                if c and t:
                    k_rows.append((f"{p} T={res['T']}", c / t, None, BLUE if c >= t else GREY,
                                   f"{c / t:.1f}x {c:.0f}GB/s"))
    h = 66 + (38 + 22 * max(1, len(e2e_rows)) + 30) + 10 + (38 + 22 * max(1, len(k_rows)) + 30)
    cv = Canvas(1100, h)
    y = 16
    cv.text(20, y, "lmkv_async benchmarks", BLACK, 3)
    sub = []
    if e2e:
        sub.append(f"e2e {e2e.get('date', '')[:16]}")
    if kernel:
        sub.append(f"kernel: median of {kernel.get('reps')} reps")
    m = (e2e or {}).get("machine", {})
    sub.append(f"{m.get('nproc', os.cpu_count())} CPUs {m.get('cpu_model', cpu_model())}")
    cv.text(20, y + 28, "  ".join(sub), GREY, 1)
    y += 50
    y = bar_panel(cv, y, "E2E speed-up over the official lmcache SDK (median ratio)",
                  "log scale; >1x = lmkv_async faster; red mark = target; "
                  "blue/green latency ratios, orange throughput ratios", e2e_rows)
    y += 10
    bar_panel(cv, y, "Copy kernel: C vs torch fallback (GB/s ratio)",
              "log scale; label: speed-up and C kernel GB/s", k_rows)
    return cv.png()


# ----------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--md", default=str(ROOT / "docs" / "benchmarks.md"))
    ap.add_argument("--png", default=str(ROOT / "docs" / "benchmarks.png"))
    args = ap.parse_args()
    res = Path(args.results)
    kernel = load(res / "kernel.json")
    e2e = load(res / "e2e.json")
    if kernel is None and e2e is None:
        raise SystemExit(f"no kernel.json or e2e.json under {res}")
    png_path, md_path = Path(args.png), Path(args.md)
    lines = [
        "# Benchmarks",
        "",
        f"Generated {time.strftime('%Y-%m-%d %H:%M:%S %Z')} by `python benchmarks/report.py` "
        f"on a machine with `nproc` = {os.cpu_count()} ({cpu_model()}). The numbers come "
        "from the result files below; on a small, shared machine absolute numbers move "
        "from run to run, so read the same-run ratios.",
        "",
        f"![benchmark summary]({os.path.relpath(png_path, md_path.parent)})",
        "",
    ]
    if e2e is not None:
        lines += e2e_md(e2e)
    if kernel is not None:
        lines += kernel_md(kernel)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text("\n".join(lines).rstrip() + "\n")
    png_path.write_bytes(draw_png(kernel, e2e))
    print(f"wrote {md_path} and {png_path}")


if __name__ == "__main__":
    main()
