"""Soak: >= 10,000 mixed operations, 64 in flight, on one context (``nox -s soak``).

Against a private lmcache 0.5.6 and a 0.5.7rc2 SHM server: stores, lookups, retrieves and
retrieves into caller buffers over a few hundred token "families" (prefixes of
one base sequence share chunks, so stores overlap and skip what is cached) plus
a few large families (2 MiB results take the mmap/huge-page output path) and
sequences that were never stored. A few "hot" families take a large share of
the operations, so retrieves of the *same* prefix run concurrently (the path
that once leaked server read locks; the client now serialises them itself) and
the test asserts that this happened many times. Requires zero errors, every
retrieve bit-exact against what was stored for that prefix, no sessions or
locks in ``/status`` while the context is still registered (unregistering
sweeps pending reads and writes) and none after, and bounded growth of the
client's own heap (``RssAnon``: ``VmRSS`` also counts the mapped SHM pool)
after a warm-up. Figures are printed (run pytest with ``-s``) and written to
``$LMKV_SOAK_RESULTS`` if set, else to ``soak.json`` in pytest's temporary
directory; never into the repository.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import platform
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from servers import assert_quiescent
from test_context import random_kv, same_bits, tokens_for

import lmkv_async as lmkv
from lmkv_async.testing import LocalServer

pytestmark = [pytest.mark.soak, pytest.mark.anyio]

LAYOUT = lmkv.KVLayout(num_layers=1, num_kv_heads=1, head_dim=32, dtype=torch.bfloat16,
                       block_size=16)           # 128 B per token, 32 KiB per chunk object
IN_FLIGHT = 64
WARMUP_OPS = 2_000
MAIN_OPS = 10_000
FAMILIES = 256                                  # 4 chunks each
FAMILY_CHUNKS = 4
LARGE_FAMILIES = 4                              # 64 chunks each: 2 MiB results
LARGE_CHUNKS = 64
HOT_FAMILIES = 2                                # drawn for HOT_SHARE of the family ops
HOT_SHARE = 0.25
MIN_SAME_PREFIX_OVERLAPS = 200                  # same-prefix retrieves that overlapped
MAX_ANON_GROWTH_MIB = 64
FILL = 0x2B2B


def proc_status_mib(field_name: str = "VmRSS") -> float:
    """A ``kB`` field of /proc/self/status in MiB (VmRSS includes the mapped SHM pool)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field_name}:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field_name} in /proc/self/status")


def rss_mib() -> float:
    return proc_status_mib("VmRSS")


def anon_mib() -> float:
    """The client's own resident heap (RssAnon), without the mapped SHM pool."""
    return proc_status_mib("RssAnon")


