"""Fleet against real servers: light lookups, fan-out deadlines, health, the event index, faults.

A trio of private servers (two 0.5.7rc2, one 0.5.6; small L1 so evictions happen)
is shared by the module for fan-out and health tests; tests of the index start
servers of their own (``fresh``), because what a server held before the fleet
attached decides whether the index may answer for it.

Every async test runs on asyncio and natively under trio, except the
one about ``asyncio.timeout`` and ``wait_for`` (asyncio's own cancellation).
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from servers import ServerPool, ServerSpec, leak_report
from storer import LmcacheStorer, astore
from test_context import gather
from timing import SETTLE, SLACK, eventually

import lmkv_async as lmkv
from lmkv_async.errors import (
    ClosedError,
    InvalidInputError,
    KVCacheError,
    ServerTimeoutError,
    ServerUnavailableError,
)
from lmkv_async.fleet import Fleet
from lmkv_async.testing import LocalServer, server_env
from lmkv_async.wire.events import KVResync, KVStored

LAYOUT = lmkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                       block_size=16)
C = 256
#: 2*2*256*128 bf16 = 256 KiB a chunk; 0.03 GiB holds about 120 chunks.
SMALL_L1 = 0.03
#: 0.01 GiB holds about 39 chunks (measured: total_object_count 39), and the server
#: evicts from 80 % of it: the seeded test's working set does not fit.
TINY_L1 = 0.01
SDK_INTEROP = Path(__file__).resolve().parent / "server_scripts" / "sdk_interop.py"


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test here runs on asyncio and natively under trio."""
    return str(request.param)


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


@pytest.fixture
def fresh(server_pool: ServerPool) -> Iterator[dict[str, LocalServer]]:
    """Three new servers (two 0.5.7rc2, one 0.5.6) with no history, for this test only."""
    specs = {"s1": ServerSpec("0.5.7rc2", l1_size_gb=TINY_L1),
             "s2": ServerSpec("0.5.7rc2", l1_size_gb=TINY_L1),
             "s3": ServerSpec("0.5.6", l1_size_gb=TINY_L1)}
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


async def synced(fleet: Fleet, names: list[str], timeout: float | None = None) -> None:
    await eventually(lambda: all(fleet[n].synced for n in names), timeout,
                     what=lambda: f"{names} synced: "
                                  f"{ {n: fleet[n].sync.why_not() for n in names} }")


async def following(fleet: Fleet, names: list[str]) -> None:
    """Every member's stream started and its server audited (what the index needs
    before it could answer, if the server's history allows)."""
    def ready() -> bool:
        return all(fleet[n].sync.incarnation is not None
                   and fleet[n].sync.audited_incarnation == fleet[n].sync.incarnation
                   for n in names)
    await eventually(ready, what=f"{names} following their streams")


async def lib_store(srv: LocalServer, model: str, seq: list[int]) -> None:
    """An engine-driven store by this library, outside any fleet."""
    async with lmkv.connect(srv.url, srv.http_url, model, layout=LAYOUT) as ctx:
        res = await ctx.store(kv_for(len(seq)), seq)
        assert res.total_chunks == len(seq) // C


async def sdk_store(srv: LocalServer, model: str, seq: list[int], tmp: Path) -> None:
    """An engine-driven store by lmcache's official SDK, run under the server's own
    interpreter (the library env never has lmcache). The SDK needs an lmcache-driven
    registration of the model on the server (an LmcacheStorer has one)."""
    tag = f"{srv.zmq_port}-{time.monotonic_ns()}"
    torch.save(torch.tensor(seq), tmp / f"t-{tag}.pt")
    torch.save(kv_for(len(seq)), tmp / f"kv-{tag}.pt")
    job = {"url": srv.url, "http_url": srv.http_url, "model": model, "timeout": 60,
           "ops": [{"op": "store", "tokens": str(tmp / f"t-{tag}.pt"),
                    "kv": str(tmp / f"kv-{tag}.pt")}]}

    def run_job() -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([srv.config.python, str(SDK_INTEROP), json.dumps(job)],
                              capture_output=True, timeout=300, env=server_env())

    proc = await anyio.to_thread.run_sync(run_job)
    lines = proc.stdout.decode().splitlines()
    assert lines, proc.stderr.decode()[-3000:]
    result = json.loads(lines[-1])
    assert result["ok"] and result["results"] == [{"op": "store", "stored": True}], result


