"""Fan-out against real servers: ``lookup_many`` / ``retrieve_many`` / ``store_many``,
many single calls at once, and a multi-socket context.

Every ``*_many`` call returns one :class:`ItemResult` per input, in input order; a
bad item fails alone with a typed error; ``max_in_flight`` bounds the calls
running at once (checked by instrumenting the single-item method, so a helper
that ignored the bound would fail). Runs on all four ``server`` configurations
and checks ``/status`` for leaks after each test. Every async test runs on asyncio
and natively under trio.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest
import torch
from servers import VERSIONS, checked_context
from test_context import gather, random_kv, same_bits, tokens_for

import lmkv_async as lmkv
from lmkv_async.testing import LocalServer

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test here runs on asyncio and natively under trio."""
    return str(request.param)

# Small geometry: one chunk object is 32 KiB, so pickle servers stay quick too.
LAYOUT = lmkv.KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16,
                       block_size=16)
_models = itertools.count()
_seeds = itertools.count(1000)


def model_name() -> str:
    return f"fanout-model-{next(_models)}"


@pytest.fixture
async def ctx(server: LocalServer) -> AsyncIterator[lmkv.AsyncKVContext]:
    # checked while still registered (unregistering sweeps pending reads/writes), then after
    async with checked_context(server, model_name(), layout=LAYOUT, timeout=30) as c:
        yield c


def make_seq(ctx: lmkv.AsyncKVContext, chunks: int, extra: int = 0
             ) -> tuple[list[int], torch.Tensor]:
    toks = tokens_for(chunks * ctx.chunk_size + extra)
    return toks, random_kv(LAYOUT, len(toks), seed=next(_seeds))


def out_buffer(n_tokens: int, dtype: torch.dtype = LAYOUT.dtype) -> torch.Tensor:
    buf = torch.empty((LAYOUT.planes, LAYOUT.num_layers, n_tokens, LAYOUT.hidden_dim),
                      dtype=dtype)
    buf.view(torch.int16 if buf.element_size() == 2 else torch.int32).fill_(0x3A5C)
    return buf


def untouched(t: torch.Tensor) -> bool:
    v = t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)
    return bool((v == 0x3A5C).all())


class Gauge:
    """Counts concurrent calls of a wrapped coroutine method (instance attribute).

    The ``*_many`` helpers call the wrapper in the caller's run; anyio sleeps on either
    backend.
    """

    def __init__(self, ctx: lmkv.AsyncKVContext, name: str, hold: float = 0.005) -> None:
        self.now = 0
        self.peak = 0
        self.calls = 0
        real = getattr(ctx, name)

        async def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.now += 1
            self.peak = max(self.peak, self.now)
            try:
                await anyio.sleep(hold)  # guarantees overlap if the bound is ignored
                return await real(*args, **kwargs)
            finally:
                self.now -= 1

        setattr(ctx, name, wrapped)


# ----------------------------------------------------------------------------- order and values


async def test_lookup_many_one_result_per_item_in_order(ctx: lmkv.AsyncKVContext) -> None:
    C = ctx.chunk_size
    seqs = [make_seq(ctx, k) for k in (3, 1, 2)]
    for toks, kv in seqs:
        assert (await ctx.store(kv, toks)).written_chunks == len(toks) // C
    a, b, c = (t for t, _ in seqs)
    miss = tokens_for(2 * C)
    # prefixes, extensions past the stored part, a miss, a sub-chunk input, duplicates
    inputs = [a, miss, b, [*b, *miss], c[:C], a[: 2 * C + 5], a[:10], c, a]
    expected = [3 * C, 0, C, C, C, 2 * C, 0, 2 * C, 3 * C]
    results = await ctx.lookup_many(inputs, max_in_flight=4)
    assert len(results) == len(inputs)
    assert all(isinstance(r, lmkv.ItemResult) and r.ok and r.error is None for r in results)
    assert [r.value for r in results] == expected
    assert [r.unwrap() for r in results] == expected
    assert await ctx.lookup_many([]) == []


