"""The global options (``lmkv --url ... COMMAND``), the shared ones, layouts, and the
connection they make."""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Annotated, Any

import torch
import typer

from .. import __version__
from ..context import AsyncKVContext, connect
from ..errors import InvalidInputError
from ..layout import SUPPORTED_DTYPES, KVLayout, LayoutNotFoundError
from ._exits import UsageProblem

log = logging.getLogger("lmkv_async.cli")

_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16",
                  "fp32": "float32", "float": "float32"}
_BY_NAME = {name: dtype for dtype, name in SUPPORTED_DTYPES.items()}
#: the smallest registration, for commands that move no data
PROBE_LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.bfloat16,
                        block_size=1)
DEFAULT_BENCH_LAYOUT = "4,8,128,bfloat16,16"


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


@dataclasses.dataclass
class GlobalOptions:
    url: str = "tcp://127.0.0.1:5555"
    http_url: str = "http://127.0.0.1:8080"
    model: str = "lmkv-cli"
    api_key: str | None = None
    timeout: float = 10.0
    transport: str = "auto"
    json: bool = False
    debug: bool = False

    def reset(self) -> None:
        """Back to the defaults: each :func:`~lmkv_async.cli.main` call starts afresh."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, field.default)


options = GlobalOptions()


async def open_context(layout: KVLayout | None, *, fallback: bool, prefault: bool = False,
                heartbeat: bool = False) -> AsyncKVContext:
    """Connect with the global options; ``fallback``: probe layout if none is registered."""
    kwargs: dict[str, Any] = {
        "timeout": options.timeout, "transport": options.transport, "api_key": options.api_key,
        "prefault": prefault,
    }
    if not heartbeat:
        kwargs["heartbeat_interval"] = 0
    try:
        return await connect(options.url, options.http_url, options.model, layout=layout, **kwargs)
    except LayoutNotFoundError:
        if layout is not None or not fallback:
            raise
        log.debug("no layout registered for %r; using the probe layout", options.model)
        return await connect(options.url, options.http_url, options.model, layout=PROBE_LAYOUT,
                             **kwargs)


def layout_or_none(text: str | None) -> KVLayout | None:
    return None if text is None else parse_layout(text)


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


def global_options(
    url: Annotated[str, typer.Option("--url", envvar="LMKV_URL",
                                     help="ZMQ endpoint of the server.")] = options.url,
    http_url: Annotated[str, typer.Option("--http-url", envvar="LMKV_HTTP_URL",
                                          help="HTTP API of the server.")] = options.http_url,
    model: Annotated[str, typer.Option("--model", envvar="LMKV_MODEL",
                                       help="Model name (server-side namespace).")] = options.model,
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
    options.url, options.http_url, options.model, options.api_key = url, http_url, model, api_key
    options.timeout, options.transport = timeout, transport
    options.json, options.debug = json_out, debug

