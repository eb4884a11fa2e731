"""End-to-end demo against a real local lmcache server: ``python -m lmkv_async.demo``.

Starts an lmcache MP server as a child process (``lmkv_async.testing``,
``--supported-transfer-mode auto``, SHM on unless ``--no-shm``), connects with
an explicit :class:`~lmkv_async.KVLayout`, and runs concurrent stores,
``lookup_many``, ``retrieve_many`` (half of them into caller buffers), a
re-store, a salted miss and a paged ``store_blocks``/``retrieve_blocks`` round
trip. Every result is checked bit for bit, and the server's ``/status`` must
show no sessions, read locks or write reservations at the end and no
registration after ``aclose()``.

The server runs from a separate environment that has ``lmcache`` installed
(``nox -s demo`` builds it); this package never imports ``lmcache``.

Exit status: 0 when every check passed, 1 when one failed or the server
misbehaved, 2 when no server environment was found.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import lmkv_async as lmkv
from lmkv_async.testing import (
    KNOWN_VERSIONS,
    LocalServer,
    LocalServerError,
    ServerConfig,
    env_var_for,
    find_server_python,
)

__all__ = ["main"]

LAYOUT = lmkv.KVLayout(
    num_layers=8, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16, block_size=16
)
MODEL = "lmkv-demo"
CHUNK = 256  # --chunk-size of the demo server (the server default)
PREFIX_CHUNKS = 2  # chunks of "system prompt" shared by every prompt of a family
FAMILY_SIZE = 4  # prompts per shared prefix
SEED = 20240


# --------------------------------------------------------------------------- output


@dataclass
class Checks:
    """Collects pass/fail results and prints each one as it happens."""

    passed: int = 0
    failed: list[str] = field(default_factory=list)

    def __call__(self, ok: bool, what: str) -> bool:
        print(f"    {'ok  ' if ok else 'FAIL'}  {what}")
        if ok:
            self.passed += 1
        else:
            self.failed.append(what)
        return ok


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / max(seconds, 1e-9) / 1e9:.2f} GB/s"


def phase(title: str) -> None:
    print(f"\n== {title}")


# --------------------------------------------------------------------------- data


def random_bits(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """Random bit patterns as bf16: any value, NaNs included, so copies must be bit-exact."""
    bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen)
    return bits.view(LAYOUT.dtype)


def random_kv(gen: torch.Generator, tokens: int) -> torch.Tensor:
    """``[2, L, T, D]`` KV for ``tokens`` tokens."""
    return random_bits(gen, (LAYOUT.planes, LAYOUT.num_layers, tokens, LAYOUT.hidden_dim))


def random_tokens(gen: torch.Generator, n: int) -> list[int]:
    ids: list[int] = torch.randint(0, 2**32, (n,), dtype=torch.int64, generator=gen).tolist()
    return ids


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included), which ``torch.equal`` on floats is not."""
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@dataclass
class Prompt:
    tokens: list[int]
    kv: torch.Tensor  # [2, L, len(tokens), D]
    family: int

    @property
    def full(self) -> int:
        """Tokens in whole chunks: what the server can hold of this prompt."""
        return len(self.tokens) // CHUNK * CHUNK


def make_prompts(gen: torch.Generator, n: int) -> list[Prompt]:
    """``n`` prompts in families of FAMILY_SIZE that share a PREFIX_CHUNKS-chunk prefix.

    Equal tokens get equal KV, as a real model would produce: the server keeps
    one copy of a chunk per prefix hash, whoever stored it first.
    """
    prompts: list[Prompt] = []
    families = math.ceil(n / FAMILY_SIZE)
    for f in range(families):
        prefix_toks = random_tokens(gen, PREFIX_CHUNKS * CHUNK)
        prefix_kv = random_kv(gen, PREFIX_CHUNKS * CHUNK)
        for j in range(min(FAMILY_SIZE, n - f * FAMILY_SIZE)):
            # 1-3 chunks of its own, and every other prompt a ragged tail that is not stored
            tail = (1 + j % 3) * CHUNK + (37 if j % 2 else 0)
            toks = prefix_toks + random_tokens(gen, tail)
            kv = torch.cat([prefix_kv, random_kv(gen, tail)], dim=2)
            prompts.append(Prompt(toks, kv, f))
    return prompts