def cpu_seconds(pid: int | None = None) -> float:
    """utime + stime of this process (or ``pid``) from /proc."""
    with open(f"/proc/{pid or 'self'}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Family:
    tokens: list[int]
    kv: torch.Tensor
    chunks: int
    issued: int = 0      # longest prefix (chunks) any store has been started for
    completed: int = 0   # longest prefix (chunks) a store has finished for
    # ``completed`` as of the last moment no store of the family was running. A store
    # that returns while another one still fills the same chunks (it found them
    # reserved and skipped them) does not make them visible yet; this does.
    settled: int = 0
    stores_running: int = 0
    #: retrieves in flight per prefix length (chunks), to count same-prefix overlaps
    retrieving: Counter[int] = field(default_factory=Counter)


@dataclass
class Stats:
    ops: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    hit_chunks: int = 0
    bytes_retrieved: int = 0
    #: retrieves started while another retrieve of the same prefix was in flight
    same_prefix_overlaps: int = 0


class Soak:
    def __init__(self, ctx: lmkv.AsyncKVContext, seed: int) -> None:
        self.ctx = ctx
        self.C = ctx.chunk_size
        self.rng = random.Random(seed)
        self.families = [self._family(i, FAMILY_CHUNKS) for i in range(FAMILIES)]
        self.large = [self._family(FAMILIES + i, LARGE_CHUNKS) for i in range(LARGE_FAMILIES)]
        self.buffers: asyncio.Queue[torch.Tensor] = asyncio.Queue()
        for _ in range(IN_FLIGHT):
            self.buffers.put_nowait(torch.empty(
                (LAYOUT.planes, LAYOUT.num_layers, (FAMILY_CHUNKS + 1) * self.C,
                 LAYOUT.hidden_dim), dtype=LAYOUT.dtype))
        self.stats = Stats()

    def _family(self, i: int, chunks: int) -> Family:
        n = chunks * self.C
        return Family(tokens_for(n, seed=7_000_000 + i), random_kv(LAYOUT, n, seed=5_000 + i),
                      chunks)

    def draw(self) -> tuple[str, Family | None, int, int]:
        """(kind, family, chunks asked for, extra sub-chunk tokens)."""
        r = self.rng.random()
        extra = self.rng.choice((0, 0, 0, 17, self.C - 1))
        if r < 0.04:
            fam = self.rng.choice(self.large)
            kind = self.rng.choice(("store", "retrieve", "lookup"))
            return kind, fam, self.rng.randint(LARGE_CHUNKS // 2, LARGE_CHUNKS), 0
        if r < 0.08:
            return self.rng.choice(("lookup_miss", "retrieve_miss")), None, 2, extra
        hot = self.rng.random() < HOT_SHARE
        fam = self.rng.choice(self.families[:HOT_FAMILIES] if hot else self.families)
        kind = self.rng.choices(("store", "lookup", "retrieve", "retrieve_out"),
                                weights=(3, 2, 3, 3))[0]
        k = self.rng.randint(1, fam.chunks)
        if k == fam.chunks:
            extra = 0  # no tokens past the family's data
        return kind, fam, k, extra

    async def one(self, kind: str, fam: Family | None, k: int, extra: int) -> None:
        ctx, C = self.ctx, self.C
        if fam is None:
            toks = tokens_for(k * C + extra)  # never stored
            if kind == "lookup_miss":
                assert await ctx.lookup(toks) == 0
            else:
                assert await ctx.retrieve(toks) is None
            return
        toks = fam.tokens[: k * C + extra]
        if kind == "store":
            fam.issued = max(fam.issued, k)
            fam.stores_running += 1
            try:
                res = await ctx.store(fam.kv[:, :, : k * C + extra], toks)
                assert (res.total_chunks, res.ignored_tokens) == (k, extra), res
                assert 0 <= res.written_chunks <= k
                fam.completed = max(fam.completed, k)
            finally:
                fam.stores_running -= 1
                if fam.stores_running == 0:
                    fam.settled = fam.completed
            return
        low = min(k, fam.settled)  # visible before this call started: must hit
        if kind == "lookup":
            hit = await ctx.lookup(toks) // C
        else:
            # no serialisation here: same-prefix retrieves overlap on purpose
            if fam.retrieving[k]:
                self.stats.same_prefix_overlaps += 1
            fam.retrieving[k] += 1
            try:
                hit = await self._retrieve(fam, toks, k, out=kind == "retrieve_out")
            finally:
                fam.retrieving[k] -= 1
        high = min(k, fam.issued)
        assert low <= hit <= high, f"{kind}: hit {hit} outside [{low}, {high}]"
        self.stats.hit_chunks += hit

    async def _retrieve(self, fam: Family, toks: list[int], k: int, *, out: bool) -> int:
        C = self.C
        if not out:
            got = await self.ctx.retrieve(toks)
            if got is None:
                return 0
            hit = got.shape[2] // C
            assert got.shape[2] % C == 0 and same_bits(got, fam.kv[:, :, : hit * C])
            self.stats.bytes_retrieved += got.numel() * got.element_size()
            return hit
        buf = await self.buffers.get()
        try:
            buf.view(torch.int16).fill_(FILL)
            got = await self.ctx.retrieve(toks, out=buf)
            if got is None:
                assert bool((buf.view(torch.int16) == FILL).all()), "miss wrote the buffer"
                return 0
            hit = got.shape[2] // C
            assert got.data_ptr() == buf.data_ptr()
            assert same_bits(got, fam.kv[:, :, : hit * C])
            assert bool((buf[:, :, hit * C:].view(torch.int16) == FILL).all()), \
                "written past the hit"
            self.stats.bytes_retrieved += hit * C * LAYOUT.token_bytes()
            return hit
        finally:
            self.buffers.put_nowait(buf)

    async def run(self, total: int) -> float:
        """``total`` operations with IN_FLIGHT workers; returns the elapsed seconds."""
        plan = [self.draw() for _ in range(total)]
        it = iter(plan)

        async def worker() -> None:
            for kind, fam, k, extra in it:
                try:
                    await self.one(kind, fam, k, extra)
                    self.stats.ops[kind] += 1
                except Exception as exc:  # every failure is recorded; the run goes on
                    self.stats.errors.append(f"{kind} k={k}: {type(exc).__name__}: {exc}")

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))
        return time.perf_counter() - t0


