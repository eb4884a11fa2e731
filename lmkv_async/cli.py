"""``lmkv``: a command line for LMCache MP servers (extra ``lmkv_async[cli]``: typer + rich).

Commands::

    lmkv ping                      HTTP health, version and one ZMQ round trip, timed
    lmkv status                    version, dialect, capabilities, transport, chunk size,
                                   sessions / locks / objects / memory from /status
    lmkv lookup [FILE|-]           cached prefix of token ids given as JSON
    lmkv events                    tail the server's KV event stream
    lmkv bench                     store / retrieve / lookup at a size and concurrency
    lmkv server                    start a local lmcache server (lmkv_async.testing)

Global options come before the command: ``--url``, ``--http-url``, ``--model``,
``--api-key`` (never printed; ``$LMCACHE_API_KEY`` / ``$LMCACHE_API_KEY_FILE``
work too), ``--timeout``, ``--transport``, ``--json`` and ``--debug``
(``--json`` and ``--debug`` are also accepted after the command). ``--json``
prints one JSON document (``events``: one per line). Errors print as one line,
``lmkv: error: <type>: <message>`` on stderr (with ``--json``, an ``{"error":
...}`` object on stdout), without a traceback unless ``--debug``.

Exit codes (:data:`EXIT_CODES`):

===  ==============================================================
0    success
1    the server failed or answered something unusable
2    usage error or bad input (options, token file, layout)
3    the server is unreachable or did not answer in time
4    authentication failed (HTTP 401: API key missing or wrong)
5    not available: this build or this server lacks the feature
130  interrupted (Ctrl-C), except for ``events`` and ``server``,
     for which Ctrl-C (and SIGTERM) is the normal way to stop (0)
===  ==============================================================

Commands that need a registration (``status``, ``lookup``, ``events``) use
``--layout L,NH,HS,dtype,block`` when given, else the layout an engine
registered for ``--model``, else a one-element probe layout (lookups do not
depend on the geometry: keys hash the model name, world size, tokens and salt).
The package itself never imports this module, typer or rich; without them
importing it raises :class:`ImportError` and the ``lmkv`` console script
(:mod:`lmkv_async.__main__`) prints :data:`MISSING_EXTRA` and exits with 5.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import logging
import math
import os
import secrets
import signal
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, NoReturn

import torch

from . import __version__
from .context import AsyncKVContext, connect
from .errors import (
    AuthenticationError,
    InvalidInputError,
    KVCacheError,
    ServerTimeoutError,
    ServerUnavailableError,
    UnsupportedOperationError,
)
from .http import HttpClient, resolve_api_key
from .layout import SUPPORTED_DTYPES, KVLayout, LayoutNotFoundError

#: What ``lmkv`` prints (one line, exit code 5) when typer or rich is not installed.
MISSING_EXTRA = "the lmkv command line needs the 'cli' extra: pip install 'lmkv_async[cli]'"

try:
    import rich  # noqa: F401  (tables and progress bars; imported where used)
    import typer
except ImportError as _exc:  # exercised without the extra (tests/test_cli.py)
    # An ImportError, not SystemExit: importing this module is a library call; the
    # console script (lmkv_async.__main__) turns it into one line and exit code 5.
    raise ImportError(MISSING_EXTRA) from _exc

__all__ = ["EXIT_CODES", "MISSING_EXTRA", "ExitCode", "exit_code_for", "main", "parse_layout"]

log = logging.getLogger("lmkv_async.cli")

# typer >= 0.16 vendors click (typer._click); take its classes from typer itself.
_UsageError: type[Exception] = next(
    k for k in typer.BadParameter.__mro__ if k.__name__ == "UsageError")
_ClickException: type[Exception] = next(
    k for k in typer.BadParameter.__mro__ if k.__name__ == "ClickException")


def _named(exc: BaseException, name: str) -> bool:
    return any(k.__name__ == name for k in type(exc).__mro__)


class ExitCode(enum.IntEnum):
    """What ``lmkv`` exits with."""

    OK = 0
    SERVER_ERROR = 1
    USAGE = 2
    UNREACHABLE = 3
    AUTH = 4
    NOT_AVAILABLE = 5
    INTERRUPTED = 130


#: ``{code: meaning}``, as documented in the module docstring and ``docs/cli.md``.
EXIT_CODES: Mapping[int, str] = {
    ExitCode.OK: "success",
    ExitCode.SERVER_ERROR: "the server failed or answered something unusable",
    ExitCode.USAGE: "usage error or bad input",
    ExitCode.UNREACHABLE: "the server is unreachable or did not answer in time",
    ExitCode.AUTH: "authentication failed (API key missing or wrong)",
    ExitCode.NOT_AVAILABLE: "this build or this server lacks the feature",
    ExitCode.INTERRUPTED: "interrupted",
}

_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16",
                  "fp32": "float32", "float": "float32"}
_BY_NAME = {name: dtype for dtype, name in SUPPORTED_DTYPES.items()}
#: the smallest registration, for commands that move no data
PROBE_LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.bfloat16,
                        block_size=1)
DEFAULT_BENCH_LAYOUT = "4,8,128,bfloat16,16"


class UsageProblem(Exception):
    """Bad command-line input: exit code 2, one line."""


class NotAvailable(Exception):
    """The feature is missing from this build: exit code 5, one line."""


def exit_code_for(exc: BaseException) -> ExitCode:
    """The exit code an exception maps to (see :data:`EXIT_CODES`)."""
    if isinstance(exc, KeyboardInterrupt):
        return ExitCode.INTERRUPTED
    if isinstance(exc, AuthenticationError):
        return ExitCode.AUTH
    if isinstance(exc, (ServerTimeoutError, ServerUnavailableError, TimeoutError,
                        ConnectionError)):
        return ExitCode.UNREACHABLE
    if isinstance(exc, (UnsupportedOperationError, NotAvailable)):
        return ExitCode.NOT_AVAILABLE
    if isinstance(exc, (InvalidInputError, UsageProblem, _UsageError)):
        return ExitCode.USAGE
    return ExitCode.SERVER_ERROR


def parse_layout(text: str) -> KVLayout:
    """``"L,NH,HS,dtype,block"`` (optionally ``,mla``) -> :class:`KVLayout`.

    ``dtype`` is ``bfloat16``, ``float16`` or ``float32`` (``bf16``, ``fp16``,
    ``fp32`` also work). Raises :class:`UsageProblem` for anything else.
    """
    parts = [p.strip() for p in text.split(",")]
    mla = len(parts) == 6 and parts[5].lower() == "mla"
    if len(parts) != 5 and not mla:
        raise UsageProblem(f"--layout must be L,NH,HS,dtype,block[,mla], got {text!r}")
    try:
        layers, heads, head_dim, block = (int(parts[0]), int(parts[1]), int(parts[2]),
                                          int(parts[4]))
    except ValueError:
        raise UsageProblem(f"--layout: L, NH, HS and block must be integers, got {text!r}"
                           ) from None
    dtype_name = _DTYPE_ALIASES.get(parts[3].lower(), parts[3].lower())
    if dtype_name not in _BY_NAME:
        raise UsageProblem(f"--layout: dtype must be one of {sorted(_BY_NAME)}, "
                           f"got {parts[3]!r}")
    try:
        return KVLayout(layers, heads, head_dim, _BY_NAME[dtype_name], block, use_mla=mla)
    except InvalidInputError as exc:
        raise UsageProblem(f"--layout: {exc}") from None


# ----------------------------------------------------------------------------- state/output


@dataclasses.dataclass
class _Globals:
    url: str = "tcp://127.0.0.1:5555"
    http_url: str = "http://127.0.0.1:8080"
    model: str = "lmkv-cli"
    api_key: str | None = None
    timeout: float = 10.0
    transport: str = "auto"
    json: bool = False
    debug: bool = False


_G = _Globals()


class _Out:
    """Where a command prints: rich for people, JSON for machines."""

    def __init__(self, json_out: bool, debug: bool) -> None:
        self.json = json_out or _G.json
        self.debug = debug or _G.debug
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
        sys.stdout.write(json.dumps(doc, default=_jsonable) + "\n")
        sys.stdout.flush()

    def print(self, *things: Any) -> None:
        """Human output on stdout."""
        self.console.print(*things)

    def fail(self, exc: BaseException) -> int:
        """Report ``exc`` in one line (traceback with --debug); return its exit code."""
        code = exit_code_for(exc)
        kind = type(exc).__name__
        message = _one_line(exc)
        if self.debug:
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        if self.json:
            self.emit({"error": {"type": kind, "message": message, "exit_code": int(code)}})
        else:
            prefix = "" if isinstance(exc, (UsageProblem, NotAvailable)) else f"{kind}: "
            sys.stderr.write(f"lmkv: error: {prefix}{message}\n")
            sys.stderr.flush()
        return int(code)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    first = text.splitlines()[0]
    return first + (" (...)" if len(text.splitlines()) > 1 else "")


def _jsonable(obj: Any) -> Any:
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


def _run(out: _Out, fn: Callable[[], Awaitable[int]], *,
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


async def _open(layout: KVLayout | None, *, fallback: bool, prefault: bool = False,
                heartbeat: bool = False) -> AsyncKVContext:
    """Connect with the global options; ``fallback``: probe layout if none is registered."""
    kwargs: dict[str, Any] = {
        "timeout": _G.timeout, "transport": _G.transport, "api_key": _G.api_key,
        "prefault": prefault,
    }
    if not heartbeat:
        kwargs["heartbeat_interval"] = 0
    try:
        return await connect(_G.url, _G.http_url, _G.model, layout=layout, **kwargs)
    except LayoutNotFoundError:
        if layout is not None or not fallback:
            raise
        log.debug("no layout registered for %r; using the probe layout", _G.model)
        return await connect(_G.url, _G.http_url, _G.model, layout=PROBE_LAYOUT, **kwargs)


def _layout_arg(text: str | None) -> KVLayout | None:
    return None if text is None else parse_layout(text)


# ----------------------------------------------------------------------------- shared options

JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output (JSON).")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Tracebacks and debug logs on stderr.")]
LayoutOpt = Annotated[
    str | None,
    typer.Option("--layout", metavar="L,NH,HS,DTYPE,BLOCK",
                 help="Explicit geometry, e.g. 2,2,64,bfloat16,16 (append ,mla for MLA)."),
]
SaltOpt = Annotated[str, typer.Option("--salt", help="cache_salt (namespace) to use.")]


def _print_version(value: bool) -> None:
    # An eager option callback runs while parsing, before click checks that a
    # command was given, so `lmkv --version` works on its own.
    if value:
        sys.stdout.write(f"lmkv_async {__version__}\n")
        raise typer.Exit(0)


def _root(
    url: Annotated[str, typer.Option("--url", envvar="LMKV_URL",
                                     help="ZMQ endpoint of the server.")] = _G.url,
    http_url: Annotated[str, typer.Option("--http-url", envvar="LMKV_HTTP_URL",
                                          help="HTTP API of the server.")] = _G.http_url,
    model: Annotated[str, typer.Option("--model", envvar="LMKV_MODEL",
                                       help="Model name (server-side namespace).")] = _G.model,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="LMKV_API_KEY", show_default=False, show_envvar=True,
        help="HTTP API key (never printed); default: $LMCACHE_API_KEY(_FILE).")] = None,
    timeout: Annotated[float, typer.Option("--timeout", min=0.001,
                                           help="Deadline of each operation, seconds.")] = 10.0,
    transport: Annotated[str, typer.Option("--transport",
                                           help="auto, shm or pickle.")] = "auto",
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
    version: Annotated[bool, typer.Option("--version", help="Print lmkv_async's version.",
                                          is_eager=True, callback=_print_version)] = False,
) -> None:
    """lmkv: talk to an LMCache multiprocess KV-cache server."""
    if transport not in ("auto", "shm", "pickle"):
        raise typer.BadParameter("must be auto, shm or pickle", param_hint="--transport")
    if "://" not in url:
        url = f"tcp://{url}"
    _G.url, _G.http_url, _G.model, _G.api_key = url, http_url, model, api_key
    _G.timeout, _G.transport, _G.json, _G.debug = timeout, transport, json_out, debug


# ----------------------------------------------------------------------------- ping


async def _zmq_probe(url: str, timeout: float) -> tuple[object, float]:
    """One harmless op-21 round trip on a fresh DEALER: (reply, seconds)."""
    import zmq
    import zmq.asyncio

    from .errors import ProtocolError
    from .wire import requests
    from .wire.frames import decode_reply, encode_request, pack

    zctx = zmq.asyncio.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    uid = secrets.randbits(31)
    req = requests.probe()
    try:
        sock.connect(url)
        t0 = time.perf_counter()
        await sock.send_multipart(encode_request(uid, req.op_id, req.payloads))
        try:
            frames = await asyncio.wait_for(sock.recv_multipart(), timeout)
        except asyncio.TimeoutError:
            raise ServerTimeoutError("no reply to the ZMQ probe", op="probe", server=url,
                                     timeout=timeout) from None
        elapsed = time.perf_counter() - t0
    finally:
        sock.close(linger=0)
        zctx.term()
    reply = decode_reply(frames, expected_op=pack(req.op_id))
    if reply.uid_frame != pack(uid):
        raise ProtocolError("probe reply has another request's id", op="probe", server=url)
    return reply.result(), elapsed


def ping(
    count: Annotated[int, typer.Option("--count", "-c", min=1, help="Round trips.")] = 1,
    interval: Annotated[float, typer.Option("--interval", min=0.0,
                                            help="Seconds between round trips.")] = 1.0,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> int:
    """HTTP health and version, then a ZMQ round trip, timed."""
    out = _Out(json_out, debug)

    async def body() -> int:
        http = HttpClient(_G.http_url, timeout=_G.timeout, api_key=resolve_api_key(_G.api_key))
        rounds: list[dict[str, Any]] = []
        try:
            for i in range(count):
                if i:
                    await asyncio.sleep(interval)
                t0 = time.perf_counter()
                healthy = await http.healthcheck(timeout=_G.timeout)
                http_s = time.perf_counter() - t0
                if not healthy:
                    raise ServerUnavailableError("HTTP /healthcheck did not report healthy",
                                                 op="GET /healthcheck", server=_G.http_url)
                version = await http.version()
                reply, zmq_s = await _zmq_probe(_G.url, _G.timeout)
                row = {"seq": i + 1, "healthy": healthy, "version": version,
                       "http_ms": round(http_s * 1e3, 3), "zmq_ms": round(zmq_s * 1e3, 3),
                       "zmq_reply": reply}
                rounds.append(row)
                if not out.json:
                    out.print(f"{_G.url} ({_G.http_url}): lmcache {version}, healthy; "
                              f"http {row['http_ms']:.2f} ms, zmq {row['zmq_ms']:.2f} ms")
        finally:
            await http.aclose()
        if out.json:
            out.emit({"url": _G.url, "http_url": _G.http_url, "rounds": rounds})
        return 0

    return _run(out, body)


# ----------------------------------------------------------------------------- status


def _dig(data: Mapping[str, Any], *paths: str) -> Any:
    """First value found along dotted ``paths`` in nested mappings, else None."""
    for path in paths:
        node: Any = data
        for part in path.split("."):
            if not isinstance(node, Mapping) or part not in node:
                node = None
                break
            node = node[part]
        if node is not None:
            return node
    return None


def summarize_status(status: Mapping[str, Any]) -> dict[str, Any]:
    """The numbers people look for in ``GET /status`` (0.5.2 and 0.5.6+ layouts)."""
    l1 = ("storage_manager.l1_manager", "storage_manager.l1_managers._default")
    used = _dig(status, *(f"{p}.memory_used_bytes" for p in l1))
    total = _dig(status, *(f"{p}.memory_total_bytes" for p in l1))
    usage = _dig(status, "storage_manager.l1_usage")
    if (used is None or total is None) and isinstance(usage, list) and len(usage) == 2:
        used, total = usage
    return {
        "healthy": status.get("is_healthy"),
        "active_sessions": status.get("active_sessions"),
        "objects": _dig(status, *(f"{p}.total_object_count" for p in l1)),
        "read_locked": _dig(status, *(f"{p}.read_locked_count" for p in l1)),
        "write_locked": _dig(status, *(f"{p}.write_locked_count" for p in l1)),
        "memory_used_bytes": used,
        "memory_total_bytes": total,
        "engine_registrations": len(status.get("registered_non_cuda_instance_ids") or []),
        "gpu_registrations": len(status.get("registered_gpu_ids") or []),
        "kv_event_subscribers": _dig(status, "kv_events.subscribers"),
    }


def _bytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def status(
    layout: LayoutOpt = None,
    raw: Annotated[bool, typer.Option("--raw", help="With --json: the whole /status too.")] = False,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> int:
    """Server version, dialect, capabilities, transport, chunk size, and /status numbers."""
    out = _Out(json_out, debug)

    async def body() -> int:
        ctx = await _open(_layout_arg(layout), fallback=True)
        try:
            # our own registration is not the server's business here
            st = await ctx.status()
            srv_info: dict[str, Any] = {
                "url": ctx.url, "http_url": ctx.http_url, "version": ctx.server_version,
                "dialect": ctx.dialect.name, "capabilities": sorted(ctx.capabilities),
                "transport": ctx.transport, "chunk_size": ctx.chunk_size,
                "untested_server": ctx.untested_server,
            }
        finally:
            await ctx.aclose()
        summary = summarize_status(st)
        summary["engine_registrations"] = max(0, summary["engine_registrations"] - 1)
        if out.json:
            doc: dict[str, Any] = {"server": srv_info, "status": summary}
            if raw:
                doc["raw_status"] = st
            out.emit(doc)
            return 0
        from rich.table import Table

        table = Table(title=f"lmcache server {ctx.url}", show_header=False, title_justify="left")
        table.add_column("", style="bold")
        table.add_column("")
        rows = [
            ("version", srv_info["version"] + ("  (newer than tested)"
                                              if srv_info["untested_server"] else "")),
            ("dialect", srv_info["dialect"]),
            ("capabilities", ", ".join(srv_info["capabilities"]) or "-"),
            ("transport", srv_info["transport"]),
            ("chunk size", f"{srv_info['chunk_size']} tokens"),
            ("healthy", str(summary["healthy"])),
            ("sessions", str(summary["active_sessions"])),
            ("read locks", str(summary["read_locked"])),
            ("write locks", str(summary["write_locked"])),
            ("objects", str(summary["objects"])),
            ("memory", f"{_bytes(summary['memory_used_bytes'])} of "
                       f"{_bytes(summary['memory_total_bytes'])}"),
            ("engine registrations", str(summary["engine_registrations"])),
        ]
        for k, v in rows:
            table.add_row(k, v)
        out.print(table)
        return 0

    return _run(out, body)


# ----------------------------------------------------------------------------- lookup


def _read_token_lists(source: str) -> tuple[list[list[int]], bool]:
    """Token lists from a JSON file or ``-`` (stdin): ``[ids]`` or ``[[ids], ...]``.

    Returns the lists and whether the input was a single list.
    """
    if source == "-":
        if sys.stdin.isatty():
            raise UsageProblem("no token ids: pass a JSON file or pipe JSON into stdin")
        text = sys.stdin.read()
        where = "stdin"
    else:
        try:
            text = Path(source).read_text()
        except OSError as exc:
            raise UsageProblem(f"cannot read {source}: {exc.strerror or exc}") from None
        where = source
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise UsageProblem(f"{where} is not JSON: {exc}") from None
    if isinstance(data, Mapping) and "tokens" in data:
        data = data["tokens"]

    def ok(seq: Any) -> bool:
        return isinstance(seq, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in seq)

    if ok(data) and data:
        return [data], True
    if isinstance(data, list) and data and all(ok(s) and s for s in data):
        return data, False
    raise UsageProblem(f"{where} must hold a non-empty JSON list of token ids, or a list of "
                       "such lists")


def lookup(
    source: Annotated[str, typer.Argument(metavar="[FILE|-]",
                                          help="JSON token ids; '-' or nothing: stdin.")] = "-",
    layout: LayoutOpt = None,
    salt: SaltOpt = "",
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> int:
    """How many leading tokens of each sequence the server has cached."""
    out = _Out(json_out, debug)

    async def body() -> int:
        token_lists, _single = _read_token_lists(source)
        lay = _layout_arg(layout)
        ctx = await _open(lay, fallback=True)
        try:
            C = ctx.chunk_size
            results = await ctx.lookup_many(token_lists, cache_salt=salt)
        finally:
            await ctx.aclose()
        rows: list[dict[str, Any]] = []
        first_error: BaseException | None = None
        for i, (toks, r) in enumerate(zip(token_lists, results, strict=True)):
            row: dict[str, Any] = {"index": i, "tokens": len(toks)}
            if r.ok:
                hit = int(r.value or 0)
                row.update(hit_tokens=hit, hit_chunks=hit // C,
                           full_chunks=len(toks) // C)
            else:
                assert r.error is not None
                first_error = first_error or r.error
                row["error"] = {"type": type(r.error).__name__, "message": _one_line(r.error)}
            rows.append(row)
        if out.json:
            out.emit({"chunk_size": C, "cache_salt": salt, "results": rows})
        else:
            for row in rows:
                if "error" in row:
                    out.print(f"[{row['index']}] error: {row['error']['type']}: "
                              f"{row['error']['message']}")
                else:
                    out.print(f"[{row['index']}] {row['hit_tokens']} of {row['tokens']} tokens "
                              f"cached ({row['hit_chunks']} of {row['full_chunks']} chunks "
                              f"of {C})")
        return int(exit_code_for(first_error)) if first_error else 0

    return _run(out, body)


# ----------------------------------------------------------------------------- events


def _record_doc(rec: Any) -> Any:
    """A KV event record as plain JSON-able data."""
    doc = _jsonable(rec) if not isinstance(rec, (dict, list, str, int, float)) else rec
    if isinstance(doc, Mapping):
        return {k: _jsonable(v) if not isinstance(v, (str, int, float, bool, type(None),
                                                       list, dict)) else v
                for k, v in doc.items()}
    return doc


def events(
    count: Annotated[int, typer.Option("--count", "-n", min=0,
                                       help="Stop after N events (0: until Ctrl-C).")] = 0,
    layout: LayoutOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> int:
    """Tail the server's KV event stream (stores, evictions), one line per event."""
    out = _Out(json_out, debug)
    if getattr(AsyncKVContext, "kv_events", None) is None:
        return out.fail(NotAvailable(
            "KV event streams are not available in this build of lmkv_async "
            "(AsyncKVContext has no kv_events())"))

    async def body() -> int:
        ctx = await _open(_layout_arg(layout), fallback=True, heartbeat=True)
        try:
            stream = ctx.kv_events()
            seen = 0
            async for rec in stream:
                doc = _record_doc(rec)
                if out.json:
                    out.emit(doc)
                else:
                    out.print(json.dumps(doc, default=_jsonable))
                seen += 1
                if count and seen >= count:
                    break
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            await ctx.aclose()
        return 0

    return _run(out, body, interrupt_ok=True)


