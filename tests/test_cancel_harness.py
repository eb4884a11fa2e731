"""Every public operation, cancelled at its k-th await point, for k = 1, 2, ... (real servers).

For each operation and each way of cancelling (on asyncio: ``Task.cancel``,
``asyncio.timeout``, an anyio cancel scope; under trio: a trio cancel scope and
``trio.fail_after``: see ``cancel_points.py``), the operation is cancelled at
the k-th point where it, or a task it started, yields to the loop, for every k up
to the number of points it passes (a seeded sample past :data:`LIMIT`), and once
more past the end so that it completes. After each run:

* the cancellation surfaced to the caller (or the operation had completed);
* a follow-up operation on the same context works, and data stored before reads
  back bit-exact;
* the server holds no session and no lock (``/status``) once the context's
  release steps have run, and after close no registration of the context.

Against real 0.5.6 and 0.5.7rc2 SHM servers.
"""

from __future__ import annotations

import itertools
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import pytest
import torch
from cancel_points import MODES, TRIO_MODES, cancel_at, count_points, points
from servers import assert_no_leaks, assert_quiescent
from timing import SETTLE

import lmkv_async as lmkv
from lmkv_async.testing import LocalServer

pytestmark = pytest.mark.anyio

LAYOUT = lmkv.KVLayout(
    num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, block_size=16
)
#: at most this many k per operation and mode (all of them when it has fewer points)
LIMIT = 24
_models = itertools.count()
_fresh = itertools.count(1)

#: (backend, way of cancelling): each harness test runs on asyncio with its three ways
#: and under trio with its two
BACKEND_MODES = pytest.mark.parametrize(
    ("anyio_backend", "mode"),
    [("asyncio", m) for m in MODES] + [("trio", m) for m in TRIO_MODES],
)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**31, (n,), generator=g).tolist()


