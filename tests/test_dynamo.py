"""NVIDIA Dynamo's standalone KV indexer (1.6.1) as a real consumer of the vLLM-event
publisher, against real LMCache servers.

The indexer runs from its own environment (``LMKV_DYNAMO_PYTHON``: nox builds
``.nox/dynamo-indexer``; without it these tests FAIL, they do not skip). Its HTTP
server binds 0.0.0.0 with no flag to change it, so it runs inside a private network
namespace with only ``lo`` (examples/dynamo_netns.py under ``unshare -n``): it reads
the publishers over ``ipc://`` and answers on a Unix socket. Nothing listens on a
non-loopback interface.

For every query, Dynamo's ``longest_matched`` for a worker, rounded down to whole
chunks, must equal what that worker's LMCache server answers (a lookup). At a
block size below the chunk Dynamo may also credit the whole blocks of a partial
chunk, which LMCache cannot serve: that is checked too, as a fact to document.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from storer import LmcacheStorer, astore
from timing import SLACK, eventually

import lmkv_async as lmkv
from lmkv_async.vllm_events import VllmEventPublisher, dynamo_workers_arg

ROOT = Path(__file__).resolve().parent.parent
NETNS = ROOT / "examples" / "dynamo_netns.py"
LAYOUT = lmkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                       block_size=16)
C = 256
SETTLE = 10 * SLACK


def dynamo_python() -> str:
    py = os.environ.get("LMKV_DYNAMO_PYTHON", "")
    if not py or not Path(py).exists():
        pytest.fail("LMKV_DYNAMO_PYTHON is not set to Dynamo's indexer environment "
                    "(nox -s tests builds .nox/dynamo-indexer and exports it)")
    return py


class Dynamo:
    """A running indexer: ``query(tokens) -> {worker_id: longest_matched}``."""

    def __init__(self, client: httpx.AsyncClient, model: str) -> None:
        self.client = client
        self.model = model

    async def answer(self, tokens: Sequence[int]) -> dict[str, Any]:
        r = await self.client.post("/query", json={"token_ids": list(tokens),
                                                   "model_name": self.model})
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out

    async def query(self, tokens: Sequence[int]) -> dict[int, int]:
        inst = (await self.answer(tokens))["instances"]
        return {int(k): int(v["longest_matched"]) for k, v in inst.items()}


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for Unix sockets: ``sun_path`` holds 107 bytes, and pytest's
    ``tmp_path`` under a deep checkout (or a pytest-xdist worker) is longer than that."""
    d = Path(tempfile.mkdtemp(prefix="lmkv-dyn-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """Stop the wrapper and everything it started (the indexer too, even if the wrapper
    died before it could stop it): it runs in its own process group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(15)


@asynccontextmanager
async def dynamo(tmp: Path, socks: Path, *, block_size: int, workers: str, model: str
                 ) -> AsyncIterator[Dynamo]:
    uds = socks / "dynamo-http.sock"
    unshare = ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-rn"]
    log = open(tmp / "dynamo.log", "wb")
    hello_path = tmp / "dynamo.hello"
    hello_file = open(hello_path, "wb")
    proc = subprocess.Popen(
        [*unshare, dynamo_python(), str(NETNS), str(uds), "--", "--block-size", str(block_size),
         "--port", "8090", "--threads", "1", "--model-name", model, "--workers", workers],
        stdout=hello_file, stderr=log, env={**os.environ, "DO_NOT_TRACK": "1"},
        start_new_session=True)
    hello_file.close()
    try:
        # The first stdout line, read from a file by polling: a thread blocked on a pipe
        # that an orphaned child keeps open would hang the event loop's shutdown.
        async def first_line() -> bytes | None:
            data = hello_path.read_bytes()
            if b"\n" in data:
                return data.split(b"\n", 1)[0]
            assert proc.poll() is None, (
                f"dynamo_netns.py exited (rc={proc.returncode}); see {tmp / 'dynamo.log'}")
            return None

        line = await eventually(first_line, 60, interval=0.05, what="dynamo_netns.py hello")
        hello = json.loads(line)
        assert hello["interfaces"] == ["lo"]  # a private namespace: nothing else to bind
        transport = httpx.AsyncHTTPTransport(uds=str(uds))
        async with httpx.AsyncClient(transport=transport, base_url="http://dynamo",
                                     timeout=10, trust_env=False) as client:
            async def ready() -> bool:
                try:
                    r = await client.get("/workers")
                except httpx.HTTPError:
                    return False
                listeners = [ls for w in r.json() for ls in w["listeners"].values()]
                return bool(listeners) and all(ls["status"] == "active" for ls in listeners)

            await eventually(ready, 60, what="dynamo listeners active")
            yield Dynamo(client, model)
    finally:
        await asyncio.to_thread(_stop_group, proc)
        log.close()


async def agree(dyn: Dynamo, fleet: lmkv.Fleet, ids: dict[str, int],
                queries: Sequence[Sequence[int]]) -> list[tuple[dict[str, int], dict[int, int]]]:
    """Poll until, for every query, Dynamo's answer rounded down to whole chunks equals
    each server's lookup; return the last (truth, dynamo) pairs."""
    last: list[tuple[dict[str, int], dict[int, int]]] = []

    async def check() -> bool:
        last.clear()
        ok = True
        for q in queries:
            truth = (await fleet.lookup(q, source="lookup", timeout=5)).hits
            got = await dyn.query(q)
            last.append((truth, got))
            for name, wid in ids.items():
                # A member that is down (a restart) has no answer yet: keep polling.
                if name not in truth or got.get(wid, 0) // C * C != truth[name]:
                    ok = False
        return ok

    try:
        await eventually(check, SETTLE, interval=0.2, what="dynamo agrees with lmcache")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {last}") from None
    return list(last)


async def stored(fleet: lmkv.Fleet, tokens: Sequence[int], want: dict[str, int]) -> None:
    """Wait until the servers answer ``want`` for ``tokens`` (an lmcache-driven store is
    acknowledged before the server's lookup sees it); only then compare with Dynamo,
    or both could agree on a 0 that is about to change."""
    async def ok() -> bool:
        return (await fleet.lookup(tokens, source="lookup", timeout=5)).hits == want

    await eventually(ok, SETTLE, interval=0.1, what=f"servers hold {want}")


def _prompts() -> tuple[list[int], list[int]]:
    rng = random.Random(time.monotonic_ns())
    return rng.choices(range(1, 2**31), k=3 * C + 7), rng.choices(range(1, 2**31), k=C + 3)


def _kv(n: int) -> torch.Tensor:
    return torch.zeros(2, 2, n, 128, dtype=torch.bfloat16)


@pytest.mark.anyio
@pytest.mark.parametrize(("block_size", "encoding"),
                         [(16, "map"), (16, "array"), (256, "map"), (256, "array")])
async def test_dynamo_credits_lmcache_cpu_tier(server_factory: Any, tmp_path: Path,
                                               sock_dir: Path, block_size: int,
                                               encoding: str) -> None:
    """Prompt A (3 chunks) stored lmcache-driven on s1; B (1 chunk) and A's first chunk
    stored through the fleet on s2; then s2 is cleared (removals)."""
    s1 = server_factory("0.5.7rc2", l1_size_gb=0.2)
    s2 = server_factory("0.5.7rc2", l1_size_gb=0.25)  # another spec: another server
    model = f"dyn-{block_size}-{encoding}-{time.monotonic_ns()}"
    A, B = _prompts()
    ids = {"s1": 3, "s2": 8}
    storer = LmcacheStorer(s1, model)
    try:
        async with lmkv.Fleet({"s1": (s1.url, s1.http_url), "s2": (s2.url, s2.http_url)},
                              model_name=model, layout=LAYOUT) as fleet:
            pubs = [VllmEventPublisher(fleet[n], endpoint=f"ipc://{sock_dir}/pub-{n}",
                                       replay_endpoint=f"ipc://{sock_dir}/rep-{n}",
                                       block_size=block_size, hash_mode="dynamo",
                                       encoding=encoding,  # type: ignore[arg-type]
                                       worker_id=ids[n]) for n in ("s1", "s2")]
            for p in pubs:
                await p.start()
            try:
                async with dynamo(tmp_path, sock_dir, block_size=block_size, model=model,
                                  workers=dynamo_workers_arg(pubs)) as dyn:
                    for p in pubs:
                        await p.wait_subscribed(SETTLE)
                    await astore(storer, A)
                    await fleet["s2"].store(_kv(2 * C), B[:C] + A[:C])
                    await fleet["s2"].store(_kv(C), A[:C])
                    await stored(fleet, A, {"s1": 3 * C, "s2": C})
                    queries = [A, A[:C], A[:2 * C], A[:C + 100], A[:5], B, B + A, A[:C] + B,
                               random.Random(1).choices(range(2**31), k=2 * C)]
                    last = await agree(dyn, fleet, ids, queries)
                    truth_a, dyn_a = last[0]
                    assert truth_a == {"s1": 3 * C, "s2": C}  # the scenario is what we meant
                    assert dyn_a == {3: 3 * C, 8: C}
                    # Below the chunk, Dynamo credits whole blocks of a partial chunk.
                    _, dyn_partial = last[3]
                    assert dyn_partial[3] == C + (100 // block_size) * block_size
                    # Every BlockStored block is B tokens: the counts say so.
                    assert pubs[0].blocks == 3 * C // block_size
                    assert pubs[1].blocks == 3 * C // block_size  # B, A[0] after B, A[0]
                    # A removal: clear s2; Dynamo withdraws exactly what was announced.
                    ctx = await fleet["s2"].context()
                    await ctx._s.rpc(ctx._s.transport.pick(),
                                     lmkv.wire.requests.clear(ctx._s.d, force=True),
                                     time.monotonic() + 5)
                    last = await agree(dyn, fleet, ids, queries)
                    assert all(got.get(8, 0) == 0 for _, got in last)
                    assert last[0][1].get(3) == 3 * C
            finally:
                for p in pubs:
                    await p.aclose()
    finally:
        await asyncio.to_thread(storer.close)


@pytest.mark.anyio
async def test_dynamo_after_server_restart(server_factory: Any, tmp_path: Path,
                                           sock_dir: Path) -> None:
    """A restart voids the server's CPU tier: the publisher resets Dynamo's view of that
    worker (AllBlocksCleared), and stores after the restart are credited again."""
    srv = server_factory("0.5.7rc2", l1_size_gb=0.2, private=True)
    model = f"dyn-restart-{time.monotonic_ns()}"
    A, B = _prompts()
    storer = LmcacheStorer(srv, model)
    try:
        async with lmkv.Fleet({"s1": (srv.url, srv.http_url)}, model_name=model,
                              layout=LAYOUT) as fleet:
            pubs = [await VllmEventPublisher(fleet["s1"], endpoint=f"ipc://{sock_dir}/pub",
                                             block_size=16, worker_id=5).start()]
            try:
                async with dynamo(tmp_path, sock_dir, block_size=16, model=model,
                                  workers=dynamo_workers_arg(pubs)) as dyn:
                    await pubs[0].wait_subscribed(SETTLE)
                    await astore(storer, A)
                    await stored(fleet, A, {"s1": 3 * C})
                    last = await agree(dyn, fleet, {"s1": 5}, [A, B])
                    assert last[0][1] == {5: 3 * C}
                    await asyncio.to_thread(storer.close)
                    await asyncio.to_thread(srv.restart)
                    storer = LmcacheStorer(srv, model)

                    async def forgotten() -> bool:
                        return (await dyn.query(A)).get(5, 0) == 0

                    await eventually(forgotten, SETTLE, what="dynamo forgets the old tier")
                    await astore(storer, B)
                    await stored(fleet, B, {"s1": C})
                    last = await agree(dyn, fleet, {"s1": 5}, [A, B])
                    assert last[1][1] == {5: C} and last[0][1].get(5, 0) == 0
            finally:
                for p in pubs:
                    await p.aclose()
    finally:
        await asyncio.to_thread(storer.close)