async def settle(servers: dict[str, LocalServer]) -> None:
    """Wait until the servers' own background work (evictions) is done: their event log,
    object count and engine-driven store count stay the same for a while."""
    def snap() -> list[tuple[int, int, int]]:
        out = []
        for srv in servers.values():
            st = srv.status()
            kv = st["kv_events"]
            out.append((kv["next_seq"], kv["unbound_stores"],
                        st["storage_manager"]["l1_manager"]["total_object_count"]))
        return out
    last = await anyio.to_thread.run_sync(snap)
    deadline = time.monotonic() + SETTLE
    while True:
        await anyio.sleep(0.3)
        now = await anyio.to_thread.run_sync(snap)
        if now == last or time.monotonic() > deadline:
            return
        last = now


async def no_leaks(servers: dict[str, LocalServer], allowed: dict[str, list[int]] | None = None,
                   timeout: float | None = None) -> None:
    deadline = time.monotonic() + (SETTLE if timeout is None else timeout)
    while True:
        problems = {}
        for name, srv in servers.items():
            status = await anyio.to_thread.run_sync(srv.status)
            p = leak_report(status, (allowed or {}).get(name, ()))
            if status.get("kv_events", {}).get("subscribers", 0):
                p.append(f"kv_events.subscribers={status['kv_events']['subscribers']}")
            if p:
                problems[name] = p
        if not problems:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"leaks: {problems}")
        await anyio.sleep(0.1)


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
async def test_history_before_the_fleet_opened_is_never_answered_from_the_index(
        fresh: dict[str, LocalServer]) -> None:
    """The issue's table: prompts stored through plain ``lmkv.connect`` contexts (engine-
    driven: no event) before the fleet opens; every later answer matches the truth,
    then one member is SIGKILLed and is never answered with a count."""
    model = fresh_model()
    A, B = toks(1, 3 * C), toks(2, 2 * C)
    await lib_store(fresh["s1"], model, A)
    await lib_store(fresh["s2"], model, B)
    await lib_store(fresh["s3"], model, A[:C])
    truth_a = {"s1": 3 * C, "s2": 0, "s3": C}
    truth_b = {"s1": 0, "s2": 2 * C, "s3": 0}
    async with Fleet(urls(fresh), model_name=model, layout=LAYOUT, timeout=2.0,
                     audit_interval=0.1) as fleet:
        assert dict(await fleet.lookup(A)) == truth_a
        assert await fleet.best(A) == ("s1", 3 * C)
        await following(fleet, list(fresh))  # the index would answer now if it could
        await anyio.sleep(5 * fleet.audit_interval)
        for _ in range(3):
            res = await fleet.lookup(B)
            assert dict(res) == truth_b
            assert set(res.sources.values()) == {"lookup"}, res.sources
            assert await fleet.best(A) == ("s1", 3 * C)
        for name in fresh:
            assert not fleet[name].exact and not fleet[name].synced
            assert "engine-driven" in fleet[name].sync.why_not()
        # A member SIGKILLed: an error value, never a count; best() picks from the rest.
        fresh["s1"].kill()
        for _ in range(5):
            assert await fleet.best(A, timeout=0.5) == ("s3", C)
        res = await fleet.lookup(A, timeout=0.5)
        assert isinstance(res["s1"], KVCacheError) and res["s3"] == C
    await no_leaks({n: fresh[n] for n in ("s2", "s3")})


@pytest.mark.anyio
async def test_allow_stale_index_trades_exactness_for_speed(
        fresh: dict[str, LocalServer]) -> None:
    """The opt-in does what its name says: it answers from the index a server whose
    engine-driven history the index cannot know (so here: a wrong 0)."""
    model = fresh_model()
    B = toks(3, 2 * C)
    srv = fresh["s2"]
    await lib_store(srv, model, B)
    async with Fleet({"s2": (srv.url, srv.http_url)}, model_name=model, layout=LAYOUT,
                     audit_interval=0.1, allow_stale_index=True) as fleet:
        await synced(fleet, ["s2"])
        res = await fleet.lookup(B)
        assert (res["s2"], res.sources["s2"]) == (0, "index")  # stale: the truth is 512
        assert await fleet.lookup(B, source="lookup") == {"s2": 2 * C}


