"""Where a command prints: rich tables and lines for people, JSON for machines, one line
per error; and the loop that runs a command's async body."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import logging
import sys
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from ._exits import ExitCode, NotAvailable, UsageProblem, exit_code_for
from ._options import options


class Output:
    """Where a command prints: rich for people, JSON for machines."""

    def __init__(self, json_out: bool, debug: bool) -> None:
        self.json = json_out or options.json
        self.debug = debug or options.debug
        _setup_logging(self.debug)
        self._console: Any = None

    @property
    def console(self) -> Any:
        if self._console is None:
            from rich.console import Console

            self._console = Console(highlight=False, soft_wrap=True)
        return self._console

    def emit(self, doc: Any) -> None:
        """One JSON document on stdout (``--json``)."""
        sys.stdout.write(json.dumps(doc, default=jsonable) + "\n")
        sys.stdout.flush()

    def print(self, *things: Any) -> None:
        """Human output on stdout."""
        self.console.print(*things)

    def fail(self, exc: BaseException) -> int:
        """Report ``exc`` in one line (traceback with --debug); return its exit code."""
        code = exit_code_for(exc)
        kind = type(exc).__name__
        message = one_line(exc)
        if self.debug:
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        if self.json:
            self.emit({"error": {"type": kind, "message": message, "exit_code": int(code)}})
        else:
            prefix = "" if isinstance(exc, (UsageProblem, NotAvailable)) else f"{kind}: "
            sys.stderr.write(f"lmkv: error: {prefix}{message}\n")
            sys.stderr.flush()
        return int(code)


def one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    first = text.splitlines()[0]
    return first + (" (...)" if len(text.splitlines()) > 1 else "")


def jsonable(obj: Any) -> Any:
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return bytes(obj).hex()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=str)
    if isinstance(obj, enum.Enum):
        return obj.value
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if hasattr(obj, "_asdict"):
        return obj._asdict()
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    if hasattr(obj, "__dict__"):
        return {k: v for k, v in vars(obj).items() if not k.startswith("_")}
    return repr(obj)


_logging_ready = False


def _setup_logging(debug: bool) -> None:
    global _logging_ready
    if _logging_ready:
        return
    _logging_ready = True
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("lmkv: %(levelname)s: %(name)s: %(message)s"))
    root = logging.getLogger("lmkv_async")
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if debug else logging.WARNING)
    root.propagate = False


def run_body(out: Output, fn: Callable[[], Awaitable[int]], *,
         interrupt_ok: bool = False) -> int:
    """Run an async command body; map every failure onto one line and an exit code."""
    try:
        return asyncio.run(_as_coroutine(fn))
    except KeyboardInterrupt as exc:
        if interrupt_ok:
            return int(ExitCode.OK)
        return out.fail(exc) if out.debug or out.json else int(ExitCode.INTERRUPTED)
    except Exception as exc:
        return out.fail(exc)


async def _as_coroutine(fn: Callable[[], Awaitable[int]]) -> int:
    return await fn()


def human_bytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)

