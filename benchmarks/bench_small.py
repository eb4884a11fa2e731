"""Small transfers at memory speed (issue 11): same-run ratios against the copy, the wire and
the official SDK.

One real lmcache 0.5.6 MP server (SHM, ``--supported-transfer-mode auto``) and an
lmcache-driven registration of the benchmark model (L=32, NH=8, HS=128, bf16, BS=16, chunk
256 tokens: 128 KiB per token, so T=1024 moves 128 MiB). Sections:

  copy      per T in 256/1024/4096: ``store``, ``retrieve(out=)``, ``retrieve_view`` (enter,
            build the tensors, exit) and ``retrieve_view`` + ``copy_to``, each rep
            interleaved with a ``torch`` ``copy_`` and the kernel's ``stream_copy`` of the
            same bytes between pre-faulted buffers; ratio = copy time / operation time
            (1.0: the operation keeps pace with a bare copy)
  view      ``retrieve_view`` latency across T=256..16384 (flat: max/min of the medians)
  lookup    one at a time: lmkv ``lookup`` vs a bare blocking pyzmq DEALER sending the same
            frames (built with ``lmkv_async.wire.requests``: lookup, query_prefetch_status,
            then free_lookup_locks + end_session without waiting, like lmkv's background
            release), alternating blocks; and 64 in flight (``lookup_many``) vs the official
            SDK with 8 threads (``benchmarks/sdk_peer.py`` in the server's Python)
  looplag   a 1 ms ticker's largest gap while a 512 MiB retrieve is awaited, with and
            without ``out=`` (the output pool warmed first), and with nothing to do (the
            machine's own jitter)
  pipelining  before/after of this issue's latency changes in one process: lookup
            (T=1024) and retrieve(out=) (T=256) with the query pipelined behind the lookup
            and release steps started after the caller resumed, vs the earlier sequence
            (query after the lookup's ack, release sent first), alternating

Run from the repo root (dev venv: ``PYTHONPATH=.``)::

    python benchmarks/bench_small.py            # ~4-6 min on 2 cores
    python benchmarks/bench_small.py --quick    # fewer reps (~2-3 min)

Writes ``benchmarks/results/small.json`` (``--out`` to change), with the command that
reproduces it.
"""

from __future__ import annotations

import argparse
import asyncio
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
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("LMKV_OUTPUT_POOL_BYTES", str(3 << 30))

import httpx  # noqa: E402
import msgpack  # noqa: E402
import torch  # noqa: E402
import zmq  # noqa: E402
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
from lmkv_async.testing import (  # noqa: E402
    LocalServer,
    ServerConfig,
    find_server_python,
    registered_engine,
    server_env,
)
from lmkv_async.wire import requests  # noqa: E402
from lmkv_async.wire.frames import decode_reply, encode_request  # noqa: E402
from lmkv_async.wire.keys import KeyEncoder  # noqa: E402
from lmkv_async.wire.replies import parse_prepare_retrieve, parse_prepare_store  # noqa: E402

MODEL = "lmkv-bench-small"
SECTIONS = ("copy", "view", "lookup", "looplag", "pipelining")


def log(msg: str) -> None:
    print(msg, flush=True)