@pytest.mark.anyio
async def test_index_answers_equal_real_lookups_seeded(fresh: dict[str, LocalServer],
                                                       tmp_path: Path) -> None:
    """Property-style, over real servers with real evictions: random stores, lmcache-
    driven and through the fleet, plus engine-driven stores by this library and by the
    official SDK before and after the fleet attached. After every step, the default
    fleet's answers equal ``source="lookup"`` on every probe."""
    rng = random.Random(20261205)
    model = fresh_model()
    bases = [toks(100 + i, 8 * C) for i in range(8)]  # 64 distinct chunks a server > L1
    storers = {n: LmcacheStorer(s, model) for n, s in fresh.items()}
    lm_chunks: dict[str, set[tuple[int, int]]] = {n: set() for n in fresh}

    async def lm_store(name: str, b: int, k: int) -> None:
        await astore(storers[name], bases[b][: k * C])
        lm_chunks[name].update((b, i) for i in range(k))

    try:
        # History: s1 only lmcache-driven stores (the stream replays them from cursor 0:
        # the index may answer for s1); s2 the official SDK; s3 this library.
        await lm_store("s1", 0, 4)
        await sdk_store(fresh["s2"], model, bases[1][: 3 * C], tmp_path)
        await lib_store(fresh["s3"], model, bases[2][: 2 * C])
        probes = [b[: k * C] for b in bases for k in (1, 2, 4, 8)]
        from_index: Counter[str] = Counter()
        async with Fleet(urls(fresh), model_name=model, layout=LAYOUT, timeout=5.0,
                         audit_interval=0.2) as fleet:
            names = list(fresh)
            await following(fleet, names)
            await _agree(fleet, probes, "after attach", from_index)
            assert from_index["s1"] > 0  # the replayed history is known: index answers
            assert from_index["s2"] == from_index["s3"] == 0  # engine-driven history
            before_sdk = 0
            for step in range(18):
                # bases[7] is kept for the engine-driven stores after attach (new data:
                # the SDK reports a store of cached data as not stored).
                name, b, k = rng.choice(names), rng.randrange(len(bases) - 1), rng.randint(1, 8)
                if step == 9:
                    name, how, k = "s1", "SDK store after attach", 5
                    before_sdk = from_index["s1"]
                    await sdk_store(fresh["s1"], model, bases[7][: k * C], tmp_path)
                elif step == 13:
                    name, how, k = "s1", "library store after attach", 8
                    await lib_store(fresh["s1"], model, bases[7][: k * C])
                elif rng.random() < 0.5:
                    how = "lmcache-driven store"
                    await lm_store(name, b, k)
                else:
                    how = "fleet store"
                    await fleet[name].store(kv_for(k * C), bases[b][: k * C])
                await settle(fresh)
                await _agree(fleet, probes, f"step {step}: {how} of {k} chunks on {name}",
                             from_index)
            assert before_sdk > 0
            # After the SDK's store on s1, s1 is never answered from the index again.
            assert from_index["s1"] == before_sdk
            assert not fleet["s1"].exact
            res = await fleet.lookup(probes[0])
            assert res.sources["s1"] == "lookup"
        # Real evictions, from /status: more objects went in than are there now.
        evicted = {}
        for name, srv in fresh.items():
            st = await anyio.to_thread.run_sync(srv.status)
            went_in = st["kv_events"]["unbound_stores"] + len(lm_chunks[name])
            evicted[name] = went_in - st["storage_manager"]["l1_manager"]["total_object_count"]
        assert sum(evicted.values()) > 0 and evicted["s1"] > 0, evicted
    finally:
        for s in storers.values():
            await anyio.to_thread.run_sync(s.close)


async def _agree(fleet: Fleet, probes: list[list[int]], what: str,
                 from_index: Counter[str]) -> None:
    """The default fleet's answers equal direct lookups on every probe, at once."""
    for p in probes:
        auto = await fleet.lookup(p)
        real = await fleet.lookup(p, source="lookup")
        assert set(real.sources.values()) == {"lookup"}
        assert dict(auto) == dict(real), (
            f"{what}: {len(p) // C} chunks: fleet {dict(auto)} ({auto.sources}) "
            f"!= lookups {dict(real)}")
        from_index.update(n for n, src in auto.sources.items() if src == "index")


