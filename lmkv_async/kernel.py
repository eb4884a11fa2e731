"""Copy kernel: moves KV data between dense tensors, chunk objects and paged caches.

Layouts (CPU memory; element size 1, 2, 4 or 8 bytes):

* **dense** ``[P, L, T, D]`` -- ``P = 2`` (K, V) or ``1`` (MLA), any strides as
  long as the last dim is contiguous (``out[:, :, :T]`` views are fine).
* **chunk object** -- a C-order ``[P, L, n, D]`` block at a raw address, holding
  tokens ``[k*C, k*C + n)`` of the dense tensor, where ``C = chunk_tokens`` and
  ``n = min(C, T - k*C)``: full chunks hold ``C`` tokens, a trailing partial
  chunk is stored compactly with its ``n`` tokens.  Chunks are given as
  ``(k, address)`` placements; addresses normally come from the network, so each
  ``[address, address + P*L*n*D*itemsize)`` is checked against ``region`` (the
  shared-memory mapping, or one :class:`Region` per chunk for tensor-backed
  chunks, see :func:`tensor_placements`) before anything is copied.
* **paged** -- one tensor per layer, ``[NB, P, NH, BS, HS]`` (HND; any strides
  with ``HS`` contiguous) or ``[NB, BS, D]`` for MLA, plus a block table:
  ``dense[kv, l, p, h*HS + d] = cache_l[block_ids[p // BS], kv, h, p % BS, d]``.

Every check (shapes, dtypes, region bounds, block ids) runs before the first
byte is written, so a rejected call leaves every destination untouched.  Errors:
:class:`~lmkv_async.errors.CopyBoundsError` for anything that would leave a
mapping or tensor (chunk ranges, chunk indices, block ids),
:class:`~lmkv_async.errors.LayoutMismatchError` for tensors that do not fit
together, :class:`~lmkv_async.errors.InvalidInputError` for other bad arguments.

Two backends, bit-identical: ``"c"`` -- the ``lmkv_async._copy`` extension
(GIL released for the whole copy, streaming stores for payloads >= 1 MiB, a
persistent pool of one thread per CPU -- caller included, at most 8 -- for
payloads >= 4 MiB; ``LMKV_COPY_THREADS`` overrides the thread count) -- and
``"torch"``, a pure-torch fallback (many small torch ops: slow when the CPUs
are oversubscribed, as each waits on torch's OpenMP team).
``"auto"`` picks ``"c"`` when the extension is built.

Overlapping destinations (two chunks at the same address, a block id repeated in
a write to the paged cache) give an unspecified one of the candidate values.
"""

from __future__ import annotations

import ctypes
import importlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ._kernel_args import (
    _block_table,
    _bt_args,
    _check_placements,
    _chunk_tokens,
    _Dense,
    _dense,
    _Paged,
    _paged,
    _region_args,
)
from .errors import (
    InvalidInputError,
    LayoutMismatchError,
    TransportUnavailableError,
)
from .memory import Region, RegionArg

__all__ = [
    "Region",
    "RegionArg",
    "chunks_to_dense",
    "chunks_to_paged",
    "dense_to_chunks",
    "dense_to_paged",
    "kernel_available",
    "num_threads",
    "paged_to_chunks",
    "paged_to_dense",
    "set_num_threads",
    "stream_copy",
    "tensor_placements",
]

_ext: Any
try:
    _ext = importlib.import_module("lmkv_async._copy")
except ImportError:  # not built: the torch fallback serves every call
    _ext = None

_ITEMSIZES = (1, 2, 4, 8)
_ADDR_LIMIT = 1 << 64


def kernel_available() -> bool:
    """Whether the C extension ``lmkv_async._copy`` is importable."""
    return _ext is not None


def num_threads() -> int:
    """Threads (including the caller) the C kernel uses for large copies (1 without it)."""
    return int(_ext.num_threads()) if _ext is not None else 1


def set_num_threads(n: int) -> None:
    """Set the C kernel's thread count (including the caller); workers start lazily."""
    if _ext is not None:
        _ext.set_num_threads(int(n))


