"""Fleet + LMCache's coordinator (0.5.7rc2): discovery, directory answers, fallback.

A real ``lmcache coordinator`` and three real servers started with
``--coordinator-url`` and event reporting, all on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from servers import ServerPool, leak_report, server_python
from storer import LmcacheStorer, astore
from timing import SETTLE, SLACK

import lmkv_async as lmkv
from lmkv_async.coordinator import prefix_by_instance
from lmkv_async.testing import LocalServer, ServerConfig
from lmkv_async.testing.coordinator import LocalCoordinator

LAYOUT = lmkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                       block_size=16)
C = 256
NAMES = ("co-a", "co-b", "co-c")


def test_prefix_by_instance_needs_every_chunk_and_rank() -> None:
    def r(*insts: str, tier: str = "l1") -> dict[str, Any]:
        return {"placements": [{"instance_id": i, "tier": tier} for i in insts]}

    results = [r("x", "y"), r("x"), r("x", "y"), r("y", tier="l2")]
    assert prefix_by_instance(results, 4) == {"x": 3, "y": 1}
    # Two ranks a chunk: a chunk counts only where both ranks are placed.
    assert prefix_by_instance([r("x"), r("x", "y"), r("y"), r("y")], 2) == {"x": 1}
    assert prefix_by_instance([], 0) == {}


@pytest.fixture(scope="module")
def coordinated(server_pool: ServerPool) -> Iterator[tuple[LocalCoordinator,
                                                          dict[str, LocalServer]]]:
    coord = LocalCoordinator(server_python("0.5.7rc2"),
                             log_path=server_pool.log_dir / "coordinator.log")
    coord.start()
    servers: dict[str, LocalServer] = {}
    try:
        for name in NAMES:
            # Started here, not through the pool: the pool names logs after the flags,
            # and these carry a URL.
            cfg = ServerConfig(version="0.5.7rc2", python=server_python("0.5.7rc2"),
                               l1_size_gb=0.1, extra_args=coord.server_args(instance_id=name))
            servers[name] = LocalServer(cfg, log_path=server_pool.log_dir / f"{name}.log")
            servers[name].start()
        deadline = time.monotonic() + 10 * SLACK
        while len(coord.instances()) < len(NAMES):
            assert time.monotonic() < deadline, "servers did not register"
            time.sleep(0.2)
        yield coord, servers
    finally:
        for srv in servers.values():
            srv.stop()
        coord.stop()


async def _settle(fleet: lmkv.Fleet, seq: list[int], timeout: float = 2 * SETTLE
                  ) -> lmkv.FleetLookup:
    """The directory is fed asynchronously (event flushes): wait until it agrees."""
    deadline = time.monotonic() + timeout
    while True:
        co = await fleet.lookup(seq, source="coordinator", timeout=2.0)
        real = await fleet.lookup(seq, source="lookup", timeout=2.0)
        if dict(co) == dict(real) or time.monotonic() > deadline:
            assert dict(co) == dict(real), (dict(co), dict(real))
            assert set(co.sources.values()) == {"coordinator"}
            return co
        await asyncio.sleep(0.2)


@pytest.mark.anyio
async def test_discovery_directory_answers_and_fallback(
        coordinated: tuple[LocalCoordinator, dict[str, LocalServer]]) -> None:
    coord, servers = coordinated
    model = f"coord-{time.monotonic_ns()}"
    rng = random.Random(11)
    storer = LmcacheStorer(servers["co-a"], model)
    try:
        # No servers given: the coordinator names them (discover=True allows them all).
        async with lmkv.Fleet(None, model_name=model, layout=LAYOUT,
                              coordinator_url=coord.url, discover=True) as fleet:
            assert set(fleet.members) == set(NAMES)
            assert {m.url for m in fleet.members.values()} == {s.url for s in servers.values()}
            lm = rng.choices(range(2**31), k=3 * C)
            await astore(storer, lm)  # lmcache-driven
            eng = rng.choices(range(2**31), k=2 * C)
            await fleet["co-b"].store(torch.zeros(2, 2, 2 * C, 128, dtype=torch.bfloat16), eng)
            res = await _settle(fleet, lm)
            assert dict(res) == {"co-a": 3 * C, "co-b": 0, "co-c": 0}
            # Measured: the directory also sees engine-driven stores (no KV event).
            res = await _settle(fleet, eng)
            assert dict(res) == {"co-a": 0, "co-b": 2 * C, "co-c": 0}
            assert await fleet.best(eng, source="coordinator") == ("co-b", 2 * C)
            # ... and a store by a plain client that the fleet never saw.
            other = rng.choices(range(2**31), k=C)
            srv = servers["co-c"]
            async with lmkv.connect(srv.url, srv.http_url, model, layout=LAYOUT) as ctx:
                await ctx.store(torch.zeros(2, 2, C, 128, dtype=torch.bfloat16), other)
                res = await _settle(fleet, other)
                assert res["co-c"] == C
            # A frozen coordinator: it gets half the deadline, the servers the rest.
            assert coord._proc is not None
            coord._proc.send_signal(signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                res = await fleet.lookup(lm, source="coordinator", timeout=1.0)
                assert time.monotonic() - t0 < 1.0 + SLACK
                assert dict(res) == {"co-a": 3 * C, "co-b": 0, "co-c": 0}
                assert "coordinator" not in res.sources.values()
            finally:
                coord._proc.send_signal(signal.SIGCONT)
            # The coordinator dies: answers come from the servers themselves.
            coord.kill()
            t0 = time.monotonic()
            res = await fleet.lookup(lm, source="coordinator", timeout=1.0)
            assert time.monotonic() - t0 < 1.0 + SLACK
            assert dict(res) == {"co-a": 3 * C, "co-b": 0, "co-c": 0}
            assert "coordinator" not in res.sources.values()
            assert await fleet.best(lm, source="coordinator") == ("co-a", 3 * C)
        # Every member joined once and closed: no light registration is left behind
        # (a member joined twice once leaked a registered session here).
        await asyncio.to_thread(storer.close)
        for name, srv in servers.items():
            deadline = time.monotonic() + SETTLE
            while leak_report(await asyncio.to_thread(srv.status)):
                assert time.monotonic() < deadline, (name, leak_report(srv.status()))
                await asyncio.sleep(0.1)
    finally:
        await asyncio.to_thread(storer.close)
        if not coord.is_running():
            coord.start()  # for other tests of the module


@pytest.mark.anyio
async def test_discovered_servers_join_only_when_allowed(
        coordinated: tuple[LocalCoordinator, dict[str, LocalServer]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator lists every server that registered with it; a server the fleet
    was not given joins (and is sent the API key, and a data path) only when
    ``discover`` allows it, and one that is not allowed is never contacted."""
    import lmkv_async.coordinator as coordinator_mod
    from lmkv_async.http import HttpClient

    coord, servers = coordinated
    contacted: list[tuple[str, bool]] = []

    class Spy(HttpClient):
        def __init__(self, base_url: str, **kwargs: Any) -> None:
            contacted.append((base_url, kwargs.get("api_key") is not None))
            super().__init__(base_url, **kwargs)

    monkeypatch.setattr(coordinator_mod, "HttpClient", Spy)
    # The coordinator may have been restarted by another test: wait for its list.
    deadline = time.monotonic() + 10 * SLACK
    while len(await asyncio.to_thread(coord.instances)) < len(NAMES):
        assert time.monotonic() < deadline, "servers did not register again"
        await asyncio.sleep(0.2)
    a = servers["co-a"]
    given = {"co-a": (a.url, a.http_url)}
    model = f"coord-{time.monotonic_ns()}"
    kw: dict[str, Any] = {"model_name": model, "layout": LAYOUT, "coordinator_url": coord.url,
                          "api_key": "k-not-checked-by-these-servers"}
    # Default: only the configured server; the others are not asked anything.
    async with lmkv.Fleet(given, **kw) as fleet:
        assert set(fleet.members) == {"co-a"}
    assert {u for u, _ in contacted} == {a.http_url}
    # An allowlist: by instance id, or by host:port.
    contacted.clear()
    b, c = servers["co-b"], servers["co-c"]
    c_addr = c.http_url.split("//", 1)[1]
    async with lmkv.Fleet(given, discover={"co-b", c_addr}, **kw) as fleet:
        assert set(fleet.members) == {"co-a", "co-b", "co-c"}
    async with lmkv.Fleet(given, discover={"co-b"}, **kw) as fleet:
        assert set(fleet.members) == {"co-a", "co-b"}
    assert c.http_url in {u for u, _ in contacted}  # only while allowed
    contacted.clear()
    async with lmkv.Fleet(given, discover={"co-b"}, **kw) as fleet:
        pass
    assert {u for u, _ in contacted} == {a.http_url, b.http_url}
    # Without servers, the fleet must be told to trust the coordinator's list.
    with pytest.raises(lmkv.InvalidInputError):
        lmkv.Fleet(None, model_name=model, layout=LAYOUT, coordinator_url=coord.url)
    with pytest.raises(lmkv.InvalidInputError):
        lmkv.Fleet(given, discover="co-b", **kw)  # a string is not a collection of names