@pytest.mark.anyio
async def test_index_keeps_salts_apart_and_foreign_stores_force_lookups(
        fresh: dict[str, LocalServer]) -> None:
    model = fresh_model()
    srv = fresh["s2"]
    seq = toks(7, 3 * C)
    async with Fleet({"b": (srv.url, srv.http_url)}, model_name=model, layout=LAYOUT,
                     audit_interval=0.1) as fleet:
        await synced(fleet, ["b"])
        await fleet["b"].store(kv_for(3 * C), seq, cache_salt="tenant-1")
        r1 = await fleet.lookup(seq, cache_salt="tenant-1")
        r0 = await fleet.lookup(seq)
        assert (r1["b"], r1.sources["b"]) == (3 * C, "index")
        assert (r0["b"], r0.sources["b"]) == (0, "index")
        # Someone else stores engine-driven: no event says so; the audit made for the
        # very next call sees it, and the member is asked directly from then on.
        other = toks(8, 2 * C)
        await lib_store(srv, model, other)
        res = await fleet.lookup(other)
        assert (res["b"], res.sources["b"]) == (2 * C, "lookup")
        assert not fleet["b"].exact


@pytest.mark.anyio
async def test_own_stores_come_back_after_a_resync_that_discards(
        fresh: dict[str, LocalServer], anyio_backend: str) -> None:
    """A resync that discards (a lost range, a new subscription) drops the fleet's own
    stores from the index; they emit no event, so the fleet re-verifies and re-enters
    them, and a member's ``kv_events()`` stream re-announces them (what the vLLM-event
    publisher follows)."""
    model = fresh_model()
    srv = fresh["s1"]
    seq = toks(9, 3 * C)
    async with Fleet({"m": (srv.url, srv.http_url)}, model_name=model, layout=LAYOUT,
                     audit_interval=0.1) as fleet:
        m = fleet["m"]
        await synced(fleet, ["m"])
        await m.store(kv_for(3 * C), seq)
        assert fleet.index.size("m") == 3
        # What the follower does on a "lost" batch (the log outran it):
        m.sync.apply(KVResync("lost", m.sync.incarnation, 0, True, False))
        await eventually(lambda: fleet.index.size("m") == 3, what="own stores re-indexed")
        async with m.kv_events() as stream:
            with anyio.fail_after(SLACK):
                first = await stream.next()
            assert isinstance(first, KVResync) and first.discard
            again: list[object] = []
            for _ in range(3):
                with anyio.fail_after(SLACK):
                    again.append(await stream.next())
        assert all(isinstance(e, KVStored) and e.seq == 0 for e in again)
        assert [len(e.token_ids) for e in again if isinstance(e, KVStored)] == [C] * 3
        assert isinstance(again[0], KVStored) and tuple(again[0].token_ids) == tuple(seq[:C])
        # The lost range is not forgotten: by default the member is now asked directly.
        res = await fleet.lookup(seq)
        assert (res["m"], res.sources["m"]) == (3 * C, "lookup")


@pytest.mark.anyio
async def test_mixed_fleet_with_a_server_without_events(fresh: dict[str, LocalServer],
                                                        server_factory: Any) -> None:
    old: LocalServer = server_factory("0.5.2")
    servers = {"a": fresh["s1"], "c": fresh["s3"], "old": old}
    model = fresh_model()
    seq = toks(4, 2 * C)
    async with Fleet(urls(servers), model_name=model, layout=LAYOUT,
                     audit_interval=0.1) as fleet:
        assert fleet["old"].state == "up" and "kv_events" not in fleet["old"].capabilities
        await synced(fleet, ["a", "c"])
        assert not fleet["old"].synced
        for i in range(5):
            await fleet["old"].store(kv_for(2 * C), toks(40 + i, 2 * C))
        # Nothing is indexed for a member without events (the index is never read for it).
        assert fleet.index.size("old") == 0
        await fleet["old"].store(kv_for(2 * C), seq)
        res = await fleet.lookup(seq)
        assert dict(res) == {"a": 0, "c": 0, "old": 2 * C}
        assert res.sources == {"a": "index", "c": "index", "old": "lookup"}
        assert await fleet.best(seq) == ("old", 2 * C)
        old_ids = [int(i) for i in (await anyio.to_thread.run_sync(old.status))
                   ["registered_non_cuda_instance_ids"]]
        assert old_ids  # the data-path context registered
    await no_leaks(servers)