def _use_c(backend: str) -> bool:
    if backend == "auto":
        return _ext is not None
    if backend == "c":
        if _ext is None:
            raise TransportUnavailableError("the C copy kernel lmkv_async._copy is not built")
        return True
    if backend == "torch":
        return False
    raise InvalidInputError(f"backend must be 'auto', 'c' or 'torch', got {backend!r}")


def _raw(addr: int, ntok: int, g: _Dense | tuple[int, int, int, int], dtype: torch.dtype) -> Tensor:
    """A [P, L, ntok, D] tensor over raw chunk memory (already bounds-checked)."""
    P, L, D, it = (g.P, g.L, g.D, g.itemsize) if isinstance(g, _Dense) else g
    nbytes = P * L * ntok * D * it
    buf = (ctypes.c_char * nbytes).from_address(addr)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(P, L, ntok, D)


def _t_pack(dense: Tensor, cache: Tensor, bt: Tensor, scratch: Tensor | None) -> None:
    """dense [P, n, D] <- cache [NB, P, NH, BS, HS] through bt: row gather, then permute."""
    _, P, NH, BS, HS = cache.shape
    n = dense.shape[1]
    full, rem = divmod(n, BS)
    if full:
        if scratch is not None:
            g = torch.index_select(cache, 0, bt[:full], out=scratch[:full])
        else:
            g = cache.index_select(0, bt[:full])
        dense[:, : full * BS].view(P, full, BS, NH, HS).copy_(g.permute(1, 0, 3, 2, 4))
    if rem:
        src = cache[int(bt[full])][:, :, :rem].permute(0, 2, 1, 3)
        dense[:, full * BS :].view(P, rem, NH, HS).copy_(src)


def _t_unpack(dense: Tensor, cache: Tensor, bt: Tensor, scratch: Tensor) -> None:
    """cache [NB, P, NH, BS, HS] <- dense [P, n, D] through bt: permute, then row scatter.

    index_copy_ from a permuted view goes element by element (~100x slower), so
    the blocks are first laid out contiguously in ``scratch``.
    """
    _, P, NH, BS, HS = cache.shape
    n = dense.shape[1]
    full, rem = divmod(n, BS)
    if full:
        src = dense[:, : full * BS].view(P, full, BS, NH, HS).permute(1, 0, 3, 2, 4)
        cache.index_copy_(0, bt[:full], scratch[:full].copy_(src))
    if rem:
        dst = cache[int(bt[full])][:, :, :rem].permute(0, 2, 1, 3)
        dst.copy_(dense[:, full * BS :].view(P, rem, NH, HS))


def _scratch(pg: _Paged, tokens: int) -> Tensor:
    # One layer's blocks in cache order, reused across layers (one allocation).
    full = tokens // pg.BS
    return torch.empty((full, pg.P, pg.NH, pg.BS, pg.HS), dtype=pg.dtype)


# --------------------------------------------------------------------------- public API


def chunks_to_dense(
    dst: Tensor,
    chunks: Sequence[tuple[int, int]],
    *,
    chunk_tokens: int,
    region: RegionArg,
    backend: str = "auto",
) -> None:
    """Gather chunk objects into ``dst`` ``[P, L, T, D]``: ``dst[:, :, k*C:k*C+n] = chunk_k``.

    ``chunks`` are ``(k, address)`` placements; only the listed chunks' tokens
    are written.  Every chunk range is checked against ``region`` first.
    """
    g = _dense(dst, "dst", write=True)
    C = _chunk_tokens(chunk_tokens)
    if _use_c(backend):
        _ext.chunks_dense(1, *g.c_args(), C, chunks, *_region_args(region))
        return
    placed = _check_placements(chunks, region, P=g.P, L=g.L, T=g.T, C=C, row=g.D * g.itemsize)
    for p in placed:
        dst[:, :, p.k * C : p.k * C + p.ntok].copy_(_raw(p.addr, p.ntok, g, dst.dtype))