@pytest.fixture
def single_torch_thread() -> Any:
    # The harness's own checks (fill, compare) are small torch ops; with the server on
    # the same 2 cores, intra-op threads spin against it and cost milliseconds each.
    # (The library's copies use the C kernel's own threads, not torch's.)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def results_path(tmp_path: Path) -> Path:
    """Where the figures go: $LMKV_SOAK_RESULTS, else pytest's tmp dir (not the repo)."""
    env = os.environ.get("LMKV_SOAK_RESULTS")
    return Path(env) if env else tmp_path / "soak.json"  # per version: tmp_path differs


@pytest.mark.parametrize("version", ["0.5.6", "0.5.7rc2"])
async def test_soak_mixed_operations(version: str, server_factory: Callable[..., LocalServer],
                                     single_torch_thread: Any, tmp_path: Path) -> None:
    server = server_factory(version, private=True)
    async with lmkv.connect(server.url, server.http_url, "soak", layout=LAYOUT,
                            timeout=60) as ctx:
        assert ctx.transport == "shm"
        soak = Soak(ctx, seed=20260)
        gc.collect()
        rss_start, anon_start = rss_mib(), anon_mib()
        warm_s = await soak.run(WARMUP_OPS)
        gc.collect()
        rss_warm, anon_warm = rss_mib(), anon_mib()
        cpu_client0, cpu_server0 = cpu_seconds(), cpu_seconds(server.pid)
        main_s = await soak.run(MAIN_OPS)
        cpu_client, cpu_server = cpu_seconds() - cpu_client0, cpu_seconds(server.pid) - cpu_server0
        gc.collect()
        rss_end, anon_end = rss_mib(), anon_mib()
        stats = soak.stats
        status = await ctx.status()
        # while registered: a missing commit_retrieve / commit_store still shows here
        await assert_quiescent(ctx, timeout=60)
    await assert_quiescent(server)
    total_ops = sum(stats.ops.values())
    figures: dict[str, Any] = {
        "server": f"lmcache {server.config.version} shm",
        "geometry": {"num_layers": LAYOUT.num_layers, "num_kv_heads": LAYOUT.num_kv_heads,
                     "head_dim": LAYOUT.head_dim, "dtype": str(LAYOUT.dtype),
                     "chunk_size": 256, "chunk_bytes": 256 * LAYOUT.token_bytes()},
        "in_flight": IN_FLIGHT,
        "ops_total": total_ops,
        "ops_by_kind": dict(sorted(stats.ops.items())),
        "errors": len(stats.errors),
        "warmup_ops": WARMUP_OPS,
        "main_ops": MAIN_OPS,
        "warmup_seconds": round(warm_s, 3),
        "main_seconds": round(main_s, 3),
        "ops_per_second_main": round(MAIN_OPS / main_s, 1),
        "ops_per_second_overall": round(total_ops / (warm_s + main_s), 1),
        "hit_chunks": stats.hit_chunks,
        "bytes_retrieved": stats.bytes_retrieved,
        "rss_mib": {"start": round(rss_start, 1), "after_warmup": round(rss_warm, 1),
                    "end": round(rss_end, 1)},
        "rss_growth_after_warmup_mib": round(rss_end - rss_warm, 1),
        "rss_anon_growth_after_warmup_mib": round(anon_end - anon_warm, 1),
        "same_prefix_retrieve_overlaps": stats.same_prefix_overlaps,
        "rss_anon_mib": {"start": round(anon_start, 1), "after_warmup": round(anon_warm, 1),
                         "end": round(anon_end, 1)},
        "note_rss": "VmRSS includes the server's SHM pool (1 GiB L1), mapped and pre-faulted "
                    "at connect; RssAnon is the client's own heap",
        "cpu_seconds_main": {"client": round(cpu_client, 2), "server": round(cpu_server, 2)},
        "rss_anon_growth_limit_mib": MAX_ANON_GROWTH_MIB,
        "server_active_sessions_at_end": status.get("active_sessions"),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "machine": f"{platform.machine()} x{os.cpu_count()}",
        "command": "PYTHONPATH=. python -m pytest tests/test_soak.py -m soak -s "
                   "(LMKV_SOAK_RESULTS=path.json to keep the figures)",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    out = results_path(tmp_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"\nsoak ({out}):", json.dumps(figures, indent=2))
    assert not stats.errors, f"{len(stats.errors)} errors, first: {stats.errors[:5]}"
    assert total_ops == WARMUP_OPS + MAIN_OPS >= 10_000
    assert stats.same_prefix_overlaps >= MIN_SAME_PREFIX_OVERLAPS, figures
    # the client's own heap, not VmRSS (which includes the 1 GiB SHM pool mapping)
    assert anon_end - anon_warm < MAX_ANON_GROWTH_MIB, figures["rss_anon_mib"]
