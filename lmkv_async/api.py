"""Module-level functions mirroring lmcache's ``sdk/kvcache.py`` functional API.

So code written against the official SDK migrates line by line::

    ctx = await lmkv.connect(url, http_url, model_name)   # was: kvcache.connect(...)
    await lmkv.store(ctx, kv, tokens)                       # was: kvcache.store(ctx, kv, tokens)
    kv = await lmkv.retrieve(ctx, tokens)                   # was: kvcache.retrieve(ctx, tokens)
    await lmkv.close(ctx)                                   # was: kvcache.close(ctx)

Differences: ``store`` returns a :class:`StoreResult` (not a bool whose meaning
depends on the transport), and failures raise typed errors instead of
returning ``None`` after a timeout.
"""

from __future__ import annotations

import torch

from .context import AsyncKVContext, StoreResult
from .validate import Tokens

__all__ = ["close", "lookup", "retrieve", "store"]


async def store(
    ctx: AsyncKVContext,
    kv: torch.Tensor,
    tokens: Tokens,
    cache_salt: str = "",
    *,
    timeout: float | None = None,
) -> StoreResult:
    """Same as :meth:`AsyncKVContext.store`."""
    return await ctx.store(kv, tokens, cache_salt=cache_salt, timeout=timeout)


async def retrieve(
    ctx: AsyncKVContext,
    tokens: Tokens,
    cache_salt: str = "",
    *,
    out: torch.Tensor | None = None,
    timeout: float | None = None,
) -> torch.Tensor | None:
    """Same as :meth:`AsyncKVContext.retrieve`: the cached prefix's KV, or None on a miss."""
    return await ctx.retrieve(tokens, out=out, cache_salt=cache_salt, timeout=timeout)


async def lookup(
    ctx: AsyncKVContext, tokens: Tokens, cache_salt: str = "", *, timeout: float | None = None
) -> int:
    """Same as :meth:`AsyncKVContext.lookup`: cached prefix length in tokens."""
    return await ctx.lookup(tokens, cache_salt=cache_salt, timeout=timeout)


async def close(ctx: AsyncKVContext) -> None:
    """Same as :meth:`AsyncKVContext.aclose`."""
    await ctx.aclose()
