"""The version policy at connect, against a small fake that reports any ``/version``:
a release newer than the newest tested is spoken to with the newest dialect, warned
about once, flagged on the context, and named in every timeout; older than 0.5.0 is
refused; an unparseable version falls back to ``/config``. (Real releases are covered by
the whole suite; a fake is the only way to be a release that does not exist yet.)"""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

import lmkv_async as lmkv
from lmkv_async.wire import DIALECT_056, DIALECT_057

pytestmark = pytest.mark.anyio

LAYOUT = lmkv.KVLayout(num_layers=1, num_kv_heads=1, head_dim=16)


class VersionFake:
    """HTTP ``/version`` + ``/config`` and a ZMQ ROUTER that registers, answers chunk size,
    ping, unregister and end_session, and never answers anything else (like a server that
    silently rejects a request)."""

    def __init__(self, version: Any, mp: dict[str, Any]) -> None:
        fake = self
        self.version = version
        self.config = {"mp": mp}
        self.ops: list[object] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body: Any = {"/version": fake.version, "/config": fake.config}.get(self.path)
                if body is None:
                    self.send_response(404)
                    self.end_headers()
                    return
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.url = f"tcp://127.0.0.1:{port}"
        self.http_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._task: asyncio.Task[None] | None = None

    async def _serve(self) -> None:
        answers = {14: {"shm_name": "", "pool_size": 0, "null_block_id": 0}, 21: 256,
                   22: True, 15: None, 13: None, 32: ["kv_event_stream"]}
        while True:
            identity, uid, op_frame, *_ = await self.sock.recv_multipart()
            op = msgpack.unpackb(op_frame)
            self.ops.append(op)
            if op in answers:
                result = answers[op]
                tail = [] if result is None else [msgpack.packb(result)]
                await self.sock.send_multipart([identity, uid, op_frame, *tail])

    async def __aenter__(self) -> VersionFake:
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()
        self._task = asyncio.create_task(self._serve())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        self.httpd.shutdown()
        self.sock.close(0)
        self.ctx.term()


MP_057 = {"chunk_size": 256, "supported_transfer_mode": "auto", "session_ttl_seconds": 600,
          "worker_reap_timeout_seconds": 120, "kv_load_policy": "default"}


@pytest.fixture
async def newer() -> AsyncIterator[VersionFake]:
    async with VersionFake("0.6.0-gfuture", MP_057) as fake:
        yield fake


async def test_newer_release_is_spoken_to_flagged_warned_and_named_in_timeouts(
    newer: VersionFake, caplog: pytest.LogCaptureFixture
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
    # only the integer ids of the 0.5.7 table went out
    assert all(isinstance(op, int) for op in newer.ops)


async def test_release_older_than_050_is_refused_before_zmq() -> None:
    async with VersionFake("0.4.9", MP_057) as fake:
        with pytest.raises(lmkv.UnsupportedServerError, match=r"older than 0\.5\.0"):
            await lmkv.connect(fake.url, fake.http_url, "old", layout=LAYOUT)
        assert fake.ops == []


@pytest.mark.parametrize(("mp", "dialect"), [
    (MP_057, DIALECT_057),
    ({"chunk_size": 256, "supported_transfer_mode": "auto", "session_ttl_seconds": 600,
      "enable": True}, DIALECT_056),
])
async def test_unparseable_version_falls_back_to_config_keys(
    mp: dict[str, Any], dialect: object
) -> None:
    async with VersionFake("dev-build", mp) as fake, lmkv.connect(
        fake.url, fake.http_url, "cfg", layout=LAYOUT, heartbeat_interval=0
    ) as ctx:
        assert ctx.dialect is dialect and not ctx.untested_server
