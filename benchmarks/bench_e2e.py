"""End-to-end benchmark: lmkv_async vs lmcache's OFFICIAL synchronous SDK, same run, same server.

One real lmcache 0.5.6 MP server (SHM, ``--supported-transfer-mode auto``,
``--max-gpu-workers 1``) with an lmcache-driven registration of the benchmark
model (L=32, NH=8, HS=128, bf16, BS=16, chunk 256 tokens; one token of KV is
128 KiB, so T=4096 moves 512 MiB and T=16384 moves 2 GiB). Sections:

  store     store latency per T: lmkv ``ctx.store`` vs SDK ``store`` (fresh tokens every rep)
  retrieve  retrieve latency per T: SDK ``retrieve`` vs lmkv ``retrieve`` without / with ``out=``
  fanout    32 distinct T=1024 prefixes: SDK one after another vs lmkv ``retrieve_many``
            (all 32 in flight) with and without caller buffers
  lookup    lookup throughput: lmkv at 1/8/64 in flight vs SDK with 1 and 8 threads
  looplag   event-loop tick gaps (1 ms sleeper) while awaiting a 512 MiB / 2 GiB retrieve
  soak      the same store/retrieve/lookup mix (30/40/30, T=1024): lmkv 64 in flight vs
            SDK with 1 and 8 threads
  sockets   32 concurrent retrieves+stores at T=1024 with ``sockets=1/2/4``, on the main
            server (``--max-gpu-workers 1``) and on a second one (``--max-gpu-workers 2``)
  sdk_cold  reference only: the SDK in a fresh process without a warm pool mapping

How the SDK is driven: ``benchmarks/sdk_peer.py`` runs in the server's Python
(one job per section, while lmkv_async is idle), through a small in-process
wrapper (:data:`PEER_WRAPPER`) that changes only untimed set-up:

* it pre-faults the SDK's mapping of the SHM pool once at connect (what
  lmkv_async does at connect, and the state a long-lived SDK process reaches
  once it has touched the pool); without it every fresh SDK process pays a
  4 KiB page fault per slot page on first use (the ``sdk_cold`` section shows
  how much);
* it builds the random KV tensors from random int16 bits (NaN-free bf16)
  instead of float32 ``randn`` (same shape and bytes, half the peak memory);
* ``"clear_before": true`` on a workload empties L1 (``POST /cache/clear``)
  before it starts, so one job can write more than L1 holds without OOM or
  eviction inside timed work.

lmkv_async's latency samples exclude its background release steps (it returns
before ``end_session``); the throughput sections wait for them inside the clock.
lmkv samples of each section are split around the SDK job(s) (store and
retrieve: three lmkv parts around two SDK processes; other sections: two
halves around one) so machine-load drift hits both clients alike.

Same-prefix retrieves: lmcache 0.5.6 keys pending SHM reads by a key that ignores
the request id, so two retrieves of one prefix in flight on one context would leak
read locks; lmkv_async serialises them itself (the soak relies on that, and every
section ends with a check that the server holds no read locks). The socket section
retrieves 16 distinct prefixes so that serialisation does not mask the sockets.

Run from the repo root (the dev venv needs ``PYTHONPATH=.``; in ``nox -s bench``
the package is installed)::

    python benchmarks/bench_e2e.py            # full run (~8-10 min on 2 cores)
    python benchmarks/bench_e2e.py --quick    # T <= 4096, 4 reps, L1 6 GiB (~4-5 min)

Writes ``benchmarks/results/e2e.json``; ``benchmarks/report.py`` turns it into
``docs/benchmarks.md`` and its charts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Cap lmkv_async's pooled output memory (retrieve without out=) so L1 + caller buffers +
# the pool fit in RAM next to the SDK process; big enough for every result set used here.
os.environ.setdefault("LMKV_OUTPUT_POOL_BYTES", str(9 << 29))  # 4.5 GiB

import httpx  # noqa: E402
import torch  # noqa: E402
from _common import (  # noqa: E402  (same directory)
    BS,
    DTYPE,
    GEOMETRY,
    HS,
    LAYOUT,
    NH,
    SDK_PEER,
    TOKEN_BYTES,
    VOCAB,
    C,
    D,
    L,
    LoopTicker,
    cpu_model,
    drain,
    summarize,
)

import lmkv_async as lmkv  # noqa: E402
from lmkv_async import kernel  # noqa: E402
from lmkv_async.memory import output_pool  # noqa: E402
from lmkv_async.testing import (  # noqa: E402
    LocalServer,
    ServerConfig,
    find_server_python,
    registered_engine,
    server_env,
)

# ----------------------------------------------------------------------------- geometry
MODEL = "lmkv-bench-e2e"
SECTIONS = ("store", "retrieve", "looplag", "fanout", "lookup", "soak", "sdk_cold", "sockets")
#: L1 may hold at most this fraction before a section writes (eviction triggers at 0.8).
FILL_LIMIT = 0.72

# Runs inside the server env: prefault the SDK's pool mapping, lean KV generation,
# "clear_before" workloads. argv: <sdk_peer.py> @<job.json>
PEER_WRAPPER = r"""
import ctypes, importlib.util, json, os, sys, urllib.request
peer_path, job_arg = sys.argv[1], sys.argv[2]
with open(job_arg[1:]) as f:
    job = json.load(f)
if os.environ.get("LMKV_BENCH_SDK_WARM") == "1":
    from multiprocessing import shared_memory
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    _orig_init = shared_memory.SharedMemory.__init__
    def _init(self, *a, **k):
        _orig_init(self, *a, **k)
        if self.name.lstrip("/").startswith("lmcache_l1_pool_"):
            c = ctypes.c_char.from_buffer(self.buf)
            addr = ctypes.addressof(c)
            del c
            for advice in (23, 22):  # MADV_POPULATE_WRITE, MADV_POPULATE_READ
                if libc.madvise(addr, self.size, advice) == 0:
                    break
    shared_memory.SharedMemory.__init__ = _init
spec = importlib.util.spec_from_file_location("sdk_peer", peer_path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)

