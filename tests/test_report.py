"""benchmarks/report.py: matplotlib charts and the page, from the committed result files.

No benchmark runs here: the report is regenerated into a temporary directory from
``benchmarks/results/*.json`` (a few seconds, mostly importing matplotlib).
"""

from __future__ import annotations

import importlib.util
import json
import struct
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")  # the bench extra; the test extra has it too

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def load_report() -> types.ModuleType:
    bench = str(ROOT / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)  # report.py imports _common, which sits next to it
    spec = importlib.util.spec_from_file_location("lmkv_report", ROOT / "benchmarks" / "report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def test_spread_is_p10_p90_of_the_pairwise_ratios() -> None:
    report = load_report()
    # ratios of (2, 4) over (1, 2): 1, 2, 2, 4 -> p10 = 1.3, p90 = 3.4 (linear interpolation)
    lo, hi = report.spread({"samples": [2.0, 4.0]}, {"samples": [1.0, 2.0]})
    assert lo == pytest.approx(1.3) and hi == pytest.approx(3.4)
    assert report.spread({"median": 1.0}, {"samples": [1.0]}) is None  # no samples kept
    assert report.x(2.5, (2.0, 3.0)) == "**2.50x** (2.00-3.00)"


def test_e2e_ratios_match_the_result_file_and_carry_their_spread() -> None:
    report = load_report()
    e2e = json.loads((RESULTS / "e2e.json").read_text())
    ratios = {r.label: r for r in report.e2e_ratios(e2e)}
    rows = {w["T"]: w for w in e2e["results"]["retrieve"]["rows"]}
    r = ratios["retrieve(out=) T=4096"]
    assert r.value == rows[4096]["speedup_out"] and r.group == "latency"
    assert r.goal == 6.0  # the target of that row in e2e.json
    assert r.spread is not None and r.spread[0] < r.value < r.spread[1]
    assert ratios["fan-out 32x, outs="].group == "throughput"
    assert all(x.spread is not None for x in ratios.values()), "a ratio lost its spread"


def test_report_writes_the_page_and_both_charts(tmp_path: Path) -> None:
    md = tmp_path / "docs" / "benchmarks.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"),
                           "--results", str(RESULTS), "--md", str(md)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = md.read_text()
    for name in ("benchmarks-e2e.png", "benchmarks-kernel.png", "benchmarks-index.png"):
        assert f"]({name})" in text, f"the page does not embed {name}"
        width, height = png_size(md.parent / name)
        assert width >= 800 and height >= 400, (name, width, height)
        assert (md.parent / name).stat().st_size > 20_000  # a drawn chart, not a blank page
    assert "## End to end" in text and "## Copy kernel" in text
    # ratios in the tables come with their spread: the retrieve table's T=4096 out= ratio
    # is the same figure as the committed run's first target
    e2e = json.loads((RESULTS / "e2e.json").read_text())
    (want,) = [t["value"] for t in e2e["targets"]
               if t["target"] == "retrieve T=4096 into out= vs SDK retrieve"]
    assert f"**{want:.2f}x** (" in text
    assert "## Small transfers" in text and "bare floor" in text  # small.json's section
    assert "## Prefix index at router scale" in text  # index.json's section


def test_committed_page_embeds_the_committed_charts() -> None:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    for name in ("benchmarks-e2e.png", "benchmarks-kernel.png", "benchmarks-index.png"):
        assert f"]({name})" in text
        png_size(ROOT / "docs" / name)
    assert not (ROOT / "docs" / "benchmarks.png").exists(), "the old hand-drawn PNG is back"


def index_point(impl: str, servers: int, rss: float, traced: float, rate: float,
                p50: float, p99: float, remove: float, discard: float) -> dict[str, object]:
    entries = servers * 10_004
    return {"impl": impl, "servers": servers, "prompts_per_server": 1422, "entries": entries,
            "rss_bytes_per_entry": rss, "traced_bytes_per_entry": traced,
            "ingest_entries_per_s": rate, "longest_us": {"n": 100, "p50": p50, "p99": p99},
            "remove_us_per_entry_p50": remove, "discard_us_per_entry_p50": discard,
            "wrong_answers": 0, "same_answers": True}