def dense_to_chunks(
    src: Tensor,
    chunks: Sequence[tuple[int, int]],
    *,
    chunk_tokens: int,
    region: RegionArg,
    backend: str = "auto",
) -> None:
    """Scatter ``src`` ``[P, L, T, D]`` into chunk objects: ``chunk_k = src[:, :, k*C:k*C+n]``."""
    g = _dense(src, "src", write=False)
    C = _chunk_tokens(chunk_tokens)
    if _use_c(backend):
        _ext.chunks_dense(0, *g.c_args(), C, chunks, *_region_args(region))
        return
    placed = _check_placements(chunks, region, P=g.P, L=g.L, T=g.T, C=C, row=g.D * g.itemsize)
    for p in placed:
        _raw(p.addr, p.ntok, g, src.dtype).copy_(src[:, :, p.k * C : p.k * C + p.ntok])


def _check_dense_paged(g: _Dense, pg: _Paged, dense: Tensor, name: str) -> None:
    if g.L != len(pg.layers):
        raise LayoutMismatchError(f"{name} has {g.L} layers, caches has {len(pg.layers)}")
    if g.P != pg.P or g.D != pg.NH * pg.HS:
        raise LayoutMismatchError(
            f"{name} is [P={g.P}, D={g.D}], caches are [P={pg.P}, NH*HS={pg.NH * pg.HS}]"
        )
    if dense.dtype != pg.dtype:
        raise LayoutMismatchError(f"{name} is {dense.dtype}, caches are {pg.dtype}")


