"""The commands that read a server: ``ping``, ``status`` and ``lookup``."""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer

from ..errors import ServerTimeoutError, ServerUnavailableError
from ..http import HttpClient, resolve_api_key
from ._exits import UsageProblem, exit_code_for
from ._options import DebugOpt, JsonOpt, LayoutOpt, SaltOpt, layout_or_none, open_context, options
from ._output import Output, human_bytes, one_line, run_body


async def _zmq_probe(url: str, timeout: float) -> tuple[object, float]:
    """One harmless op-21 round trip on a fresh DEALER: (reply, seconds)."""
    import zmq
    import zmq.asyncio

    from ..errors import ProtocolError
    from ..wire import requests
    from ..wire.frames import decode_reply, encode_request, pack

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
    out = Output(json_out, debug)

    async def body() -> int:
        http = HttpClient(options.http_url, timeout=options.timeout,
                          api_key=resolve_api_key(options.api_key))
        rounds: list[dict[str, Any]] = []
        try:
            for i in range(count):
                if i:
                    await asyncio.sleep(interval)
                t0 = time.perf_counter()
                healthy = await http.healthcheck(timeout=options.timeout)
                http_s = time.perf_counter() - t0
                if not healthy:
                    raise ServerUnavailableError("HTTP /healthcheck did not report healthy",
                                                 op="GET /healthcheck", server=options.http_url)
                version = await http.version()
                reply, zmq_s = await _zmq_probe(options.url, options.timeout)
                row = {"seq": i + 1, "healthy": healthy, "version": version,
                       "http_ms": round(http_s * 1e3, 3), "zmq_ms": round(zmq_s * 1e3, 3),
                       "zmq_reply": reply}
                rounds.append(row)
                if not out.json:
                    out.print(f"{options.url} ({options.http_url}): lmcache {version}, healthy; "
                              f"http {row['http_ms']:.2f} ms, zmq {row['zmq_ms']:.2f} ms")
        finally:
            await http.aclose()
        if out.json:
            out.emit({"url": options.url, "http_url": options.http_url, "rounds": rounds})
        return 0

    return run_body(out, body)


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


def status(
    layout: LayoutOpt = None,
    raw: Annotated[bool, typer.Option("--raw", help="With --json: the whole /status too.")] = False,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> int:
    """Server version, dialect, capabilities, transport, chunk size, and /status numbers."""
    out = Output(json_out, debug)

    async def body() -> int:
        ctx = await open_context(layout_or_none(layout), fallback=True)
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
            ("memory", f"{human_bytes(summary['memory_used_bytes'])} of "
                       f"{human_bytes(summary['memory_total_bytes'])}"),
            ("engine registrations", str(summary["engine_registrations"])),
        ]
        for k, v in rows:
            table.add_row(k, v)
        out.print(table)
        return 0

    return run_body(out, body)


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
    out = Output(json_out, debug)

    async def body() -> int:
        token_lists, _single = _read_token_lists(source)
        lay = layout_or_none(layout)
        ctx = await open_context(lay, fallback=True)
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
                row["error"] = {"type": type(r.error).__name__, "message": one_line(r.error)}
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

    return run_body(out, body)

