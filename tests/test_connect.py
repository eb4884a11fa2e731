"""Connect-time behaviour: layout discovery, server modes, dialects (real servers)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from servers import VERSIONS, assert_no_leaks, assert_quiescent, checked_context
from test_context import random_kv, same_bits, tokens_for
from timing import SLACK, fast

import lmkv_async as lmkv
from lmkv_async.testing import LocalServer
from lmkv_async.wire import requests as wire_requests

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test here runs on asyncio and natively under trio."""
    return str(request.param)


@pytest.mark.parametrize("version", VERSIONS)
async def test_discovered_layout_matches_engine(
    version: str, server_factory: Callable[..., LocalServer], register_engine: Callable[..., Any]
) -> None:
    server = server_factory(version)
    model = f"discover-{version}"
    reg = register_engine(server, model=model, num_layers=3, num_kv_heads=4, head_dim=32,
                          block_size=16, dtype="float16")
    async with checked_context(server, model, allowed_instance_ids=reg.instance_ids) as ctx:
        assert ctx.layout == lmkv.KVLayout(num_layers=3, num_kv_heads=4, head_dim=32,
                                           dtype=torch.float16, block_size=16)
        toks = tokens_for(2 * ctx.chunk_size)
        kv = random_kv(ctx.layout, len(toks), seed=11)
        assert (await ctx.store(kv, toks)).written_chunks == 2
        out = await ctx.retrieve(toks)
        assert out is not None and same_bits(out, kv)
    # an unknown model has no layout to discover: a typed error naming the fix
    with pytest.raises(lmkv.LayoutNotFoundError, match="layout=KVLayout"):
        await lmkv.connect(server.url, server.http_url, "no-such-model")
    assert_no_leaks(server, allowed_instance_ids=reg.instance_ids)


@pytest.mark.parametrize("version", VERSIONS)
async def test_explicit_layout_needs_no_engine(
    version: str, server_factory: Callable[..., LocalServer]
) -> None:
    server = server_factory(version, transfer_mode="engine_driven")
    assert not server.status().get("cache_context_meta")
    layout = lmkv.KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, dtype=torch.float32)
    async with checked_context(server, "explicit", layout=layout) as ctx:
        toks = tokens_for(ctx.chunk_size)
        kv = random_kv(layout, len(toks), seed=12)
        await ctx.store(kv, toks)
        out = await ctx.retrieve(toks)
        assert out is not None and same_bits(out, kv)
    assert_no_leaks(server)


@pytest.mark.parametrize("version", VERSIONS)
async def test_lmcache_driven_server_fails_fast(
    version: str, server_factory: Callable[..., LocalServer]
) -> None:
    server = server_factory(version, transfer_mode="lmcache_driven")
    layout = lmkv.KVLayout(num_layers=1, num_kv_heads=1, head_dim=16)
    t0 = time.monotonic()
    with pytest.raises(lmkv.UnsupportedServerError, match="--supported-transfer-mode"):
        await lmkv.connect(server.url, server.http_url, "m", layout=layout, timeout=60)
    fast(time.monotonic() - t0, limit=2 * SLACK, what="must not wait for the 60 s timeout")


@pytest.mark.parametrize("version", VERSIONS)
async def test_dialect_chosen_from_version(
    version: str, server_factory: Callable[..., LocalServer]
) -> None:
    server = server_factory(version)
    layout = lmkv.KVLayout(num_layers=1, num_kv_heads=1, head_dim=16)
    async with checked_context(server, "dialect", layout=layout) as ctx:
        expected = {"0.5.2": lmkv.wire.DIALECT_052, "0.5.6": lmkv.wire.DIALECT_056,
                    "0.5.7rc2": lmkv.wire.DIALECT_057}[version]
        assert ctx.dialect is expected
        assert not ctx.untested_server
        # the request loop is alive after everything we sent (a wrong op id would kill it)
        conn = ctx._transport.pick()
        assert await conn.probe(wire_requests.noop(ctx.dialect), timeout=5) == "OK"
    assert_no_leaks(server)


@pytest.mark.parametrize("version", VERSIONS)
async def test_chunk_size_must_be_a_multiple_of_block_size(
    version: str, server_factory: Callable[..., LocalServer]
) -> None:
    """A server with --chunk-size 200: block_size 16 is refused before registering,
    block_size 8 (200 = 25 * 8) works end to end."""
    server = server_factory(version, chunk_size=200)
    bad = lmkv.KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_size=16)
    with pytest.raises(lmkv.InvalidInputError, match="not a multiple of block_size 16"):
        await lmkv.connect(server.url, server.http_url, "chunk200", layout=bad)
    await assert_quiescent(server)  # nothing registered
    good = lmkv.KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_size=8)
    async with checked_context(server, "chunk200", layout=good) as ctx:
        assert ctx.chunk_size == 200
        toks = tokens_for(2 * 200 + 7)
        kv = random_kv(good, len(toks), seed=13)
        assert (await ctx.store(kv, toks)).written_chunks == 2
        out = await ctx.retrieve(toks)
        assert out is not None and same_bits(out, kv[:, :, :400])
