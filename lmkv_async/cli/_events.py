"""``lmkv events``: tail the server's KV event stream."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any

import typer

from ..context import AsyncKVContext
from ._exits import NotAvailable
from ._options import DebugOpt, JsonOpt, LayoutOpt, layout_or_none, open_context
from ._output import Output, jsonable, run_body


def _record_doc(rec: Any) -> Any:
    """A KV event record as plain JSON-able data."""
    doc = jsonable(rec) if not isinstance(rec, (dict, list, str, int, float)) else rec
    if isinstance(doc, Mapping):
        return {k: jsonable(v) if not isinstance(v, (str, int, float, bool, type(None),
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
    out = Output(json_out, debug)
    if getattr(AsyncKVContext, "kv_events", None) is None:
        return out.fail(NotAvailable(
            "KV event streams are not available in this build of lmkv_async "
            "(AsyncKVContext has no kv_events())"))

    async def body() -> int:
        ctx = await open_context(layout_or_none(layout), fallback=True, heartbeat=True)
        try:
            stream = ctx.kv_events()
            seen = 0
            async for rec in stream:
                doc = _record_doc(rec)
                if out.json:
                    out.emit(doc)
                else:
                    out.print(json.dumps(doc, default=jsonable))
                seen += 1
                if count and seen >= count:
                    break
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            await ctx.aclose()
        return 0

    return run_body(out, body, interrupt_ok=True)