@pytest.mark.anyio
async def test_sigkill_during_best_then_restart_rejoins_and_resyncs(
        fresh: dict[str, LocalServer]) -> None:
    model = fresh_model()
    seq = toks(5, 3 * C)
    a = fresh["s1"]
    storer = LmcacheStorer(a, model)
    try:
        async with Fleet(urls(fresh), model_name=model, layout=LAYOUT,
                         probe_backoff=(0.1, 0.5), audit_interval=0.1) as fleet:
            await synced(fleet, list(fresh))
            await astore(storer, seq)
            await eventually(lambda: fleet.index.size("s1") == 3, what="s1's events")
            assert await fleet.best(seq) == ("s1", 3 * C)
            await fleet["s3"].store(kv_for(2 * C), seq[: 2 * C])
            deadline = 0.25
            answers: list[tuple[str, int]] = []
            for i in range(30):
                if i == 5:
                    a.kill()
                t0 = time.monotonic()
                answers.append(await fleet.best(seq, timeout=deadline))
                assert time.monotonic() - t0 < deadline + SLACK
                await anyio.sleep(0.02)
            # Before: s1 (3 chunks). After: never a dead server, s3 has the longest.
            assert answers[0] == ("s1", 3 * C)
            assert all(ans == ("s3", 2 * C) for ans in answers[6:]), answers
            assert fleet["s1"].state == "down" or not fleet["s1"].synced
            storer.close()
            await anyio.to_thread.run_sync(a.restart)
            await eventually(lambda: fleet["s1"].state == "up", what="s1 to rejoin")
            await synced(fleet, ["s1"])
            assert fleet.index.size("s1") == 0  # the restart discarded what s1 held
            res = await fleet.lookup(seq)
            assert res["s1"] == 0 and res.sources["s1"] == "index"
            storer = LmcacheStorer(a, model)
            await astore(storer, seq)
            await eventually(lambda: fleet.index.size("s1") == 3, what="s1's new events")
            assert await fleet.best(seq) == ("s1", 3 * C)
    finally:
        await anyio.to_thread.run_sync(storer.close)
    await no_leaks(fresh)


# ------------------------------------------------------------------ close
@pytest.mark.anyio
async def test_aclose_leaves_nothing_on_any_server(trio: dict[str, LocalServer]) -> None:
    model = fresh_model()
    seq = toks(6, 2 * C)
    fleet = Fleet(urls(trio), model_name=model, layout=LAYOUT, registration="always")
    await fleet.open()
    await following(fleet, list(trio))
    for name in trio:
        await fleet[name].store(kv_for(2 * C), seq)
        assert await fleet[name].retrieve(seq) is not None
    results = await gather(*(fleet.lookup(seq, source="lookup") for _ in range(20)))
    assert all(r == {"a": 2 * C, "b": 2 * C, "c": 2 * C} for r in results)
    for srv in trio.values():
        st = await anyio.to_thread.run_sync(srv.status)
        assert st["kv_events"]["subscribers"] >= 1
        assert len(st["registered_non_cuda_instance_ids"]) >= 2  # light + data path
    await fleet.aclose()
    await no_leaks(trio)
    await fleet.aclose()  # idempotent


async def _busy_fleet(servers: dict[str, LocalServer], model: str,
                      busy: list[asyncio.Future[Any]]) -> Fleet:
    """A fleet in use: every member with a light registration, a data-path context, a
    stream, and lookups in flight."""
    fleet = Fleet(urls(servers), model_name=model, layout=LAYOUT, registration="always")
    await fleet.open()
    seq = toks(11, 2 * C)
    for name in servers:
        await fleet[name].store(kv_for(2 * C), seq)
    busy.extend(asyncio.ensure_future(fleet.lookup(seq, source="lookup", timeout=5.0))
                for _ in range(3))
    return fleet


