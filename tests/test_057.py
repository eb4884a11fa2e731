"""lmcache 0.5.7 specifics against real 0.5.7rc2 servers: API keys, capabilities, and a
bounded ``aclose()`` on a server that never answers (also on 0.5.6 and 0.5.2)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from servers import VERSIONS, assert_no_leaks
from test_context import LAYOUT, random_kv, same_bits, tokens_for

import lmkv_async as lmkv
from lmkv_async.testing import LocalServer
from lmkv_async.wire.dialect import CAP_API_KEYS, CAP_KV_EVENTS

pytestmark = pytest.mark.anyio

#: Recognisable, so a leak into any text is found by a plain substring search.
KEY = "lmkv-test-key-7Qz9XfK2pLmN4rT8"


@pytest.fixture
def keyed_server(server_factory: Callable[..., LocalServer]) -> LocalServer:
    """One shared 0.5.7rc2 server started with --api-key-file (same spec for every test)."""
    return server_factory("0.5.7rc2", api_key=KEY)


async def test_api_key_round_trip_and_nothing_leaks_the_key(
    keyed_server: LocalServer, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for var in ("LMCACHE_API_KEY", "LMCACHE_API_KEY_FILE", "LMCACHE_HTTP_API_KEY",
                "LMCACHE_HTTP_API_KEY_FILE"):
        monkeypatch.delenv(var, raising=False)
    caplog.set_level(logging.DEBUG)
    srv = keyed_server
    async with lmkv.connect(srv.url, srv.http_url, "keyed", layout=LAYOUT,
                            api_key=KEY) as ctx:
        assert CAP_API_KEYS in ctx.capabilities and CAP_KV_EVENTS in ctx.capabilities
        C = ctx.chunk_size
        toks, kv = tokens_for(2 * C), random_kv(LAYOUT, 2 * C, seed=5)
        await ctx.store(kv, toks)
        out = await ctx.retrieve(toks)
        assert out is not None and same_bits(out, kv)
        status = await ctx.status()  # an authenticated HTTP call after connect
        assert ctx.instance_id in status["registered_non_cuda_instance_ids"]
        texts = [repr(ctx), str(ctx), repr(ctx._s.http), caplog.text]
    assert not any(KEY in t for t in texts)


async def test_key_from_the_servers_environment_variables(
    keyed_server: LocalServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = keyed_server
    for var in ("LMCACHE_API_KEY", "LMCACHE_API_KEY_FILE", "LMCACHE_HTTP_API_KEY",
                "LMCACHE_HTTP_API_KEY_FILE"):
        monkeypatch.delenv(var, raising=False)
    key_file = tmp_path / "client.key"
    key_file.write_text(f"  {KEY}  \n")
    monkeypatch.setenv("LMCACHE_API_KEY_FILE", str(key_file))
    monkeypatch.setenv("LMCACHE_API_KEY", "wrong-but-ignored")  # the file comes first
    async with lmkv.connect(srv.url, srv.http_url, "keyed-env", layout=LAYOUT) as ctx:
        assert await ctx.lookup(tokens_for(ctx.chunk_size)) == 0
    monkeypatch.delenv("LMCACHE_API_KEY_FILE")
    monkeypatch.setenv("LMCACHE_HTTP_API_KEY", KEY)  # legacy: read once the new ones are unset
    monkeypatch.setenv("LMCACHE_API_KEY", "")
    async with lmkv.connect(srv.url, srv.http_url, "keyed-env", layout=LAYOUT) as ctx:
        assert ctx.server_version.startswith("0.5.7")


@pytest.mark.parametrize("key", [None, "not-the-key-Zp4Q"])
async def test_missing_or_wrong_key_is_a_typed_error_at_once(
    keyed_server: LocalServer, key: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("LMCACHE_API_KEY", "LMCACHE_API_KEY_FILE", "LMCACHE_HTTP_API_KEY",
                "LMCACHE_HTTP_API_KEY_FILE"):
        monkeypatch.delenv(var, raising=False)
    srv = keyed_server
    t0 = time.monotonic()
    with pytest.raises(lmkv.AuthenticationError) as info:
        await lmkv.connect(srv.url, srv.http_url, "keyed", layout=LAYOUT, api_key=key,
                           timeout=30)
    assert time.monotonic() - t0 < 3, "a 401 must not be retried or waited out"
    assert isinstance(info.value, lmkv.KVCacheError)
    message = str(info.value)
    assert "401" in message and KEY not in message
    assert ("requires an API key" in message) if key is None else ("not accepted" in message)
    if key is not None:
        assert key not in message
    assert_no_leaks(srv)


def test_empty_key_is_refused_before_any_traffic() -> None:
    with pytest.raises(lmkv.InvalidInputError):
        lmkv.connect("tcp://127.0.0.1:1", "http://127.0.0.1:1", "m", api_key="  ")


@pytest.mark.parametrize("version", VERSIONS)
async def test_aclose_is_bounded_on_a_frozen_server(
    version: str, server_factory: Callable[..., LocalServer]
) -> None:
    server = server_factory(version, private=True)
    ctx = await lmkv.connect(server.url, server.http_url, "close-frozen", layout=LAYOUT,
                             timeout=20)
    C = ctx.chunk_size
    toks = tokens_for(2 * C)
    await ctx.store(random_kv(LAYOUT, 2 * C, seed=3), toks)
    server.freeze()
    try:
        # calls that will never be answered: in flight while we close
        calls = [asyncio.create_task(ctx.lookup(toks)),
                 asyncio.create_task(ctx.retrieve(toks))]
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        await ctx.aclose()
        took = time.monotonic() - t0
        assert took < 6.0, f"aclose took {took:.1f}s on a frozen server"
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(r, lmkv.KVCacheError) for r in results), results
    finally:
        server.resume()
    # Documented residue: the registration (unanswered unregister) until the reap timeout,
    # the lookup's read locks until their TTL. The server itself is healthy again:
    async with lmkv.connect(server.url, server.http_url, "close-frozen", layout=LAYOUT) as c2:
        out = await c2.retrieve(toks)
        assert out is not None
