"""Unit tests for lmkv_async.copy: both backends against indexing formulas, bit for bit."""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from timing import eventually_sync

from lmkv_async import kernel as kc
from lmkv_async import memory
from lmkv_async.errors import (
    CopyBoundsError,
    InvalidInputError,
    LayoutMismatchError,
    TransportUnavailableError,
)

# Always both: a missing C extension must fail its tests, not drop them from the run.
BACKENDS = ["c", "torch"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

HYP = settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,  # kernel_mode only flips a global switch
    ],
)


def require_c() -> None:
    """Fail (never skip) when the C kernel is not built."""
    if not kc.kernel_available():
        pytest.fail("the C copy kernel lmkv_async._copy is not built (python setup.py "
                    "build_ext --inplace, or install the package)", pytrace=False)


def backends() -> list[str]:
    """Both backends for a loop; fails if "c" is not built (some calls, e.g. empty
    copies, would otherwise pass without ever reaching the missing kernel)."""
    require_c()
    return BACKENDS


@pytest.fixture(autouse=True)
def _c_backend_present(request: pytest.FixtureRequest) -> None:
    # a test parametrized with backend="c" fails at once when the kernel is missing
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("backend") == "c":
        require_c()


def test_c_kernel_is_built() -> None:
    require_c()
    assert kc._use_c("auto") and kc._use_c("c")


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view: compares NaN payloads and signed zeros exactly."""
    return t.view(_INT_VIEW[t.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def rand_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns (NaNs, infs, denormals included) of any dtype."""
    it = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * it), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


