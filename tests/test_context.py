"""AsyncKVContext against real lmcache servers (0.5.2 and 0.5.6, SHM and pickle).

Every async test runs on asyncio and natively under trio, unless
marked otherwise. :func:`gather` is the backend-neutral ``asyncio.gather`` the
other modules import too.
"""

from __future__ import annotations

import itertools
import pickle
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import pytest
import torch
from servers import VERSIONS, assert_no_leaks, assert_quiescent, checked_context
from timing import SLACK, fast

import lmkv_async as lmkv
from lmkv_async.testing import LocalServer

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test here runs on asyncio and natively under trio."""
    return str(request.param)


LAYOUT = lmkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                       block_size=16)
_models = itertools.count()
_token_base = itertools.count(1)


def model_name() -> str:
    return f"test-model-{next(_models)}"


def tokens_for(n: int, seed: int | None = None) -> list[int]:
    """Distinct token sequences per call (the cache is shared by tests)."""
    g = torch.Generator().manual_seed(seed if seed is not None else next(_token_base) * 7919)
    return torch.randint(0, 2**32, (n,), generator=g, dtype=torch.int64).tolist()


def random_kv(layout: lmkv.KVLayout, n: int, seed: int = 0) -> torch.Tensor:
    """Random *bit patterns* (NaNs, infs, denormals included)."""
    g = torch.Generator().manual_seed(seed)
    ibits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    itype = ibits[layout.dtype]
    info = torch.iinfo(itype)
    raw = torch.randint(info.min, info.max, (layout.planes, layout.num_layers, n,
                                             layout.hidden_dim), generator=g, dtype=torch.int64)
    return raw.to(itype).view(layout.dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    itype = torch.int32 if a.element_size() == 4 else torch.int16
    return a.shape == b.shape and torch.equal(a.contiguous().view(itype),
                                              b.contiguous().view(itype))


async def gather(*aws: Awaitable[Any]) -> list[Any]:
    """Await ``aws`` concurrently, each in its own task of a task group (asyncio or trio);
    their results in argument order (``asyncio.gather`` for either backend)."""
    results: list[Any] = [None] * len(aws)

    async def run(i: int, aw: Awaitable[Any]) -> None:
        results[i] = await aw

    async with anyio.create_task_group() as tg:
        for i, aw in enumerate(aws):
            tg.start_soon(run, i, aw)
    return results


@pytest.fixture
async def ctx(server: LocalServer) -> AsyncIterator[lmkv.AsyncKVContext]:
    # checked while still registered (unregistering sweeps pending reads/writes), then after
    async with checked_context(server, model_name(), layout=LAYOUT, timeout=20) as c:
        yield c


async def test_transport_and_version_reported(ctx: lmkv.AsyncKVContext, server: LocalServer
                                              ) -> None:
    assert ctx.transport == ("shm" if server.config.shm else "pickle")
    assert ctx.server_version.startswith(server.config.version)
    assert ctx.chunk_size == 256
    assert ctx.layout == LAYOUT
    ids = (await ctx.status())["registered_non_cuda_instance_ids"]
    assert ctx.instance_id in ids


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
async def test_round_trip_is_bit_exact(server: LocalServer, dtype: torch.dtype) -> None:
    layout = lmkv.KVLayout(num_layers=3, num_kv_heads=2, head_dim=32, dtype=dtype)
    async with checked_context(server, model_name(), layout=layout) as ctx:
        C = ctx.chunk_size
        toks = tokens_for(3 * C + 17)
        kv = random_kv(layout, len(toks), seed=5)
        res = await ctx.store(kv, toks)
        assert (res.total_chunks, res.written_chunks, res.skipped_chunks) == (3, 3, 0)
        assert res.ignored_tokens == 17 and res.stored_tokens == 3 * C
        assert await ctx.lookup(toks) == 3 * C
        out = await ctx.retrieve(toks)
        assert out is not None and out.dtype == dtype
        assert same_bits(out, kv[:, :, : 3 * C])


async def test_prefix_partial_hit_and_miss(ctx: lmkv.AsyncKVContext) -> None:
    C = ctx.chunk_size
    toks = tokens_for(4 * C)
    kv = random_kv(LAYOUT, 4 * C, seed=1)
    assert (await ctx.store(kv[:, :, : 2 * C], toks[: 2 * C])).written_chunks == 2
    # the longer sequence shares 2 cached chunks
    assert await ctx.lookup(toks) == 2 * C
    out = await ctx.retrieve([*toks, 1, 2, 3])
    assert out is not None and out.shape[2] == 2 * C
    assert same_bits(out, kv[:, :, : 2 * C])
    # a different first chunk misses entirely
    other = tokens_for(4 * C)
    assert await ctx.lookup(other) == 0
    assert await ctx.retrieve(other) is None


async def test_under_one_chunk_sends_nothing(ctx: lmkv.AsyncKVContext,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def no_traffic() -> Any:
        raise AssertionError("no request may be sent")

    monkeypatch.setattr(ctx._transport, "pick", no_traffic)
    toks = tokens_for(ctx.chunk_size - 1)
    kv = random_kv(LAYOUT, len(toks))
    res = await ctx.store(kv, toks)
    assert (res.total_chunks, res.written_chunks, res.ignored_tokens) == (0, 0, len(toks))
    assert await ctx.lookup(toks) == 0
    assert await ctx.retrieve(toks) is None


async def test_restore_reports_skipped_chunks(ctx: lmkv.AsyncKVContext) -> None:
    C = ctx.chunk_size
    toks = tokens_for(3 * C)
    kv = random_kv(LAYOUT, 3 * C, seed=2)
    first = await ctx.store(kv[:, :, :C], toks[:C])
    assert (first.written_chunks, first.skipped_chunks) == (1, 0)
    again = await ctx.store(kv, toks)
    assert (again.total_chunks, again.written_chunks, again.skipped_chunks) == (3, 2, 1)
    third = await ctx.store(kv, toks)
    assert (third.written_chunks, third.skipped_chunks) == (0, 3)
    out = await ctx.retrieve(toks)
    assert out is not None and same_bits(out, kv)


async def test_salt_isolation(ctx: lmkv.AsyncKVContext) -> None:
    C = ctx.chunk_size
    toks = tokens_for(2 * C)
    kv = random_kv(LAYOUT, 2 * C, seed=3)
    await ctx.store(kv, toks, cache_salt="tenant-a")
    assert await ctx.lookup(toks) == 0
    assert await ctx.lookup(toks, cache_salt="tenant-b") == 0
    assert await ctx.lookup(toks, cache_salt="tenant-a") == 2 * C
    assert await ctx.retrieve(toks, cache_salt="tenant-b") is None
    out = await ctx.retrieve(toks, cache_salt="tenant-a")
    assert out is not None and same_bits(out, kv)


async def test_retrieve_into_caller_buffer(ctx: lmkv.AsyncKVContext) -> None:
    C = ctx.chunk_size
    toks = tokens_for(2 * C + 5)
    kv = random_kv(LAYOUT, len(toks), seed=4)
    await ctx.store(kv, toks)
    buf = torch.full((2, LAYOUT.num_layers, 3 * C, LAYOUT.hidden_dim), 7.0, dtype=LAYOUT.dtype)
    view = await ctx.retrieve(toks, out=buf)
    assert view is not None and view.shape[2] == 2 * C
    assert view.data_ptr() == buf.data_ptr()
    assert same_bits(buf[:, :, : 2 * C], kv[:, :, : 2 * C])
    assert bool((buf[:, :, 2 * C :] == 7.0).all())  # untouched past the hit


async def test_functional_api_mirrors_official_sdk(server: LocalServer) -> None:
    ctx = await lmkv.connect(server.url, server.http_url, model_name(), layout=LAYOUT)
    try:
        toks = tokens_for(ctx.chunk_size)
        kv = random_kv(LAYOUT, len(toks), seed=6)
        assert (await lmkv.store(ctx, kv, toks)).written_chunks == 1
        assert await lmkv.lookup(ctx, toks) == ctx.chunk_size
        out = await lmkv.retrieve(ctx, toks)
        assert out is not None and same_bits(out, kv)
        await assert_quiescent(ctx)
    finally:
        await lmkv.close(ctx)
    assert ctx.closed
    with pytest.raises(lmkv.ClosedError):
        await ctx.lookup(toks)
    assert_no_leaks(server)


BAD_TOKENS: list[Any] = [[], [-1], [2**32], [1.5], [True], "abc", torch.zeros(2, 2,
                                                                           dtype=torch.int64)]


@pytest.mark.parametrize("bad", BAD_TOKENS, ids=lambda b: repr(b)[:20])
async def test_bad_tokens_raise_before_traffic(ctx: lmkv.AsyncKVContext, bad: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ctx._transport, "pick", lambda: pytest.fail("traffic sent"))
    with pytest.raises(lmkv.InvalidInputError):
        await ctx.lookup(bad)
    with pytest.raises(lmkv.InvalidInputError):
        await ctx.retrieve(bad)
    with pytest.raises(ValueError):  # InvalidInputError is also a ValueError
        await ctx.store(random_kv(LAYOUT, 1), bad)


@pytest.mark.parametrize("salt", ["a@b", "a/b", "a\\b", "a\x00b", "x" * 129, 5])
async def test_bad_salt_raises(ctx: lmkv.AsyncKVContext, salt: Any,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ctx._transport, "pick", lambda: pytest.fail("traffic sent"))
    toks = tokens_for(ctx.chunk_size)
    with pytest.raises(lmkv.InvalidInputError, match="cache_salt"):
        await ctx.lookup(toks, cache_salt=salt)
    with pytest.raises(lmkv.InvalidInputError, match="cache_salt"):
        await ctx.store(random_kv(LAYOUT, len(toks)), toks, cache_salt=salt)


async def test_bad_kv_and_options_raise(ctx: lmkv.AsyncKVContext,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ctx._transport, "pick", lambda: pytest.fail("traffic sent"))
    C = ctx.chunk_size
    toks = tokens_for(C)
    good = random_kv(LAYOUT, C)
    bad_kvs: list[Any] = [
        good.to(torch.float16),                      # dtype
        good[:, :1],                                 # layers
        good[:, :, : C - 1],                         # T != len(tokens)
        good[:1],                                    # planes
        good.transpose(2, 3),                        # shape / last dim not contiguous
        [[1.0]],                                     # not a tensor
    ]
    for kv in bad_kvs:
        with pytest.raises(lmkv.InvalidInputError):
            await ctx.store(kv, toks)
    with pytest.raises(lmkv.LayoutMismatchError):
        await ctx.store(good.to(torch.float32), toks)
    for timeout in (0, -1, float("nan"), float("inf"), "1"):
        with pytest.raises(lmkv.InvalidInputError, match="timeout"):
            await ctx.lookup(toks, timeout=timeout)  # type: ignore[arg-type]
    with pytest.raises(lmkv.LayoutMismatchError, match="room"):
        await ctx.retrieve(toks, out=torch.empty(2, 2, C - 1, 128, dtype=torch.bfloat16))
    with pytest.raises(lmkv.LayoutMismatchError):
        await ctx.retrieve(toks, out=torch.empty(2, 2, C, 128, dtype=torch.float16))


async def test_bad_connect_arguments_fail_fast() -> None:
    with pytest.raises(lmkv.InvalidInputError):
        lmkv.connect("tcp://127.0.0.1:1", "not-a-url", "m")
    with pytest.raises(lmkv.InvalidInputError):
        lmkv.connect("tcp://127.0.0.1:1", "http://127.0.0.1:1", "m", transport="rdma")  # type: ignore[arg-type]
    with pytest.raises(lmkv.InvalidInputError):
        lmkv.KVLayout(num_layers=0, num_kv_heads=1, head_dim=1)
    with pytest.raises(lmkv.InvalidInputError):
        lmkv.KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.int8)
    t0 = time.monotonic()
    with pytest.raises(lmkv.ServerUnavailableError):
        await lmkv.connect("tcp://127.0.0.1:9", "http://127.0.0.1:9", "m", layout=LAYOUT)
    fast(time.monotonic() - t0, limit=2 * SLACK, what="connect to a closed port")


@pytest.mark.parametrize("version", VERSIONS)
async def test_shm_required_on_pickle_server(version: str,
                                             server_factory: Callable[..., LocalServer]) -> None:
    server = server_factory(version, shm=False)
    with pytest.raises(lmkv.TransportUnavailableError, match="--shm-name"):
        await lmkv.connect(server.url, server.http_url, model_name(), layout=LAYOUT,
                           transport="shm")
    assert_no_leaks(server)  # the registration made to find out was dropped


@pytest.mark.parametrize("version", VERSIONS)
async def test_pickle_forced_on_shm_server_is_refused(
    version: str, server_factory: Callable[..., LocalServer]
) -> None:
    server = server_factory(version, shm=True)
    with pytest.raises(lmkv.TransportUnavailableError, match="transport='pickle'"):
        await lmkv.connect(server.url, server.http_url, model_name(), layout=LAYOUT,
                           transport="pickle")
    assert_no_leaks(server)


@pytest.mark.parametrize("version", VERSIONS)
async def test_shm_unmappable_falls_back_or_raises(
    version: str, server_factory: Callable[..., LocalServer], tmp_path: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = server_factory(version, shm=True)
    empty_dir = str(tmp_path)  # the segment is not visible here, as in a container
    name = model_name()
    async with lmkv.connect(server.url, server.http_url, name, layout=LAYOUT,
                            shm_dir=empty_dir) as ctx:
        assert ctx.transport == "pickle"
        toks = tokens_for(ctx.chunk_size)
        kv = random_kv(LAYOUT, len(toks), seed=10)
        assert (await ctx.store(kv, toks)).written_chunks == 1  # pickle commit on an SHM server
        assert await ctx.lookup(toks) == ctx.chunk_size
        # the server hands out retrieves only as SHM slots: a typed error, locks released
        with pytest.raises(lmkv.TransportUnavailableError, match="SHM pool"):
            await ctx.retrieve(toks)
        await assert_quiescent(ctx)  # the refused SHM read was committed back
    assert "falling back to pickle" in caplog.text
    with pytest.raises(lmkv.TransportUnavailableError):
        await lmkv.connect(server.url, server.http_url, model_name(), layout=LAYOUT,
                           shm_dir=empty_dir, transport="shm")
    assert_no_leaks(server)
    # and the data stored through pickle reads back bit-exact through SHM
    async with checked_context(server, name, layout=LAYOUT) as ctx2:
        out = await ctx2.retrieve(toks)
        assert out is not None and same_bits(out, kv)


async def test_many_concurrent_operations(ctx: lmkv.AsyncKVContext) -> None:
    C = ctx.chunk_size
    seqs = [tokens_for(2 * C) for _ in range(12)]
    kvs = [random_kv(LAYOUT, 2 * C, seed=100 + i) for i in range(12)]
    results = await gather(*(ctx.store(kv, t) for kv, t in zip(kvs, seqs, strict=True)))
    assert all(r.written_chunks == 2 for r in results)
    hits = await gather(*(ctx.lookup(t) for t in seqs))
    assert hits == [2 * C] * 12
    outs = await gather(*(ctx.retrieve(t) for t in seqs))
    for out, kv in zip(outs, kvs, strict=True):
        assert out is not None and same_bits(out, kv)


def test_restricted_unpickler_rejects_code() -> None:
    import io
    import os

    from lmkv_async.wire.tensors import dumps_tensors, loads_tensors

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, ("echo pwned > /tmp/lmkv-pwned",))

    with pytest.raises(lmkv.ProtocolError, match="refusing"):
        loads_tensors(pickle.dumps([Evil()]))

    # A payload hidden in the storage bytes torch would hand to torch.load(weights_only=False).
    class EvilStorage:
        def __reduce__(self) -> tuple[Any, ...]:
            import torch.storage

            inner = io.BytesIO()
            pickle.dump(Evil(), inner)
            return (torch.storage._load_from_bytes, (inner.getvalue(),))

    with pytest.raises(lmkv.ProtocolError):
        loads_tensors(pickle.dumps([EvilStorage()]))
    assert not os.path.exists("/tmp/lmkv-pwned")
    with pytest.raises(lmkv.ProtocolError):
        loads_tensors(b"not a pickle")
    with pytest.raises(lmkv.ProtocolError, match="list of tensors"):
        loads_tensors(pickle.dumps({"a": 1}))
    ts = [random_kv(LAYOUT, 4, seed=i) for i in range(2)]
    back = loads_tensors(dumps_tensors(ts))
    assert all(same_bits(a, b) for a, b in zip(ts, back, strict=True))


async def test_closed_context_and_bad_heartbeat(server: LocalServer) -> None:
    with pytest.raises(lmkv.InvalidInputError, match="heartbeat_interval"):
        lmkv.connect(server.url, server.http_url, "m", layout=LAYOUT, heartbeat_interval=-1)
    ctx = await lmkv.connect(server.url, server.http_url, model_name(), layout=LAYOUT)
    await ctx.aclose()
    await ctx.aclose()  # idempotent
    with pytest.raises(lmkv.ClosedError):
        await ctx.status()
    with pytest.raises(lmkv.ClosedError):
        await ctx.store(random_kv(LAYOUT, 256), tokens_for(256))


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("skip", ["commit_retrieve", "commit_store"])
async def test_leak_check_sees_a_missing_commit_only_while_registered(
    version: str, skip: str, server_factory: Callable[..., LocalServer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check the context fixtures run can fail: with a commit step suppressed, the
    pending SHM read/write shows in /status while the context is registered, and the
    server sweeps it at unregister (so a check after aclose() alone would miss it)."""
    from lmkv_async.wire import requests as wire_requests

    server = server_factory(version, private=True)  # it will hold a leak for a while
    async with lmkv.connect(server.url, server.http_url, model_name(), layout=LAYOUT) as ctx:
        assert ctx.transport == "shm"
        toks = tokens_for(2 * ctx.chunk_size)
        kv = random_kv(LAYOUT, len(toks), seed=13)
        if skip == "commit_store":
            # a harmless ping in place of the commit: the reservation stays write-locked
            monkeypatch.setattr(wire_requests, "commit_store",
                                lambda d, key, iid, data=b"": wire_requests.ping(d, iid))
            await ctx.store(kv, toks)
            lock = "write_locked_count"
        else:
            await ctx.store(kv, toks)
            monkeypatch.setattr(wire_requests, "commit_retrieve",
                                lambda d, key, iid: wire_requests.ping(d, iid))
            out = await ctx.retrieve(toks)
            assert out is not None and same_bits(out, kv)
            lock = "read_locked_count"
        with pytest.raises(AssertionError, match=lock):
            await assert_quiescent(ctx, timeout=1.0)
    await assert_quiescent(server)  # swept by unregister: invisible from here