@pytest.mark.parametrize("with_outs", [False, True], ids=["alloc", "outs"])
async def test_retrieve_many_bit_exact_in_order(ctx: lmkv.AsyncKVContext, with_outs: bool
                                                ) -> None:
    C = ctx.chunk_size
    seqs = [make_seq(ctx, k, extra=7) for k in (1, 3, 2, 1)]
    for toks, kv in seqs:
        await ctx.store(kv, toks)
    miss_toks = tokens_for(2 * C)
    inputs = [seqs[1][0], miss_toks, seqs[0][0], seqs[2][0], seqs[3][0], seqs[1][0][: 2 * C]]
    want = [seqs[1][1][:, :, : 3 * C], None, seqs[0][1][:, :, :C], seqs[2][1][:, :, : 2 * C],
            seqs[3][1][:, :, :C], seqs[1][1][:, :, : 2 * C]]
    outs: list[torch.Tensor | None] | None = None
    if with_outs:
        # a mix of caller buffers (some larger than needed) and None
        outs = [out_buffer(3 * C + 7), out_buffer(2 * C), None, out_buffer(4 * C),
                out_buffer(C), None]
    results = await ctx.retrieve_many(inputs, outs=outs, max_in_flight=3)
    assert len(results) == len(inputs)
    for i, (res, exp) in enumerate(zip(results, want, strict=True)):
        assert res.ok, (i, res.error)
        if exp is None:
            assert res.value is None
            if outs is not None and outs[i] is not None:
                assert untouched(outs[i])  # type: ignore[arg-type]
            continue
        assert res.value is not None and same_bits(res.value, exp), i
        buf = outs[i] if outs is not None else None
        if buf is not None:
            n = exp.shape[2]
            assert res.value.data_ptr() == buf.data_ptr(), i
            assert untouched(buf[:, :, n:]), f"item {i}: written past its hit"


async def test_store_many_in_order_then_readable(ctx: lmkv.AsyncKVContext) -> None:
    C = ctx.chunk_size
    seqs = [make_seq(ctx, k, extra=e) for k, e in ((2, 0), (1, 30), (3, 0), (0, 100), (1, 0))]
    # one item re-stores a prefix that an earlier call already wrote
    first, kv_first = seqs[0]
    assert (await ctx.store(kv_first[:, :, :C], first[:C])).written_chunks == 1
    results = await ctx.store_many([(kv, toks) for toks, kv in seqs], max_in_flight=2)
    assert len(results) == len(seqs)
    assert all(r.ok for r in results), [r.error for r in results]
    got = [(r.value.total_chunks, r.value.written_chunks, r.value.ignored_tokens)
           for r in results if r.value is not None]
    assert got == [(2, 1, 0), (1, 1, 30), (3, 3, 0), (0, 0, 100), (1, 1, 0)]
    outs = await ctx.retrieve_many([t for t, _ in seqs])
    for (toks, kv), res in zip(seqs, outs, strict=True):
        n = len(toks) // C * C
        if n == 0:
            assert res.ok and res.value is None
        else:
            assert res.value is not None and same_bits(res.value, kv[:, :, :n])


# ----------------------------------------------------------------------------- bad items