def kv_for(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(
        -(2**15), 2**15 - 1, (LAYOUT.planes, LAYOUT.num_layers, n, LAYOUT.hidden_dim), generator=g
    )
    return bits.to(torch.int16).view(LAYOUT.dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def paged(kv: torch.Tensor, block: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``kv`` ([P, L, T, D]) as per-layer HND caches ``[NB, P, NH, BS, HS]`` + block ids."""
    P, L, T, _ = kv.shape
    nb = T // block
    ids = torch.randperm(nb + 3, generator=torch.Generator().manual_seed(T))[:nb]
    caches = []
    for layer in range(L):
        cache = torch.zeros(
            nb + 3, P, LAYOUT.num_kv_heads, block, LAYOUT.head_dim, dtype=LAYOUT.dtype
        )
        per = kv[:, layer].reshape(P, nb, block, LAYOUT.num_kv_heads, LAYOUT.head_dim)
        cache[ids] = per.permute(1, 0, 3, 2, 4)
        caches.append(cache)
    return caches, ids


@pytest.fixture(params=["0.5.6", "0.5.7rc2"])
def shm_server(
    request: pytest.FixtureRequest, server_factory: Callable[..., LocalServer]
) -> LocalServer:
    return server_factory(request.param, shm=True, l1_size_gb=0.5)


class Base:
    """Data stored before the harness runs; read back after every cancellation."""

    def __init__(self, ctx: lmkv.AsyncKVContext, seed: int) -> None:
        self.ctx = ctx
        C = ctx.chunk_size
        self.toks = tokens(3 * C, seed)
        self.kv = kv_for(3 * C, seed)

    async def check(self) -> None:
        out = await self.ctx.retrieve(self.toks)
        assert out is not None and torch.equal(bits(out), bits(self.kv)), (
            "data stored before the cancellation no longer reads back bit-exact"
        )


def operations(ctx: lmkv.AsyncKVContext, base: Base) -> dict[str, Callable[[], Awaitable[Any]]]:
    C = ctx.chunk_size
    out = torch.empty(
        LAYOUT.planes, LAYOUT.num_layers, 3 * C, LAYOUT.hidden_dim, dtype=LAYOUT.dtype
    )
    caches, ids = paged(torch.zeros_like(base.kv), LAYOUT.block_size)

    def fresh(chunks: int = 2) -> tuple[torch.Tensor, list[int]]:
        seed = 10_000 + next(_fresh)  # a store that really writes, every time
        return kv_for(chunks * C, seed), tokens(chunks * C, seed)

    async def view_copy() -> torch.Tensor:
        async with ctx.retrieve_view(base.toks) as v:
            return await v.copy_to(out)

    async def store_blocks() -> Any:
        kv, toks = fresh()
        src, src_ids = paged(kv, LAYOUT.block_size)
        return await ctx.store_blocks(src, src_ids, toks)

    return {
        "lookup": lambda: ctx.lookup(base.toks),
        "store": lambda: ctx.store(*fresh()),
        "retrieve": lambda: ctx.retrieve(base.toks),
        "retrieve_out": lambda: ctx.retrieve(base.toks, out=out),
        "retrieve_view_copy_to": view_copy,
        "retrieve_blocks": lambda: ctx.retrieve_blocks(base.toks, caches, ids),
        "store_blocks": store_blocks,
        "lookup_many": lambda: ctx.lookup_many([base.toks, base.toks[:C], fresh()[1]]),
        "retrieve_many": lambda: ctx.retrieve_many([base.toks, fresh()[1]]),
        "store_many": lambda: ctx.store_many([fresh(1), fresh(1)]),
    }


OPS = [
    "lookup",
    "store",
    "retrieve",
    "retrieve_out",
    "retrieve_view_copy_to",
    "retrieve_blocks",
    "store_blocks",
    "lookup_many",
    "retrieve_many",
    "store_many",
]


@pytest.fixture
async def ctx(shm_server: LocalServer) -> AsyncIterator[lmkv.AsyncKVContext]:
    async with lmkv.connect(
        shm_server.url,
        shm_server.http_url,
        f"cancel-harness-{next(_models)}",
        layout=LAYOUT,
        timeout=20,
        prefault=False,
    ) as c:
        yield c
    assert_no_leaks(shm_server)


async def run_harness(
    op: Callable[[], Awaitable[Any]],
    mode: str,
    seed: int,
    after_each: Callable[[], Awaitable[None]],
) -> tuple[int, int]:
    """Cancel ``op`` at each chosen k; returns (points counted, runs cut short)."""
    total = await count_points(op, mode)
    await after_each()
    assert total > 0
    cut = 0
    for k in points(total, LIMIT, seed):
        out = await cancel_at(k, mode, op)
        assert out.error is None, f"k={k}: {out.error!r}"
        if out.fired and mode == "task_cancel":
            assert out.surfaced, f"k={k}: Task.cancel() did not surface to the caller"
        cut += out.surfaced
        try:
            await after_each()
        except AssertionError as exc:
            raise AssertionError(
                f"after a cancellation at k={k} of {total} ({out}): {exc}"
            ) from None
    # and past the end: a run that completes
    k = total + 1
    while True:
        out = await cancel_at(k, mode, op)
        assert out.error is None, f"k={k}: {out.error!r}"
        await after_each()
        if not out.fired:
            break
        k += 1
        assert k < total * 4 + 50, "the operation never completes"
    return total, cut


@BACKEND_MODES
@pytest.mark.parametrize("name", OPS)
async def test_operation_cancelled_at_every_point(
    ctx: lmkv.AsyncKVContext, name: str, mode: str
) -> None:
    seed = zlib.crc32(f"{name}/{mode}".encode())
    base = Base(ctx, seed)
    await ctx.store(base.kv, base.toks)
    op = operations(ctx, base)[name]

    async def after_each() -> None:
        await assert_quiescent(ctx)  # no session, no lock, no release step running
        await base.check()  # the same context still works; earlier data intact

    total, cut = await run_harness(op, mode, seed, after_each)
    assert cut > 0, f"{name}: no run was cut short out of {total} points: proves nothing"


@BACKEND_MODES
async def test_connect_cancelled_at_every_point(shm_server: LocalServer, mode: str) -> None:
    model = f"cancel-harness-{next(_models)}"
    made: list[lmkv.AsyncKVContext] = []

    async def op() -> None:
        ctx = await lmkv.connect(
            shm_server.url, shm_server.http_url, model, layout=LAYOUT, prefault=True
        )
        made.append(ctx)

    async def after_each() -> None:
        for ctx in made:  # a connect that completed: the caller owns the context
            await ctx.aclose()
        made.clear()
        await assert_quiescent(shm_server)  # a cut-short connect left nothing

    total, cut = await run_harness(op, mode, zlib.crc32(mode.encode()), after_each)
    assert cut > 0 and total > 10


@BACKEND_MODES
async def test_aclose_cancelled_at_every_point(shm_server: LocalServer, mode: str) -> None:
    model = f"cancel-harness-{next(_models)}"
    current: list[lmkv.AsyncKVContext] = []

    async def op() -> None:
        ctx = await lmkv.connect(
            shm_server.url, shm_server.http_url, model, layout=LAYOUT, prefault=False
        )
        current[:] = [ctx]  # ours to close from here on, whatever happens next
        C = ctx.chunk_size
        await ctx.store(kv_for(C, 1), tokens(C, next(_fresh)))
        await anyio.sleep(0)
        await ctx.aclose()

    async def after_each() -> None:
        for ctx in current:
            await ctx.aclose()  # a second close after a cut-short one finishes the cleanup
            assert ctx.closed
        current.clear()
        await assert_quiescent(shm_server)

    _total, cut = await run_harness(op, mode, zlib.crc32(b"aclose" + mode.encode()), after_each)
    assert cut > 0


# ------------------------------------------------------------------ the fleet
FLEET_OPS = ["fleet_lookup", "fleet_best", "member_retrieve", "member_retrieve_out"]


@BACKEND_MODES
@pytest.mark.parametrize("name", FLEET_OPS)
async def test_fleet_operation_cancelled_at_every_point(
    shm_server: LocalServer, name: str, mode: str
) -> None:
    """``Fleet.lookup`` / ``best`` and ``FleetMember.retrieve``, cut at every point."""
    model = f"cancel-harness-{next(_models)}"
    seed = zlib.crc32(f"fleet/{name}/{mode}".encode())
    async with lmkv.connect(
        shm_server.url, shm_server.http_url, model, layout=LAYOUT, prefault=False
    ) as ctx:
        base = Base(ctx, seed)
        await ctx.store(base.kv, base.toks)
        want = len(base.toks)
        async with lmkv.Fleet(
            {"a": (shm_server.url, shm_server.http_url)}, model_name=model, layout=LAYOUT
        ) as fleet:
            member = fleet.members["a"]
            out = torch.empty_like(base.kv)
            ops: dict[str, Callable[[], Awaitable[Any]]] = {
                "fleet_lookup": lambda: fleet.lookup(base.toks),
                "fleet_best": lambda: fleet.best(base.toks),
                "member_retrieve": lambda: member.retrieve(base.toks),
                "member_retrieve_out": lambda: member.retrieve(base.toks, out=out),
            }

            async def after_each() -> None:
                # The fleet still answers, from both sources, and the data reads back
                # through the member; nothing but the open registrations is held.
                assert (await fleet.lookup(base.toks, source="lookup"))["a"] == want
                assert await fleet.best(base.toks) == ("a", want)
                got = await member.retrieve(base.toks)
                assert got is not None and torch.equal(bits(got), bits(base.kv))
                mctx = await member.context()
                allowed = [ctx.instance_id]
                if member.session is not None:
                    allowed.append(member.session.instance_id)
                await assert_quiescent(mctx, allowed_instance_ids=allowed)
                await base.check()

            total, cut = await run_harness(ops[name], mode, seed, after_each)
            assert cut > 0, f"{name}: no run was cut short out of {total} points"
        # the fleet's registrations are gone once it closed; only ctx's is left
        await assert_quiescent(ctx)
    assert_no_leaks(shm_server)


# ------------------------------------------------------------------ KV events
@BACKEND_MODES
async def test_kv_events_iteration_cancelled_at_every_point(
    shm_server: LocalServer, mode: str
) -> None:
    """``async with ctx.kv_events() as s: async for ev in s`` cut at every point: the
    stream closes (the server's subscriber count falls back) and a new one works."""
    model = f"cancel-harness-{next(_models)}"
    seed = zlib.crc32(f"events/{mode}".encode())
    async with lmkv.connect(
        shm_server.url, shm_server.http_url, model, layout=LAYOUT, prefault=False
    ) as ctx:
        if "kv_events" not in ctx.capabilities:
            pytest.fail("this server was expected to record KV events")
        base = Base(ctx, seed)
        await ctx.store(base.kv, base.toks)
        streams: list[lmkv.KVEventStream] = []

        async def op() -> int:
            seen = 0
            async with ctx.kv_events(max_events=2) as stream:
                streams.append(stream)
                async for _ in stream:
                    seen += 1
                    # The start resync: this context's stores are engine-driven, which
                    # LMCache records no event for, so nothing else would come.
                    break
            return seen

        async def subscribers() -> int:
            status = await anyio.to_thread.run_sync(shm_server.status)
            return int(status["kv_events"]["subscribers"])

        async def after_each() -> None:
            assert all(s.closed for s in streams), "a cut-short stream was left open"
            streams.clear()
            deadline = time.monotonic() + SETTLE
            while (n := await subscribers()) != 0:
                assert time.monotonic() < deadline, (
                    f"{n} KV-event subscription(s) left on the server"
                )
                await anyio.sleep(0.05)
            await assert_quiescent(ctx)
            await base.check()

        total, cut = await run_harness(op, mode, seed, after_each)
        assert cut > 0, f"no run was cut short out of {total} points"
    assert_no_leaks(shm_server)
