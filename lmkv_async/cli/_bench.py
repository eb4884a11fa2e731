"""``lmkv bench``: store, retrieve and look up at a chosen size and concurrency."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import secrets
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import torch
import typer

from ..context import AsyncKVContext
from ..errors import KVCacheError
from ._exits import ExitCode, UsageProblem
from ._options import DEFAULT_BENCH_LAYOUT, DebugOpt, JsonOpt, open_context, parse_layout
from ._output import Output, human_bytes, run_body


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
    out = Output(json_out, debug)

    async def body() -> int:
        from ..metrics import OpStats

        lay = parse_layout(layout)
        chosen = [o.strip().lower() for o in (ops or ["all"])]
        for o in chosen:
            if o not in ("store", "retrieve", "lookup", "all"):
                raise UsageProblem(f"--op must be store, retrieve, lookup or all, got {o!r}")
        order = [o for o in ("store", "retrieve", "lookup") if o in chosen or "all" in chosen]
        cache_salt = salt if salt is not None else f"lmkv-bench-{secrets.token_hex(4)}"
        ctx = await open_context(lay, fallback=False, prefault=True, heartbeat=True)
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

    return run_body(out, body)


async def _bench_op(out: Output, ctx: AsyncKVContext, stats: Any, op: str,
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


def _bench_table(out: Output, s: Mapping[str, Any]) -> None:
    from rich.table import Table

    lay = s["layout"]
    title = (f"lmkv bench: {s['requests']} x {s['tokens']} tokens "
             f"(L={lay['num_layers']} NH={lay['num_kv_heads']} HS={lay['head_dim']} "
             f"{lay['dtype']}, {human_bytes(s['bytes_per_request'])} per request), "
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