async def test_bad_items_fail_alone(ctx: lmkv.AsyncKVContext) -> None:
    C = ctx.chunk_size
    (ta, kva), (tb, kvb) = make_seq(ctx, 2), make_seq(ctx, 1)
    await ctx.store(kva, ta)
    await ctx.store(kvb, tb)
    neg = [*ta[:-1], -1]

    looked = await ctx.lookup_many([ta, neg, [], tb, [2**32], "abc"])  # type: ignore[list-item]
    assert [r.value for r in looked if r.ok] == [2 * C, C]
    assert [type(r.error) for r in looked] == [type(None), lmkv.InvalidInputError,
                                               lmkv.InvalidInputError, type(None),
                                               lmkv.InvalidInputError, lmkv.InvalidInputError]

    outs: list[torch.Tensor | None] = [
        out_buffer(2 * C), out_buffer(2 * C, dtype=torch.float16), out_buffer(C), None,
        out_buffer(C), torch.zeros(4)]
    items = [ta, ta, ta, neg, tb, tb]
    got = await ctx.retrieve_many(items, outs=outs)
    assert got[0].ok and got[0].value is not None and same_bits(got[0].value, kva)
    assert isinstance(got[1].error, lmkv.LayoutMismatchError)       # wrong dtype
    assert isinstance(got[2].error, lmkv.LayoutMismatchError)       # too small for 2 chunks
    assert isinstance(got[3].error, lmkv.InvalidInputError)         # negative token id
    assert got[4].ok and got[4].value is not None and same_bits(got[4].value, kvb)
    assert isinstance(got[5].error, lmkv.LayoutMismatchError)       # not [P, L, T, D]
    assert untouched(outs[1]) and untouched(outs[2])  # type: ignore[arg-type]
    with pytest.raises(lmkv.InvalidInputError):
        await ctx.retrieve_many([ta, tb], outs=[None])

    (tc, kvc), (td, kvd) = make_seq(ctx, 1), make_seq(ctx, 2)
    stored = await ctx.store_many([
        (kvc, tc),
        (kvd.to(torch.float16), td),             # wrong dtype
        (kvd, [*td[:-1], -5]),                   # negative token id
        (kvd[:, :, :-1], td),                    # T != len(tokens)
        ("not a tensor", td),                    # type: ignore[list-item]
        (kvd, td),
    ])
    assert stored[0].ok and stored[0].value is not None and stored[0].value.written_chunks == 1
    assert isinstance(stored[1].error, lmkv.LayoutMismatchError)
    assert isinstance(stored[2].error, lmkv.InvalidInputError)
    assert isinstance(stored[3].error, lmkv.LayoutMismatchError)
    assert isinstance(stored[4].error, lmkv.InvalidInputError)
    assert stored[5].ok and stored[5].value is not None and stored[5].value.written_chunks == 2
    with pytest.raises(lmkv.InvalidInputError):
        stored[1].unwrap()
    back = await ctx.retrieve_many([tc, td])
    assert same_bits(back[0].unwrap(), kvc) and same_bits(back[1].unwrap(), kvd)  # type: ignore[arg-type]