@pytest.mark.anyio
@pytest.mark.parametrize("after", [0.0, 0.2, 0.6])
async def test_caller_scope_ending_around_async_with_leaves_nothing(
        trio: dict[str, LocalServer], after: float) -> None:
    """``anyio.move_on_after`` around ``async with Fleet(...)``: whenever it fires (while
    opening, while working, while closing), nothing stays on any server."""
    model = fresh_model()
    seq = toks(12, 2 * C)
    with anyio.move_on_after(after):
        async with Fleet(urls(trio), model_name=model, layout=LAYOUT,
                         registration="always") as fleet:
            for name in trio:
                await fleet[name].store(kv_for(2 * C), seq)
            while True:
                await fleet.lookup(seq, source="lookup", timeout=5.0)
    await no_leaks(trio)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # asyncio.timeout and wait_for
async def test_asyncio_timeout_and_cut_short_aclose_leave_nothing(
        trio: dict[str, LocalServer]) -> None:
    model = fresh_model()
    # asyncio.timeout around the whole fleet's life
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.5):
            async with Fleet(urls(trio), model_name=model, layout=LAYOUT,
                             registration="always") as fleet:
                for name in trio:
                    await fleet[name].store(kv_for(2 * C), toks(13, 2 * C))
                await asyncio.sleep(10 * SLACK)
    await no_leaks(trio)
    # wait_for(aclose, 0.0005): cut short at once; the cleanup still runs, and a second
    # aclose waits for that same cleanup.
    busy: list[asyncio.Future[Any]] = []
    fleet = await _busy_fleet(trio, model, busy)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(fleet.aclose(), 0.0005)
    t0 = time.monotonic()
    await fleet.aclose()
    assert time.monotonic() - t0 < 5 * SLACK
    await no_leaks(trio)
    # a member closed on its own, twice, concurrently
    fleet = await _busy_fleet(trio, model, busy)
    m = fleet["a"]
    await asyncio.gather(m.aclose(), m.aclose())
    assert m.state == "closed"
    await fleet.aclose()
    await asyncio.gather(*busy, return_exceptions=True)
    await no_leaks(trio)


def test_api_key_is_never_kept_or_shown_in_the_clear() -> None:
    secret = "sk-fleet-secret-value"
    fleet = Fleet({"a": ("tcp://127.0.0.1:1", "http://127.0.0.1:2")}, model_name="m",
                  layout=LAYOUT, api_key=secret)
    assert fleet.api_key is not None and fleet.api_key.reveal() == secret
    for text in (repr(fleet), str(fleet.api_key), repr(fleet.api_key), repr(fleet["a"])):
        assert secret not in text
    assert all(secret not in repr(v) for v in vars(fleet).values())

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
                assert took < 0.3 + SLACK, f"call {i} took {took:.3f}s"
                assert res["a"] == 0 and res["c"] == 2 * C
                assert isinstance(res["b"], (ServerTimeoutError, ServerUnavailableError))
                assert await fleet.best(seq, timeout=0.3) == ("c", 2 * C)
            assert fleet["b"].state == "down"
            t0 = time.monotonic()
            res = await fleet.lookup(seq, timeout=0.3)
            assert res.sources["b"] == "down" and time.monotonic() - t0 < SLACK
        finally:
            trio["b"].resume()
        await eventually(lambda: fleet["b"].state == "up", what="b to rejoin")
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
            outcome: list[str] = []

            async def cut_lookup(scope: anyio.CancelScope) -> None:
                with scope:
                    await fleet.lookup(seq, timeout=5.0)
                    outcome.append("returned")
                outcome.append("cancelled" if scope.cancelled_caught else "not cancelled")

            scope = anyio.CancelScope()
            async with anyio.create_task_group() as tg:
                tg.start_soon(cut_lookup, scope)
                await anyio.sleep(0.3)
                scope.cancel()
            assert outcome == ["cancelled"]  # the cancellation reached the caller
        finally:
            trio["a"].resume()
        await eventually(lambda: all(m.in_flight == 0 for m in fleet.members.values()),
                         what="the cancelled lookups to finish their release steps")
        assert dict(await fleet.lookup(seq)) == {"a": 2 * C, "b": 2 * C, "c": 2 * C}
        ids = {n: [fleet[n]._ctx.instance_id] if fleet[n]._ctx else [] for n in trio}
        light = {n: [fleet[n].session.instance_id] if fleet[n].session and
                 fleet[n].session.light_registered else [] for n in trio}
        await no_leaks(trio, {n: ids[n] + light[n] for n in trio})
    await no_leaks(trio)


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