def mapping_rss_bytes(address: int) -> int:
    """Resident bytes of this process's mapping starting at ``address`` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                inside = int(head.split("-")[0], 16) == address
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")


@pytest.mark.parametrize("version", VERSIONS)
async def test_prefault_populates_the_shm_mapping(
    version: str, server_factory: Callable[..., LocalServer]
) -> None:
    """prefault=True maps every page of the pool into this process at connect (smaps Rss
    of the mapping = its size); prefault=False leaves it unpopulated. Both work."""
    server = server_factory(version, shm=True)
    for prefault in (True, False):
        async with checked_context(server, model_name(), layout=LAYOUT,
                                   prefault=prefault) as ctx:
            pool = ctx._s.pool
            assert ctx.transport == "shm" and pool is not None
            rss = mapping_rss_bytes(pool.address)
            if prefault:
                assert rss == pool.size, (rss, pool.size)
            else:
                assert rss < pool.size // 100, (rss, pool.size)
            toks = tokens_for(2 * ctx.chunk_size)
            kv = random_kv(LAYOUT, len(toks), seed=14)
            await ctx.store(kv, toks)
            out = await ctx.retrieve(toks)
            assert out is not None and same_bits(out, kv)
            if not prefault:  # only the pages of the touched slots were faulted in
                assert 0 < mapping_rss_bytes(pool.address) < pool.size // 100


async def test_mla_layout_end_to_end(server: LocalServer) -> None:
    """use_mla=True: one plane ([1, L, T, D]) stored, looked up, retrieved bit-exact,
    dense and paged ([NB, 1, NH, BS, HS])."""
    layout = lmkv.KVLayout(num_layers=2, num_kv_heads=1, head_dim=64, dtype=torch.bfloat16,
                           use_mla=True)
    assert layout.planes == 1 and layout.chunk_shape(256) == (2, 256, 64)
    async with checked_context(server, model_name(), layout=layout) as ctx:
        C = ctx.chunk_size
        toks = tokens_for(2 * C + 5)
        kv = random_kv(layout, len(toks), seed=15)
        assert kv.shape == (1, 2, len(toks), 64)
        res = await ctx.store(kv, toks)
        assert (res.written_chunks, res.ignored_tokens) == (2, 5)
        assert await ctx.lookup(toks) == 2 * C
        out = await ctx.retrieve(toks)
        assert out is not None and out.shape == (1, 2, 2 * C, 64)
        assert same_bits(out, kv[:, :, : 2 * C])
        with pytest.raises(lmkv.LayoutMismatchError):  # two planes do not fit an MLA layout
            await ctx.store(torch.zeros(2, 2, C, 64, dtype=torch.bfloat16), toks[:C])
        nb = 2 * C // layout.block_size
        # paged MLA caches are [NB, BS, D] per layer: no plane or head axis
        caches = [torch.zeros(nb + 3, layout.block_size, 64, dtype=torch.bfloat16)
                  for _ in range(layout.num_layers)]
        ids = list(range(3, nb + 3))
        assert await ctx.retrieve_blocks(toks, caches, ids) == 2 * C
        for layer, cache in enumerate(caches):
            assert same_bits(cache[3:].reshape(1, 2 * C, 64), kv[:, layer, : 2 * C])
            assert bool((cache[:3] == 0).all())
        other = tokens_for(2 * C)
        assert (await ctx.store_blocks(caches, ids, other)).written_chunks == 2
        back = await ctx.retrieve(other)
        assert back is not None and same_bits(back, kv[:, :, : 2 * C])


async def test_connect_validates_arguments_before_any_traffic(server: LocalServer) -> None:
    bad: list[dict[str, Any]] = [
        {"model_name": ""}, {"model_name": "a@b"}, {"model_name": "a\x00b"},
        {"model_name": 5}, {"layout": {"num_layers": 2}}, {"layout": (2, 2, 64)},
        {"sockets": 0}, {"sockets": -1}, {"sockets": True}, {"sockets": 1.5}, {"sockets": "2"},
        {"timeout": 0}, {"timeout": -1}, {"timeout": float("nan")}, {"timeout": float("inf")},
        {"timeout": "1"}, {"transport": "rdma"}, {"url": ""}, {"url": "http://h:1"},
        {"http_url": "tcp://127.0.0.1:1"},
    ]
    for override in bad:
        args: dict[str, Any] = {"url": server.url, "http_url": server.http_url,
                                "model_name": model_name(), "layout": LAYOUT}
        args.update(override)
        with pytest.raises(lmkv.InvalidInputError):  # raised by connect() itself, unawaited
            lmkv.connect(args.pop("url"), args.pop("http_url"), args.pop("model_name"), **args)
    await assert_quiescent(server)  # nothing was registered
    # a bare host:port is a tcp:// endpoint
    bare = server.url.removeprefix("tcp://")
    async with lmkv.connect(bare, server.http_url, model_name(), layout=LAYOUT) as ctx:
        assert ctx.url == server.url
        toks = tokens_for(ctx.chunk_size)
        kv = random_kv(LAYOUT, len(toks), seed=16)
        await ctx.store(kv, toks)
        out = await ctx.retrieve(toks)
        assert out is not None and same_bits(out, kv)
        await assert_quiescent(ctx)
    await assert_quiescent(server)


@pytest.mark.parametrize("version", VERSIONS)
async def test_pickle_transport_on_a_pickle_server(
    version: str, server_factory: Callable[..., LocalServer]
) -> None:
    server = server_factory(version, shm=False)
    async with checked_context(server, model_name(), layout=LAYOUT, transport="pickle") as ctx:
        assert ctx.transport == "pickle" and ctx._s.pool is None
        toks = tokens_for(2 * ctx.chunk_size)
        kv = random_kv(LAYOUT, len(toks), seed=17)
        assert (await ctx.store(kv, toks)).written_chunks == 2
        out = await ctx.retrieve(toks)
        assert out is not None and same_bits(out, kv)


async def test_aclose_waits_for_operations_in_flight(server: LocalServer) -> None:
    """aclose() while calls are running: they finish normally (not cancelled), then the
    context unregisters; later calls raise ClosedError; the server ends clean."""
    ctx = await lmkv.connect(server.url, server.http_url, model_name(), layout=LAYOUT)
    C = ctx.chunk_size
    seqs = [tokens_for(2 * C) for _ in range(6)]
    kvs = [random_kv(LAYOUT, 2 * C, seed=200 + i) for i in range(6)]
    for kv, toks in zip(kvs[:3], seqs[:3], strict=True):
        await ctx.store(kv, toks)
    await assert_quiescent(ctx)  # no release step of the set-up left in flight
    started = 0
    results: list[Any] = [None] * 6
    done = [False] * 6

    async def call(i: int, coro: Any) -> None:
        nonlocal started
        # The call passes its open-context check in this same step, on either backend,
        # ahead of aclose() below.
        started += 1
        try:
            results[i] = await coro
        except Exception as exc:  # as gather(return_exceptions=True): judged below
            results[i] = exc
        done[i] = True

    async with anyio.create_task_group() as tg:
        for i, t in enumerate(seqs[:3]):
            tg.start_soon(call, i, ctx.retrieve(t))
        for i, (kv, t) in enumerate(zip(kvs[3:], seqs[3:], strict=True), start=3):
            tg.start_soon(call, i, ctx.store(kv, t))
        try:
            # Close the moment all six have started: none can have finished, since each
            # needs server round trips. (Polling for requests in flight raced with fast
            # replies, and a failed poll left the registration on the shared server for
            # every later test.)
            for _ in range(100):
                if started == 6:
                    break
                await anyio.sleep(0)
            assert started == 6, started
            assert not any(done), "a call finished before aclose() began"
        finally:
            await ctx.aclose()
        assert ctx.closed
    assert all(done)
    for out, kv in zip(results[:3], kvs[:3], strict=True):
        assert isinstance(out, torch.Tensor) and same_bits(out, kv), out
    assert all(isinstance(r, lmkv.StoreResult) and r.written_chunks == 2
               for r in results[3:]), results[3:]
    with pytest.raises(lmkv.ClosedError):
        await ctx.retrieve(seqs[0])
    await assert_quiescent(server)
    # the stores that were in flight at aclose() were committed
    async with checked_context(server, ctx.model_name, layout=LAYOUT) as again:
        for kv, toks in zip(kvs, seqs, strict=True):
            out = await again.retrieve(toks)
            assert out is not None and same_bits(out, kv)