# --------------------------------------------------------------------------- the demo


async def run(server: LocalServer, args: argparse.Namespace, check: Checks) -> None:
    gen = torch.Generator().manual_seed(SEED)
    prompts = make_prompts(gen, args.prompts)
    chunk_bytes = CHUNK * LAYOUT.token_bytes()

    phase("connect")
    async with lmkv.connect(server.url, server.http_url, MODEL, layout=LAYOUT,
                            timeout=30) as ctx:
        print(f"    server_version={ctx.server_version!r}  dialect={ctx.dialect.name}  "
              f"transport={ctx.transport!r}  chunk_size={ctx.chunk_size}")
        print(f"    layout: L={LAYOUT.num_layers} NH={LAYOUT.num_kv_heads} "
              f"HS={LAYOUT.head_dim} {LAYOUT.dtype_name}, "
              f"{LAYOUT.token_bytes() // 1024} KiB/token, {mib(chunk_bytes)}/chunk")
        check(ctx.chunk_size == CHUNK, f"chunk size {ctx.chunk_size} == --chunk-size {CHUNK}")
        want = "pickle" if args.no_shm else "shm"
        check(ctx.transport == want, f"ctx.transport is {want!r}")
        check(ctx.server_version.startswith(args.version),
              f"ctx.server_version starts with {args.version}")

        # ------------------------------------------------------------ concurrent stores
        phase(f"store: {len(prompts)} prompts at once (asyncio.gather over ctx.store)")
        families = math.ceil(len(prompts) / FAMILY_SIZE)
        distinct = families * PREFIX_CHUNKS + sum(p.full // CHUNK - PREFIX_CHUNKS for p in prompts)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(ctx.store(p.kv, p.tokens) for p in prompts))
        dt = time.perf_counter() - t0
        total = sum(r.total_chunks for r in results)
        written = sum(r.written_chunks for r in results)
        ignored = sum(r.ignored_tokens for r in results)
        print(f"    {total} chunks offered, {written} written, {total - written} skipped "
              f"(shared prefixes), {ignored} ragged-tail tokens not sent")
        print(f"    {mib(written * chunk_bytes)} written in {dt * 1e3:.0f} ms "
              f"= {rate(written * chunk_bytes, dt)}")
        check(all(r.written_chunks + r.skipped_chunks == r.total_chunks for r in results),
              "written + skipped == total for every store")
        if ctx.transport == "shm":
            # prepare_store reserves only missing chunks, atomically on the server, so
            # concurrent stores of one prefix write each of its chunks once.
            check(written == distinct, f"each distinct chunk written exactly once ({distinct})")
        else:
            # A pickle store counts the chunks missing when it looked (the pickle commit
            # does not say what it wrote), so racing stores of one prefix each count it.
            check(written >= distinct, f"every distinct chunk was written ({distinct}); "
                  "pickle counts are per-store upper bounds")

        # ------------------------------------------------------------ lookups
        phase("lookup_many: stored prompts, continuations, shared-prefix-only, unknown")
        fresh = [random_tokens(gen, CHUNK) for _ in prompts]
        continuations = [p.tokens[: p.full] + f for p, f in zip(prompts, fresh, strict=True)]
        prefix_only = [prompts[0].tokens[: PREFIX_CHUNKS * CHUNK] + fresh[0]]
        unknown = [random_tokens(gen, 2 * CHUNK)]
        queries = [p.tokens for p in prompts] + continuations + prefix_only + unknown
        expected = ([p.full for p in prompts] * 2 + [PREFIX_CHUNKS * CHUNK, 0])
        t0 = time.perf_counter()
        hits = await ctx.lookup_many(queries, max_in_flight=16)
        dt = time.perf_counter() - t0
        got = [h.unwrap() for h in hits]
        n = len(prompts)
        print(f"    {len(queries)} lookups in {dt * 1e3:.0f} ms "
              f"({len(queries) / dt:.0f} lookups/s)")
        print(f"    hits in tokens: stored {got[:min(n, 6)]}{' ...' if n > 6 else ''}")
        print(f"                    continuations {got[n:n + min(n, 6)]}"
              f"{' ...' if n > 6 else ''}")
        print(f"                    family prefix + new tokens {got[2 * n]}, "
              f"unknown {got[2 * n + 1]}")
        check(all(h.ok for h in hits), "no lookup failed")
        check(got == expected, "every hit is the longest stored full-chunk prefix")

        # ------------------------------------------------------------ retrieves
        phase("retrieve_many: every prompt, even ones into caller buffers (outs=)")
        outs: list[torch.Tensor | None] = [
            torch.empty(LAYOUT.planes, LAYOUT.num_layers, p.full, LAYOUT.hidden_dim,
                        dtype=LAYOUT.dtype) if i % 2 == 0 else None
            for i, p in enumerate(prompts)
        ]
        t0 = time.perf_counter()
        got_kv = await ctx.retrieve_many([p.tokens for p in prompts], outs=outs,
                                         max_in_flight=16)
        dt = time.perf_counter() - t0
        moved = sum(p.full for p in prompts) * LAYOUT.token_bytes()
        print(f"    {len(prompts)} retrieves, {mib(moved)} in {dt * 1e3:.0f} ms "
              f"= {rate(moved, dt)}")
        exact = in_place = 0
        for p, res, out in zip(prompts, got_kv, outs, strict=True):
            value = res.value if res.ok else None
            if value is not None and same_bits(value, p.kv[:, :, : p.full]):
                exact += 1
            if out is not None and value is not None and value.data_ptr() == out.data_ptr():
                in_place += 1
        n_outs = sum(o is not None for o in outs)
        check(exact == len(prompts), f"{exact}/{len(prompts)} retrieves bit-exact")
        check(in_place == n_outs, f"{in_place}/{n_outs} written in place into the caller's out")
        cont = await ctx.retrieve(continuations[0])
        check(cont is not None and same_bits(cont, prompts[0].kv[:, :, : prompts[0].full]),
              f"a continuation retrieves its cached prefix ({prompts[0].full} tokens)")

        # ------------------------------------------------------------ re-store
        phase("re-store: the same prompts again (store_many), and one grown by a chunk")
        again = prompts[: min(4, len(prompts))]
        grown_kv = torch.cat([prompts[0].kv[:, :, : prompts[0].full],
                              random_kv(gen, CHUNK)], dim=2)
        items = [(p.kv, p.tokens) for p in again] + [(grown_kv, continuations[0])]
        t0 = time.perf_counter()
        restored = await ctx.store_many(items)
        dt = time.perf_counter() - t0
        rs = [r.unwrap() for r in restored]
        for p, r in zip(again, rs[:-1], strict=True):
            assert r is not None
            print(f"    {len(p.tokens):5d} tokens: written {r.written_chunks}, "
                  f"skipped {r.skipped_chunks} of {r.total_chunks}")
        last = rs[-1]
        assert last is not None
        print(f"    {len(continuations[0]):5d} tokens (grown): written {last.written_chunks}, "
              f"skipped {last.skipped_chunks} of {last.total_chunks}  [{dt * 1e3:.0f} ms]")
        check(all(r is not None and r.written_chunks == 0 for r in rs[:-1]),
              "re-storing cached prompts writes nothing")
        check(last.written_chunks == 1 and last.skipped_chunks == last.total_chunks - 1,
              "the grown prompt writes only its new chunk")

        # ------------------------------------------------------------ salted miss
        phase("cache_salt: another tenant's namespace")
        salt = "tenant-b"
        salted_hit = await ctx.lookup(prompts[0].tokens, cache_salt=salt)
        salted_kv = await ctx.retrieve(prompts[0].tokens, cache_salt=salt)
        print(f"    lookup with cache_salt={salt!r}: {salted_hit} tokens; retrieve: "
              f"{'None' if salted_kv is None else tuple(salted_kv.shape)}")
        check(salted_hit == 0 and salted_kv is None, "a salted lookup misses unsalted data")
        await ctx.store(prompts[0].kv, prompts[0].tokens, cache_salt=salt)
        check(await ctx.lookup(prompts[0].tokens, cache_salt=salt) == prompts[0].full,
              "after a salted store the salted lookup hits")

        # ------------------------------------------------------------ paged
        await paged_round_trip(ctx, gen, check)

        # ------------------------------------------------------------ server state
        phase("server /status before aclose()")
        status = await ctx.status()
        report_status(status)
        print("    (release steps run in the background once a caller has its answer, so a "
              "session or lock\n     may still show here; aclose() waits for them)")
        check(ctx.instance_id in status.get("registered_non_cuda_instance_ids", []),
              "our engine-driven registration is listed")
        instance_id = ctx.instance_id

    phase("server /status after aclose()")
    status = await asyncio.to_thread(server.status)
    report_status(status)
    l1 = status.get("storage_manager", {}).get("l1_manager", {})
    check(status.get("active_sessions") == 0, "active_sessions == 0")
    check(l1.get("read_locked_count") == 0, "read_locked_count == 0")
    check(l1.get("write_locked_count") == 0, "write_locked_count == 0")
    check(instance_id not in status.get("registered_non_cuda_instance_ids", []),
          "aclose() unregistered the context")


async def paged_round_trip(ctx: lmkv.AsyncKVContext, gen: torch.Generator,
                           check: Checks) -> None:
    """store_blocks from one HND block table, retrieve_blocks into another."""
    BS, NH, HS = LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim
    T = 2 * CHUNK + 40  # 2 chunks are stored; the 40-token tail (a partial block) is not
    n = T // CHUNK * CHUNK
    NB = 2 * math.ceil(T / BS)
    phase(f"paged: store_blocks / retrieve_blocks, HND [NB={NB}, 2, NH={NH}, BS={BS}, "
          f"HS={HS}] x {LAYOUT.num_layers} layers")
    src = [random_bits(gen, (NB, 2, NH, BS, HS)) for _ in range(LAYOUT.num_layers)]
    ids_src = torch.randperm(NB, generator=gen)[: math.ceil(T / BS)].tolist()
    toks = random_tokens(gen, T)
    t0 = time.perf_counter()
    res = await ctx.store_blocks(src, ids_src, toks)
    t_store = time.perf_counter() - t0
    print(f"    store_blocks: {len(ids_src)} blocks in a shuffled table -> written "
          f"{res.written_chunks} chunks, ignored {res.ignored_tokens} tokens "
          f"[{t_store * 1e3:.0f} ms]")
    check(res.written_chunks == 2 and res.ignored_tokens == T - n,
          "store_blocks wrote the 2 full chunks")

    # The dense tensor a retrieve returns follows the HND formula
    # dense[kv, l, p, h*HS + d] = cache_l[ids[p // BS], kv, h, p % BS, d].
    full_blocks = torch.tensor(ids_src[: n // BS])
    want = torch.stack([
        c[full_blocks].permute(1, 0, 3, 2, 4).reshape(2, n, NH * HS) for c in src
    ], dim=1)
    dense = await ctx.retrieve(toks)
    check(dense is not None and same_bits(dense, want),
          "retrieve() of the paged store matches the HND formula")

    dst = [torch.zeros_like(c) for c in src]
    ids_dst = torch.randperm(NB, generator=gen)[: math.ceil(T / BS)].tolist()
    t0 = time.perf_counter()
    hit = await ctx.retrieve_blocks(toks, dst, ids_dst)
    t_ret = time.perf_counter() - t0
    print(f"    retrieve_blocks into another table: {hit} tokens "
          f"({hit // BS} blocks) [{t_ret * 1e3:.0f} ms]")
    moved = ids_dst[: hit // BS]
    same = all(same_bits(d[moved], s[full_blocks]) for d, s in zip(dst, src, strict=True))
    untouched = [b for b in range(NB) if b not in set(moved)]
    zero = all(bool((d[untouched].view(torch.int16) == 0).all()) for d in dst)
    check(hit == n and same, "retrieve_blocks put every block where the new table says")
    check(zero, "blocks outside the hit (incl. the tail's partial block) are untouched")


def report_status(status: dict[str, Any]) -> None:
    l1 = status.get("storage_manager", {}).get("l1_manager", {})
    print(f"    active_sessions={status.get('active_sessions')}  "
          f"read_locked_count={l1.get('read_locked_count')}  "
          f"write_locked_count={l1.get('write_locked_count')}  "
          f"objects={l1.get('total_object_count')}  "
          f"registered engine-driven contexts="
          f"{len(status.get('registered_non_cuda_instance_ids', []))}")


# --------------------------------------------------------------------------- entry point


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m lmkv_async.demo",
        description="Run lmkv_async against a real local lmcache server it starts and stops.",
    )
    p.add_argument("--version", choices=KNOWN_VERSIONS, default="0.5.6",
                   help="lmcache server version to start (default 0.5.6)")
    p.add_argument("--prompts", type=int, default=16, metavar="N",
                   help="number of prompts stored concurrently (1-256, default 16)")
    p.add_argument("--no-shm", action="store_true",
                   help="start the server without an SHM pool (pickle transport)")
    args = p.parse_args(argv)
    if not 1 <= args.prompts <= 256:
        p.error("--prompts must be between 1 and 256")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the process exit status."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="    [%(name)s] %(levelname)s %(message)s")
    python = find_server_python(args.version)
    if python is None:
        print(f"No lmcache {args.version} server environment: ${env_var_for(args.version)} "
              "is not set.\n"
              "Run `nox -s demo`: it builds the server environments and runs this demo.",
              file=sys.stderr)
        return 2
    # Room for every distinct chunk twice over, so nothing the checks read is evicted.
    worst = (math.ceil(args.prompts / FAMILY_SIZE) * PREFIX_CHUNKS + 4 * args.prompts + 16)
    l1_gb = max(1.0, math.ceil(2 * worst * CHUNK * LAYOUT.token_bytes() / 2**30))
    cfg = ServerConfig(version=args.version, python=python, shm=not args.no_shm,
                       transfer_mode="auto", chunk_size=CHUNK, l1_size_gb=l1_gb)
    server = LocalServer(cfg)
    print(f"lmkv_async {lmkv.__version__} demo: lmcache {args.version} server, "
          f"{'no SHM (pickle)' if args.no_shm else 'SHM'}, {args.prompts} prompts")
    check = Checks()
    t_all = time.perf_counter()
    try:
        server.start()
        # The command is only complete once start() has picked the SHM name.
        print(f"    server command: {' '.join(server.command())}")
        print(f"    server ready in {server.start_seconds:.1f} s (pid {server.pid}): "
              f"{server.url}  {server.http_url}  log {server.log_path}")
        asyncio.run(run(server, args, check))
    except LocalServerError as exc:
        print(f"\nserver error: {exc}", file=sys.stderr)
        return 1
    except lmkv.KVCacheError as exc:
        print(f"\nlmkv_async error: {type(exc).__name__}: {exc}", file=sys.stderr)
        print(f"server log tail:\n{server.log_tail(20)}", file=sys.stderr)
        return 1
    finally:
        t0 = time.perf_counter()
        server.stop()
        print(f"\n    server stopped in {time.perf_counter() - t0:.1f} s")
    print(f"\n{check.passed} checks passed, {len(check.failed)} failed "
          f"({time.perf_counter() - t_all:.1f} s in all)")
    for what in check.failed:
        print(f"    FAILED: {what}")
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
