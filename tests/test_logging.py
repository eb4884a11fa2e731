"""Log records carry ``op``, ``server`` and ``request_id``, and never keys or token contents.

The unit tests check the mechanism (lmkv_async._logctx); the live test makes a real
0.5.6 server stop answering in the middle of a retrieve, so the library logs from
the operation's release steps, and checks what those records say.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import lmkv_async as lmkv
from lmkv_async import _logctx
from lmkv_async.testing import LocalServer

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = lmkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                       block_size=16)


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def captured() -> Iterator[Capture]:
    root = logging.getLogger("lmkv_async")
    handler = Capture()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


def test_every_logger_in_the_sources_has_the_filter() -> None:
    names: set[str] = set()
    for path in (ROOT / "lmkv_async").rglob("*.py"):
        names.update(re.findall(r"""logging\.getLogger\(\s*["']([^"']+)["']""",
                                path.read_text()))
    assert names, "no loggers found: the pattern is stale"
    assert names <= set(_logctx.LOGGER_NAMES), names - set(_logctx.LOGGER_NAMES)
    for name in names:
        assert any(isinstance(f, _logctx.ContextFilter) for f in logging.getLogger(name).filters)


def test_binding_is_per_task_inherited_by_tasks_it_starts_and_extra_wins(
        captured: Capture) -> None:
    log = logging.getLogger("lmkv_async.transport")

    async def op() -> None:
        _logctx.bind(op="lookup", server="tcp://x:1", request_id="lmkv-lookup-abc")
        log.warning("inside")
        await asyncio.create_task(child())  # a release step: created after bind()
        log.warning("explicit", extra={"op": "other"})

    async def child() -> None:
        log.warning("release step")

    async def main() -> None:
        await asyncio.create_task(op())
        log.warning("outside")  # the caller's context was never bound

    asyncio.run(main())
    got = {r.getMessage(): (r.op, r.server, r.request_id)  # type: ignore[attr-defined]
           for r in captured.records}
    assert got == {
        "inside": ("lookup", "tcp://x:1", "lmkv-lookup-abc"),
        "release step": ("lookup", "tcp://x:1", "lmkv-lookup-abc"),
        "explicit": ("other", "tcp://x:1", "lmkv-lookup-abc"),
        "outside": (None, None, None),
    }
    # a formatter can use the fields on every record of the package
    fmt = logging.Formatter("%(op)s %(server)s %(request_id)s %(message)s")
    assert fmt.format(captured.records[-1]) == "None None None outside"


def test_a_stalled_retrieve_logs_with_its_op_server_and_request_id(
        server_factory: Callable[..., LocalServer], captured: Capture) -> None:
    srv = server_factory("0.5.6", private=True)
    base = 987_654_321
    tokens = list(range(base, base + 2 * 256))

    async def go() -> None:
        ctx = await lmkv.connect(srv.url, srv.http_url, "log-test", layout=LAYOUT,
                                 heartbeat_interval=0)
        try:
            kv = torch.randn(2, 2, len(tokens), 128).to(torch.bfloat16)
            await ctx.store(kv, tokens)
            srv.freeze()  # no answers: the retrieve times out with release steps pending
            with pytest.raises(lmkv.ServerTimeoutError):
                await ctx.retrieve(tokens, timeout=1.0)
            srv.kill()  # the pending release steps fail or are skipped, and say so
            deadline = time.monotonic() + 15
            while not [r for r in captured.records if getattr(r, "op", None) == "retrieve"]:
                assert time.monotonic() < deadline, [r.getMessage() for r in captured.records]
                await asyncio.sleep(0.1)
        finally:
            await ctx.aclose()

    asyncio.run(go())
    ours = [r for r in captured.records if getattr(r, "op", None) == "retrieve"]
    assert ours
    for r in ours:
        assert r.server == srv.url  # type: ignore[attr-defined]
        assert re.fullmatch(r"lmkv-retrieve-[0-9a-f]{32}", r.request_id)  # type: ignore[attr-defined]
    assert len({r.request_id for r in ours}) == 1  # type: ignore[attr-defined]
    for r in captured.records:
        for name in _logctx.FIELDS:
            assert hasattr(r, name), (name, r.getMessage())
        text = r.getMessage() + " " + " ".join(str(a) for a in (r.args or ()))
        # neither token ids nor their bytes (the key material) appear anywhere
        assert str(base) not in text and str(base + 1) not in text, text
        assert base.to_bytes(4, "little").hex() not in text, text
        assert base.to_bytes(4, "big").hex() not in text, text
