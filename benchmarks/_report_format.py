"""Formatting shared by the report's sections: result files, numbers, ratios, tables.

``report.py`` (the page) and its section modules import these; they sit next to it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from _common import summarize


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


def spread(num_s: dict[str, Any] | None,
           den_s: dict[str, Any] | None) -> tuple[float, float] | None:
    """p10/p90 of ``a / b`` over every pair of runs ``a`` of ``num_s``, ``b`` of ``den_s``.

    ``None`` when either side kept no samples (older result files)."""
    a = (num_s or {}).get("samples") or []
    b = (den_s or {}).get("samples") or []
    ratios = [x / y for x in a for y in b if y]
    if not ratios:
        return None
    s = summarize(ratios)
    return s["p10"], s["p90"]


def x(v: float | None, sp: tuple[float, float] | None = None) -> str:
    if v is None:
        return "-"
    return f"**{v:.2f}x**" + (f" ({sp[0]:.2f}-{sp[1]:.2f})" if sp else "")


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---:" if i else ":---" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return [*out, ""]