def synthetic_index() -> dict[str, object]:
    now16 = index_point("after", 16, 210.4, 180.2, 190_500.0, 8.04, 21.6, 1.814, 0.826)
    now256 = index_point("after", 256, 230.0, 190.0, 95_000.0, 70.0, 1250.0, 2.5, 1.75)
    before16 = index_point("before", 16, 1683.2, 1525.0, 155_000.0, 15.0, 43.2, 2.09, 1.22)
    return {
        "kind": "index", "date": "2026-01-02 03:04:05 UTC", "command": "python x.py",
        "workload": {"chunk": 256, "chunks_per_prompt": 8, "shared_first_chunks": 50,
                     "queries": 100, "before": "fb4a8d3"},
        "machine": {"cpus": 2, "python": "3.11.7", "platform": "Linux"},
        "curve": [now16, before16, now256],
        "skipped": [{"impl": "before", "servers": 256, "prompts_per_server": 1422,
                     "reason": "estimated peak over 6 GiB"}],
        "target_point": dict(now256),  # a copy, as after a JSON round trip
        "targets": [
            {"target": "bytes per entry (RSS) at 256 x 10,000", "value": 230.0, "goal": 256.0,
             "unit": "B", "higher_is_better": False, "met": True},
            {"target": "longest p99 at 256 x 10,000", "value": 1250.0, "goal": 1000.0,
             "unit": "us", "higher_is_better": False, "met": False},
        ],
        "wall_s": 12.0,
    }


def test_index_section_renders_every_point_from_the_result_file(tmp_path: Path) -> None:
    load_report()  # puts benchmarks/ on sys.path
    import _report_index

    ix = synthetic_index()
    text = "\n".join(_report_index.index_md(ix))
    rows = [line for line in text.splitlines() if line.startswith("| now") or
            line.startswith("| before")]
    # one row per point (the target point is the curve's 256 one, not a row of its own),
    # the index now first, each by fleet size
    assert rows == [
        "| now | 16 | 160,064 | 210 | 180 | 190,500 | 8.0 / 22 | 1.81 | 0.83 |",
        "| now | 256 | 2,561,024 | 230 | 190 | 95,000 | 70 / 1,250 | 2.50 | 1.75 |",
        "| before | 16 | 160,064 | 1,683 | 1,525 | 155,000 | 15 / 43 | 2.09 | 1.22 |",
    ]
    # now against before at the largest fleet both ran: 1683.2 / 210.4 = 8.0x less memory
    assert "At 16 servers the index now takes 8.0x less memory per entry" in text
    assert "identical answers" in text and "1,422 prompts" in text
    assert "Not measured: the index before at 256 servers (estimated peak over 6 GiB)." in text
    assert "| longest p99 at 256 x 10,000 | <= 1,000 µs | 1,250 µs | **missed** |" in text
    assert "| bytes per entry (RSS) at 256 x 10,000 | <= 256 B | 230 B | met |" in text

    png = tmp_path / "index.png"
    _report_index.draw_index(ix, png)
    width, height = png_size(png)
    assert width >= 800 and height >= 400 and png.stat().st_size > 20_000


def test_index_section_reads_a_lone_target_point() -> None:
    load_report()
    import _report_index

    ix = synthetic_index()
    ix["curve"], ix["skipped"] = [], []  # the first result file held the target point only
    points = _report_index.index_points(ix)
    assert [(p["impl"], p["servers"]) for p in points] == [("after", 256)]
    text = "\n".join(_report_index.index_md(ix))
    assert "| now | 256 | 2,561,024 | 230 |" in text and "At 16 servers" not in text