def _kv(self, n):
    t = self._kv_cache.get(n)
    if t is None:
        torch = self.torch
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + n)
        base_n = min(n, 4096)
        bits = torch.randint(-2**15, 2**15, (2, self.num_layers, base_n, self.hidden),
                             dtype=torch.int16, generator=g)
        bits &= -16385  # clear the top exponent bit: no NaN/Inf, so torch.equal works
        if base_n < n:
            bits = bits.repeat(1, 1, -(-n // base_n), 1)[:, :, :n].contiguous()
        t = bits.view(self.dtype)
        self._kv_cache[n] = t
    return t
mod.Peer.kv = _kv

def _clear():
    req = urllib.request.Request(job["http_url"] + "/cache/clear", method="POST",
                                 data=b'{"tier": "l1", "force": false}',
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=30).read()

def _wrap(fn):
    def run(peer, w):
        if w.get("clear_before"):
            _clear()
        return fn(peer, w)
    return run
for _name in list(mod.RUNNERS):
    mod.RUNNERS[_name] = _wrap(mod.RUNNERS[_name])
mod.main([peer_path, job_arg])
"""


# ----------------------------------------------------------------------------- helpers
def split_reps(reps: int) -> tuple[int, int]:
    """lmkv reps before / after the SDK job."""
    first = (reps + 1) // 2
    return first, reps - first


def parts(reps: int, k: int) -> list[int]:
    """``reps`` split into ``k`` near-equal parts, larger first (7, 3 -> [3, 2, 2])."""
    return [reps // k + (1 if i < reps % k else 0) for i in range(k)]


def log(msg: str) -> None:
    print(msg, flush=True)


def random_kv(n: int, seed: int) -> torch.Tensor:
    """A ``[2, L, n, D]`` bf16 tensor of random, NaN-free bits (pre-touched)."""
    g = torch.Generator().manual_seed(seed)
    base_n = min(n, 4096)
    bits = torch.randint(-(2**15), 2**15, (2, L, base_n, D), dtype=torch.int16, generator=g)
    bits &= -16385
    if base_n < n:
        bits = bits.repeat(1, 1, -(-n // base_n), 1)[:, :, :n].contiguous()
    return bits.view(DTYPE)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def pretouched_out(n: int) -> torch.Tensor:
    out = output_pool.empty((2, L, n, D), DTYPE)
    out.view(torch.int16).fill_(0)
    return out


# ----------------------------------------------------------------------------- the runner
class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick: bool = args.quick
        self.reps: int = args.reps or (4 if self.quick else 7)
        self.tokens_list: list[int] = args.tokens or (
            [256, 1024, 4096] if self.quick else [256, 1024, 4096, 16384])
        self.fan_n = 32
        self.fan_t = 1024
        self.lookup_n = 128 if self.quick else 256
        self.sdk_lookup_n = 100 if self.quick else 200
        self.soak_ops = 24 if self.quick else 40
        self.rng = random.Random(args.seed)
        self.server_python = find_server_python("0.5.6")
        self.results: dict[str, Any] = {}
        self.errors: dict[str, str] = {}
        self.srv: LocalServer | None = None
        self.ctx: lmkv.AsyncKVContext | None = None
        self.http: httpx.AsyncClient | None = None
        self.tmp = Path(tempfile.mkdtemp(prefix="lmkv-bench-e2e-"))
        self.sdk_meta: dict[str, Any] = {}
        self._kvs: dict[int, torch.Tensor] = {}

    def kv(self, n: int) -> torch.Tensor:
        """The (cached) random source tensor for ``n`` tokens, shared by all sections."""
        t = self._kvs.get(n)
        if t is None:
            t = self._kvs[n] = random_kv(n, 1000 + n)
        return t

    def release_memory(self, keep_kv_upto: int = 4096) -> None:
        """Free big source tensors and lmkv's pooled result memory (before an SDK job)."""
        for n in [n for n in self._kvs if n > keep_kv_upto]:
            del self._kvs[n]
        gc.collect()
        if output_pool is not None:
            output_pool.clear()

    async def read_locks(self, http_url: str | None = None) -> int:
        """Server-side L1 read locks right now (leak check after each section)."""
        assert self.http is not None and self.srv is not None
        await drain(self.ctx)
        r = await self.http.get((http_url or self.srv.http_url) + "/status")
        return int(r.json()["storage_manager"]["l1_manager"]["read_locked_count"])

    # ------------------------------------------------------------------ utilities
    def tokens(self, n: int) -> list[int]:
        """Fresh random token ids: a new prefix every call."""
        r = self.rng
        return [r.randrange(VOCAB) for _ in range(n)]

    @property
    def c(self) -> lmkv.AsyncKVContext:
        assert self.ctx is not None
        return self.ctx

    async def l1_usage(self, http_url: str | None = None) -> tuple[int, int]:
        assert self.http is not None and self.srv is not None
        r = await self.http.get((http_url or self.srv.http_url) + "/status")
        r.raise_for_status()
        l1 = r.json()["storage_manager"]["l1_manager"]
        return int(l1["memory_used_bytes"]), int(l1["memory_total_bytes"])

    async def clear_l1(self, http_url: str | None = None) -> None:
        assert self.http is not None and self.srv is not None
        url = (http_url or self.srv.http_url) + "/cache/clear"
        r = await self.http.post(url, json={"tier": "l1", "force": False})
        r.raise_for_status()

    async def ensure_room(self, nbytes: int, http_url: str | None = None) -> bool:
        """Make sure L1 can take ``nbytes`` more without eviction; clears it if needed."""
        used, total = await self.l1_usage(http_url)
        if used + nbytes <= FILL_LIMIT * total:
            return False
        if nbytes > FILL_LIMIT * total:
            raise RuntimeError(f"a section needs {nbytes / 2**30:.1f} GiB of L1, which holds "
                               f"{total / 2**30:.1f} GiB; raise --l1-gb")
        await drain(self.ctx)
        await self.clear_l1(http_url)
        for _ in range(100):
            used, total = await self.l1_usage(http_url)
            if used + nbytes <= FILL_LIMIT * total:
                return True
            await asyncio.sleep(0.05)
        raise RuntimeError(f"L1 still holds {used / 2**30:.2f} GiB after /cache/clear")

    async def ensure_cached(self, prefixes: Sequence[tuple[list[int], torch.Tensor]]) -> None:
        """Store each ``(tokens, kv)`` again unless the server still has all of it."""
        for toks, kv in prefixes:
            if await self.c.lookup(toks) != len(toks):
                await self.ensure_room(len(toks) * TOKEN_BYTES)
                res = await self.c.store(kv, toks)
                if await self.c.lookup(toks) != len(toks):
                    raise RuntimeError(f"prefix of {len(toks)} tokens not cached after {res}")
        await drain(self.ctx)

    async def sdk_job(self, name: str, workloads: list[dict[str, Any]], *, warm: bool = True,
                      timeout: float = 600) -> dict[str, Any]:
        """Run one sdk_peer job (lmkv_async is idle meanwhile); returns its result object."""
        assert self.srv is not None and self.server_python is not None
        await drain(self.ctx)
        job = {"url": self.srv.url, "http_url": self.srv.http_url, "model": MODEL,
               "geometry": GEOMETRY, "seed": self.args.seed, "timeout": 120, "vocab": VOCAB,
               "workloads": workloads}
        path = self.tmp / f"job-{name}.json"
        path.write_text(json.dumps(job))
        env = server_env()
        env["LMKV_BENCH_SDK_WARM"] = "1" if warm else "0"
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            self.server_python, "-c", PEER_WRAPPER, str(SDK_PEER), f"@{path}",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise RuntimeError(f"sdk job {name} timed out after {timeout}s") from None
        (self.tmp / f"job-{name}.stderr").write_bytes(err)
        lines = out.decode("utf-8", "replace").strip().splitlines()
        try:
            result: dict[str, Any] = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            result = {"ok": False, "error": "no JSON result line"}
        if not result.get("ok"):
            tail = err.decode("utf-8", "replace")[-3000:]
            raise RuntimeError(f"sdk job {name} failed: {result.get('error')}\n{tail}")
        sanity = result.get("sanity", {})
        shape = sanity.get("shape", [])
        if (len(shape) != 4 or shape[0] != 2 or shape[1] != L or shape[3] != D
                or sanity.get("dtype") != "torch.bfloat16"
                or not sanity.get("retrieve_bit_exact")):
            raise RuntimeError(f"sdk job {name}: geometry/sanity mismatch {sanity}")
        self.sdk_meta = {"lmcache_version": result.get("lmcache_version"),
                         "connect_s": result.get("connect_s"), "sanity": sanity}
        result["wall_s"] = time.monotonic() - t0
        log(f"    sdk job {name}: {result['wall_s']:.1f}s (process incl. start-up)")
        return result

    def sdk_plan(self, items: list[tuple[dict[str, Any], int]],
                 budget: int | None = None) -> list[dict[str, Any]]:
        """Insert ``clear_before`` so no stretch of workloads writes more than ``budget``."""
        assert self.srv is not None
        budget = budget or int(FILL_LIMIT * self.srv.config.l1_size_gb * 2**30) - 2**27
        out: list[dict[str, Any]] = []
        used = 2**27  # sanity check
        for w, nbytes in items:
            if nbytes > budget:
                raise RuntimeError(f"workload {w} writes {nbytes} bytes > L1 budget {budget}")
            w = dict(w)
            if used + nbytes > budget or w.get("clear_before"):
                w["clear_before"] = True
                used = 0
            used += nbytes
            out.append(w)
        out[0]["clear_before"] = True
        return out

    # ------------------------------------------------------------------ sections
    async def sec_store(self) -> dict[str, Any]:
        R = self.reps
        lm: dict[int, list[float]] = {T: [] for T in self.tokens_list}

        async def one(T: int, timed: bool = True) -> None:
            await self.ensure_room(T * TOKEN_BYTES)
            toks = self.tokens(T)
            kv = self.kv(T)
            await drain(self.ctx)
            t0 = time.perf_counter()
            res = await self.c.store(kv, toks)
            dt = time.perf_counter() - t0
            if res.written_chunks != T // C:
                raise RuntimeError(f"store T={T} wrote {res.written_chunks}/{T // C} chunks")
            if timed:
                lm[T].append(dt)

        # lmkv reps in three parts around two SDK processes (load drift and
        # per-process variance of the baseline hit both clients alike)
        lm_parts, sdk_parts = parts(R, 3), parts(R, 2)
        for T in self.tokens_list:
            await one(T, timed=False)  # warm-up
            for _ in range(lm_parts[0]):
                await one(T)
        assert self.srv is not None
        per_budget = FILL_LIMIT * self.srv.config.l1_size_gb * 2**30 - 2**28
        results: list[dict[str, Any]] = []
        walls = []
        for j, sdk_reps in enumerate(sdk_parts):
            # SDK: an untimed warm-up store per T, then the timed ones, L1 emptied as needed
            items: list[tuple[dict[str, Any], int]] = []
            for T in self.tokens_list:
                items.append(({"op": "store", "T": T, "reps": 1, "warmup": True},
                              T * TOKEN_BYTES))
                per = max(1, int(per_budget // (T * TOKEN_BYTES)))
                left = sdk_reps
                while left:
                    k = min(left, per)
                    items.append(({"op": "store", "T": T, "reps": k}, k * T * TOKEN_BYTES))
                    left -= k
            await self.clear_l1()
            self.release_memory()
            res = await self.sdk_job(f"store-{j + 1}", self.sdk_plan(items))
            results += res["results"]
            walls.append(res["wall_s"])
            await self.clear_l1()
            for T in self.tokens_list:
                for _ in range(lm_parts[j + 1]):
                    await one(T)
        sdk: dict[int, list[float]] = {T: [] for T in self.tokens_list}
        for w in results:
            if not w.get("warmup"):
                sdk[int(w["T"])].extend(w["samples"])
        rows = []
        for T in self.tokens_list:
            s_l, s_s = summarize(lm[T]), summarize(sdk[T])
            rows.append({"T": T, "bytes": T * TOKEN_BYTES, "lmkv": s_l, "sdk": s_s,
                         "speedup": s_s["median"] / s_l["median"]})
        await self.clear_l1()
        return {"rows": rows, "sdk_job_wall_s": walls}

    async def sec_retrieve(self) -> dict[str, Any]:
        R = self.reps
        toks_by_t = {T: self.tokens(T) for T in self.tokens_list}
        no_out: dict[int, list[float]] = {T: [] for T in self.tokens_list}
        with_out: dict[int, list[float]] = {T: [] for T in self.tokens_list}
        exact: dict[str, bool] = {}
        await self.ensure_room(sum(self.tokens_list) * TOKEN_BYTES)

        async def phase(n: int, check: bool = False) -> None:
            await self.ensure_cached([(toks_by_t[T], self.kv(T)) for T in self.tokens_list])
            for T in self.tokens_list:
                toks = toks_by_t[T]
                out = pretouched_out(T)
                # warm-up (and, once, the bit-exactness check of both variants)
                got = await self.c.retrieve(toks)
                assert got is not None and got.shape[2] == T
                if check:
                    exact[f"T={T} no out"] = same_bits(got, self.kv(T))
                del got
                got = await self.c.retrieve(toks, out=out)
                assert got is not None
                if check:
                    exact[f"T={T} out="] = same_bits(out, self.kv(T))
                del got
                for _ in range(n):
                    for dest, samples in ((None, no_out[T]), (out, with_out[T])):
                        await drain(self.ctx)
                        gc.collect()
                        t0 = time.perf_counter()
                        got = await self.c.retrieve(toks, out=dest)
                        dt = time.perf_counter() - t0
                        if got is None or got.shape[2] != T:
                            raise RuntimeError(f"retrieve T={T} missed")
                        samples.append(dt)
                        del got
                del out
                gc.collect()

        lm_parts, sdk_parts = parts(R, 3), parts(R, 2)
        await phase(lm_parts[0], check=True)
        if not all(exact.values()):
            raise RuntimeError(f"lmkv retrieve is not bit-exact: {exact}")
        sdk: dict[int, list[float]] = {T: [] for T in self.tokens_list}
        walls = []
        for j, sdk_reps in enumerate(sdk_parts):
            # SDK: one stored prefix per T; reps+1 retrieves, the first is a warm-up
            await self.ensure_room(sum(self.tokens_list) * TOKEN_BYTES + 2**27)
            items = [({"op": "retrieve", "T": T, "reps": sdk_reps + 1}, T * TOKEN_BYTES)
                     for T in self.tokens_list]
            plan = self.sdk_plan(items, budget=10**15)
            plan[0].pop("clear_before", None)
            self.release_memory()
            res = await self.sdk_job(f"retrieve-{j + 1}", plan)
            walls.append(res["wall_s"])
            for w in res["results"]:
                sdk[int(w["T"])].extend(w["samples"][1:])
            await phase(lm_parts[j + 1])
        rows = []
        for T in self.tokens_list:
            s_s, s_n, s_o = summarize(sdk[T]), summarize(no_out[T]), summarize(with_out[T])
            rows.append({"T": T, "bytes": T * TOKEN_BYTES, "sdk": s_s, "lmkv": s_n,
                         "lmkv_out": s_o, "speedup": s_s["median"] / s_n["median"],
                         "speedup_out": s_s["median"] / s_o["median"]})
        return {"rows": rows, "bit_exact": exact, "sdk_job_wall_s": walls}

    async def sec_fanout(self) -> dict[str, Any]:
        R, N, T = self.reps, self.fan_n, self.fan_t
        a, b = split_reps(R)
        self.release_memory(keep_kv_upto=T)
        prefixes = [(self.tokens(T), self.kv(T)) for _ in range(N)]
        toks_list = [p[0] for p in prefixes]
        thr: dict[str, list[float]] = {"with_outs": [], "no_outs": [], "sequential": []}

        async def fan(outs: list[torch.Tensor] | None) -> float:
            await drain(self.ctx)
            gc.collect()
            t0 = time.perf_counter()
            res = await self.c.retrieve_many(toks_list, outs=outs, max_in_flight=N)
            await drain(self.ctx)
            dt = time.perf_counter() - t0
            bad = [i for i, r in enumerate(res) if not r.ok or r.value is None]
            if bad:
                raise RuntimeError(f"fan-out items failed/missed: {bad[:5]} {res[bad[0]]}")
            del res
            return N / dt

        async def seq(outs: list[torch.Tensor]) -> float:
            await drain(self.ctx)
            t0 = time.perf_counter()
            for toks, out in zip(toks_list, outs, strict=True):
                if await self.c.retrieve(toks, out=out) is None:
                    raise RuntimeError("sequential retrieve missed")
            await drain(self.ctx)
            return N / (time.perf_counter() - t0)

        async def phase(n: int) -> None:
            await self.ensure_room(N * T * TOKEN_BYTES)
            await self.ensure_cached(prefixes)
            # caller buffers: N preallocated, pre-touched [2, L, T, D] tensors
            outs = [pretouched_out(T) for _ in range(N)]
            await fan(outs)  # warm-up
            for _ in range(n):
                thr["with_outs"].append(await fan(outs))
                thr["sequential"].append(await seq(outs))
            del outs
            gc.collect()
            await fan(None)  # warm-up (fills lmkv's output pool)
            for _ in range(n):
                thr["no_outs"].append(await fan(None))
            self.release_memory(keep_kv_upto=T)

        await phase(a)
        items = [({"op": "retrieve_seq", "n_prefixes": N, "T": T, "clear_before": True},
                  N * T * TOKEN_BYTES) for _ in range(R)]
        res = await self.sdk_job("fanout", self.sdk_plan(items))
        await self.clear_l1()
        await phase(b)
        await self.clear_l1()
        sdk_thr = [N / sum(w["samples"]) for w in res["results"]]
        sdk_lat = [x for w in res["results"] for x in w["samples"]]
        s_sdk = summarize(sdk_thr)
        out = {"N": N, "T": T, "bytes_per_prefix": T * TOKEN_BYTES,
               "sdk_sequential": s_sdk, "sdk_latency": summarize(sdk_lat),
               "sdk_job_wall_s": res["wall_s"]}
        for k, v in thr.items():
            s_ = summarize(v)
            out[f"lmkv_{k}"] = s_
            out[f"ratio_{k}"] = s_["median"] / s_sdk["median"]
        return out

    async def sec_lookup(self) -> dict[str, Any]:
        R, T, n = self.reps, 1024, self.lookup_n
        a, b = split_reps(R)
        toks, kv = self.tokens(T), self.kv(T)
        levels = (1, 8, 64)
        thr: dict[int, list[float]] = {k: [] for k in levels}

        async def batch(k: int) -> float:
            await drain(self.ctx)
            t0 = time.perf_counter()
            res = await self.c.lookup_many([toks] * n, max_in_flight=k)
            await drain(self.ctx)
            dt = time.perf_counter() - t0
            if any((not r.ok) or r.value != T for r in res):
                raise RuntimeError("lookup did not hit")
            return n / dt

        async def phase(reps: int) -> None:
            await self.ensure_room(T * TOKEN_BYTES)
            await self.ensure_cached([(toks, kv)])
            for k in levels:
                await batch(k)  # warm-up
            for _ in range(reps):
                for k in levels:
                    thr[k].append(await batch(k))

        await phase(a)
        items = []
        for threads in (1, 8):
            for i in range(R + 1):
                items.append(({"op": "lookup", "n": self.sdk_lookup_n, "T": T,
                               "threads": threads, "warmup": i == 0}, T * TOKEN_BYTES))
        await self.ensure_room((2 * R + 2) * T * TOKEN_BYTES + 2**27)
        plan = self.sdk_plan(items, budget=10**15)
        plan[0].pop("clear_before", None)
        res = await self.sdk_job("lookup", plan, warm=False)
        await phase(b)
        sdk: dict[int, list[float]] = {1: [], 8: []}
        sdk_lat: dict[int, list[float]] = {1: [], 8: []}
        for w in res["results"]:
            if not w.get("warmup"):
                sdk[int(w["threads"])].append(int(w["n"]) / w["wall_s"])
                sdk_lat[int(w["threads"])].extend(w["samples"])
        out: dict[str, Any] = {"T": T, "n_per_rep": n, "sdk_n_per_rep": self.sdk_lookup_n,
                               "sdk_job_wall_s": res["wall_s"]}
        for k in levels:
            out[f"lmkv_{k}"] = summarize(thr[k])
        for t in (1, 8):
            out[f"sdk_threads_{t}"] = summarize(sdk[t])
            out[f"sdk_threads_{t}_latency"] = summarize(sdk_lat[t])
        best_sdk = max(out["sdk_threads_1"]["median"], out["sdk_threads_8"]["median"])
        for k in levels:
            out[f"ratio_{k}_vs_best_sdk"] = out[f"lmkv_{k}"]["median"] / best_sdk
        out["ratio_1_vs_sdk_1"] = out["lmkv_1"]["median"] / out["sdk_threads_1"]["median"]
        return out

    async def sec_looplag(self) -> dict[str, Any]:
        """Tick gaps of a 1 ms sleeper while a big retrieve is awaited on the same loop.

        Variants: ``no out`` (lmkv's output pool already holds a free mapping: the
        steady state), ``out=`` (caller buffer), and two diagnostics: ``no out, pool
        miss`` (the pool is emptied first, as on a first retrieve or a new size) and
        ``out=, 1 copy thread`` (the C kernel limited to the calling worker thread).
        """
        R = self.reps
        sizes = [T for T in (4096, 16384) if T <= max(self.tokens_list)]
        res: dict[str, Any] = {"rows": []}

        async def measure(coro_fn: Callable[[], Awaitable[Any]]) -> tuple[list[float], float]:
            async with LoopTicker() as ticker:
                t0 = time.perf_counter()
                await coro_fn()
                dt = time.perf_counter() - t0
            return ticker.gaps, dt

        # baseline: the ticker alone (scheduling noise of this machine)
        base_max, base_gaps = [], []
        for _ in range(R):
            gaps, _ = await measure(lambda: asyncio.sleep(0.3))
            base_max.append(max(gaps))
            base_gaps.extend(gaps)
        res["idle"] = {"max": summarize(base_max), "p99": _p(base_gaps, 0.99),
                       "worst": max(base_max)}
        threads = kernel.num_threads()
        for T in sizes:
            toks = self.tokens(T)
            await self.ensure_room(T * TOKEN_BYTES)
            await self.ensure_cached([(toks, self.kv(T))])
            self.release_memory(keep_kv_upto=1024)
            out = pretouched_out(T)
            variants: list[tuple[str, torch.Tensor | None, bool, int]] = [
                ("no out", None, False, threads), ("out=", out, False, threads)]
            if output_pool is not None:
                variants.append(("no out, pool miss", None, True, threads))
            if threads > 1:
                variants.append(("out=, 1 copy thread", out, False, 1))
            for label, dest, miss, nthreads in variants:
                maxes, all_gaps, durs = [], [], []
                kernel.set_num_threads(nthreads)
                try:
                    await self.c.retrieve(toks, out=dest)  # warm-up
                    for _ in range(R):
                        await drain(self.ctx)
                        gc.collect()
                        if miss:
                            output_pool.clear()
                        holder: list[Any] = []

                        async def op(dest: torch.Tensor | None = dest, toks: list[int] = toks,
                                     holder: list[Any] = holder) -> None:
                            holder.append(await self.c.retrieve(toks, out=dest))

                        gaps, dt = await measure(op)
                        if holder[0] is None:
                            raise RuntimeError("looplag retrieve missed")
                        holder.clear()
                        maxes.append(max(gaps))
                        all_gaps.extend(gaps)
                        durs.append(dt)
                finally:
                    kernel.set_num_threads(threads)
                res["rows"].append({"T": T, "bytes": T * TOKEN_BYTES, "variant": label,
                                    "diagnostic": miss or nthreads != threads,
                                    "copy_threads": nthreads,
                                    "max": summarize(maxes), "worst": max(maxes),
                                    "p99": _p(all_gaps, 0.99), "p50": _p(all_gaps, 0.5),
                                    "retrieve_s": summarize(durs), "ticks": len(all_gaps)})
            del out
            self.release_memory(keep_kv_upto=1024)
        await self.clear_l1()
        return res

    async def sec_soak(self) -> dict[str, Any]:
        R, T, n = self.reps, 1024, self.soak_ops
        a, b = split_reps(R)
        kv = self.kv(T)
        # same plan as sdk_peer.run_mixed_soak (random.Random(seed + 7), weights 3/4/3)
        plan_rng = random.Random(self.args.seed + 7)
        kinds = plan_rng.choices(["store", "retrieve", "lookup"], weights=[3, 4, 3], k=n)
        picks = [plan_rng.random() for _ in range(n)]
        n_store = kinds.count("store")
        thr: list[float] = []
        lat: dict[str, list[float]] = {"store": [], "retrieve": [], "lookup": []}

        async def rep() -> float:
            await self.ensure_room((4 + n_store) * T * TOKEN_BYTES)
            stored = [self.tokens(T) for _ in range(4)]
            for toks in stored:
                await self.c.store(kv, toks)
            fresh = [self.tokens(T) for _ in range(n)]
            gate = asyncio.Semaphore(64)

            async def one(i: int) -> None:
                async with gate:
                    kind = kinds[i]
                    t0 = time.perf_counter()
                    if kind == "store":
                        r = await self.c.store(kv, fresh[i])
                        if r.written_chunks != T // C:
                            raise RuntimeError(f"soak store wrote {r.written_chunks}")
                        stored.append(fresh[i])
                    else:
                        toks = stored[int(picks[i] * len(stored))]
                        if kind == "retrieve":
                            got = await self.c.retrieve(toks)
                            if got is None:
                                raise RuntimeError("soak retrieve missed")
                            del got
                        elif await self.c.lookup(toks) != T:
                            raise RuntimeError("soak lookup missed")
                    lat[kind].append(time.perf_counter() - t0)

            await drain(self.ctx)
            gc.collect()
            t0 = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(n)))
            await drain(self.ctx)
            return n / (time.perf_counter() - t0)

        await rep()  # warm-up
        for k in lat.values():
            k.clear()
        for _ in range(a):
            thr.append(await rep())
        items = []
        for threads in (1, 8):
            for i in range(R + 1):
                ops = 8 if i == 0 else n  # a short untimed warm-up run first
                items.append(({"op": "mixed_soak", "ops": ops, "T": T, "threads": threads,
                               "clear_before": True, "warmup": i == 0},
                              (4 + n_store) * T * TOKEN_BYTES))
        res = await self.sdk_job("soak", self.sdk_plan(items))
        await self.clear_l1()
        for _ in range(b):
            thr.append(await rep())
        sdk: dict[int, list[float]] = {1: [], 8: []}
        sdk_lat: dict[int, dict[str, list[float]]] = {1: {}, 8: {}}
        for w in res["results"]:
            if w.get("warmup"):
                continue
            t = int(w["threads"])
            sdk[t].append(int(w["ops"]) / w["wall_s"])
            for kind, xs in w["samples"].items():
                sdk_lat[t].setdefault(kind, []).extend(xs)
        out: dict[str, Any] = {"T": T, "ops_per_rep": n, "mix": {"store": n_store,
                               "retrieve": kinds.count("retrieve"),
                               "lookup": kinds.count("lookup")},
                               "lmkv_64": summarize(thr),
                               "lmkv_latency": {k: summarize(v) for k, v in lat.items()},
                               "sdk_job_wall_s": res["wall_s"]}
        for t in (1, 8):
            out[f"sdk_threads_{t}"] = summarize(sdk[t])
            out[f"sdk_threads_{t}_latency"] = {k: summarize(v) for k, v in sdk_lat[t].items()}
            out[f"ratio_vs_sdk_{t}"] = out["lmkv_64"]["median"] / out[f"sdk_threads_{t}"]["median"]
        return out

    async def sockets_on(self, srv: LocalServer, label: str) -> dict[str, Any]:
        """32 in flight (16 retrieves of 16 stored prefixes + 16 fresh stores), sockets 1/2/4."""
        R, T = self.reps, 1024
        kv = self.kv(T)
        configs = (1, 2, 4)
        thr: dict[int, list[float]] = {s: [] for s in configs}
        ctxs: dict[int, lmkv.AsyncKVContext] = {}
        try:
            for s in configs:
                ctxs[s] = await lmkv.connect(srv.url, srv.http_url, MODEL, layout=LAYOUT,
                                             sockets=s, timeout=60)

            async def rep(ctx: lmkv.AsyncKVContext) -> float:
                await drain(ctx)
                await self.clear_l1(srv.http_url)
                base = [self.tokens(T) for _ in range(16)]
                for toks in base:
                    await ctx.store(kv, toks)
                fresh = [self.tokens(T) for _ in range(16)]
                await drain(ctx)
                gc.collect()

                async def get(toks: list[int]) -> None:
                    if await ctx.retrieve(toks) is None:
                        raise RuntimeError("sockets retrieve missed")

                async def put(toks: list[int]) -> None:
                    r = await ctx.store(kv, toks)
                    if r.written_chunks != T // C:
                        raise RuntimeError(f"sockets store wrote {r.written_chunks}")

                ops = [get(t) for t in base] + [put(t) for t in fresh]
                order = list(range(32))
                random.Random(len(thr[1])).shuffle(order)
                t0 = time.perf_counter()
                await asyncio.gather(*(ops[i] for i in order))
                await drain(ctx)
                return 32 / (time.perf_counter() - t0)

            for s in configs:
                await rep(ctxs[s])  # warm-up
            for _ in range(R):
                for s in configs:  # interleaved, so drift hits every config alike
                    thr[s].append(await rep(ctxs[s]))
        finally:
            for ctx in ctxs.values():
                await ctx.aclose()
        out: dict[str, Any] = {"server": label, "T": T, "in_flight": 32}
        for s in configs:
            out[f"sockets_{s}"] = summarize(thr[s])
            out[f"ratio_{s}_vs_1"] = out[f"sockets_{s}"]["median"] / statistics.median(thr[1])
        return out

    async def sec_sockets(self) -> dict[str, Any]:
        assert self.srv is not None
        await drain(self.ctx)
        rows = [await self.sockets_on(self.srv, "--max-gpu-workers 1")]
        return {"rows": rows}

    async def sockets_w2(self) -> dict[str, Any]:
        assert self.server_python is not None
        cfg = ServerConfig(version="0.5.6", python=self.server_python, shm=True,
                           l1_size_gb=6.0, extra_args=("--max-gpu-workers", "2"))
        srv = LocalServer(cfg, log_path=self.tmp / "server-w2.log")
        try:
            srv.start()
            return await self.sockets_on(srv, "--max-gpu-workers 2")
        finally:
            srv.stop()

    async def sec_sdk_cold(self) -> dict[str, Any]:
        T, R = 4096, self.reps
        await self.clear_l1()
        res = await self.sdk_job("sdk_cold", [
            {"op": "store", "T": T, "reps": R}, {"op": "retrieve", "T": T, "reps": R}],
            warm=False)
        await self.clear_l1()
        out: dict[str, Any] = {"T": T, "sdk_job_wall_s": res["wall_s"]}
        for w in res["results"]:
            out[f"sdk_cold_{w['op']}"] = summarize(w["samples"])
        return out

    # ------------------------------------------------------------------ driver
    async def run_main(self, sections: list[str]) -> None:
        assert self.srv is not None
        self.http = httpx.AsyncClient(timeout=60, trust_env=False)
        try:
            t0 = time.monotonic()
            self.ctx = await lmkv.connect(self.srv.url, self.srv.http_url, MODEL, timeout=60)
            self.results["lmkv_connect_s"] = time.monotonic() - t0
            if self.ctx.layout != LAYOUT or self.ctx.transport != "shm" or self.ctx.chunk_size != C:
                raise RuntimeError(f"unexpected context: {self.ctx.layout} "
                                   f"{self.ctx.transport} {self.ctx.chunk_size}")
            log(f"lmkv_async connected in {self.results['lmkv_connect_s']:.1f}s "
                "(incl. pre-faulting the SHM pool)")
            order = [s for s in SECTIONS if s in sections]
            for name in order:
                if name == "sockets":
                    continue
                await self.run_section(name, getattr(self, f"sec_{name}"))
            if "sockets" in order:
                await self.run_section("sockets", self.sec_sockets)
            await self.ctx.aclose()
            self.ctx = None
        finally:
            if self.ctx is not None:
                with contextlib.suppress(Exception):
                    await self.ctx.aclose()
            await self.http.aclose()

    async def run_section(self, name: str, fn: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        log(f"\n== {name} (load avg {os.getloadavg()[0]:.2f})")
        t0 = time.monotonic()
        load0 = os.getloadavg()[0]
        try:
            res = await fn()
        except Exception as exc:
            self.errors[name] = f"{type(exc).__name__}: {exc}"
            log(f"   FAILED: {self.errors[name]}")
            traceback.print_exc()
            return
        res["section_s"] = time.monotonic() - t0
        res["loadavg_1m"] = [load0, os.getloadavg()[0]]
        if self.ctx is not None:
            with contextlib.suppress(Exception):
                res["server_read_locks_after"] = await self.read_locks()
                if res["server_read_locks_after"]:
                    log(f"   NOTE: {res['server_read_locks_after']} L1 objects still read-locked")
        self.results[name] = res
        log(f"   done in {res['section_s']:.1f}s")
        print_section(name, res)


def _p(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


# ----------------------------------------------------------------------------- printing
def ms(s: dict[str, Any]) -> str:
    return f"{s['median'] * 1e3:9.1f} ms [{s['p10'] * 1e3:.1f}-{s['p90'] * 1e3:.1f}]"


def rate(s: dict[str, Any], unit: str = "/s") -> str:
    return f"{s['median']:9.1f}{unit} [{s['p10']:.1f}-{s['p90']:.1f}]"


def print_section(name: str, r: dict[str, Any]) -> None:
    if name == "store":
        log(f"   {'T':>6} {'MiB':>5}  {'lmkv store':<28}{'SDK store':<28}{'SDK/lmkv':>8}")
        for row in r["rows"]:
            log(f"   {row['T']:>6} {row['bytes'] / 2**20:>5.0f}  {ms(row['lmkv']):<28}"
                f"{ms(row['sdk']):<28}{row['speedup']:>7.2f}x")
    elif name == "retrieve":
        log(f"   {'T':>6} {'MiB':>5}  {'SDK retrieve':<28}{'lmkv':<28}{'lmkv out=':<28}"
            f"{'x':>6}{'x out=':>8}")
        for row in r["rows"]:
            log(f"   {row['T']:>6} {row['bytes'] / 2**20:>5.0f}  {ms(row['sdk']):<28}"
                f"{ms(row['lmkv']):<28}{ms(row['lmkv_out']):<28}{row['speedup']:>5.2f}x"
                f"{row['speedup_out']:>7.2f}x")
        log(f"   bit-exact: {r['bit_exact']}")
    elif name == "fanout":
        log(f"   SDK sequential      {rate(r['sdk_sequential'], ' pfx/s')}")
        for k in ("with_outs", "no_outs", "sequential"):
            log(f"   lmkv {k:<14} {rate(r['lmkv_' + k], ' pfx/s')}  {r['ratio_' + k]:.2f}x SDK")
    elif name == "lookup":
        for t in (1, 8):
            log(f"   SDK {t} thread(s)     {rate(r[f'sdk_threads_{t}'])}")
        for n in (1, 8, 64):
            log(f"   lmkv {n:>2} in flight   {rate(r[f'lmkv_{n}'])}  "
                f"{r[f'ratio_{n}_vs_best_sdk']:.2f}x best SDK")
    elif name == "looplag":
        i = r["idle"]
        log(f"   idle ticker: max gap median {i['max']['median'] * 1e3:.2f} ms, "
            f"worst {i['worst'] * 1e3:.2f} ms, p99 {i['p99'] * 1e3:.2f} ms")
        for row in r["rows"]:
            log(f"   T={row['T']:>5} ({row['bytes'] / 2**20:.0f} MiB) {row['variant']:<20} "
                f"retrieve {row['retrieve_s']['median'] * 1e3:7.1f} ms: max gap median "
                f"{row['max']['median'] * 1e3:.2f} ms (worst {row['worst'] * 1e3:.2f}), "
                f"p99 {row['p99'] * 1e3:.2f} ms")
    elif name == "soak":
        log(f"   lmkv 64 in flight   {rate(r['lmkv_64'], ' ops/s')}")
        for t in (1, 8):
            log(f"   SDK {t} thread(s)     {rate(r[f'sdk_threads_{t}'], ' ops/s')}  "
                f"lmkv {r[f'ratio_vs_sdk_{t}']:.2f}x")
    elif name == "sockets":
        for row in r["rows"]:
            log(f"   {row['server']}: " + ", ".join(
                f"sockets={s} {row[f'sockets_{s}']['median']:.1f} op/s "
                f"({row[f'ratio_{s}_vs_1']:.2f}x)" for s in (1, 2, 4)))
    elif name == "sdk_cold":
        log(f"   SDK cold process, T={r['T']}: store {ms(r['sdk_cold_store'])}, "
            f"retrieve {ms(r['sdk_cold_retrieve'])}")


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The brief's targets, evaluated on this run's medians."""
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, goal: float, unit: str, higher: bool = True) -> None:
        ok = None if value is None else (value >= goal if higher else value <= goal)
        out.append({"target": name, "value": value, "goal": goal, "unit": unit,
                    "higher_is_better": higher, "met": ok})

    def row(sec: str, T: int, key: str) -> float | None:
        for r in res.get(sec, {}).get("rows", []):
            if r["T"] == T:
                return float(r[key])
        return None

    add("retrieve T=4096 into out= vs SDK retrieve", row("retrieve", 4096, "speedup_out"),
        6.0, "x")
    add("store T=4096 vs SDK store", row("store", 4096, "speedup"), 2.0, "x")
    f: dict[str, Any] | None = res.get("fanout")
    add("32-prefix fan-out T=1024, caller buffers, vs SDK sequential",
        f["ratio_with_outs"] if f else None, 8.0, "x")
    add("32-prefix fan-out T=1024, no buffers, vs SDK sequential",
        f["ratio_no_outs"] if f else None, 3.0, "x")
    lag = res.get("looplag", {}).get("rows", [])
    for row_ in lag:
        if row_.get("diagnostic"):
            continue
        add(f"loop lag max (median of reps), T={row_['T']} retrieve {row_['variant']}",
            row_["max"]["median"] * 1e3, 5.0, "ms", higher=False)
    return out


def print_targets(ts: list[dict[str, Any]]) -> None:
    log("\n== targets (this run's medians)")
    for t in ts:
        v = "n/a" if t["value"] is None else f"{t['value']:.2f} {t['unit']}"
        op = ">=" if t["higher_is_better"] else "<="
        verdict = {True: "MET", False: "MISSED", None: "not run"}[t["met"]]
        log(f"   {t['target']:<66} {v:>10}  (goal {op} {t['goal']:g} {t['unit']})  {verdict}")


# ----------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="T <= 4096, 4 reps, smaller batches, L1 6 GiB, no sdk_cold")
    ap.add_argument("--reps", type=int, default=None, help="reps per measurement (default 7)")
    ap.add_argument("--tokens", type=int, nargs="*", help="token counts for store/retrieve")
    ap.add_argument("--sections", nargs="*", choices=SECTIONS, default=None)
    ap.add_argument("--l1-gb", type=float, default=None,
                    help="main server L1 in GiB (default 8; 6 with --quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "e2e.json"))
    args = ap.parse_args()
    if args.reps is not None and args.reps < 1:
        ap.error("--reps must be >= 1")
    for T in args.tokens or []:
        if T <= 0 or T % C:
            ap.error(f"token counts must be positive multiples of {C}")
    sections = list(args.sections or SECTIONS)
    if args.quick and args.sections is None:
        sections.remove("sdk_cold")
    bench = Bench(args)
    if bench.server_python is None:
        log("no lmcache 0.5.6 server environment: set LMKV_LMCACHE_PYTHON_056 or build "
            ".nox/lmcache-server-056 (nox -s server-envs)")
        return 2
    l1_gb = args.l1_gb or (6.0 if args.quick else 8.0)
    shm_free = os.statvfs("/dev/shm")
    free_gb = shm_free.f_bavail * shm_free.f_frsize / 2**30
    if free_gb < l1_gb + 4.5:
        log(f"/dev/shm has {free_gb:.1f} GiB free; this run needs about {l1_gb + 4.5:.1f}")
        return 2
    t_start = time.monotonic()
    log(f"lmkv_async e2e benchmark: L={L} NH={NH} HS={HS} bf16 BS={BS} chunk={C}, "
        f"{TOKEN_BYTES // 1024} KiB/token; reps={bench.reps}; T={bench.tokens_list}; "
        f"L1 {l1_gb:g} GiB; {os.cpu_count()} CPUs ({cpu_model()}); load avg "
        f"{os.getloadavg()[0]:.2f}")
    cfg = ServerConfig(version="0.5.6", python=bench.server_python, shm=True,
                       transfer_mode="auto", chunk_size=C, l1_size_gb=l1_gb,
                       extra_args=("--max-gpu-workers", "1"))
    srv = LocalServer(cfg, log_path=bench.tmp / "server-main.log")
    bench.srv = srv
    try:
        srv.start()
        log(f"server {srv.reported_version} pid {srv.pid} started in {srv.start_seconds:.1f}s")
        with registered_engine(srv, model=MODEL, num_layers=L, num_kv_heads=NH, head_dim=HS,
                               block_size=BS, num_blocks=16, log_dir=bench.tmp) as reg:
            log(f"registered lmcache-driven engine (pid {reg.proc.pid})")
            asyncio.run(bench.run_main(sections))
    finally:
        srv.stop()
    if "sockets" in sections and "sockets" not in bench.errors:
        async def w2() -> None:
            bench.http = httpx.AsyncClient(timeout=60, trust_env=False)
            try:
                await bench.run_section("sockets_w2", bench.sockets_w2)
            finally:
                await bench.http.aclose()
        bench.srv = srv  # only for l1_usage defaults; sockets_on passes its own URL
        asyncio.run(w2())
        w2res = bench.results.pop("sockets_w2", None)
        if w2res is not None and "sockets" in bench.results:
            bench.results["sockets"]["rows"].append(w2res)
            print_section("sockets", bench.results["sockets"])
        elif "sockets_w2" in bench.errors:
            bench.errors["sockets"] = bench.errors.pop("sockets_w2")
    ts = targets(bench.results)
    print_targets(ts)
    cmd_env = ""
    if os.environ.get("LMKV_LMCACHE_PYTHON_056"):
        cmd_env = f"LMKV_LMCACHE_PYTHON_056={shlex.quote(os.environ['LMKV_LMCACHE_PYTHON_056'])} "
    if os.environ.get("PYTHONPATH"):
        cmd_env += f"PYTHONPATH={shlex.quote(os.environ['PYTHONPATH'])} "
    command = cmd_env + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    doc = {
        "kind": "lmkv_async e2e vs official lmcache SDK",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "geometry": {"L": L, "NH": NH, "HS": HS, "BS": BS, "C": C, "dtype": "bfloat16",
                     "token_bytes": TOKEN_BYTES},
        "reps": bench.reps,
        "quick": bench.quick,
        "tokens": bench.tokens_list,
        "server": {"version": srv.reported_version, "l1_size_gb": l1_gb,
                   "flags": "--supported-transfer-mode auto --max-gpu-workers 1 (SHM)"},
        "sdk": bench.sdk_meta,
        "lmkv_async": {"version": lmkv.__version__, "file": lmkv.__file__,
                       "kernel": kernel.kernel_available(), "kernel_threads": kernel.num_threads()},
        "machine": {"nproc": os.cpu_count(), "cpu_model": cpu_model(),
                    "platform": platform.platform(), "torch": torch.__version__,
                    "python": platform.python_version()},
        "results": bench.results,
        "errors": bench.errors,
        "targets": ts,
        "wall_s": time.monotonic() - t_start,
        "command": command,
        "cwd": str(Path.cwd()),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    log(f"\nwall time {doc['wall_s']:.0f}s; wrote {out}")
    if bench.errors:
        log(f"sections that FAILED: {sorted(bench.errors)}; logs kept in {bench.tmp}")
    else:
        shutil.rmtree(bench.tmp, ignore_errors=True)
    log(f"reproduce: cd {Path.cwd()} && {command}")
    return 1 if bench.errors else 0


if __name__ == "__main__":
    sys.exit(main())