async def test_bad_salt_fails_every_item_without_traffic(ctx: lmkv.AsyncKVContext,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    toks, kv = make_seq(ctx, 1)
    monkeypatch.setattr(ctx._transport, "pick", lambda: pytest.fail("traffic sent"))
    for salt in ("a@b", "x" * 129):
        for results in (
            await ctx.lookup_many([toks, toks], cache_salt=salt),
            await ctx.retrieve_many([toks, toks], cache_salt=salt),
            await ctx.store_many([(kv, toks), (kv, toks)], cache_salt=salt),
        ):
            assert len(results) == 2
            assert all(isinstance(r.error, lmkv.InvalidInputError) for r in results)


# ----------------------------------------------------------------------------- max_in_flight


@pytest.mark.parametrize("limit", [1, 3])
@pytest.mark.parametrize("method", ["lookup", "retrieve", "store"])
async def test_max_in_flight_is_respected(ctx: lmkv.AsyncKVContext, method: str, limit: int
                                          ) -> None:
    seqs = [make_seq(ctx, 1) for _ in range(12)]
    if method != "store":
        await ctx.store_many([(kv, t) for t, kv in seqs[::2]])
    gauge = Gauge(ctx, method)
    if method == "lookup":
        results: list[Any] = await ctx.lookup_many([t for t, _ in seqs], max_in_flight=limit)
        assert [r.value for r in results] == [ctx.chunk_size if i % 2 == 0 else 0
                                              for i in range(12)]
    elif method == "retrieve":
        results = await ctx.retrieve_many([t for t, _ in seqs], max_in_flight=limit)
        for i, (r, (_, kv)) in enumerate(zip(results, seqs, strict=True)):
            assert (r.value is None) if i % 2 else same_bits(r.value, kv)
    else:
        results = await ctx.store_many([(kv, t) for t, kv in seqs], max_in_flight=limit)
        assert all(r.value.written_chunks == 1 for r in results)
    assert gauge.calls == 12
    assert gauge.peak == limit, f"peak {gauge.peak} concurrent calls for max_in_flight={limit}"


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2", None])
async def test_max_in_flight_must_be_positive_int(ctx: lmkv.AsyncKVContext, bad: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    toks, kv = make_seq(ctx, 1)
    monkeypatch.setattr(ctx._transport, "pick", lambda: pytest.fail("traffic sent"))
    with pytest.raises(lmkv.InvalidInputError, match="max_in_flight"):
        await ctx.lookup_many([toks], max_in_flight=bad)
    with pytest.raises(lmkv.InvalidInputError, match="max_in_flight"):
        await ctx.retrieve_many([toks], max_in_flight=bad)
    with pytest.raises(lmkv.InvalidInputError, match="max_in_flight"):
        await ctx.store_many([(kv, toks)], max_in_flight=bad)


# ----------------------------------------------------------------------------- plain gather


async def test_gather_of_50_mixed_calls(ctx: lmkv.AsyncKVContext) -> None:
    """50 single calls at once on one context: 10 stores, 10 lookups, 10 retrieves,
    10 retrieves into caller buffers, 10 misses; every answer checked bit-exact.

    Concurrent retrieves use distinct prefixes (see
    test_concurrent_retrieves_of_one_prefix for the same prefix at once).
    """
    C = ctx.chunk_size
    old = [make_seq(ctx, 1 + i % 3, extra=i) for i in range(20)]
    await ctx.store_many([(kv, t) for t, kv in old])
    new = [make_seq(ctx, 1 + i % 2) for i in range(10)]
    bufs = [out_buffer(4 * C) for _ in range(10)]
    kinds = ("store", "lookup", "retrieve", "retrieve_out", "miss")
    calls: list[tuple[str, int]] = [(kinds[i % 5], i // 5) for i in range(50)]
    coros: list[Any] = []
    for kind, j in calls:
        if kind == "store":
            coros.append(ctx.store(new[j][1], new[j][0]))
        elif kind == "lookup":
            coros.append(ctx.lookup(old[j][0]))
        elif kind == "retrieve":
            coros.append(ctx.retrieve(old[j][0]))
        elif kind == "retrieve_out":
            coros.append(ctx.retrieve(old[10 + j][0], out=bufs[j]))
        else:
            coros.append(ctx.retrieve(tokens_for(2 * C)))
    results = await gather(*coros)
    for (kind, j), res in zip(calls, results, strict=True):
        if kind == "store":
            t = new[j][0]
            assert res.total_chunks == res.written_chunks == len(t) // C
        elif kind == "lookup":
            assert res == len(old[j][0]) // C * C, j
        elif kind in ("retrieve", "retrieve_out"):
            t, kv = old[j if kind == "retrieve" else 10 + j]
            n = len(t) // C * C
            assert res is not None and same_bits(res, kv[:, :, :n]), (kind, j)
            if kind == "retrieve_out":
                assert res.data_ptr() == bufs[j].data_ptr() and untouched(bufs[j][:, :, n:])
        else:
            assert res is None
    # every sequence stored by the gather reads back bit-exact
    back = await ctx.retrieve_many([t for t, _ in new])
    for (_, kv), res in zip(new, back, strict=True):
        assert res.value is not None and same_bits(res.value, kv)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("shm", [True, False], ids=["shm", "pickle"])
async def test_concurrent_retrieves_of_one_prefix(
    version: str, shm: bool, server_factory: Callable[..., LocalServer],
    request: pytest.FixtureRequest,
) -> None:
    """Many requests sharing one cached prefix (a system prompt) retrieved at once."""
    # private: leaked locks must not outlive this test on a shared server
    server = server_factory(version, shm=shm, private=shm)
    async with checked_context(server, model_name(), layout=LAYOUT, timeout=30) as ctx:
        C = ctx.chunk_size
        toks, kv = make_seq(ctx, 2)
        await ctx.store(kv, toks)
        # the same prefix, and requests that extend it with different suffixes
        inputs = [toks] * 4 + [[*toks, *tokens_for(C + i)] for i in range(4)]
        outs = await gather(*(ctx.retrieve(t) for t in inputs))
        for out in outs:
            assert out is not None and same_bits(out, kv)
        many = await ctx.retrieve_many(inputs, max_in_flight=8)
        assert all(r.value is not None and same_bits(r.value, kv) for r in many)


# ----------------------------------------------------------------------------- several sockets


@pytest.mark.parametrize("version", VERSIONS)
async def test_four_sockets_two_gpu_workers(version: str,
                                            server_factory: Callable[..., LocalServer]) -> None:
    server = server_factory(version, extra_args=("--max-gpu-workers", "2"))
    async with checked_context(server, model_name(), layout=LAYOUT, sockets=4,
                               timeout=30) as ctx:
        conns = ctx._transport.connections
        assert len(conns) == 4
        used: Counter[int] = Counter()
        busy_peak = 0

        for conn in conns:
            real = conn.request

            async def counted(*args: Any, _real: Any = real, _index: int = conn.index,
                              **kwargs: Any) -> Any:
                used[_index] += 1
                return await _real(*args, **kwargs)

            conn.request = counted  # type: ignore[method-assign]

        async def sample_busy_sockets() -> None:
            nonlocal busy_peak
            while True:
                busy_peak = max(busy_peak, sum(1 for c in conns if c.in_flight > 0))
                await anyio.sleep(0.0005)

        C = ctx.chunk_size
        async with anyio.create_task_group() as sampler:
            sampler.start_soon(sample_busy_sockets)
            first = [make_seq(ctx, 1 + i % 3) for i in range(16)]
            stored = await gather(*(ctx.store(kv, t) for t, kv in first))
            assert [s.written_chunks for s in stored] == [len(t) // C for t, _ in first]
            # stores of new sequences concurrent with retrieves (distinct prefixes) of the others
            second = [make_seq(ctx, 2) for _ in range(8)]
            bufs = [out_buffer(3 * C) for _ in first[8:]]
            mixed = await gather(
                *(ctx.store(kv, t) for t, kv in second),
                *(ctx.retrieve(t) for t, _ in first[:8]),
                *(ctx.retrieve(t, out=b) for (t, _), b in zip(first[8:], bufs, strict=True)),
            )
            assert all(s.written_chunks == 2 for s in mixed[:8])
            for (_, kv), out in zip(first[:8], mixed[8:16], strict=True):
                assert out is not None and same_bits(out, kv)
            for (_, kv), out, b in zip(first[8:], mixed[16:], bufs, strict=True):
                n = kv.shape[2]
                assert out is not None and same_bits(out, kv) and untouched(b[:, :, n:])
            sampler.cancel_scope.cancel()
        for t, kv in second:
            out = await ctx.retrieve(t)
            assert out is not None and same_bits(out, kv)
        assert len([i for i, n in used.items() if n > 0]) >= 2, f"requests per socket: {used}"
        assert busy_peak >= 2, "never more than one socket busy at once"


async def test_many_calls_with_a_salt(ctx: lmkv.AsyncKVContext) -> None:
    C = ctx.chunk_size
    seqs = [make_seq(ctx, k) for k in (1, 2, 1)]
    stored = await ctx.store_many([(kv, t) for t, kv in seqs], cache_salt="tenant-a",
                                  timeout=20)
    assert [r.unwrap().written_chunks for r in stored] == [1, 2, 1]  # type: ignore[union-attr]
    toks = [t for t, _ in seqs]
    assert [r.value for r in await ctx.lookup_many(toks, cache_salt="tenant-a")] == \
        [C, 2 * C, C]
    assert [r.value for r in await ctx.lookup_many(toks)] == [0, 0, 0]
    assert [r.value for r in await ctx.lookup_many(toks, cache_salt="tenant-b")] == [0, 0, 0]
    missed = await ctx.retrieve_many(toks, cache_salt="tenant-b")
    assert all(r.ok and r.value is None for r in missed)
    got = await ctx.retrieve_many(toks, cache_salt="tenant-a", timeout=20)
    for r, (_, kv) in zip(got, seqs, strict=True):
        assert r.value is not None and same_bits(r.value, kv)


async def test_many_calls_on_a_closed_context(server: LocalServer,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Every item fails with ClosedError (per item, as documented), nothing is sent."""
    ctx = await lmkv.connect(server.url, server.http_url, model_name(), layout=LAYOUT)
    toks, kv = make_seq(ctx, 1)
    await ctx.aclose()
    monkeypatch.setattr(ctx._transport, "pick", lambda: pytest.fail("traffic sent"))
    for results in (await ctx.lookup_many([toks, toks]),
                    await ctx.retrieve_many([toks, toks], outs=[out_buffer(256), None]),
                    await ctx.store_many([(kv, toks), (kv, toks)])):
        assert len(results) == 2
        assert all(isinstance(r.error, lmkv.ClosedError) for r in results), results
        with pytest.raises(lmkv.ClosedError):
            results[0].unwrap()