def _paged_dense(
    to_dense: int,
    dense: Tensor,
    caches: Sequence[Tensor],
    block_ids: Sequence[int] | Tensor,
    backend: str,
    name: str,
) -> None:
    g = _dense(dense, name, write=bool(to_dense))
    pg = _paged(caches, write=not to_dense)
    _check_dense_paged(g, pg, dense, name)
    need = -(-g.T // pg.BS)
    if _use_c(backend):
        seq, bptr, blen, keep = _bt_args(block_ids)
        # dense side given by pointer and strides; no chunks, no region
        dense_side = (g.ptr, g.sP, g.sL, g.sT, 0, None, 0, 0, 0, None)
        _ext.paged(to_dense, *pg.c_args(g.L, g.T, g.itemsize), seq, bptr, blen, *dense_side)
        del keep
        return
    bt = _block_table(block_ids, need, pg.NB)
    scratch = _scratch(pg, g.T)
    for layer, cache in enumerate(pg.views()):
        if to_dense:
            _t_pack(dense[:, layer], cache, bt, scratch)
        else:
            _t_unpack(dense[:, layer], cache, bt, scratch)


def paged_to_dense(
    dst: Tensor,
    caches: Sequence[Tensor],
    block_ids: Sequence[int] | Tensor,
    *,
    backend: str = "auto",
) -> None:
    """Pack: ``dst[kv, l, p] = caches[l][block_ids[p // BS], kv, :, p % BS]`` for ``p < T``.

    ``T = dst.shape[2]``; ``block_ids`` needs at least ``ceil(T / BS)`` entries,
    each in ``[0, NB)``.
    """
    _paged_dense(1, dst, caches, block_ids, backend, "dst")


def dense_to_paged(
    src: Tensor,
    caches: Sequence[Tensor],
    block_ids: Sequence[int] | Tensor,
    *,
    backend: str = "auto",
) -> None:
    """Unpack: the inverse of :func:`paged_to_dense`; slots past ``T`` in the last block
    are left untouched."""
    _paged_dense(0, src, caches, block_ids, backend, "src")


def _paged_chunks(
    to_chunks: int,
    caches: Sequence[Tensor],
    block_ids: Sequence[int] | Tensor,
    chunks: Sequence[tuple[int, int]],
    num_tokens: int,
    chunk_tokens: int,
    dtype: torch.dtype,
    region: RegionArg,
    backend: str,
) -> None:
    pg = _paged(caches, write=not to_chunks)
    C = _chunk_tokens(chunk_tokens)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise InvalidInputError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    if dtype != pg.dtype:
        raise LayoutMismatchError(f"dtype {dtype} does not match the caches' {pg.dtype}")
    if C % pg.BS:
        raise LayoutMismatchError(f"chunk_tokens={C} must be a multiple of the block size {pg.BS}")
    it = pg.layers[0].element_size()
    L, T, row = len(pg.layers), num_tokens, pg.NH * pg.HS * it
    if _use_c(backend):
        mode, base, size, rl = _region_args(region)
        seq, bptr, blen, keep = _bt_args(block_ids)
        chunk_side = (0, 0, 0, 0, C, chunks, mode, base, size, rl)
        _ext.paged(to_chunks, *pg.c_args(L, T, it), seq, bptr, blen, *chunk_side)
        del keep
        return
    placed = _check_placements(chunks, region, P=pg.P, L=L, T=T, C=C, row=row)
    bt = _block_table(block_ids, -(-T // pg.BS), pg.NB)
    geom = (pg.P, L, pg.NH * pg.HS, it)
    scratch = _scratch(pg, C)
    views = pg.views()
    for p in placed:
        view = _raw(p.addr, p.ntok, geom, dtype)
        b0 = p.k * C // pg.BS
        sub = bt[b0 : b0 + -(-p.ntok // pg.BS)]
        for layer, cache in enumerate(views):
            if to_chunks:
                _t_pack(view[:, layer], cache, sub, scratch)
            else:
                _t_unpack(view[:, layer], cache, sub, scratch)


def paged_to_chunks(
    caches: Sequence[Tensor],
    block_ids: Sequence[int] | Tensor,
    chunks: Sequence[tuple[int, int]],
    *,
    num_tokens: int,
    chunk_tokens: int,
    dtype: torch.dtype,
    region: RegionArg,
    backend: str = "auto",
) -> None:
    """Direct store path: write the listed chunk objects straight from the paged cache.

    ``chunk_k[kv, l, t] = caches[l][block_ids[(k*C + t) // BS], kv, :, (k*C + t) % BS]``;
    ``chunk_tokens`` must be a multiple of the block size, ``dtype`` must match
    the caches, ``block_ids`` needs ``ceil(num_tokens / BS)`` entries.
    """
    _paged_chunks(1, caches, block_ids, chunks, num_tokens, chunk_tokens, dtype, region, backend)


def chunks_to_paged(
    chunks: Sequence[tuple[int, int]],
    caches: Sequence[Tensor],
    block_ids: Sequence[int] | Tensor,
    *,
    num_tokens: int,
    chunk_tokens: int,
    dtype: torch.dtype,
    region: RegionArg,
    backend: str = "auto",
) -> None:
    """Direct retrieve path: the inverse of :func:`paged_to_chunks`."""
    _paged_chunks(0, caches, block_ids, chunks, num_tokens, chunk_tokens, dtype, region, backend)


def tensor_placements(
    tensors: Sequence[Tensor], first_index: int = 0
) -> tuple[list[tuple[int, int]], list[Region]]:
    """Placements and per-chunk regions for chunk objects held in tensors (pickle path).

    Chunk ``first_index + i`` is ``tensors[i]``; each must be contiguous.  Pass
    the returned regions as ``region=`` so each chunk is checked against its own
    tensor's extent.
    """
    placements: list[tuple[int, int]] = []
    regions: list[Region] = []
    for i, t in enumerate(tensors):
        if not t.is_contiguous() or t.device.type != "cpu":
            raise LayoutMismatchError(f"chunk tensor #{i} must be a contiguous CPU tensor")
        placements.append((first_index + i, t.data_ptr()))
        regions.append(Region(t.data_ptr(), t.numel() * t.element_size()))
    return placements, regions


def stream_copy(dst: Tensor, src: Tensor) -> None:
    """Copy contiguous ``src`` into contiguous ``dst`` (same byte size) with streaming
    stores on all kernel threads: the bandwidth ceiling the other copies are measured
    against.  Falls back to ``copy_`` without the extension."""
    for name, t in (("dst", dst), ("src", src)):
        if not isinstance(t, Tensor) or t.device.type != "cpu" or not t.is_contiguous():
            raise LayoutMismatchError(f"{name} must be a contiguous CPU tensor")
    n = dst.numel() * dst.element_size()
    if n != src.numel() * src.element_size():
        raise LayoutMismatchError("dst and src differ in size")
    if _ext is not None:
        _ext.stream_copy(dst.data_ptr(), src.data_ptr(), n)
    elif n:
        dst.view(-1).view(torch.uint8).copy_(src.view(-1).view(torch.uint8))