def random_kv(n: int, seed: int) -> torch.Tensor:
    """A ``[2, L, n, D]`` bf16 tensor of random NaN-free bits (touched, so pre-faulted)."""
    g = torch.Generator().manual_seed(seed)
    base = min(n, 4096)
    bits = torch.randint(-(2**15), 2**15, (2, L, base, D), dtype=torch.int16, generator=g)
    bits &= -16385
    if base < n:
        bits = bits.repeat(1, 1, -(-n // base), 1)[:, :, :n].contiguous()
    return bits.view(DTYPE)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def prefaulted(n: int) -> torch.Tensor:
    t = torch.empty((2, L, n, D), dtype=DTYPE)
    t.view(torch.int16).fill_(0)
    return t


class Floor:
    """A bare blocking pyzmq DEALER sending lmkv's own lookup frames: the wire's floor."""

    def __init__(self, ctx: lmkv.AsyncKVContext) -> None:
        # the same sequence lmkv sends: query right behind the lookup when the server's
        # normal pool is one ordered thread
        self.s = ctx._s  # the context's session: its instance id, pool and slot layout
        self.pipelined = self.s.pipelines_lookup_query
        self.d = ctx.dialect
        self.ws = ctx.layout.world_size
        self.zctx = zmq.Context()
        self.sock = self.zctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(ctx.url)
        self.uid = 0
        self.outstanding: set[int] = set()

    def send(self, req: requests.Request) -> int:
        self.uid += 1
        self.sock.send_multipart(encode_request(self.uid, req.op_id, req.payloads), copy=False)
        self.outstanding.add(self.uid)
        return self.uid

    def wait(self, uid: int) -> object:
        """The reply to ``uid`` (None if it already came while waiting for another)."""
        if uid not in self.outstanding:
            return None
        while True:
            if not self.sock.poll(30_000):
                raise TimeoutError("floor client: no reply in 30 s")
            reply = decode_reply(self.sock.recv_multipart())
            got = msgpack.unpackb(reply.uid_frame)
            self.outstanding.discard(got)
            if got == uid:
                return reply.result()

    def drain(self) -> None:
        while self.outstanding:
            self.wait(max(self.outstanding))

    def _looked_up(self, toks: list[int]) -> tuple[KeyEncoder, str, int]:
        """lookup and its query, pipelined where lmkv pipelines them; returns the key
        encoder, the request id and the hit chunks (read-locked on the server)."""
        rid = f"floor-{uuid.uuid4().hex}"
        enc = KeyEncoder(self.d, MODEL, self.ws, toks, "")
        n = len(toks)
        key = enc.encode(prefix_len=n, start=0, end=n, request_id=rid, worker_id=None)
        ack = self.send(requests.lookup(self.d, key, self.ws))
        if not self.pipelined:
            self.wait(ack)
        hit = self.wait(self.send(requests.query_prefetch_status(self.d, rid)))
        if self.pipelined:
            self.wait(ack)
        assert isinstance(hit, int) and hit > 0, hit
        return enc, rid, hit

    def _prepared(self, toks: list[int]) -> tuple[bytes, str, int, object]:
        """A whole-prefix hit and its prepare_retrieve: (key, request id, hit, reply)."""
        enc, rid, hit = self._looked_up(toks)
        n = len(toks)
        assert hit * C == n, hit
        rkey = enc.encode(prefix_len=n, start=0, end=n, request_id=rid, worker_id=0)
        raw = self.wait(self.send(requests.prepare_retrieve(self.d, rkey, self.s.instance_id)))
        assert raw is not None
        return rkey, rid, hit, raw

    def _release_retrieve(self, rkey: bytes, rid: str) -> None:
        # sent now, replies collected later: lmkv releases after the caller resumed too
        self.send(requests.commit_retrieve(self.d, rkey, self.s.instance_id))
        self.send(requests.end_session(self.d, rid))

    def lookup(self, toks: list[int]) -> int:
        enc, rid, hit = self._looked_up(toks)
        n = len(toks)
        fkey = enc.encode(prefix_len=n, start=0, end=hit * C, request_id=rid, worker_id=None)
        # release like lmkv: sent now, replies collected later
        self.send(requests.free_lookup_locks(self.d, fkey, self.ws))
        self.send(requests.end_session(self.d, rid))
        return hit * C

    def view(self, toks: list[int]) -> int:
        """A retrieve_view's RPCs, bare: lookup (+ query), prepare_retrieve, and the
        release (commit_retrieve, end_session) sent without waiting, as lmkv does at the
        block's exit. The server's share of a view, with no client around it."""
        rkey, rid, hit, _ = self._prepared(toks)
        self._release_retrieve(rkey, rid)
        return hit

    def store(self, kv: torch.Tensor, toks: list[int]) -> int:
        """A store's RPCs and copy, bare and blocking: prepare_store, the same C kernel
        scatter into the reserved slots, commit_store; end_session sent without waiting
        (lmkv sends it after answering too). Returns the chunks written."""
        s = self.s
        assert s.pool is not None and s.slot_spec is not None
        rid = f"floor-{uuid.uuid4().hex}"
        n = len(toks)
        enc = KeyEncoder(self.d, MODEL, self.ws, toks, "")
        key = enc.encode(prefix_len=n, start=0, end=n, request_id=rid, worker_id=0)
        raw = self.wait(self.send(requests.prepare_store(self.d, key, s.instance_id)))
        prep = parse_prepare_store(raw, s.slot_spec, n // C)
        chunks = [(i, s.pool.address + sl.offset)
                  for i, sl in zip(prep.chunk_indices, prep.slots, strict=True)]
        kernel.dense_to_chunks(kv, chunks, chunk_tokens=C, region=s.pool.region)
        ok = self.wait(self.send(requests.commit_store(self.d, key, s.instance_id)))
        self.send(requests.end_session(self.d, rid))
        assert ok is True, ok
        return len(chunks)

    def retrieve(self, toks: list[int], out: torch.Tensor) -> int:
        """A retrieve(out=)'s RPCs and copy, bare and blocking: lookup (+ query),
        prepare_retrieve, the same C kernel gather; the release sent without waiting."""
        s = self.s
        assert s.pool is not None and s.slot_spec is not None
        rkey, rid, hit, raw = self._prepared(toks)
        reply = parse_prepare_retrieve(raw, s.slot_spec, hit)
        assert reply.success and reply.shm
        chunks = [(i, s.pool.address + sl.offset) for i, sl in enumerate(reply.slots)]
        kernel.chunks_to_dense(out, chunks, chunk_tokens=C, region=s.pool.region)
        self._release_retrieve(rkey, rid)
        return hit

    def many(self, toks: list[int], n: int, in_flight: int) -> float:
        """``n`` lookups of ``toks`` with ``in_flight`` at once (each lookup's release sent
        behind its query, as above); returns lookups per second, all replies collected."""
        enc = KeyEncoder(self.d, MODEL, self.ws, toks, "")
        T = len(toks)
        query_of: dict[int, tuple[str, int]] = {}  # query uid -> (rid, lookup uid)
        started = done = 0
        t0 = time.perf_counter()

        def start() -> None:
            nonlocal started
            rid = f"floor-{uuid.uuid4().hex}"
            key = enc.encode(prefix_len=T, start=0, end=T, request_id=rid, worker_id=None)
            ack = self.send(requests.lookup(self.d, key, self.ws))
            # with a multi-thread normal pool a query could overtake; this floor is only
            # meaningful (and only used) on the ordered one
            query_of[self.send(requests.query_prefetch_status(self.d, rid))] = (rid, ack)
            started += 1

        for _ in range(min(in_flight, n)):
            start()
        while done < n:
            if not self.sock.poll(30_000):
                raise TimeoutError("floor client: no reply in 30 s")
            reply = decode_reply(self.sock.recv_multipart())
            uid = msgpack.unpackb(reply.uid_frame)
            self.outstanding.discard(uid)
            if uid in query_of:
                rid, _ack = query_of.pop(uid)
                hit = reply.result()
                assert isinstance(hit, int) and hit * C == T, hit
                fkey = enc.encode(prefix_len=T, start=0, end=T, request_id=rid, worker_id=None)
                self.send(requests.free_lookup_locks(self.d, fkey, self.ws))
                self.send(requests.end_session(self.d, rid))
                done += 1
                if started < n:
                    start()
        self.drain()
        return n / (time.perf_counter() - t0)

    def close(self) -> None:
        self.drain()
        self.sock.close()
        self.zctx.term()


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick: bool = args.quick
        self.reps: int = args.reps or (5 if self.quick else 9)
        self.rng = random.Random(args.seed)
        self.server_python = find_server_python("0.5.6")
        self.results: dict[str, Any] = {}
        self.errors: dict[str, str] = {}
        self.srv: LocalServer | None = None
        self.ctx: lmkv.AsyncKVContext | None = None
        self.http: httpx.AsyncClient | None = None
        self.tmp = Path(tempfile.mkdtemp(prefix="lmkv-bench-small-"))
        self._kvs: dict[int, torch.Tensor] = {}

    @property
    def c(self) -> lmkv.AsyncKVContext:
        assert self.ctx is not None
        return self.ctx

    def kv(self, n: int) -> torch.Tensor:
        t = self._kvs.get(n)
        if t is None:
            t = self._kvs[n] = random_kv(n, 1000 + n)
        return t

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    async def l1(self) -> tuple[int, int, int]:
        assert self.http is not None and self.srv is not None
        r = await self.http.get(self.srv.http_url + "/status")
        l1 = r.json()["storage_manager"]["l1_manager"]
        return (int(l1["memory_used_bytes"]), int(l1["memory_total_bytes"]),
                int(l1["read_locked_count"]))

    async def room(self, nbytes: int) -> None:
        """Empty L1 if ``nbytes`` more would come near the eviction watermark (0.8)."""
        used, total, _ = await self.l1()
        if used + nbytes <= 0.7 * total:
            return
        assert self.http is not None and self.srv is not None
        await drain(self.c)
        r = await self.http.post(self.srv.http_url + "/cache/clear",
                                 json={"tier": "l1", "force": False})
        r.raise_for_status()

    async def cached(self, n: int) -> list[int]:
        """Fresh tokens of ``n`` whose KV (``self.kv(n)``) is stored."""
        await self.room(n * TOKEN_BYTES)
        toks = self.tokens(n)
        res = await self.c.store(self.kv(n), toks)
        if res.written_chunks != n // C:
            raise RuntimeError(f"store of {n} tokens wrote {res.written_chunks} chunks")
        await drain(self.c)
        return toks

    # ------------------------------------------------------------------ sections
    async def sec_copy(self) -> dict[str, Any]:
        rows = []
        for T in (256, 1024, 4096):
            kv = self.kv(T)
            a, b = prefaulted(T), prefaulted(T)
            out = prefaulted(T)
            s: dict[str, list[float]] = {k: [] for k in (
                "copy_", "stream_copy", "store", "retrieve_out", "view", "view_copy_to",
                "floor_store", "floor_retrieve_out")}
            exact = True
            floor = Floor(self.c) if self.c._s.slot_spec is not None else None
            for rep in range(self.reps + 1):  # rep 0 warms up
                t0 = time.perf_counter()
                a.copy_(b)
                t1 = time.perf_counter()
                kernel.stream_copy(a, b)
                t2 = time.perf_counter()
                await self.room(T * TOKEN_BYTES)
                toks = self.tokens(T)
                await drain(self.c)
                t3 = time.perf_counter()
                res = await self.c.store(kv, toks)
                t4 = time.perf_counter()
                assert res.written_chunks == T // C
                await drain(self.c)
                t5 = time.perf_counter()
                got = await self.c.retrieve(toks, out=out)
                t6 = time.perf_counter()
                assert got is not None
                await drain(self.c)
                t7 = time.perf_counter()
                async with self.c.retrieve_view(toks) as view:
                    tensors = view.tensors
                    assert len(tensors) == T // C
                t8 = time.perf_counter()
                await drain(self.c)
                t9 = time.perf_counter()
                async with self.c.retrieve_view(toks) as view:
                    await view.copy_to(a)
                t10 = time.perf_counter()
                await drain(self.c)
                floor_t: dict[str, float] = {}
                if floor is not None:
                    # the same store and retrieve with no client around the RPCs and the
                    # copy: what the protocol itself costs (fresh tokens, so it writes)
                    await self.room(T * TOKEN_BYTES)
                    ftoks = self.tokens(T)
                    t11 = time.perf_counter()
                    assert floor.store(kv, ftoks) == T // C
                    t12 = time.perf_counter()
                    floor.drain()
                    b.zero_()
                    t13 = time.perf_counter()
                    assert floor.retrieve(ftoks, b) == T // C
                    t14 = time.perf_counter()
                    floor.drain()
                    floor_t = {"floor_store": t12 - t11, "floor_retrieve_out": t14 - t13}
                    if rep == 0 and not same_bits(b, kv):
                        raise RuntimeError(f"floor round trip T={T} not bit-exact")
                if rep == 0:
                    exact = same_bits(out, kv) and same_bits(a, kv)
                    continue
                for k, v in (("copy_", t1 - t0), ("stream_copy", t2 - t1), ("store", t4 - t3),
                             ("retrieve_out", t6 - t5), ("view", t8 - t7),
                             ("view_copy_to", t10 - t9), *floor_t.items()):
                    s[k].append(v)
            if floor is not None:
                floor.close()
            s = {k: v for k, v in s.items() if v}
            med = {k: statistics.median(v) for k, v in s.items()}
            row: dict[str, Any] = {"T": T, "bytes": T * TOKEN_BYTES, "bit_exact": exact,
                                   **{k: summarize(v) for k, v in s.items()}}
            for op in ("store", "retrieve_out", "view_copy_to", "floor_store",
                       "floor_retrieve_out"):
                if op not in med:
                    continue
                row[f"{op}_vs_copy_"] = med["copy_"] / med[op]
                row[f"{op}_vs_stream_copy"] = med["stream_copy"] / med[op]
                row[f"{op}_fixed_ms"] = (med[op] - med["stream_copy"]) * 1e3
            for op in ("store", "retrieve_out"):
                if f"floor_{op}" in med:  # > 1: lmkv is slower than the bare protocol
                    row[f"{op}_over_floor"] = med[op] / med[f"floor_{op}"]
            rows.append(row)
            log(f"   T={T:>5} ({T * TOKEN_BYTES >> 20:>4} MiB) copy_ {med['copy_'] * 1e3:7.2f} "
                f"stream {med['stream_copy'] * 1e3:7.2f} | store {med['store'] * 1e3:7.2f} "
                f"({row['store_vs_copy_']:.2f}x copy_, {row['store_vs_stream_copy']:.2f}x "
                f"stream) | retrieve(out=) {med['retrieve_out'] * 1e3:7.2f} "
                f"({row['retrieve_out_vs_copy_']:.2f}x, {row['retrieve_out_vs_stream_copy']:.2f}x)"
                f" | view {med['view'] * 1e3:6.2f} | view+copy_to "
                f"{med['view_copy_to'] * 1e3:7.2f} ({row['view_copy_to_vs_copy_']:.2f}x)"
                f"{'' if exact else '  NOT BIT-EXACT'}")
            if "floor_store" in med:
                log(f"          bare floor: store {med['floor_store'] * 1e3:7.2f} "
                    f"({row['floor_store_vs_copy_']:.2f}x copy_; lmkv/floor "
                    f"{row['store_over_floor']:.2f}) | retrieve(out=) "
                    f"{med['floor_retrieve_out'] * 1e3:7.2f} "
                    f"({row['floor_retrieve_out_vs_copy_']:.2f}x copy_; lmkv/floor "
                    f"{row['retrieve_out_over_floor']:.2f})")
            del a, b, out
            gc.collect()
        return {"rows": rows}

    async def sec_view(self) -> dict[str, Any]:
        rows = []
        floor = Floor(self.c)
        try:
            for T in (256, 1024, 4096, 16384):
                toks = await self.cached(T)
                async with self.c.retrieve_view(toks) as view:  # warm-up and bit-exactness
                    if not same_bits(torch.cat(view.tensors, dim=2), self.kv(T)):
                        raise RuntimeError(f"view T={T} not bit-exact")
                samples: dict[str, list[float]] = {"lmkv": [], "floor": []}
                for rep in range(self.reps):
                    # alternate who goes first: neither side always gets the warmer server
                    for who in ("floor", "lmkv") if rep % 2 else ("lmkv", "floor"):
                        await drain(self.c)
                        floor.drain()
                        t0 = time.perf_counter()
                        if who == "lmkv":
                            async with self.c.retrieve_view(toks) as view:
                                tensors = view.tensors
                            assert len(tensors) == T // C
                        else:
                            assert floor.view(toks) == T // C
                        samples[who].append(time.perf_counter() - t0)
                floor.drain()
                rows.append({"T": T, "bytes": T * TOKEN_BYTES, "view": summarize(samples["lmkv"]),
                             "floor": summarize(samples["floor"]),
                             "view_over_floor": statistics.median(samples["lmkv"])
                             / statistics.median(samples["floor"])})
                log(f"   T={T:>5}: retrieve_view {statistics.median(samples['lmkv']) * 1e3:.2f} "
                    f"ms, bare RPC floor {statistics.median(samples['floor']) * 1e3:.2f} ms")
                if T > 4096:
                    self._kvs.pop(T, None)  # 2 GiB of source
        finally:
            floor.close()
        meds = [r["view"]["median"] for r in rows]
        fmeds = [r["floor"]["median"] for r in rows]
        # floor_max_over_min: how much of the spread the server's own work makes
        log(f"   max/min: retrieve_view {max(meds) / min(meds):.2f}, bare RPC floor "
            f"{max(fmeds) / min(fmeds):.2f}")
        return {"rows": rows, "max_over_min": max(meds) / min(meds),
                "floor_max_over_min": max(fmeds) / min(fmeds)}

    async def sec_lookup(self) -> dict[str, Any]:
        T = 1024
        toks = await self.cached(T)
        n = 100 if self.quick else 200
        floor = Floor(self.c)
        seq: dict[str, list[float]] = {"lmkv": [], "floor": []}
        lat: dict[str, list[float]] = {"lmkv": [], "floor": []}
        try:
            for rep in range(self.reps + 1):
                for who in ("floor", "lmkv") if rep % 2 else ("lmkv", "floor"):
                    await drain(self.c)
                    t0 = time.perf_counter()
                    for _ in range(n):
                        s0 = time.perf_counter()
                        if who == "lmkv":
                            hit = await self.c.lookup(toks)
                        else:
                            hit = floor.lookup(toks)
                        lat[who].append(time.perf_counter() - s0)
                        if hit != T:
                            raise RuntimeError(f"{who} lookup hit {hit}")
                    if who == "lmkv":
                        await drain(self.c)
                    else:
                        floor.drain()
                    if rep:
                        seq[who].append(n / (time.perf_counter() - t0))
        finally:
            floor.close()
        par: list[float] = []
        floor64: list[float] = []
        floor = Floor(self.c)
        try:
            for rep in range(self.reps + 1):
                await drain(self.c)
                t0 = time.perf_counter()
                res = await self.c.lookup_many([toks] * (4 * n), max_in_flight=64)
                await drain(self.c)
                if rep:
                    par.append(4 * n / (time.perf_counter() - t0))
                if any(not r.ok or r.value != T for r in res):
                    raise RuntimeError("lookup_many missed")
                if floor.pipelined:
                    rate = floor.many(toks, 4 * n, 64)
                    if rep:
                        floor64.append(rate)
        finally:
            floor.close()
        sdk = await self.sdk_lookup(T, n)
        out: dict[str, Any] = {"T": T, "n_per_rep": n, "pipelined": floor.pipelined}
        for who in ("lmkv", "floor"):
            out[f"seq_{who}"] = summarize(seq[who])
            out[f"seq_{who}_latency"] = summarize(lat[who])
        out["seq_floor_over_lmkv"] = out["seq_floor"]["median"] / out["seq_lmkv"]["median"]
        out["lmkv_64"] = summarize(par)
        if floor64:  # the server's own capacity, as far as a bare client can drive it
            out["floor_64"] = summarize(floor64)
            out["floor_64_over_lmkv_64"] = out["floor_64"]["median"] / out["lmkv_64"]["median"]
        out["sdk_threads_8"] = summarize(sdk)
        out["lmkv_64_over_sdk_8"] = out["lmkv_64"]["median"] / out["sdk_threads_8"]["median"]
        log(f"   one at a time: lmkv {out['seq_lmkv']['median']:.0f}/s, floor "
            f"{out['seq_floor']['median']:.0f}/s (floor/lmkv {out['seq_floor_over_lmkv']:.2f}); "
            f"64 in flight {out['lmkv_64']['median']:.0f}/s vs SDK 8 threads "
            f"{out['sdk_threads_8']['median']:.0f}/s ({out['lmkv_64_over_sdk_8']:.2f}x); "
            f"floor 64 in flight {out.get('floor_64', {}).get('median', float('nan')):.0f}/s")
        return out

    async def sdk_lookup(self, T: int, n: int) -> list[float]:
        """Official SDK lookups with 8 threads (each its own SDK context), lookups/s per rep."""
        assert self.srv is not None and self.server_python is not None
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from bench_e2e import PEER_WRAPPER

        reps = self.reps
        items = [{"op": "lookup", "n": 2 * n, "T": T, "threads": 8, "warmup": i == 0}
                 for i in range(reps + 1)]
        job = {"url": self.srv.url, "http_url": self.srv.http_url, "model": MODEL,
               "geometry": GEOMETRY, "seed": self.args.seed, "timeout": 120, "vocab": VOCAB,
               "workloads": items}
        path = self.tmp / "job-lookup.json"
        path.write_text(json.dumps(job))
        await self.room((reps + 2) * T * TOKEN_BYTES)
        await drain(self.c)
        proc = await asyncio.create_subprocess_exec(
            self.server_python, "-c", PEER_WRAPPER, str(SDK_PEER), f"@{path}",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**server_env(), "LMKV_BENCH_SDK_WARM": "1"})
        out, err = await asyncio.wait_for(proc.communicate(), 600)
        (self.tmp / "job-lookup.stderr").write_bytes(err)
        lines = out.decode("utf-8", "replace").strip().splitlines()
        result = json.loads(lines[-1]) if lines else {"ok": False}
        if not result.get("ok"):
            raise RuntimeError(f"sdk job failed: {result.get('error')}\n"
                               f"{err.decode('utf-8', 'replace')[-2000:]}")
        self.results["sdk_version"] = result.get("lmcache_version")
        return [int(w["n"]) / w["wall_s"] for w in result["results"] if not w.get("warmup")]

    async def sec_looplag(self) -> dict[str, Any]:
        T = 4096
        toks = await self.cached(T)
        out = prefaulted(T)
        got = await self.c.retrieve(toks)  # warms the output pool
        del got
        gc.collect()
        idle = []
        for _ in range(self.reps):  # the machine's own jitter: the ticker with nothing to do
            async with LoopTicker() as ticker:
                await asyncio.sleep(0.07)
            idle.append(ticker.max_gap)
        log(f"   idle ticker: max gap median {statistics.median(idle) * 1e3:.2f} ms, worst "
            f"{max(idle) * 1e3:.2f}")
        rows = []
        for variant in ("no out", "out="):
            gaps, durs = [], []
            for _ in range(self.reps):
                await drain(self.c)
                gc.collect()
                async with LoopTicker() as ticker:
                    t0 = time.perf_counter()
                    got = await self.c.retrieve(toks, out=out if variant == "out=" else None)
                    durs.append(time.perf_counter() - t0)
                    assert got is not None
                    del got
                gaps.append(ticker.max_gap)
            rows.append({"T": T, "bytes": T * TOKEN_BYTES, "variant": variant,
                         "max_gap": summarize(gaps), "retrieve_s": summarize(durs)})
            log(f"   {variant:<7} retrieve {statistics.median(durs) * 1e3:.1f} ms: ticker max "
                f"gap median {statistics.median(gaps) * 1e3:.2f} ms, worst {max(gaps) * 1e3:.2f}")
        return {"rows": rows, "idle_max_gap": summarize(idle)}

    async def sec_pipelining(self) -> dict[str, Any]:
        """Before/after of this issue's latency changes in one process, alternating per rep:
        ``before`` sends the query after the lookup's ack and starts release steps at once
        (the earlier sequence); ``after`` pipelines the query behind the lookup (on a
        one-thread normal pool) and lets the caller resume before the first release send."""
        toks = await self.cached(1024)
        out = prefaulted(256)
        s: dict[str, dict[str, list[float]]] = {
            m: {"lookup": [], "retrieve_256": []} for m in ("before", "after")}
        sess = self.c._s
        real = (sess.ordered_normal_pool, sess.release_yields)
        try:
            for rep in range(8 * self.reps):
                for mode in ("before", "after") if rep % 2 else ("after", "before"):
                    sess.ordered_normal_pool, sess.release_yields = (
                        real if mode == "after" else (False, 0))
                    await drain(self.c)
                    t0 = time.perf_counter()
                    assert await self.c.lookup(toks) == 1024
                    t1 = time.perf_counter()
                    await drain(self.c)
                    t2 = time.perf_counter()
                    assert await self.c.retrieve(toks[:256], out=out) is not None
                    t3 = time.perf_counter()
                    s[mode]["lookup"].append(t1 - t0)
                    s[mode]["retrieve_256"].append(t3 - t2)
        finally:
            sess.ordered_normal_pool, sess.release_yields = real
        res: dict[str, Any] = {"server_normal_pool_ordered": real[0]}
        for mode, d in s.items():
            for k, v in d.items():
                res[f"{k}_{mode}"] = summarize(v)
        for k in ("lookup", "retrieve_256"):
            res[f"{k}_after_over_before"] = (res[f"{k}_after"]["median"]
                                             / res[f"{k}_before"]["median"])
            log(f"   {k}: before {res[f'{k}_before']['median'] * 1e3:.3f} ms, after "
                f"{res[f'{k}_after']['median'] * 1e3:.3f} ms "
                f"(after/before {res[f'{k}_after_over_before']:.2f})")
        return res

    # ------------------------------------------------------------------ driver
    async def run(self, sections: list[str]) -> None:
        assert self.srv is not None
        self.http = httpx.AsyncClient(timeout=60, trust_env=False)
        try:
            self.ctx = await lmkv.connect(self.srv.url, self.srv.http_url, MODEL, timeout=60)
            if self.c.layout != LAYOUT or self.c.transport != "shm":
                raise RuntimeError(f"unexpected context {self.c.layout} {self.c.transport}")
            for name in SECTIONS:
                if name not in sections:
                    continue
                log(f"\n== {name} (load avg {os.getloadavg()[0]:.2f})")
                t0 = time.monotonic()
                try:
                    res = await getattr(self, f"sec_{name}")()
                except Exception as exc:  # keep the other sections' results
                    import traceback

                    traceback.print_exc()
                    self.errors[name] = f"{type(exc).__name__}: {exc}"
                    continue
                await drain(self.c)
                res["section_s"] = time.monotonic() - t0
                res["server_read_locks_after"] = (await self.l1())[2]
                self.results[name] = res
        finally:
            if self.ctx is not None:
                await self.ctx.aclose()
            await self.http.aclose()


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, goal: float, higher: bool = True) -> None:
        ok = None if value is None else (value >= goal if higher else value <= goal)
        out.append({"target": name, "value": value, "goal": goal, "higher_is_better": higher,
                    "met": ok})

    for row in res.get("copy", {}).get("rows", []):
        for op in ("store", "retrieve_out"):
            add(f"{op} T={row['T']} vs torch copy_", row[f"{op}_vs_copy_"], 0.8)
            add(f"{op} T={row['T']} vs stream_copy", row[f"{op}_vs_stream_copy"], 0.8)
    v = res.get("view")
    add("retrieve_view T=256..16384 max/min median", v["max_over_min"] if v else None, 2.0,
        higher=False)
    lk = res.get("lookup")
    add("lookup one at a time: floor/lmkv", lk["seq_floor_over_lmkv"] if lk else None, 1.2,
        higher=False)
    add("lookup 64 in flight vs SDK 8 threads", lk["lmkv_64_over_sdk_8"] if lk else None, 2.0)
    for row in res.get("looplag", {}).get("rows", []):
        add(f"loop lag ms, 512 MiB retrieve {row['variant']}", row["max_gap"]["median"] * 1e3,
            5.0, higher=False)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer reps and lookups")
    ap.add_argument("--reps", type=int, default=None, help="reps per measurement (9; 5 quick)")
    ap.add_argument("--sections", nargs="*", choices=SECTIONS, default=None)
    ap.add_argument("--l1-gb", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "small.json"))
    args = ap.parse_args()
    bench = Bench(args)
    if bench.server_python is None:
        log("no lmcache 0.5.6 server environment: set LMKV_LMCACHE_PYTHON_056")
        return 2
    sections = list(args.sections or SECTIONS)
    t_start = time.monotonic()
    log(f"lmkv_async small-transfer benchmark: L={L} NH={NH} HS={HS} bf16, chunk {C}, "
        f"reps={bench.reps}; {os.cpu_count()} CPUs ({cpu_model()}); load avg "
        f"{os.getloadavg()[0]:.2f}; kernel threads {kernel.num_threads()}")
    cfg = ServerConfig(version="0.5.6", python=bench.server_python, shm=True,
                       transfer_mode="auto", chunk_size=C, l1_size_gb=args.l1_gb)
    srv = LocalServer(cfg, log_path=bench.tmp / "server.log")
    bench.srv = srv
    try:
        srv.start()
        with registered_engine(srv, model=MODEL, num_layers=L, num_kv_heads=NH, head_dim=HS,
                               block_size=BS, num_blocks=16, log_dir=bench.tmp):
            asyncio.run(bench.run(sections))
    finally:
        srv.stop()
    ts = targets(bench.results)
    log("\n== targets (this run's medians)")
    for t in ts:
        v = "n/a" if t["value"] is None else f"{t['value']:.2f}"
        verdict = {True: "MET", False: "MISSED", None: "not run"}[t["met"]]
        log(f"   {t['target']:<48} {v:>8}  (goal {'>=' if t['higher_is_better'] else '<='} "
            f"{t['goal']:g})  {verdict}")
    env = "".join(f"{k}={shlex.quote(os.environ[k])} " for k in (
        "LMKV_LMCACHE_PYTHON_056", "PYTHONPATH") if os.environ.get(k))
    command = env + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    doc = {
        "kind": "lmkv_async small transfers (issue 11)",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "geometry": {"L": L, "NH": NH, "HS": HS, "BS": BS, "C": C, "dtype": "bfloat16"},
        "reps": bench.reps, "quick": bench.quick,
        "server": {"version": srv.reported_version, "l1_size_gb": args.l1_gb},
        "lmkv_async": {"version": lmkv.__version__, "file": lmkv.__file__,
                       "kernel": kernel.kernel_available(),
                       "kernel_threads": kernel.num_threads()},
        "machine": {"nproc": os.cpu_count(), "cpu_model": cpu_model(),
                    "platform": platform.platform(), "torch": torch.__version__,
                    "python": platform.python_version()},
        "results": bench.results, "errors": bench.errors, "targets": ts,
        "wall_s": time.monotonic() - t_start, "command": command, "cwd": str(Path.cwd()),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    log(f"\nwall time {doc['wall_s']:.0f}s; wrote {out}")
    if bench.errors:
        log(f"sections that FAILED: {sorted(bench.errors)}; logs in {bench.tmp}")
    else:
        shutil.rmtree(bench.tmp, ignore_errors=True)
    log(f"reproduce: cd {Path.cwd()} && {command}")
    return 1 if bench.errors else 0


if __name__ == "__main__":
    sys.exit(main())
