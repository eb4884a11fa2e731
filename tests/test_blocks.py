"""store_blocks / retrieve_blocks against real servers: paged HND caches <-> server, bit-exact."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from servers import assert_quiescent, checked_context
from test_context import random_kv, same_bits, tokens_for
from timing import SETTLE

import lmkv_async as lmkv
from lmkv_async.testing import LocalServer

pytestmark = pytest.mark.anyio

LAYOUT = lmkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16,
                       block_size=16)
NB = 80
_names = itertools.count()


def paged_from_dense(kv: torch.Tensor, block_ids: list[int], layout: lmkv.KVLayout,
                     fill: float = 0.0) -> list[torch.Tensor]:
    """Reference scatter with plain indexing: dense [2, L, T, D] -> per-layer HND caches."""
    T = kv.shape[2]
    BS, NH, HS = layout.block_size, layout.num_kv_heads, layout.head_dim
    caches = [torch.full((NB, 2, NH, BS, HS), fill, dtype=layout.dtype)
              for _ in range(layout.num_layers)]
    for p in range(T):
        blk, off = block_ids[p // BS], p % BS
        for layer in range(layout.num_layers):
            caches[layer][blk, :, :, off, :] = kv[:, layer, p, :].view(2, NH, HS)
    return caches


@pytest.fixture
async def ctx(server: LocalServer) -> AsyncIterator[lmkv.AsyncKVContext]:
    # checked while still registered (unregistering sweeps pending reads/writes), then after
    async with checked_context(server, f"blocks-{next(_names)}", layout=LAYOUT,
                               timeout=20) as c:
        yield c


async def test_store_blocks_then_retrieve_dense_and_blocks(ctx: lmkv.AsyncKVContext) -> None:
    C = ctx.chunk_size
    T = 2 * C + 40  # tail past the last chunk, partial last block
    toks = tokens_for(T)
    kv = random_kv(LAYOUT, T, seed=21)
    g = torch.Generator().manual_seed(3)
    block_ids = torch.randperm(NB, generator=g)[: -(-T // LAYOUT.block_size)].tolist()
    caches = paged_from_dense(kv, block_ids, LAYOUT)
    res = await ctx.store_blocks(caches, block_ids, toks)
    assert (res.written_chunks, res.ignored_tokens) == (2, 40)
    dense = await ctx.retrieve(toks)
    assert dense is not None and same_bits(dense, kv[:, :, : 2 * C])
    # back into a different block table of a fresh cache
    ids2 = torch.randperm(NB, generator=g)[: 2 * C // LAYOUT.block_size].tolist()
    target = [torch.full_like(c, 3.0) for c in caches]
    assert await ctx.retrieve_blocks(toks, target, ids2) == 2 * C
    expected = paged_from_dense(kv[:, :, : 2 * C], ids2, LAYOUT, fill=3.0)
    for got, want in zip(target, expected, strict=True):
        assert same_bits(got, want)  # untouched blocks still hold the fill


async def test_store_dense_retrieve_blocks_miss(ctx: lmkv.AsyncKVContext) -> None:
    C = ctx.chunk_size
    toks = tokens_for(C)
    target = [torch.zeros(NB, 2, 2, 16, 32, dtype=torch.bfloat16) for _ in range(2)]
    assert await ctx.retrieve_blocks(toks, target, list(range(C // 16))) == 0
    assert all(bool((t == 0).all()) for t in target)
    kv = random_kv(LAYOUT, C, seed=22)
    await ctx.store(kv, toks)
    assert await ctx.retrieve_blocks(toks, target, list(range(C // 16))) == C
    assert same_bits(torch.stack([t[: C // 16] for t in target]),
                     torch.stack(paged_from_dense(kv, list(range(C // 16)), LAYOUT))[:, : C // 16])


async def test_bad_blocks_raise_before_traffic(ctx: lmkv.AsyncKVContext,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ctx._transport, "pick", lambda: pytest.fail("traffic sent"))
    C = ctx.chunk_size
    toks = tokens_for(C)
    good = [torch.zeros(NB, 2, 2, 16, 32, dtype=torch.bfloat16) for _ in range(2)]
    ids = list(range(C // 16))
    cases = [
        (good[:1], ids),                                          # layer count
        ([c.to(torch.float16) for c in good], ids),               # dtype
        ([torch.zeros(NB, 2, 2, 8, 32, dtype=torch.bfloat16)] * 2, ids),  # block size
        (good, ids[:-1]),                                         # too few block ids
        (good, [*ids[:-1], NB]),                                  # id out of range
        (good, [-1, *ids[1:]]),                                   # negative id
        (good[0], ids),                                           # not a list of layers
    ]
    for caches, bids in cases:
        with pytest.raises(lmkv.InvalidInputError):
            await ctx.store_blocks(caches, bids, toks)  # type: ignore[arg-type]
        with pytest.raises(lmkv.InvalidInputError):
            await ctx.retrieve_blocks(toks, caches, bids)  # type: ignore[arg-type]


async def test_blocks_partial_hit_leaves_later_blocks_untouched(ctx: lmkv.AsyncKVContext
                                                                ) -> None:
    C = ctx.chunk_size
    T = 3 * C
    toks = tokens_for(T)
    kv = random_kv(LAYOUT, T, seed=23)
    ids = list(range(T // LAYOUT.block_size))
    caches = paged_from_dense(kv, ids, LAYOUT)
    # only the first two chunks are stored (from the blocks of a longer sequence)
    res = await ctx.store_blocks(caches, ids, toks[: 2 * C])
    assert (res.total_chunks, res.written_chunks) == (2, 2)
    target = [torch.full_like(c, 5.0) for c in caches]
    assert await ctx.retrieve_blocks(toks, target, ids) == 2 * C
    expected = paged_from_dense(kv[:, :, : 2 * C], ids, LAYOUT, fill=5.0)
    for got, want in zip(target, expected, strict=True):
        assert same_bits(got, want)  # the third chunk's blocks still hold the fill
    # a re-store from blocks writes only the missing chunk
    again = await ctx.store_blocks(caches, ids, toks)
    assert (again.written_chunks, again.skipped_chunks) == (1, 2)
    out = await ctx.retrieve(toks)
    assert out is not None and same_bits(out, kv)


async def test_blocks_under_random_cancellation(ctx: lmkv.AsyncKVContext) -> None:
    """Cancel store_blocks / retrieve_blocks at random points (seeded): no lock, session
    or reservation is left (the fixture checks while registered), and what was stored
    reads back bit-exact."""
    rng = random.Random(20261203)
    C = ctx.chunk_size
    seqs = [tokens_for(rng.randint(1, 3) * C) for _ in range(8)]
    kvs = [random_kv(LAYOUT, len(t), seed=300 + i) for i, t in enumerate(seqs)]
    tables = [rng.sample(range(NB), len(t) // LAYOUT.block_size) for t in seqs]
    caches = [paged_from_dense(kv, ids, LAYOUT) for kv, ids in zip(kvs, tables, strict=True)]
    for i in range(0, 8, 2):
        await ctx.store_blocks(caches[i], tables[i], seqs[i])
    stored: set[int] = set(range(0, 8, 2))

    async def one() -> tuple[str, int, Any]:
        i = rng.randrange(8)
        if rng.random() < 0.5:
            return "store", i, await ctx.store_blocks(caches[i], tables[i], seqs[i])
        target = [torch.zeros_like(c) for c in caches[i]]
        return "retrieve", i, (await ctx.retrieve_blocks(seqs[i], target, tables[i]), target)

    cancelled = 0
    for _round in range(4):
        tasks = [asyncio.create_task(one()) for _ in range(16)]
        await asyncio.sleep(0)
        for task in tasks:
            asyncio.get_running_loop().call_later(rng.choice([0.0, 0.001, 0.005, 0.02]),
                                                  task.cancel)
        for outcome in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(outcome, asyncio.CancelledError):
                cancelled += 1
                continue
            assert not isinstance(outcome, BaseException), outcome
            kind, i, value = outcome
            if kind == "store":
                stored.add(i)
            elif value[0]:
                n = value[0]
                want = paged_from_dense(kvs[i][:, :, :n], tables[i], LAYOUT)
                for got, exp in zip(value[1], want, strict=True):
                    assert same_bits(got, exp)
    assert cancelled > 10, "the schedule should cancel a good share of the calls"
    await assert_quiescent(ctx, timeout=3 * SETTLE)
    for i in stored:
        out = await ctx.retrieve(seqs[i])
        assert out is not None and same_bits(out, kvs[i])


async def test_blocks_calls_on_a_closed_context(server: LocalServer,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = await lmkv.connect(server.url, server.http_url, f"blocks-{next(_names)}",
                             layout=LAYOUT)
    await ctx.aclose()
    monkeypatch.setattr(ctx._transport, "pick", lambda: pytest.fail("traffic sent"))
    caches = [torch.zeros(NB, 2, 2, 16, 32, dtype=torch.bfloat16) for _ in range(2)]
    ids = list(range(256 // 16))
    with pytest.raises(lmkv.ClosedError):
        await ctx.store_blocks(caches, ids, tokens_for(256))
    with pytest.raises(lmkv.ClosedError):
        await ctx.retrieve_blocks(tokens_for(256), caches, ids)
    assert all(bool((c == 0).all()) for c in caches)
