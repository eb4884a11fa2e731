"""Fleet against real servers: light lookups, fan-out deadlines, health, the event index, faults.

A trio of private servers (two 0.5.7rc2, one 0.5.6; small L1 so evictions happen)
is shared by the module; tests that kill, freeze or restart one put it back.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from servers import ServerPool, ServerSpec, leak_report
from storer import LmcacheStorer, astore

import lmkv_async as lmkv
from lmkv_async.errors import (
    ClosedError,
    InvalidInputError,
    ServerTimeoutError,
    ServerUnavailableError,
)
from lmkv_async.fleet import Fleet, FleetLookup
from lmkv_async.testing import LocalServer

LAYOUT = lmkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                       block_size=16)
C = 256
#: 2*2*256*128 bf16 = 256 KiB a chunk; 0.03 GiB holds about 120 chunks.
SMALL_L1 = 0.03


@pytest.fixture(scope="module")
def trio(server_pool: ServerPool) -> Iterator[dict[str, LocalServer]]:
    specs = {"a": ServerSpec("0.5.7rc2", l1_size_gb=SMALL_L1),
             "b": ServerSpec("0.5.7rc2", l1_size_gb=SMALL_L1),
             "c": ServerSpec("0.5.6", l1_size_gb=SMALL_L1)}
    servers = {name: server_pool.private(spec) for name, spec in specs.items()}
    try:
        yield servers
    finally:
        for srv in servers.values():
            server_pool.stop_private(srv)


def urls(servers: dict[str, LocalServer]) -> dict[str, tuple[str, str]]:
    return {n: (s.url, s.http_url) for n, s in servers.items()}


def fresh_model() -> str:
    return f"fleet-{time.monotonic_ns()}"


def toks(seed: int, n: int) -> list[int]:
    return random.Random(seed).choices(range(2**31), k=n)


def kv_for(n: int) -> torch.Tensor:
    return torch.zeros(2, 2, n, 128, dtype=torch.bfloat16)


async def until(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def synced(fleet: Fleet, names: list[str], timeout: float = 15.0) -> None:
    await until(lambda: all(fleet[n].synced for n in names), timeout, f"{names} synced")


async def no_leaks(servers: dict[str, LocalServer], allowed: dict[str, list[int]] | None = None,
                   timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        problems = {}
        for name, srv in servers.items():
            status = await asyncio.to_thread(srv.status)
            p = leak_report(status, (allowed or {}).get(name, ()))
            if p:
                problems[name] = p
        if not problems:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"leaks: {problems}")
        await asyncio.sleep(0.1)


# ------------------------------------------------------------------ what a lookup needs
@pytest.mark.anyio
async def test_lookup_needs_a_registration_for_the_model_but_no_shm(
        trio: dict[str, LocalServer]) -> None:
    srv = trio["a"]
    model = fresh_model()
    seq = toks(1, 2 * C)
    async with lmkv.connect(srv.url, srv.http_url, model, layout=LAYOUT) as ctx:
        await ctx.store(kv_for(2 * C), seq)
    # The objects are cached, but nobody has (model, world_size) registered now.
    async with Fleet({"a": (srv.url, srv.http_url)}, model_name=model, layout=LAYOUT,
                     registration="never", events=False) as fleet:
        m = fleet["a"]
        assert m.state == "up" and m.session is not None
        assert not m.session.light_registered and m.session.pool is None  # nothing mapped
        assert await fleet.lookup(seq) == {"a": 0}  # measured: a silent 0 without one
    async with Fleet({"a": (srv.url, srv.http_url)}, model_name=model, layout=LAYOUT,
                     registration="auto", events=False) as fleet:
        m = fleet["a"]
        assert m.session is not None and m.session.light_registered
        assert m.session.pool is None  # a registration, still no SHM mapping
        assert await fleet.lookup(seq) == {"a": 2 * C}
    # While any other registration of the model exists, none of our own is needed.
    async with lmkv.connect(srv.url, srv.http_url, model, layout=LAYOUT) as ctx:
        async with Fleet({"a": (srv.url, srv.http_url)}, model_name=model, layout=LAYOUT,
                         events=False) as fleet:
            assert fleet["a"].session is not None
            assert not fleet["a"].session.light_registered
            assert await fleet.lookup(seq) == {"a": 2 * C}
        await no_leaks({"a": srv}, {"a": [ctx.instance_id]})
    await no_leaks({"a": srv})


@pytest.mark.anyio
async def test_tokens_of_every_kind_and_bad_input_before_traffic(
        trio: dict[str, LocalServer]) -> None:
    model = fresh_model()
    seq = toks(2, 2 * C)
    async with Fleet(urls(trio), model_name=model, layout=LAYOUT, events=False) as fleet:
        await fleet["b"].store(kv_for(2 * C), seq)
        import array

        for form in (seq, tuple(seq), np.array(seq, dtype=np.int64),
                     np.array(seq, dtype=np.uint32), torch.tensor(seq), array.array("q", seq)):
            res = await fleet.lookup(form)
            assert res == {"a": 0, "b": 2 * C, "c": 0}, type(form)
        assert await fleet.best(range(5, 5 + C)) in {("a", 0), ("b", 0), ("c", 0)}
        for bad in ([-1] * C, [2**32] * C, np.zeros((2, C), dtype=np.int64),
                    np.ones(C, dtype=np.float32), "abc", [], [True] * C):
            with pytest.raises(InvalidInputError):
                await fleet.lookup(bad)
        for salt in ("a/b", "x" * 129, "a@b", 5):
            with pytest.raises(InvalidInputError):
                await fleet.best(seq, cache_salt=salt)  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError):
            await fleet.lookup(seq, timeout=0)
    with pytest.raises(ClosedError):
        await fleet.lookup(seq)


# ------------------------------------------------------------------ the event index
@pytest.mark.anyio
async def test_index_agrees_with_real_lookups_seeded(trio: dict[str, LocalServer]) -> None:
    """Property-style: random stores, lmcache-driven and through the fleet, with
    evictions from a small L1; after every step the index (no RPC) must agree with
    real lookups on every server."""
    rng = random.Random(20261202)
    model = fresh_model()
    bases = [toks(100 + i, 10 * C) for i in range(6)]  # prefixes share chunks
    storers = {n: LmcacheStorer(s, model) for n, s in trio.items()}
    try:
        async with Fleet(urls(trio), model_name=model, layout=LAYOUT, timeout=2.0) as fleet:
            names = list(trio)
            await synced(fleet, names)
            probes = [b[: k * C] for b in bases for k in (1, 3, 6, 10)]
            for step in range(24):
                name = rng.choice(names)
                base = rng.choice(bases)
                k = rng.randint(1, 10)
                if rng.random() < 0.5:
                    await astore(storers[name], base[: k * C])
                    how = "lmcache-driven"
                else:
                    await fleet[name].store(kv_for(k * C), base[: k * C])
                    how = "fleet"
                await _agree(fleet, probes, f"step {step}: {how} store of {k} chunks on {name}")
            # The L1 is small: evictions must have happened and been applied.
            removed = 0
            for srv in trio.values():
                st = await asyncio.to_thread(srv.status)
                removed += st["kv_events"]["next_seq"]
            assert removed > 0
            assert all(fleet[n].synced for n in names)
            # No RPC: with every member synced, answers all come from the index.
            res = await fleet.lookup(probes[0])
            assert set(res.sources.values()) == {"index"}
    finally:
        for s in storers.values():
            await asyncio.to_thread(s.close)


async def _agree(fleet: Fleet, probes: list[list[int]], what: str) -> None:
    """Events arrive asynchronously: allow a short settling time, then require equality."""
    deadline = time.monotonic() + 5.0
    while True:
        bad = []
        for p in probes:
            idx = await fleet.lookup(p, source="index")
            real = await fleet.lookup(p, source="lookup")
            if dict(idx) != dict(real):
                bad.append((len(p) // C, dict(idx), dict(real)))
        if not bad:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: index != lookups for {bad[:3]}")
        await asyncio.sleep(0.1)


@pytest.mark.anyio
async def test_index_keeps_salts_apart_and_foreign_stores_force_lookups(
        trio: dict[str, LocalServer]) -> None:
    model = fresh_model()
    srv = trio["b"]
    seq = toks(7, 3 * C)
    async with Fleet({"b": (srv.url, srv.http_url)}, model_name=model, layout=LAYOUT) as fleet:
        await synced(fleet, ["b"])
        await fleet["b"].store(kv_for(3 * C), seq, cache_salt="tenant-1")
        r1 = await fleet.lookup(seq, cache_salt="tenant-1")
        r0 = await fleet.lookup(seq)
        assert (r1["b"], r1.sources["b"]) == (3 * C, "index")
        assert (r0["b"], r0.sources["b"]) == (0, "index")
        # Someone else stores engine-driven: no event says so; the /status audit
        # notices and the member is answered with real lookups from then on.
        other = toks(8, 2 * C)
        async with lmkv.connect(srv.url, srv.http_url, model, layout=LAYOUT) as ctx:
            await ctx.store(kv_for(2 * C), other)
        await until(lambda: not fleet["b"].exact, 10, "the audit to see a foreign store")
        res = await fleet.lookup(other)
        assert (res["b"], res.sources["b"]) == (2 * C, "lookup")


# ------------------------------------------------------------------ fan-out and health
@pytest.mark.anyio
async def test_frozen_server_never_delays_past_the_deadline_and_rejoins(
        trio: dict[str, LocalServer]) -> None:
    model = fresh_model()
    seq = toks(3, 2 * C)
    async with Fleet(urls(trio), model_name=model, layout=LAYOUT, events=False,
                     probe_backoff=(0.1, 0.5)) as fleet:
        await fleet["c"].store(kv_for(2 * C), seq)
        trio["b"].freeze()
        try:
            for i in range(4):
                t0 = time.monotonic()
                res = await fleet.lookup(seq, timeout=0.3)
                took = time.monotonic() - t0
                assert took < 0.3 + 0.15, f"call {i} took {took:.3f}s"
                assert res["a"] == 0 and res["c"] == 2 * C
                assert isinstance(res["b"], (ServerTimeoutError, ServerUnavailableError))
                assert await fleet.best(seq, timeout=0.3) == ("c", 2 * C)
            assert fleet["b"].state == "down"
            t0 = time.monotonic()
            res = await fleet.lookup(seq, timeout=0.3)
            assert res.sources["b"] == "down" and time.monotonic() - t0 < 0.1
        finally:
            trio["b"].resume()
        await until(lambda: fleet["b"].state == "up", 10, "b to rejoin")
        assert (await fleet.lookup(seq))["b"] == 0


@pytest.mark.anyio
async def test_cancelled_lookup_leaves_nothing_behind(trio: dict[str, LocalServer]) -> None:
    model = fresh_model()
    seq = toks(9, 2 * C)
    async with Fleet(urls(trio), model_name=model, layout=LAYOUT, events=False) as fleet:
        for name in trio:
            await fleet[name].store(kv_for(2 * C), seq)
        trio["a"].freeze()
        try:
            task = asyncio.create_task(fleet.lookup(seq, timeout=5.0))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            trio["a"].resume()
        await until(lambda: all(m.in_flight == 0 for m in fleet.members.values()), 10,
                    "the cancelled lookups to finish their release steps")
        assert dict(await fleet.lookup(seq)) == {"a": 2 * C, "b": 2 * C, "c": 2 * C}
        ids = {n: [fleet[n]._ctx.instance_id] if fleet[n]._ctx else [] for n in trio}
        light = {n: [fleet[n].session.instance_id] if fleet[n].session and
                 fleet[n].session.light_registered else [] for n in trio}
        await no_leaks(trio, {n: ids[n] + light[n] for n in trio})
    await no_leaks(trio)


@pytest.mark.anyio
async def test_mixed_fleet_with_a_server_without_events(trio: dict[str, LocalServer],
                                                        server_factory: Any) -> None:
    old: LocalServer = server_factory("0.5.2")
    servers = {"a": trio["a"], "c": trio["c"], "old": old}
    model = fresh_model()
    seq = toks(4, 2 * C)
    async with Fleet(urls(servers), model_name=model, layout=LAYOUT) as fleet:
        assert fleet["old"].state == "up" and "kv_events" not in fleet["old"].capabilities
        await synced(fleet, ["a", "c"])
        assert not fleet["old"].synced
        await fleet["old"].store(kv_for(2 * C), seq)
        res = await fleet.lookup(seq)
        assert dict(res) == {"a": 0, "c": 0, "old": 2 * C}
        assert res.sources == {"a": "index", "c": "index", "old": "lookup"}
        assert await fleet.best(seq) == ("old", 2 * C)
        old_ids = [int(i) for i in (await asyncio.to_thread(old.status))
                   ["registered_non_cuda_instance_ids"]]
        assert old_ids  # the data-path context registered
    await no_leaks(servers)


@pytest.mark.anyio
async def test_sigkill_during_best_then_restart_rejoins_and_resyncs(
        trio: dict[str, LocalServer]) -> None:
    model = fresh_model()
    seq = toks(5, 3 * C)
    storer = LmcacheStorer(trio["a"], model)
    try:
        async with Fleet(urls(trio), model_name=model, layout=LAYOUT,
                         probe_backoff=(0.1, 0.5)) as fleet:
            await synced(fleet, list(trio))
            await astore(storer, seq)
            await until(lambda: fleet.index.size("a") == 3, 5, "a's events")
            assert await fleet.best(seq) == ("a", 3 * C)
            await fleet["c"].store(kv_for(2 * C), seq[: 2 * C])
            deadline = 0.25
            killed_at = None
            answers: list[tuple[str, int]] = []
            for i in range(30):
                if i == 5:
                    trio["a"].kill()
                    killed_at = i
                t0 = time.monotonic()
                answers.append(await fleet.best(seq, timeout=deadline))
                assert time.monotonic() - t0 < deadline + 0.15
                await asyncio.sleep(0.02)
            assert killed_at is not None
            # Before: a (3 chunks). After: never a dead server, c has the longest.
            assert answers[0] == ("a", 3 * C) and answers[-1] == ("c", 2 * C)
            assert fleet["a"].state == "down" or not fleet["a"].synced
            storer.close()
            await asyncio.to_thread(trio["a"].restart)
            await until(lambda: fleet["a"].state == "up", 15, "a to rejoin")
            await synced(fleet, ["a"], timeout=15)
            assert fleet.index.size("a") == 0  # the restart discarded what a held
            res = await fleet.lookup(seq)
            assert res["a"] == 0 and res.sources["a"] == "index"
            storer = LmcacheStorer(trio["a"], model)
            await astore(storer, seq)
            await until(lambda: fleet.index.size("a") == 3, 5, "a's new events")
            assert await fleet.best(seq) == ("a", 3 * C)
    finally:
        await asyncio.to_thread(storer.close)
    await no_leaks(trio, {"a": [], "b": [], "c": []})


@pytest.mark.anyio
async def test_aclose_leaves_nothing_on_any_server(trio: dict[str, LocalServer]) -> None:
    model = fresh_model()
    seq = toks(6, 2 * C)
    fleet = Fleet(urls(trio), model_name=model, layout=LAYOUT, registration="always")
    await fleet.open()
    await synced(fleet, list(trio))
    for name in trio:
        await fleet[name].store(kv_for(2 * C), seq)
        assert await fleet[name].retrieve(seq) is not None
    lookups = [fleet.lookup(seq, source="lookup") for _ in range(20)]
    results: list[FleetLookup] = await asyncio.gather(*lookups)
    assert all(r == {"a": 2 * C, "b": 2 * C, "c": 2 * C} for r in results)
    for srv in trio.values():
        st = await asyncio.to_thread(srv.status)
        assert st["kv_events"]["subscribers"] >= 1
        assert len(st["registered_non_cuda_instance_ids"]) >= 2  # light + data path
    await fleet.aclose()
    await no_leaks(trio)
    for srv in trio.values():
        assert (await asyncio.to_thread(srv.status))["kv_events"]["subscribers"] == 0


# ------------------------------------------------------------------ the index, no server
def test_prefix_index_edges_salts_and_removal() -> None:
    from lmkv_async._index import PrefixIndex
    from lmkv_async.wire.hashing import chunk_hashes
    from lmkv_async.wire.keys import token_bytes

    idx = PrefixIndex(C)
    seq = toks(50, 4 * C)
    hs = chunk_hashes(seq, C)
    packed = token_bytes(seq)
    # Events: chunk 0 (a verified root), chunk 1 chained, chunk 3 with a lost parent.
    idx.add_event("x", [hs[0]], None, seq[:C])
    idx.add_event("x", [hs[1]], hs[0], seq[C:2 * C])
    idx.add_event("x", [hs[3]], None, seq[3 * C:])  # not a root: unreachable, but held
    assert idx.longest(packed, 4, "", ["x"]) == {"x": 2}
    assert idx.holds("x", hs[3]) and idx.edges == 2
    assert idx.longest(packed, 4, "tenant", ["x"]) == {"x": 0}  # events count for ""
    idx.add_own("y", seq, "tenant", 3)
    assert idx.longest(packed, 4, "tenant", ["x", "y"]) == {"x": 0, "y": 3}
    idx.remove("y", [hs[1]])
    assert idx.longest(packed, 4, "tenant", ["y"]) == {"y": 1}
    assert idx.longest(packed, 4, "", ["x"]) == {"x": 2}  # the shared edge survives on x
    idx.discard("x")
    assert idx.size("x") == 0 and idx.longest(packed, 4, "", ["x"]) == {"x": 0}
    idx.discard("y")
    assert idx.edges == 0 and idx.size() == 0  # no server holds them: edges are dropped
