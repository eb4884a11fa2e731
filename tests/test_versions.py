"""The version policy at connect, against the fake server reporting any ``/version``:
a release newer than the newest tested is spoken to with the newest dialect, warned
about once, flagged on the context, and named in every timeout; older than 0.5.0 is
refused; an unparseable version falls back to ``/config``. (Real releases are covered by
the whole suite; a fake is the only way to be a release that does not exist yet.)"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
from fake_lmcache import LOOKUP, FakeLMCache

import lmkv_async as lmkv
from lmkv_async.wire import DIALECT_056, DIALECT_057

pytestmark = pytest.mark.anyio

LAYOUT = lmkv.KVLayout(num_layers=1, num_kv_heads=1, head_dim=16)


def version_fake(fake_factory: Callable[..., FakeLMCache], version: str,
                 mp: dict[str, Any]) -> FakeLMCache:
    """A fake (no SHM pool) reporting ``version`` and ``{"mp": mp}`` over HTTP; it never
    answers a lookup (like a server that silently rejects a request)."""
    fake = fake_factory(shm=False)
    fake.http["/version"] = version
    fake.config = {"mp": mp}
    fake.on(LOOKUP, lambda req, f: None, times=None)
    return fake


MP_057 = {"chunk_size": 256, "supported_transfer_mode": "auto", "session_ttl_seconds": 600,
          "worker_reap_timeout_seconds": 120, "kv_load_policy": "default"}


@pytest.fixture
def newer(fake_factory: Callable[..., FakeLMCache]) -> FakeLMCache:
    return version_fake(fake_factory, "0.6.0-gfuture", MP_057)


async def test_newer_release_is_spoken_to_flagged_warned_and_named_in_timeouts(
    newer: FakeLMCache, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="lmkv_async")
    async with lmkv.connect(newer.url, newer.http_url, "future", layout=LAYOUT,
                            heartbeat_interval=0) as ctx:
        assert ctx.dialect is DIALECT_057
        assert ctx.untested_server and ctx.server_version == "0.6.0-gfuture"
        warnings = [r for r in caplog.records if "newer than the newest" in r.getMessage()]
        assert len(warnings) == 1
        assert "0.6.0-gfuture" in warnings[0].getMessage()
        assert "0.5.7" in warnings[0].getMessage()
        with pytest.raises(lmkv.ServerTimeoutError) as info:
            await ctx.lookup(list(range(256)), timeout=0.3)  # the fake never answers lookups
        assert "newer than the newest release lmkv_async is tested with, 0.5.7" in str(
            info.value)
    # only integer ids of the table went out (fake_factory fails the test otherwise, too)
    assert newer.requests() and not newer.bad_ops


async def test_release_older_than_050_is_refused_before_zmq(
    fake_factory: Callable[..., FakeLMCache]
) -> None:
    fake = version_fake(fake_factory, "0.4.9", MP_057)
    with pytest.raises(lmkv.UnsupportedServerError, match=r"older than 0\.5\.0"):
        await lmkv.connect(fake.url, fake.http_url, "old", layout=LAYOUT)
    assert fake.requests() == []


@pytest.mark.parametrize(("mp", "dialect"), [
    (MP_057, DIALECT_057),
    ({"chunk_size": 256, "supported_transfer_mode": "auto", "session_ttl_seconds": 600,
      "enable": True}, DIALECT_056),
])
async def test_unparseable_version_falls_back_to_config_keys(
    mp: dict[str, Any], dialect: object, fake_factory: Callable[..., FakeLMCache]
) -> None:
    fake = version_fake(fake_factory, "dev-build", mp)
    async with lmkv.connect(fake.url, fake.http_url, "cfg", layout=LAYOUT,
                            heartbeat_interval=0) as ctx:
        assert ctx.dialect is dialect and not ctx.untested_server
