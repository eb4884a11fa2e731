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
import operator
from array import array
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor

from .errors import (
    CopyBoundsError,
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


# --------------------------------------------------------------------------- checks


class _Dense(NamedTuple):
    ptr: int
    P: int
    L: int
    T: int
    D: int
    itemsize: int
    sP: int  # byte strides
    sL: int
    sT: int

    def c_args(self) -> tuple[int, ...]:
        """(ptr, P, L, T, row bytes, sP, sL, sT) as the kernel's chunks_dense takes them."""
        return (self.ptr, self.P, self.L, self.T, self.D * self.itemsize, self.sP, self.sL, self.sT)


def _check_no_overlap(name: str, shape: Sequence[int], strides: Sequence[int]) -> None:
    # A destination whose elements alias each other (expand(), as_strided) would
    # make the result depend on thread timing; torch's copy_ refuses it too.
    dims = sorted((st, sz) for sz, st in zip(shape, strides, strict=True) if sz > 1)
    reach = 1
    for st, sz in dims:
        if st < reach:
            raise LayoutMismatchError(f"{name} has overlapping elements (strides {strides})")
        reach = st * sz


def _check_extent(name: str, t: Tensor, shape: Sequence[int], strides: Sequence[int]) -> None:
    # torch keeps views inside their storage, but a storage can be resized
    # under a live view (untyped_storage().resize_()); then the view dangles.
    last = t.storage_offset()
    for n, st in zip(shape, strides, strict=True):
        if n == 0:
            return
        last += (n - 1) * st
    if (last + 1) * t.element_size() > t.untyped_storage().nbytes():
        raise CopyBoundsError(f"{name} reaches past the end of its storage")


def _dense(t: Tensor, name: str, *, write: bool) -> _Dense:
    if not isinstance(t, Tensor):
        raise LayoutMismatchError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise LayoutMismatchError(f"{name} must be a CPU tensor, got device {t.device}")
    shape = t.shape
    if len(shape) != 4:
        raise LayoutMismatchError(f"{name} must be [P, L, T, D], got shape {tuple(shape)}")
    it = t.element_size()
    if it not in _ITEMSIZES or t.is_complex():
        raise LayoutMismatchError(f"{name} has unsupported dtype {t.dtype}")
    P, L, T, D = shape
    s = t.stride()
    if D > 1 and s[3] != 1:
        raise LayoutMismatchError(f"{name}'s last dim must be contiguous, strides {s}")
    if write:
        _check_no_overlap(name, shape, s)
    _check_extent(name, t, shape, s)
    return _Dense(t.data_ptr(), P, L, T, D, it, s[0] * it, s[1] * it, s[2] * it)


class _Paged(NamedTuple):
    layers: Sequence[Tensor]
    P: int
    NH: int
    BS: int
    HS: int
    NB: int
    dtype: torch.dtype
    lay: array[int]  # L x (ptr, s_nb, s_kv, s_h, s_bs) in bytes, for the C kernel

    def c_args(self, L: int, T: int, itemsize: int) -> tuple[Any, ...]:
        """(P, L, T, NH, HS bytes, NB, BS, layer table) as the kernel's paged takes them."""
        return (self.P, L, T, self.NH, self.HS * itemsize, self.NB, self.BS, self.lay)

    def views(self) -> list[Tensor]:
        """Per-layer [NB, P, NH, BS, HS] views (MLA [NB, BS, D] gets P = NH = 1)."""
        return [c[:, None, None] if c.dim() == 3 else c for c in self.layers]


def _paged(caches: Sequence[Tensor], *, write: bool) -> _Paged:
    # Runs once per layer per call, so it sticks to the cheapest tensor queries.
    if isinstance(caches, Tensor) or not isinstance(caches, Sequence):
        raise LayoutMismatchError("caches must be a sequence of per-layer tensors")
    if len(caches) == 0:
        raise LayoutMismatchError("caches is empty")
    first = caches[0]
    if not isinstance(first, Tensor):
        raise LayoutMismatchError("caches must be a sequence of per-layer tensors")
    shape, dtype = first.shape, first.dtype
    if len(shape) == 5:
        NB, P, NH, BS, HS = shape
    elif len(shape) == 3:  # MLA [NB, BS, D]: the HND layout with P = NH = 1
        (NB, BS, HS), P, NH = shape, 1, 1
    else:
        raise LayoutMismatchError(
            f"a paged cache layer must be [NB, P, NH, BS, HS] or [NB, BS, D], got {tuple(shape)}"
        )
    if BS < 1 or HS < 1 or NH < 1:
        raise LayoutMismatchError(f"degenerate paged cache shape {tuple(shape)}")
    it = first.element_size()
    if it not in _ITEMSIZES or first.is_complex():
        raise LayoutMismatchError(f"caches have unsupported dtype {dtype}")
    lay = array("q")
    for i, c in enumerate(caches):
        if not isinstance(c, Tensor) or not c.is_cpu:
            raise LayoutMismatchError(f"caches[{i}] must be a CPU tensor")
        if c.shape != shape or c.dtype != dtype:
            raise LayoutMismatchError(
                f"caches[{i}] is {tuple(c.shape)} {c.dtype}, caches[0] is {tuple(shape)} {dtype}"
            )
        s = c.stride()
        if HS > 1 and s[-1] != 1:
            raise LayoutMismatchError(f"caches[{i}]'s head dim must be contiguous, strides {s}")
        if write:
            _check_no_overlap(f"caches[{i}]", shape, s)
        _check_extent(f"caches[{i}]", c, shape, s)
        if len(s) == 5:
            lay.extend((c.data_ptr(), s[0] * it, s[1] * it, s[2] * it, s[3] * it))
        else:
            lay.extend((c.data_ptr(), s[0] * it, 0, 0, s[1] * it))
    # a tuple: the layers stay referenced even if the caller mutates its list mid-copy
    return _Paged(tuple(caches), P, NH, BS, HS, NB, dtype, lay)


def _chunk_tokens(c: int) -> int:
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
        raise InvalidInputError(f"chunk_tokens must be a positive int, got {c!r}")
    return c


def _region_args(region: RegionArg) -> tuple[int, int, int, Any]:
    """(mode, base, size, per-chunk list) as the C kernel takes them."""
    if region is None:
        return 0, 0, 0, None
    if isinstance(region, tuple) and len(region) == 2 and all(isinstance(x, int) for x in region):
        base, size = cast("tuple[int, int]", region)
        if not (0 <= base < _ADDR_LIMIT and 0 <= size < _ADDR_LIMIT):
            raise InvalidInputError("region must be (address, size) within 64 bits")
        if base + size >= _ADDR_LIMIT:
            raise InvalidInputError("region wraps around the address space")
        return 1, base, size, None
    return 2, 0, 0, region


class _Placed(NamedTuple):
    k: int
    addr: int
    ntok: int


def _check_placements(
    chunks: Sequence[tuple[int, int]],
    region: RegionArg,
    *,
    P: int,
    L: int,
    T: int,
    C: int,
    row: int,
) -> list[_Placed]:
    """Pure-Python twin of the C kernel's checks (same order, same errors)."""
    mode, rbase, rsize, rlist = _region_args(region)
    if isinstance(chunks, (str, bytes)) or not isinstance(chunks, Sequence):
        chunks = list(chunks)
    if mode == 2:
        if isinstance(rlist, (str, bytes)) or not isinstance(rlist, Sequence):
            raise TypeError("region must be a Region or a sequence of them")
        if len(rlist) != len(chunks):
            raise InvalidInputError(f"got {len(rlist)} regions for {len(chunks)} chunks")
    out: list[_Placed] = []
    for i, item in enumerate(chunks):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise InvalidInputError("chunks must be (int, int) pairs")
        k, addr = operator.index(item[0]), operator.index(item[1])
        if not 0 <= addr < _ADDR_LIMIT:
            raise CopyBoundsError("chunk address is not a valid 64-bit address")
        if k < 0 or k * C >= T:
            raise CopyBoundsError(f"chunk #{i}: index {k} outside the {T}-token range")
        ntok = min(C, T - k * C)
        end = addr + P * L * ntok * row
        if end >= _ADDR_LIMIT or addr == 0:
            raise CopyBoundsError(f"chunk #{i}: address {addr:#x} is not valid")
        if mode == 2:
            r = rlist[i]
            if not isinstance(r, (tuple, list)) or len(r) != 2:
                raise InvalidInputError("regions must be (int, int) pairs")
            rbase, rsize = operator.index(r[0]), operator.index(r[1])
            if not (0 <= rbase < _ADDR_LIMIT and 0 <= rsize < _ADDR_LIMIT):
                raise InvalidInputError(f"region #{i} is not (address, size)")
            if rbase + rsize >= _ADDR_LIMIT:
                raise InvalidInputError(f"region #{i} wraps around the address space")
        if mode and not (rbase <= addr and end <= rbase + rsize):
            raise CopyBoundsError(
                f"chunk #{i}: [{addr:#x}, {end:#x}) is outside its region "
                f"[{rbase:#x}, {rbase + rsize:#x})"
            )
        out.append(_Placed(k, addr, ntok))
    return out


def _bt_args(block_ids: Sequence[int] | Tensor) -> tuple[Any, int, int, Tensor | None]:
    """(sequence or None, int64 pointer, length, keep-alive) for the C kernel."""
    if isinstance(block_ids, Tensor):
        if block_ids.dim() != 1:
            raise LayoutMismatchError(f"block_ids must be 1-D, got {tuple(block_ids.shape)}")
        if block_ids.is_floating_point() or block_ids.is_complex():
            raise LayoutMismatchError(f"block_ids must be integers, got {block_ids.dtype}")
        bt = block_ids.to(device="cpu", dtype=torch.int64).contiguous()
        return None, bt.data_ptr(), bt.numel(), bt
    if isinstance(block_ids, (str, bytes)):
        raise LayoutMismatchError("block_ids must be a sequence of ints or an int tensor")
    return block_ids, 0, 0, None


def _block_table(block_ids: Sequence[int] | Tensor, need: int, nb: int) -> Tensor:
    """Checked int64 block table of length ``need`` (torch backend)."""
    seq, _, n, bt = _bt_args(block_ids)
    if bt is not None:
        if n < need:
            raise LayoutMismatchError(f"block table has {n} entries, {need} needed")
        bt = bt[:need]
        if need and (int(bt.min()) < 0 or int(bt.max()) >= nb):
            bad = bt[(bt < 0) | (bt >= nb)][0]
            raise CopyBoundsError(f"block id {int(bad)} is outside [0, {nb})")
        return bt
    if not isinstance(seq, Sequence):
        seq = list(seq)
    if len(seq) < need:
        raise LayoutMismatchError(f"block table has {len(seq)} entries, {need} needed")
    vals = [operator.index(seq[i]) for i in range(need)]
    for i, b in enumerate(vals):
        if not 0 <= b < nb:
            raise CopyBoundsError(f"block id {b} at position {i} is outside [0, {nb})")
    return torch.tensor(vals, dtype=torch.int64)


# --------------------------------------------------------------------------- torch backend


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