# ----------------------------------------------------------------------------- bench


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    k = (len(sorted_values) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def bench(
    ops: Annotated[list[str] | None, typer.Option(
        "--op", help="store, retrieve, lookup or all (repeatable).")] = None,
    tokens: Annotated[int, typer.Option("--tokens", "-t", min=1,
                                        help="Tokens per request.")] = 1024,
    requests: Annotated[int, typer.Option("--requests", "-n", min=1,
                                          help="Requests per operation.")] = 32,
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", min=1,
                                             help="Requests in flight.")] = 8,
    layout: Annotated[str, typer.Option(
        "--layout", metavar="L,NH,HS,DTYPE,BLOCK",
        help="Geometry of the KV moved.")] = DEFAULT_BENCH_LAYOUT,
    salt: Annotated[str | None, typer.Option(
        "--salt", help="cache_salt; default: a fresh random one, so stores really write.")
    ] = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> int:
    """Store, retrieve and look up KV at a chosen size and concurrency; a result table."""
    out = _Out(json_out, debug)

    async def body() -> int:
        from .metrics import OpStats

        lay = parse_layout(layout)
        chosen = [o.strip().lower() for o in (ops or ["all"])]
        for o in chosen:
            if o not in ("store", "retrieve", "lookup", "all"):
                raise UsageProblem(f"--op must be store, retrieve, lookup or all, got {o!r}")
        order = [o for o in ("store", "retrieve", "lookup") if o in chosen or "all" in chosen]
        cache_salt = salt if salt is not None else f"lmkv-bench-{secrets.token_hex(4)}"
        ctx = await _open(lay, fallback=False, prefault=True, heartbeat=True)
        stats = OpStats()
        results: list[dict[str, Any]] = []
        try:
            C = ctx.chunk_size
            if tokens < C:
                raise UsageProblem(f"--tokens {tokens} is less than one chunk ({C} tokens)")
            base = secrets.randbelow(2**31)
            seqs = [list(range(base + i * tokens, base + (i + 1) * tokens))
                    for i in range(requests)]
            kv = torch.randn(lay.planes, lay.num_layers, tokens, lay.hidden_dim).to(lay.dtype)
            nbytes = kv[:, :, : tokens // C * C].numel() * kv.element_size()
            if "store" not in order:  # retrieve/lookup need data: store it, untimed
                await ctx.store_many([(kv, s) for s in seqs], cache_salt=cache_salt,
                                     max_in_flight=concurrency)
            for op in order:
                results.append(await _bench_op(out, ctx, stats, op, seqs, kv, cache_salt,
                                               concurrency, nbytes))
        finally:
            await ctx.aclose()
        summary = {"layout": dataclasses.asdict(lay) | {"dtype": lay.dtype_name},
                   "tokens": tokens, "requests": requests, "concurrency": concurrency,
                   "chunk_size": C, "bytes_per_request": nbytes, "transport": ctx.transport,
                   "server_version": ctx.server_version, "results": results}
        if out.json:
            out.emit(summary)
        else:
            _bench_table(out, summary)
        errors = sum(r["errors"] for r in results)
        return int(ExitCode.SERVER_ERROR) if errors else 0

    return _run(out, body)


async def _bench_op(out: _Out, ctx: AsyncKVContext, stats: Any, op: str,
                    seqs: list[list[int]], kv: torch.Tensor, salt: str, concurrency: int,
                    nbytes: int) -> dict[str, Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    latencies: list[float] = []
    errors: dict[str, int] = {}
    sem = asyncio.Semaphore(concurrency)
    progress = Progress("[progress.description]{task.description}", BarColumn(),
                        MofNCompleteColumn(), TimeElapsedColumn(), transient=True,
                        disable=out.json or not sys.stderr.isatty(),
                        console=_stderr_console())
    moved = 0

    async def one(seq: list[int]) -> None:
        nonlocal moved
        async with sem:
            t0 = time.perf_counter()
            try:
                with stats.measure(op) as m:
                    if op == "store":
                        await ctx.store(kv, seq, cache_salt=salt)
                        m.nbytes = nbytes
                    elif op == "retrieve":
                        res = await ctx.retrieve(seq, cache_salt=salt)
                        m.nbytes = 0 if res is None else res.numel() * res.element_size()
                    else:
                        await ctx.lookup(seq, cache_salt=salt)
                moved += m.nbytes
            except KVCacheError as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            latencies.append(time.perf_counter() - t0)
            progress.advance(task)

    with progress:
        task = progress.add_task(op, total=len(seqs))
        t0 = time.perf_counter()
        await asyncio.gather(*(one(s) for s in seqs))
        wall = time.perf_counter() - t0
    lat = sorted(latencies)
    return {
        "op": op, "requests": len(seqs), "seconds": wall,
        "ops_per_s": len(seqs) / wall if wall > 0 else math.inf,
        "mib_per_s": moved / 2**20 / wall if op != "lookup" and wall > 0 else None,
        "bytes": moved,
        "p50_ms": _percentile(lat, 0.5) * 1e3, "p90_ms": _percentile(lat, 0.9) * 1e3,
        "p99_ms": _percentile(lat, 0.99) * 1e3, "max_ms": lat[-1] * 1e3 if lat else math.nan,
        "errors": sum(errors.values()), "errors_by_type": errors,
    }


def _stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def _bench_table(out: _Out, s: Mapping[str, Any]) -> None:
    from rich.table import Table

    lay = s["layout"]
    title = (f"lmkv bench: {s['requests']} x {s['tokens']} tokens "
             f"(L={lay['num_layers']} NH={lay['num_kv_heads']} HS={lay['head_dim']} "
             f"{lay['dtype']}, {_bytes(s['bytes_per_request'])} per request), "
             f"{s['concurrency']} in flight, {s['transport']}, lmcache {s['server_version']}")
    table = Table(title=title, title_justify="left")
    for name in ("op", "ops/s", "MiB/s", "p50 ms", "p90 ms", "p99 ms", "max ms", "errors"):
        table.add_column(name, justify="left" if name == "op" else "right")
    for r in s["results"]:
        table.add_row(r["op"], f"{r['ops_per_s']:.1f}",
                      "-" if r["mib_per_s"] is None else f"{r['mib_per_s']:.0f}",
                      f"{r['p50_ms']:.2f}", f"{r['p90_ms']:.2f}", f"{r['p99_ms']:.2f}",
                      f"{r['max_ms']:.2f}", str(r["errors"]))
    out.print(table)


# ----------------------------------------------------------------------------- server


class _Stop(Exception):
    pass


def server(
    version: Annotated[str, typer.Option("--version", help="lmcache version to start.")
                       ] = "0.5.6",
    python: Annotated[str | None, typer.Option(
        "--python", help="Interpreter with that lmcache installed; default: "
                         "$LMKV_LMCACHE_PYTHON_<tag>.")] = None,
    shm: Annotated[bool, typer.Option("--shm/--no-shm", help="SHM pool on or off.")] = True,
    chunk_size: Annotated[int, typer.Option("--chunk-size", min=1)] = 256,
    l1_size_gb: Annotated[float, typer.Option("--l1-size-gb", min=0.01)] = 1.0,
    zmq_port: Annotated[int | None, typer.Option("--zmq-port", help="Default: a free port.")
                        ] = None,
    http_port: Annotated[int | None, typer.Option("--http-port", help="Default: a free port.")
                         ] = None,
    start_timeout: Annotated[float, typer.Option("--start-timeout", min=1.0)] = 120.0,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> int:
    """Start a local lmcache server on 127.0.0.1 for trying things; Ctrl-C or SIGTERM stops it.

    It prints the url and http_url to pass to other commands (``--json``: one
    ``{"event": "started", ...}`` line, then ``{"event": "stopped", ...}``).
    """
    from .testing import LocalServer, LocalServerError, ServerConfig, env_var_for
    from .testing import find_server_python as find

    out = _Out(json_out, debug)
    interpreter = python or find(version)
    if not interpreter:
        return out.fail(UsageProblem(
            f"no interpreter for lmcache {version}: pass --python or set ${env_var_for(version)}"))
    if not os.access(interpreter, os.X_OK):
        return out.fail(UsageProblem(f"--python {interpreter} is not an executable"))
    try:
        config = ServerConfig(version=version, python=interpreter, shm=shm,
                              chunk_size=chunk_size, l1_size_gb=l1_size_gb)
    except (ValueError, TypeError) as exc:
        return out.fail(UsageProblem(str(exc)))
    srv = LocalServer(config, zmq_port=zmq_port, http_port=http_port)

    def on_term(signum: int, frame: Any) -> NoReturn:
        raise _Stop()

    previous = signal.signal(signal.SIGTERM, on_term)
    code = 0
    info: dict[str, Any] = {}
    try:
        try:
            srv.start(timeout=start_timeout)
        except LocalServerError as exc:
            return out.fail(LocalServerError(f"{_one_line(exc)} (log: {srv.log_path})"))
        info = {"event": "started", "version": srv.reported_version, "url": srv.url,
                "http_url": srv.http_url, "pid": srv.pid, "shm": shm,
                "shm_segment": srv.shm_segment, "log": str(srv.log_path)}
        if out.json:
            out.emit(info)
        else:
            out.print(f"lmcache {srv.reported_version} server running (pid {srv.pid})\n"
                      f"  url       {srv.url}\n  http_url  {srv.http_url}\n"
                      f"  log       {srv.log_path}\n"
                      f"try: lmkv --url {srv.url} --http-url {srv.http_url} status\n"
                      "Ctrl-C to stop")
            sys.stdout.flush()
        while srv.is_running():
            time.sleep(0.5)
        code = out.fail(LocalServerError(f"the server exited on its own (log: {srv.log_path})"))
    except (KeyboardInterrupt, _Stop):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        srv.stop()
    if out.json:
        out.emit({"event": "stopped", "pid": info.get("pid"), "exit_code": code})
    elif code == 0:
        out.print("stopped")
    return code


# ----------------------------------------------------------------------------- app


def build_app() -> typer.Typer:
    """The typer application (commands registered without decorators, so it stays typed)."""
    app = typer.Typer(
        name="lmkv", add_completion=False, no_args_is_help=True,
        pretty_exceptions_enable=False,  # never print locals (the API key)
        context_settings={"help_option_names": ["-h", "--help"]},
        help=("Talk to an LMCache multiprocess KV-cache server. Exit codes: 0 ok, 1 server "
              "error, 2 usage/bad input, 3 unreachable/timeout, 4 auth, 5 not available, "
              "130 interrupted."),
    )
    app.callback()(_root)
    for fn in (ping, status, lookup, events, bench, server):
        app.command(fn.__name__)(fn)
    return app


def main(argv: Iterable[str] | None = None) -> int:
    """Run ``lmkv`` with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    app = build_app()
    global _G
    _G = _Globals()
    try:
        rv = app(args=args, prog_name="lmkv", standalone_mode=False)
    except KeyboardInterrupt:
        return int(ExitCode.INTERRUPTED)
    except Exception as exc:
        if _named(exc, "Exit"):  # --help, --version
            return int(getattr(exc, "exit_code", 0) or 0)
        if _named(exc, "Abort"):
            return int(ExitCode.INTERRUPTED)
        if not isinstance(exc, _ClickException):
            raise
        # usage errors: one line, minus click's help block
        message = exc.format_message()  # type: ignore[attr-defined]
        if not message:  # no command: click printed the help already
            return int(ExitCode.USAGE)
        if "--json" in args:
            sys.stdout.write(json.dumps({"error": {"type": "UsageError", "message": message,
                                                   "exit_code": int(ExitCode.USAGE)}}) + "\n")
        else:
            sys.stderr.write(f"lmkv: error: {message} (see lmkv --help)\n")
        return int(ExitCode.USAGE)
    return int(rv) if isinstance(rv, int) else 0


def _console_script() -> None:
    """``python -m lmkv_async.cli``: run :func:`main` and exit with its code."""
    sys.exit(main())


if __name__ == "__main__":
    _console_script()
