"""A tiny KV-aware router: which backend holds the longest cached prefix of this prompt?

An ASGI app (Starlette, ``pip install lmkv_async[examples]``) in front of a
:class:`lmkv_async.Fleet`. It takes an OpenAI-style request whose prompt is
token ids and answers with the backend to send it to; it does not proxy::

    POST /v1/completions        {"model": "m", "prompt": [1, 2, 3, ...]}
    POST /v1/chat/completions   {"model": "m", "prompt_token_ids": [...], "cache_salt": "t1"}
    ->  200 {"backend": "gpu-0", "url": "http://10.0.0.1:8000", "cached_tokens": 1024,
             "hits": {"gpu-0": 1024, "gpu-1": 0}, "unavailable": {}, "sources": {...}}
    GET /health                 {"members": {"gpu-0": "up", ...}}

Token ids come as ``prompt_token_ids`` or as ``prompt`` (OpenAI's completions API
accepts a list of ints there). ``cache_salt`` is optional. Errors: 400 for a body
that is not such a request (nothing is sent to any server), 503 when no backend
answered within the deadline.

Run it::

    python examples/router.py --model m --block-size 16 --layers 32 --kv-heads 8 \\
        --head-dim 128 --server gpu-0=tcp://10.0.0.1:5555,http://10.0.0.1:8080,http://10.0.0.1:8000

(``uvicorn`` serves it when installed.) ``create_app(fleet, backends)`` builds
the app around a fleet you manage yourself, which is how the tests use it.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import AsyncIterator, Mapping
from typing import Any

import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import lmkv_async as lmkv

__all__ = ["create_app", "main"]

_MAX_BODY = 8 << 20  # a prompt of ~1M token ids as JSON


def _tokens_of(body: Any) -> tuple[list[int], str]:
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    toks = body.get("prompt_token_ids", body.get("prompt"))
    if isinstance(toks, list) and len(toks) == 1 and isinstance(toks[0], list):
        toks = toks[0]  # OpenAI allows a batch of one prompt
    if not isinstance(toks, list) or not toks or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in toks
    ):
        raise ValueError("send the prompt as token ids: 'prompt_token_ids' (or 'prompt') "
                         "must be a non-empty list of ints")
    salt = body.get("cache_salt", "")
    if not isinstance(salt, str):
        raise ValueError("'cache_salt' must be a string")
    return toks, salt


def create_app(fleet: lmkv.Fleet, backends: Mapping[str, str] | None = None, *,
               timeout: float | None = None, manage_fleet: bool = False) -> Starlette:
    """The router app around ``fleet``.

    ``backends`` maps a member name to the URL of its inference engine (returned as
    ``url``). With ``manage_fleet`` the app opens and closes the fleet in its
    lifespan; otherwise the caller does.
    """
    urls = dict(backends or {})

    async def route(request: Request) -> JSONResponse:
        raw = await request.body()
        if len(raw) > _MAX_BODY:
            return JSONResponse({"error": "request body too large"}, status_code=413)
        try:
            toks, salt = _tokens_of(await request.json())
            res = await fleet.lookup(toks, cache_salt=salt, timeout=timeout)
        except ValueError as exc:  # bad JSON, bad shape, or InvalidInputError
            return JSONResponse({"error": str(exc)}, status_code=400)
        hits = res.hits
        unavailable = {k: type(v).__name__ for k, v in res.errors.items()}
        if not hits:
            return JSONResponse({"error": "no backend answered", "unavailable": unavailable},
                                status_code=503)
        # Fleet.best's rule (longest prefix, ties to the least busy), from this answer.
        top = max(hits.values())
        name = min((k for k, v in hits.items() if v == top),
                   key=lambda k: fleet[k].in_flight)
        return JSONResponse({
            "backend": name, "url": urls.get(name), "cached_tokens": top, "hits": hits,
            "unavailable": unavailable, "sources": res.sources,
        }, headers={"x-lmkv-backend": name})

    async def health(request: Request) -> JSONResponse:
        members = {k: m.state for k, m in fleet.members.items()}
        ok = any(state == "up" for state in members.values())
        return JSONResponse({"members": members}, status_code=200 if ok else 503)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if manage_fleet:
            async with fleet:
                yield
        else:
            yield

    return Starlette(routes=[
        Route("/v1/completions", route, methods=["POST"]),
        Route("/v1/chat/completions", route, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
    ], lifespan=lifespan)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and serve the router with uvicorn."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", action="append", required=True,
                   help="NAME=ZMQ_URL,HTTP_URL[,ENGINE_URL] (repeat per backend)")
    p.add_argument("--model", required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--kv-heads", type=int, required=True)
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--timeout", type=float, default=0.05)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8800)
    args = p.parse_args(argv)
    servers: dict[str, tuple[str, str]] = {}
    engines: dict[str, str] = {}
    for spec in args.server:
        name, _, rest = spec.partition("=")
        parts = rest.split(",")
        if not name or len(parts) not in (2, 3):
            p.error(f"bad --server {spec!r}")
        servers[name] = (parts[0], parts[1])
        if len(parts) == 3:
            engines[name] = parts[2]
    layout = lmkv.KVLayout(num_layers=args.layers, num_kv_heads=args.kv_heads,
                           head_dim=args.head_dim, dtype=getattr(torch, args.dtype),
                           block_size=args.block_size, world_size=args.world_size)
    fleet = lmkv.Fleet(servers, model_name=args.model, layout=layout, timeout=args.timeout)
    app = create_app(fleet, engines, manage_fleet=True)
    try:
        import uvicorn  # type: ignore[import-not-found]
    except ImportError:
        print("install uvicorn (or serve examples.router:create_app with any ASGI server)",
              file=sys.stderr)
        return 2
    uvicorn.run(app, host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
