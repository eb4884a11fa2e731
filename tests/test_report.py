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
    for name in ("benchmarks-e2e.png", "benchmarks-kernel.png"):
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


def test_committed_page_embeds_the_committed_charts() -> None:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    for name in ("benchmarks-e2e.png", "benchmarks-kernel.png"):
        assert f"]({name})" in text
        png_size(ROOT / "docs" / name)
    assert not (ROOT / "docs" / "benchmarks.png").exists(), "the old hand-drawn PNG is back"
