"""Benchmark baseline: drive lmcache's OFFICIAL synchronous SDK and time each operation.

Runs INSIDE the lmcache 0.5.6 server environment (it imports ``lmcache``; the
``lmkv_async`` library never does), with nothing beyond what that env has.

Preconditions on the server: ``--supported-transfer-mode auto`` and an
lmcache-driven registration for ``model``
(``lmkv_async.testing.registered_engine``), because the SDK discovers its layout from
``/status`` -> ``cache_context_meta``.

Input: one JSON job, as ``argv[1]`` (a JSON string or ``@path``) or on stdin::

    {"url": "tcp://127.0.0.1:P", "http_url": "http://127.0.0.1:H", "model": "m",
     "geometry": {"num_layers": 8, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"},
     "seed": 0, "timeout": 60, "vocab": 150000, ["token_nonce": N,]
     "workloads": [
        {"op": "store", "T": 4096, "reps": 7},
        {"op": "retrieve", "T": 4096, "reps": 7},
        {"op": "retrieve_seq", "n_prefixes": 32, "T": 1024},
        {"op": "lookup", "n": 200, "T": 1024, "threads": 1},
        {"op": "mixed_soak", "ops": 400, "T": 1024, "threads": 8}]}

Output: exactly one JSON line on stdout (all logging goes to stderr)::

    {"ok": true, "lmcache_version": "0.5.6", "connect_s": 0.03,
     "sanity": {"retrieve_bit_exact": true, ...},
     "results": [{"op": "store", "T": 4096, "reps": 7, "samples": [s, ...]}, ...]}

Every sample is seconds from ``time.perf_counter``. What is timed:

* ``store``: ``ctx.store(kv, tokens)`` with fresh random tokens each rep (a real write).
* ``retrieve``: ``ctx.retrieve(tokens)`` of one stored prefix, ``reps`` times (hits).
* ``retrieve_seq``: store ``n_prefixes`` prefixes (untimed), retrieve each once.
* ``lookup``: the SDK's lookup path (``maybe_submit_lookup_request`` + polling
  ``check_lookup_result``), then ``free_lookup_locks`` over the hit and
  ``end_session`` (the SDK has no public lookup-only call; without the free the
  read locks would stay until the server's read TTL). ``n`` lookups spread
  over ``threads`` threads; ``wall_s`` is the total.
* ``mixed_soak``: ``ops`` random operations (by default store 30% / retrieve
  40% / lookup 30%; ``"weights": [s, r, l]`` changes it) over ``threads``
  threads; samples are grouped per kind.

Threads: each worker thread gets its own SDK context (``connect`` once per
thread, before the clock starts). Sharing one context between threads leaks
server read locks in lmcache 0.5.6's SDK, so it is not a usable baseline.

The SDK's ``close()`` does not unregister its engine-driven context; this
script unregisters it explicitly so the server is left clean.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")


def _load_job(argv: list[str]) -> dict[str, Any]:
    if len(argv) > 1 and argv[1] not in ("-", ""):
        raw = argv[1]
        if raw.startswith("@"):
            with open(raw[1:]) as f:
                raw = f.read()
    else:
        raw = sys.stdin.read()
    job: dict[str, Any] = json.loads(raw)
    return job


class Peer:
    """One SDK context plus the data the workloads need."""

    def __init__(self, job: dict[str, Any]) -> None:
        import torch
        from lmcache.sdk import kvcache

        self.torch = torch
        geo = job["geometry"]
        self.num_layers = int(geo["num_layers"])
        self.hidden = int(geo["num_kv_heads"]) * int(geo["head_dim"])
        self.dtype = getattr(torch, geo.get("dtype", "bfloat16"))
        self.vocab = int(job.get("vocab", 150_000))
        self.seed = int(job.get("seed", 0))
        self.timeout = float(job.get("timeout", 60.0))
        # Tokens must be new on every run: storing a prefix the server already
        # holds writes nothing (SHM commit_store returns False). The nonce is
        # reported, and can be pinned with "token_nonce" to replay a run.
        self.token_nonce = int(job.get("token_nonce", int.from_bytes(os.urandom(6), "big")))
        self._rng = random.Random(self.seed * 2**48 + self.token_nonce)
        self._rng_lock = threading.Lock()
        self._kv_cache: dict[int, Any] = {}

        self._connect_args = (job["url"], job["http_url"], job["model"])
        self._kvcache = kvcache
        self._local = threading.local()
        self._contexts: list[Any] = []
        self._contexts_lock = threading.Lock()
        self._executors: dict[int, ThreadPoolExecutor] = {}
        t0 = time.perf_counter()
        first = self.ctx
        self.connect_s = time.perf_counter() - t0
        self.chunk = int(first.chunk_size)

    @property
    def ctx(self) -> Any:
        """This thread's SDK context (one per thread, created on first use).

        One context shared by several threads leaks L1 read locks on the
        server (measured: 8 threads x 8 concurrent retrieves on one context
        left 8 read-locked objects; one context per thread left none).
        """
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            url, http_url, model = self._connect_args
            ctx = self._kvcache.connect(url, http_url, model, timeout=self.timeout)
            self._local.ctx = ctx
            with self._contexts_lock:
                self._contexts.append(ctx)
        return ctx

    def executor(self, threads: int) -> ThreadPoolExecutor:
        """A pool reused across workloads, so per-thread contexts are reused too."""
        pool = self._executors.get(threads)
        if pool is None:
            pool = self._executors[threads] = ThreadPoolExecutor(max_workers=threads)
        return pool

    # ---------------------------------------------------------------- data
    def tokens(self, n: int) -> list[int]:
        """Fresh random token ids (a new prefix every call)."""
        with self._rng_lock:
            return [self._rng.randrange(self.vocab) for _ in range(n)]

    def kv(self, n: int) -> Any:
        """A random [2, L, n, D] tensor, generated once per length from the seed."""
        t = self._kv_cache.get(n)
        if t is None:
            g = self.torch.Generator().manual_seed(self.seed * 1_000_003 + n)
            t = self.torch.randn(
                (2, self.num_layers, n, self.hidden), generator=g, dtype=self.torch.float32
            ).to(self.dtype)
            self._kv_cache[n] = t
        return t

    # ---------------------------------------------------------------- ops
    def store(self, kv: Any, toks: list[int]) -> float:
        t0 = time.perf_counter()
        ok = self.ctx.store(kv, toks)
        dt = time.perf_counter() - t0
        if not ok:
            raise RuntimeError("ctx.store returned False")
        return dt

    def retrieve(self, toks: list[int], expect_tokens: int) -> tuple[float, Any]:
        t0 = time.perf_counter()
        out = self.ctx.retrieve(toks)
        dt = time.perf_counter() - t0
        if out is None or int(out.shape[2]) != expect_tokens:
            got = None if out is None else tuple(out.shape)
            raise RuntimeError(f"retrieve returned {got}, expected {expect_tokens} tokens")
        return dt, out

    def lookup(self, toks: list[int]) -> tuple[float, int]:
        ctx = self.ctx
        rid = f"lookup-{uuid.uuid4().hex}"
        t0 = time.perf_counter()
        ctx.maybe_submit_lookup_request(rid, toks)
        hit = ctx.check_lookup_result(rid)
        while hit is None:
            if time.perf_counter() - t0 > self.timeout:
                raise TimeoutError("lookup result not ready")
            time.sleep(0.0005)
            hit = ctx.check_lookup_result(rid)
        dt = time.perf_counter() - t0
        # Release the read locks the lookup took, then end the session.
        if hit > 0:
            key = ctx._create_key(toks[:hit], 0, hit, rid).no_worker_id_version()
            ctx._req_client.free_lookup_locks(key, ctx._world_size).result(timeout=self.timeout)
        ctx.end_session(rid)
        return dt, int(hit)

    def close(self) -> None:
        for pool in self._executors.values():
            pool.shutdown(wait=True)
        for ctx in self._contexts:
            # The SDK's close() leaves the engine-driven registration behind.
            with contextlib.suppress(Exception):
                ctx._req_client.unregister_kv_cache_engine_driven_context(ctx.instance_id).result(
                    timeout=self.timeout
                )
            with contextlib.suppress(Exception):
                ctx.close()


def _aligned(peer: Peer, t: int) -> int:
    if t <= 0 or t % peer.chunk:
        raise ValueError(f"T={t} must be a positive multiple of the chunk size {peer.chunk}")
    return t


def run_store(peer: Peer, w: dict[str, Any]) -> dict[str, Any]:
    t = _aligned(peer, int(w["T"]))
    kv = peer.kv(t)
    samples = [peer.store(kv, peer.tokens(t)) for _ in range(int(w.get("reps", 5)))]
    return {"samples": samples}


def run_retrieve(peer: Peer, w: dict[str, Any]) -> dict[str, Any]:
    t = _aligned(peer, int(w["T"]))
    toks = peer.tokens(t)
    peer.store(peer.kv(t), toks)
    samples = [peer.retrieve(toks, t)[0] for _ in range(int(w.get("reps", 5)))]
    return {"samples": samples}


def run_retrieve_seq(peer: Peer, w: dict[str, Any]) -> dict[str, Any]:
    t = _aligned(peer, int(w["T"]))
    kv = peer.kv(t)
    prefixes = [peer.tokens(t) for _ in range(int(w.get("n_prefixes", 16)))]
    for toks in prefixes:
        peer.store(kv, toks)
    samples = [peer.retrieve(toks, t)[0] for toks in prefixes]
    return {"samples": samples}


def _threaded(peer: Peer, n: int, threads: int, fn: Any) -> tuple[list[Any], float]:
    """Run ``fn(i)`` for i in range(n) on ``threads`` threads; return results and wall time."""
    if threads > 1:
        pool = peer.executor(threads)
        # Connect every worker's context before the clock starts.
        list(pool.map(lambda _i: (peer.ctx, time.sleep(0.05)), range(threads)))
    t0 = time.perf_counter()
    if threads <= 1:
        out = [fn(i) for i in range(n)]
    else:
        out = list(pool.map(fn, range(n)))
    return out, time.perf_counter() - t0


def run_lookup(peer: Peer, w: dict[str, Any]) -> dict[str, Any]:
    t = _aligned(peer, int(w.get("T", 1024)))
    toks = peer.tokens(t)
    peer.store(peer.kv(t), toks)
    n = int(w.get("n", 100))
    threads = int(w.get("threads", 1))

    def one(_i: int) -> float:
        dt, hit = peer.lookup(toks)
        if hit != t:
            raise RuntimeError(f"lookup hit {hit}, expected {t}")
        return dt

    samples, wall = _threaded(peer, n, threads, one)
    return {"samples": samples, "wall_s": wall}


def run_mixed_soak(peer: Peer, w: dict[str, Any]) -> dict[str, Any]:
    t = _aligned(peer, int(w.get("T", 1024)))
    n = int(w.get("ops", 200))
    threads = int(w.get("threads", 1))
    kv = peer.kv(t)
    stored: list[list[int]] = []
    stored_lock = threading.Lock()
    for _ in range(4):  # something to read from the start
        toks = peer.tokens(t)
        peer.store(kv, toks)
        stored.append(toks)
    plan_rng = random.Random(peer.seed + 7)
    weights = [float(x) for x in w.get("weights", (3, 4, 3))]  # store, retrieve, lookup
    kinds = plan_rng.choices(["store", "retrieve", "lookup"], weights=weights, k=n)
    picks = [plan_rng.random() for _ in range(n)]

    def one(i: int) -> tuple[str, float]:
        kind = kinds[i]
        if kind == "store":
            toks = peer.tokens(t)
            dt = peer.store(kv, toks)
            with stored_lock:
                stored.append(toks)
            return kind, dt
        with stored_lock:
            toks = stored[int(picks[i] * len(stored))]
        if kind == "retrieve":
            return kind, peer.retrieve(toks, t)[0]
        return kind, peer.lookup(toks)[0]

    out, wall = _threaded(peer, n, threads, one)
    samples: dict[str, list[float]] = {"store": [], "retrieve": [], "lookup": []}
    for kind, dt in out:
        samples[kind].append(dt)
    return {"samples": samples, "wall_s": wall}


RUNNERS = {
    "store": run_store,
    "retrieve": run_retrieve,
    "retrieve_seq": run_retrieve_seq,
    "lookup": run_lookup,
    "mixed_soak": run_mixed_soak,
}


def bit_equal(torch: Any, got: Any, want: Any) -> tuple[bool, str]:
    """Same dtype, same shape, same bits (integer views: NaN payloads, -0.0 count)."""
    if got.dtype != want.dtype:
        return False, f"dtype {got.dtype} != {want.dtype}"
    if tuple(got.shape) != tuple(want.shape):
        return False, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    itype = ints[got.element_size()]
    same = bool(torch.equal(got.contiguous().view(itype), want.contiguous().view(itype)))
    return same, "" if same else "bits differ"


def sanity(peer: Peer) -> dict[str, Any]:
    """Store one 2-chunk prefix and check retrieve returns exactly those bytes."""
    t = 2 * peer.chunk
    kv = peer.kv(t)
    toks = peer.tokens(t)
    peer.store(kv, toks)
    _, out = peer.retrieve(toks, t)
    exact, why = bit_equal(peer.torch, out, kv)  # no cast: a dtype change is a failure
    if not exact:
        raise RuntimeError(f"SDK retrieve did not return the stored bytes: {why}")
    return {"retrieve_bit_exact": exact, "T": t, "shape": list(out.shape), "dtype": str(out.dtype)}


def main(argv: list[str]) -> int:
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # keep stdout for the single result line
    result: dict[str, Any] = {"ok": False}
    peer: Peer | None = None
    try:
        job = _load_job(argv)
        import lmcache

        result["lmcache_version"] = getattr(lmcache, "__version__", "unknown")
        result["job"] = {k: v for k, v in job.items() if k != "workloads"}
        peer = Peer(job)
        result["connect_s"] = peer.connect_s
        result["chunk_size"] = peer.chunk
        result["token_nonce"] = peer.token_nonce
        result["sanity"] = sanity(peer)
        results = []
        for w in job.get("workloads", []):
            runner = RUNNERS.get(w.get("op", ""))
            if runner is None:
                raise ValueError(f"unknown workload op {w.get('op')!r}")
            entry = dict(w)
            entry.update(runner(peer, w))
            results.append(entry)
        result["results"] = results
        result["ok"] = True
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if peer is not None:
            peer.close()
        real_stdout.write(json.dumps(result) + "\n")
        real_stdout.flush()
        sys.stdout = real_stdout
    # The SDK's shared ZMQ polling thread can keep a normal exit waiting.
    sys.stderr.flush()
    os._exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main(sys.argv)