@pytest.fixture(params=["serial", "parallel"])
def kernel_mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the C kernel either as shipped or with threads + streaming stores forced on
    for every size (small tests then exercise the pool and the alignment fallback)."""
    if request.param == "parallel":
        require_c()
        prev = kc._ext.set_thresholds(0, 0)
        threads = kc.num_threads()
        kc.set_num_threads(2)
        try:
            yield request.param
        finally:
            kc._ext.set_thresholds(*prev)
            kc.set_num_threads(threads)
    else:
        yield request.param


# --------------------------------------------------------------------------- references


def ref_pack(caches: list[torch.Tensor], bt: list[int], T: int) -> torch.Tensor:
    """dense[kv, l, p, h*HS + d] = cache_l[bt[p // BS], kv, h, p % BS, d]."""
    c5 = [c[:, None, None] if c.dim() == 3 else c for c in caches]
    _, P, NH, BS, HS = c5[0].shape
    out = torch.empty((P, len(c5), T, NH * HS), dtype=caches[0].dtype)
    p = torch.arange(T)
    blk = torch.tensor(bt, dtype=torch.int64)[p // BS] if T else p
    for layer, c in enumerate(c5):
        # advanced indices on dims 0 and 3 -> [T, P, NH, HS]
        out[:, layer] = c[blk, :, :, p % BS].permute(1, 0, 2, 3).reshape(P, T, NH * HS)
    return out


def ref_unpack(dense: torch.Tensor, caches: list[torch.Tensor], bt: list[int]) -> None:
    """Inverse of ref_pack, token by token (unique block ids)."""
    c5 = [c[:, None, None] if c.dim() == 3 else c for c in caches]
    _, _, NH, BS, HS = c5[0].shape
    T = dense.shape[2]
    for layer, c in enumerate(c5):
        for p in range(T):
            c[bt[p // BS], :, :, p % BS] = dense[:, layer, p].reshape(-1, NH, HS)


# --------------------------------------------------------------------------- geometry


class Pool:
    """A fake SHM pool: one uint8 tensor, chunks at random non-overlapping offsets,
    some deliberately not 16-byte aligned."""

    def __init__(self, sizes: list[int], rnd: random.Random, *, unaligned: bool) -> None:
        gaps = [rnd.choice([0, 1, 3, 8, 13, 64]) if unaligned else 64 for _ in sizes]
        order = list(range(len(sizes)))
        rnd.shuffle(order)
        offsets = [0] * len(sizes)
        pos = 0
        for i in order:
            pos += gaps[i]
            offsets[i] = pos
            pos += sizes[i]
        self.buf = torch.full((pos + 64,), 0xA5, dtype=torch.uint8)
        self.base = self.buf.data_ptr()
        self.addrs = [self.base + o for o in offsets]
        self.region = kc.Region(self.base, self.buf.numel())


@st.composite
def geometries(draw: st.DrawFn) -> dict[str, Any]:
    mla = draw(st.booleans())
    P = 1 if mla else 2
    NH = 1 if mla else draw(st.sampled_from([1, 2, 3]))
    HS = draw(st.sampled_from([1, 3, 8, 16, 24, 64]))
    BS = draw(st.sampled_from([1, 2, 4, 5, 16]))
    return {
        "P": P,
        "L": draw(st.integers(1, 3)),
        "NH": NH,
        "HS": HS,
        "BS": BS,
        "C": BS * draw(st.integers(1, 4)),
        "T": draw(st.integers(0, 70)),
        "extra_blocks": draw(st.integers(0, 5)),
        "dtype": draw(st.sampled_from(DTYPES)),
        "mla3": mla and draw(st.booleans()),  # [NB, BS, D] rather than [NB, 1, 1, BS, HS]
        "cache_layout": draw(st.sampled_from(["contig", "padded", "nhd_permuted"])),
        "dense_layout": draw(st.sampled_from(["contig", "slice", "permuted"])),
        "bt_kind": draw(st.sampled_from(["list", "tensor64", "tensor32"])),
        "unaligned": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31)),
    }


def make_caches(g: dict[str, Any], nb: int, gen: torch.Generator) -> list[torch.Tensor]:
    P, NH, BS, HS, dtype = g["P"], g["NH"], g["BS"], g["HS"], g["dtype"]
    out = []
    for _ in range(g["L"]):
        if g["mla3"]:
            base = rand_bits(
                (nb, BS, NH * HS + (5 if g["cache_layout"] == "padded" else 0)), dtype, gen
            )
            out.append(base[..., : NH * HS])
        elif g["cache_layout"] == "padded":
            out.append(rand_bits((nb + 1, P, NH, BS, HS + 3), dtype, gen)[1:, ..., :HS])
        elif g["cache_layout"] == "nhd_permuted":
            out.append(rand_bits((nb, P, BS, NH, HS), dtype, gen).permute(0, 1, 3, 2, 4))
        else:
            out.append(rand_bits((nb, P, NH, BS, HS), dtype, gen))
    return out


def make_dense(g: dict[str, Any], T: int, gen: torch.Generator) -> torch.Tensor:
    """A dense [P, L, T, D] destination in one of several stride layouts."""
    P, L, D, dtype = g["P"], g["L"], g["NH"] * g["HS"], g["dtype"]
    if g["dense_layout"] == "slice":
        return rand_bits((P, L, T + 7, D), dtype, gen)[:, :, :T]
    if g["dense_layout"] == "permuted":
        return rand_bits((L, P, T, D), dtype, gen).permute(1, 0, 2, 3)
    return rand_bits((P, L, T, D), dtype, gen)


def block_table(g: dict[str, Any], nb: int, need: int, rnd: random.Random) -> Any:
    ids = rnd.sample(range(nb), need)  # unique: writes to the paged cache are deterministic
    if g["bt_kind"] == "list":
        return ids
    return torch.tensor(ids, dtype=torch.int64 if g["bt_kind"] == "tensor64" else torch.int32)


def chunk_bytes(g: dict[str, Any], T: int, k: int) -> int:
    it = torch.empty((), dtype=g["dtype"]).element_size()
    return g["P"] * g["L"] * min(g["C"], T - k * g["C"]) * g["NH"] * g["HS"] * it


def read_chunk(g: dict[str, Any], addr: int, ntok: int) -> torch.Tensor:
    shape = (g["P"], g["L"], ntok, g["NH"] * g["HS"])
    return kc._raw(addr, ntok, (shape[0], shape[1], shape[3], _itemsize(g)), g["dtype"]).clone()


def _itemsize(g: dict[str, Any]) -> int:
    return torch.empty((), dtype=g["dtype"]).element_size()


# --------------------------------------------------------------------------- properties


@HYP
@given(g=geometries())
def test_pack_unpack_match_reference(g: dict[str, Any], kernel_mode: str) -> None:
    rnd, gen = random.Random(g["seed"]), torch.Generator().manual_seed(g["seed"])
    T, BS = g["T"], g["BS"]
    need = -(-T // BS)
    nb = need + g["extra_blocks"] + 1
    caches = make_caches(g, nb, gen)
    bt = block_table(g, nb, need, rnd)
    bt_list = bt if isinstance(bt, list) else bt.tolist()
    expect = ref_pack(caches, bt_list, T)
    results = []
    for backend in backends():
        dst = make_dense(g, T, gen)
        kc.paged_to_dense(dst, caches, bt, backend=backend)
        assert same(dst, expect), backend
        results.append(dst)

    src = make_dense(g, T, gen)
    ref_caches = [c.clone() for c in caches]
    ref_unpack(src, ref_caches, bt_list)
    for backend in backends():
        mine = [c.clone() for c in caches]
        if g["cache_layout"] == "nhd_permuted" and not g["mla3"]:
            mine = [m.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4) for m in mine]
        kc.dense_to_paged(src, mine, bt, backend=backend)
        for a, b in zip(mine, ref_caches, strict=True):
            assert same(a, b), backend  # incl. untouched slots past T in the last block


@HYP
@given(g=geometries())
def test_chunks_dense_match_reference(g: dict[str, Any], kernel_mode: str) -> None:
    rnd, gen = random.Random(g["seed"]), torch.Generator().manual_seed(g["seed"])
    T, C = g["T"], g["C"]
    nchunks = -(-T // C)
    src = make_dense(g, T, gen)
    # a random subset of chunks, in random order
    ks = [k for k in range(nchunks) if rnd.random() < 0.8]
    rnd.shuffle(ks)
    for backend in backends():
        pool = Pool([chunk_bytes(g, T, k) for k in ks], rnd, unaligned=g["unaligned"])
        placements = list(zip(ks, pool.addrs, strict=True))
        before = pool.buf.clone()
        kc.dense_to_chunks(src, placements, chunk_tokens=C, region=pool.region, backend=backend)
        covered = torch.zeros_like(pool.buf, dtype=torch.bool)
        for k, addr in placements:
            ntok = min(C, T - k * C)
            assert same(read_chunk(g, addr, ntok), src[:, :, k * C : k * C + ntok]), backend
            covered[addr - pool.base : addr - pool.base + chunk_bytes(g, T, k)] = True
        assert torch.equal(pool.buf[~covered], before[~covered])  # nothing outside the chunks

        dst = make_dense(g, T, gen)
        expect = dst.clone()
        for k, _ in placements:
            expect[:, :, k * C : k * C + C] = src[:, :, k * C : k * C + C]
        kc.chunks_to_dense(dst, placements, chunk_tokens=C, region=pool.region, backend=backend)
        assert same(dst, expect), backend


@HYP
@given(g=geometries())
def test_paged_chunks_match_reference(g: dict[str, Any], kernel_mode: str) -> None:
    rnd, gen = random.Random(g["seed"]), torch.Generator().manual_seed(g["seed"])
    T, C, BS = g["T"], g["C"], g["BS"]
    need, nchunks = -(-T // BS), -(-T // C)
    nb = need + g["extra_blocks"] + 1
    caches = make_caches(g, nb, gen)
    bt = block_table(g, nb, need, rnd)
    bt_list = bt if isinstance(bt, list) else bt.tolist()
    dense = ref_pack(caches, bt_list, T)
    ks = list(range(nchunks))
    rnd.shuffle(ks)
    out = {}
    for backend in backends():
        pool = Pool([chunk_bytes(g, T, k) for k in ks], rnd, unaligned=g["unaligned"])
        placements = list(zip(ks, pool.addrs, strict=True))
        kc.paged_to_chunks(
            caches,
            bt,
            placements,
            num_tokens=T,
            chunk_tokens=C,
            dtype=g["dtype"],
            region=pool.region,
            backend=backend,
        )
        for k, addr in placements:
            ntok = min(C, T - k * C)
            assert same(read_chunk(g, addr, ntok), dense[:, :, k * C : k * C + ntok]), backend
        # and back into a different cache
        fresh = make_caches(g, nb, gen)
        expect = [c.clone() for c in fresh]
        ref_unpack(dense, expect, bt_list)
        kc.chunks_to_paged(
            placements,
            fresh,
            bt,
            num_tokens=T,
            chunk_tokens=C,
            dtype=g["dtype"],
            region=pool.region,
            backend=backend,
        )
        for a, b in zip(fresh, expect, strict=True):
            assert same(a, b), backend
        out[backend] = pool.buf
    del out


def test_region_per_chunk_tensor_placements() -> None:
    """Pickle path: chunks in their own tensors, each checked against its own extent."""
    gen = torch.Generator().manual_seed(1)
    src = rand_bits((2, 3, 40, 16), torch.bfloat16, gen)
    chunks = [torch.empty((2, 3, n, 16), dtype=torch.bfloat16) for n in (16, 16, 8)]
    placements, regions = kc.tensor_placements(chunks)
    for backend in backends():
        kc.dense_to_chunks(src, placements, chunk_tokens=16, region=regions, backend=backend)
        assert same(torch.cat(chunks, dim=2), src)
        dst = torch.zeros_like(src)
        kc.chunks_to_dense(dst, placements, chunk_tokens=16, region=regions, backend=backend)
        assert same(dst, src)
        # a 16-token tensor standing in for the 8-token last chunk is fine, the
        # reverse is not
        bad = [placements[0], (2, chunks[0].data_ptr())]
        kc.chunks_to_dense(dst, bad, chunk_tokens=16, region=[regions[0]] * 2, backend=backend)
        small = [(0, chunks[2].data_ptr())]
        with pytest.raises(CopyBoundsError):
            kc.chunks_to_dense(dst, small, chunk_tokens=16, region=[regions[2]], backend=backend)
        with pytest.raises(InvalidInputError):
            kc.chunks_to_dense(
                dst, placements, chunk_tokens=16, region=regions[:2], backend=backend
            )


# --------------------------------------------------------------------------- bounds


def _setup_small(dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    P, L, NH, HS, BS, C, T, NB = 2, 2, 2, 8, 4, 8, 20, 8
    caches = [rand_bits((NB, P, NH, BS, HS), dtype, gen) for _ in range(L)]
    nbytes = P * L * C * NH * HS * 2
    pool = torch.zeros(nbytes * 4, dtype=torch.uint8)
    return {
        "caches": caches,
        "bt": [5, 1, 7, 0, 2],
        "T": T,
        "C": C,
        "pool": pool,
        "region": kc.Region(pool.data_ptr(), pool.numel()),
        "nbytes": nbytes,
        "dense": torch.full((P, L, T, NH * HS), 3.0, dtype=dtype),
    }


SENTINEL = 0x5A


def _calls(s: dict[str, Any], chunks: Any, bt: Any) -> dict[str, Callable[[str], None]]:
    """Every entry point, writing into sentinel-filled destinations."""
    T, C, region = s["T"], s["C"], s["region"]
    return {
        "chunks_to_dense": lambda b: kc.chunks_to_dense(
            s["dst"], chunks, chunk_tokens=C, region=region, backend=b
        ),
        "dense_to_chunks": lambda b: kc.dense_to_chunks(
            s["dense"], chunks, chunk_tokens=C, region=region, backend=b
        ),
        "paged_to_dense": lambda b: kc.paged_to_dense(s["dst"], s["caches"], bt, backend=b),
        "dense_to_paged": lambda b: kc.dense_to_paged(s["dense"], s["wcaches"], bt, backend=b),
        "paged_to_chunks": lambda b: kc.paged_to_chunks(
            s["caches"],
            bt,
            chunks,
            num_tokens=T,
            chunk_tokens=C,
            dtype=torch.bfloat16,
            region=region,
            backend=b,
        ),
        "chunks_to_paged": lambda b: kc.chunks_to_paged(
            chunks,
            s["wcaches"],
            bt,
            num_tokens=T,
            chunk_tokens=C,
            dtype=torch.bfloat16,
            region=region,
            backend=b,
        ),
    }


def _fresh_dests(s: dict[str, Any]) -> None:
    s["pool"].fill_(SENTINEL)
    s["dst"] = torch.zeros_like(s["dense"]).view(torch.uint8).fill_(SENTINEL)
    s["dst"] = s["dst"].view(torch.bfloat16)
    s["wcaches"] = [c.clone().view(torch.uint8).fill_(SENTINEL).view(c.dtype) for c in s["caches"]]


def _untouched(s: dict[str, Any]) -> bool:
    ok = bool((s["pool"] == SENTINEL).all()) and bool(
        (s["dst"].view(torch.uint8) == SENTINEL).all()
    )
    return ok and all(bool((c.view(torch.uint8) == SENTINEL).all()) for c in s["wcaches"])


def _bad_chunk_cases(s: dict[str, Any]) -> dict[str, Any]:
    base, n = s["region"].address, s["nbytes"]
    end = base + s["region"].size
    good = [(0, base), (1, base + n)]
    return {
        "past_end": [*good, (2, end - n // 2 + 1)],  # the last chunk is half size
        "straddles_end": [(0, end - n // 2), (1, base)],
        "before_start": [(0, base - 16), (1, base + n)],
        "negative_addr": [(0, -base), (1, base + n)],
        "overflow_addr": [(0, 2**64 + base), (1, base + n)],
        "wraps": [(0, 2**64 - 8), (1, base)],
        "null": [(0, 0)],
        "index_past_T": [(0, base), (3, base + n)],
        "negative_index": [(-1, base)],
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "case",
    [
        "past_end",
        "straddles_end",
        "before_start",
        "negative_addr",
        "overflow_addr",
        "wraps",
        "null",
        "index_past_T",
        "negative_index",
    ],
)
def test_chunk_bounds_rejected_before_copy(backend: str, case: str) -> None:
    s = _setup_small()
    chunks = _bad_chunk_cases(s)[case]
    for name, call in _calls(s, chunks, s["bt"]).items():
        if "chunk" not in name:
            continue
        _fresh_dests(s)
        with pytest.raises(CopyBoundsError):
            call(backend)
        assert _untouched(s), name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "bt, err",
    [
        ([5, 1, 7, 0, 8], CopyBoundsError),  # == NB
        ([5, 1, -1, 0, 2], CopyBoundsError),
        ([5, 1, 7, 0, 2**70], CopyBoundsError),
        ([5, 1, 7, 0], LayoutMismatchError),  # too short for T=20, BS=4
        (torch.tensor([5, 1, 7, 0, 99]), CopyBoundsError),
        (torch.tensor([5, 1, 7, -3, 0], dtype=torch.int32), CopyBoundsError),
        (torch.tensor([5.0, 1, 7, 0, 2]), LayoutMismatchError),
        (torch.tensor([[5, 1, 7, 0, 2]]), LayoutMismatchError),
    ],
)
def test_block_ids_rejected_before_copy(backend: str, bt: Any, err: type[Exception]) -> None:
    s = _setup_small()
    base, n = s["region"].address, s["nbytes"]
    chunks = [(0, base), (1, base + n), (2, base + 2 * n)]
    for name, call in _calls(s, chunks, bt).items():
        if "paged" not in name:
            continue
        _fresh_dests(s)
        with pytest.raises(err):
            call(backend)
        assert _untouched(s), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_layout_mismatches(backend: str) -> None:
    s = _setup_small()
    _fresh_dests(s)
    caches, bt, region = s["caches"], s["bt"], s["region"]
    dst = s["dst"]
    bad: list[Callable[[], None]] = [
        lambda: kc.paged_to_dense(dst.float(), caches, bt, backend=backend),  # dtype
        lambda: kc.paged_to_dense(dst[:, :1], caches, bt, backend=backend),  # L
        lambda: kc.paged_to_dense(dst[:1], caches, bt, backend=backend),  # P
        lambda: kc.paged_to_dense(dst[..., :8], caches, bt, backend=backend),  # D
        lambda: kc.paged_to_dense(dst[..., ::2], caches, bt, backend=backend),  # stride
        lambda: kc.paged_to_dense(dst[0], caches, bt, backend=backend),  # ndim
        lambda: kc.paged_to_dense(dst, [caches[0], caches[1].float()], bt, backend=backend),
        lambda: kc.paged_to_dense(dst, [caches[0], caches[1][:4]], bt, backend=backend),
        lambda: kc.paged_to_dense(dst, caches[0], bt, backend=backend),  # not a list
        lambda: kc.paged_to_dense(dst, [], bt, backend=backend),
        lambda: kc.dense_to_paged(
            dst, [c[..., :1, :].expand(c.shape) for c in caches], bt, backend=backend
        ),  # aliasing destination
        lambda: kc.chunks_to_dense(
            dst[:, :, :1].expand(dst.shape), [], chunk_tokens=8, region=region, backend=backend
        ),
        lambda: kc.paged_to_chunks(
            caches,
            bt,
            [],
            num_tokens=20,
            chunk_tokens=8,
            dtype=torch.float16,
            region=region,
            backend=backend,
        ),
        lambda: kc.paged_to_chunks(
            caches,
            bt,
            [],
            num_tokens=20,
            chunk_tokens=6,
            dtype=torch.bfloat16,
            region=region,
            backend=backend,
        ),  # chunk not a multiple of the block
    ]
    for i, fn in enumerate(bad):
        with pytest.raises(LayoutMismatchError):
            fn()
        assert _untouched(s), i
    with pytest.raises(InvalidInputError):
        kc.chunks_to_dense(dst, [], chunk_tokens=0, region=region, backend=backend)
    with pytest.raises(InvalidInputError):
        kc.chunks_to_dense(dst, [(0,)], chunk_tokens=8, region=region, backend=backend)  # type: ignore[list-item]
    with pytest.raises(InvalidInputError):
        kc.chunks_to_dense(dst, [], chunk_tokens=8, region=kc.Region(-1, 5), backend=backend)
    with pytest.raises(InvalidInputError):
        kc.paged_to_dense(dst, caches, bt, backend="cuda")
    assert _untouched(s)


def test_backend_c_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kc, "_ext", None)
    assert not kc.kernel_available()
    s = _setup_small()
    _fresh_dests(s)
    with pytest.raises(TransportUnavailableError):
        kc.paged_to_dense(s["dst"], s["caches"], s["bt"], backend="c")
    kc.paged_to_dense(s["dst"], s["caches"], s["bt"])  # auto -> torch
    assert same(s["dst"], ref_pack(s["caches"], s["bt"], s["T"]))


def test_empty_is_noop() -> None:
    s = _setup_small()
    _fresh_dests(s)
    for backend in backends():
        kc.chunks_to_dense(s["dst"], [], chunk_tokens=8, region=s["region"], backend=backend)
        kc.paged_to_dense(s["dst"][:, :, :0], s["caches"], [], backend=backend)
        kc.chunks_to_paged(
            [],
            s["wcaches"],
            [],
            num_tokens=0,
            chunk_tokens=8,
            dtype=torch.bfloat16,
            region=None,
            backend=backend,
        )
    assert _untouched(s)


# --------------------------------------------------------------------------- runtime


def test_gil_released_during_copy() -> None:
    """While a big C copy runs in a thread, the main thread keeps executing Python.

    With the GIL held, the main thread would stall for the whole C call, i.e.
    most of each measured interval; released, it never stalls for long.
    """
    require_c()
    src = torch.ones((2, 4, 16384, 1024), dtype=torch.bfloat16)  # 256 MiB
    pool = torch.empty(src.numel() * 2, dtype=torch.uint8)
    step = pool.numel() // 64
    placements = [(k, pool.data_ptr() + k * step) for k in range(64)]
    region = kc.Region(pool.data_ptr(), pool.numel())
    kc.dense_to_chunks(src, placements, chunk_tokens=256, region=region, backend="c")  # touch
    intervals: list[tuple[float, float]] = []
    done = threading.Event()

    def work() -> None:
        for _ in range(3):
            t0 = time.perf_counter()
            kc.dense_to_chunks(src, placements, chunk_tokens=256, region=region, backend="c")
            intervals.append((t0, time.perf_counter()))
        done.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    stamps: list[float] = []
    try:
        th = threading.Thread(target=work)
        th.start()
        while not done.is_set():
            stamps.append(time.perf_counter())
        th.join()
    finally:
        sys.setswitchinterval(old)
    # the longest stretch inside a copy in which the main thread made no progress
    stalls = []
    for t0, t1 in intervals:
        edges = [t0, *(t for t in stamps if t0 < t < t1), t1]
        stalls.append(max(b - a for a, b in itertools.pairwise(edges)) / (t1 - t0))
    assert min(stalls) < 0.5, (stalls, [b - a for a, b in intervals])


def test_stream_copy() -> None:
    gen = torch.Generator().manual_seed(3)
    for n in (0, 1, 15, 17, 4096 + 3, 5 << 20):
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        dst = torch.zeros(n + 1, dtype=torch.uint8)[1:]  # misaligned destination
        kc.stream_copy(dst, src)
        assert torch.equal(dst, src)
    with pytest.raises(LayoutMismatchError):
        kc.stream_copy(torch.empty(4), torch.empty(5))
    with pytest.raises(LayoutMismatchError):
        kc.stream_copy(torch.empty(4, 4).t(), torch.empty(4, 4))


def test_offload_inline_and_threaded() -> None:
    seen: list[str] = []

    def fn(tag: str, *, mark: str) -> None:
        seen.append(f"{tag}{mark}{threading.current_thread() is threading.main_thread()}")

    async def main() -> None:
        await memory.offload(fn, "a", mark="-", nbytes=10)
        await memory.offload(fn, "b", mark="+", nbytes=memory.INLINE_LIMIT)

    asyncio.run(main())
    assert seen == ["a-True", "b+False"]


def test_concurrent_callers_share_the_pool() -> None:
    """Several Python threads copying at once: one gets the pool, the others run
    on their own thread; every result must be exact."""
    require_c()
    prev = kc._ext.set_thresholds(0, 0)
    try:
        gen = torch.Generator().manual_seed(5)
        caches = [rand_bits((64, 2, 4, 16, 32), torch.bfloat16, gen) for _ in range(3)]
        bt = torch.randperm(64, generator=gen)[:40]
        expect = ref_pack(caches, bt.tolist(), 40 * 16 - 3)
        errors: list[str] = []

        def work(seed: int) -> None:
            for _ in range(20):
                out = torch.empty_like(expect)
                kc.paged_to_dense(out, caches, bt, backend="c")
                if not same(out, expect):
                    errors.append(f"thread {seed}")

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors
    finally:
        kc._ext.set_thresholds(*prev)


def test_thread_count_from_environment() -> None:
    require_c()
    code = "from lmkv_async import kernel; print(kernel.num_threads())"
    # the child imports the same lmkv_async as this process (installed, or via PYTHONPATH)
    env = {**os.environ, "LMKV_COPY_THREADS": "3"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "3"


def test_fork_resets_pool() -> None:
    """A child forked after the pool started can still run parallel copies."""
    require_c()
    prev = kc._ext.set_thresholds(0, -1)
    try:
        src = torch.arange(1 << 16, dtype=torch.int32).view(2, 2, 64, 256)
        dst = torch.zeros_like(src)
        pool = torch.zeros(src.numel() * 4, dtype=torch.uint8)
        placements = [(0, pool.data_ptr())]
        kc.dense_to_chunks(src, placements, chunk_tokens=64, region=None, backend="c")
        pid = os.fork()
        if pid == 0:  # child: exit code tells the parent whether the copy worked
            try:
                kc.chunks_to_dense(dst, placements, chunk_tokens=64, region=None, backend="c")
                # no torch kernels here: torch's OpenMP pool is not fork-safe
                n = src.numel() * 4
                ok = ctypes.string_at(dst.data_ptr(), n) == ctypes.string_at(src.data_ptr(), n)
                os._exit(0 if ok else 1)
            except BaseException:
                os._exit(2)
        assert _wait_child(pid, timeout=60.0) == 0
    finally:
        kc._ext.set_thresholds(*prev)


def _wait_child(pid: int, timeout: float) -> int:
    """The forked child's exit code; a child that hangs fails the test instead of the run."""

    def exited() -> tuple[int, int] | None:
        done, status = os.waitpid(pid, os.WNOHANG)
        return (done, status) if done else None

    try:
        _, status = eventually_sync(exited, timeout, what="the forked child exits (a deadlock?)")
    except AssertionError:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    return os.waitstatus_to_exitcode(status)
