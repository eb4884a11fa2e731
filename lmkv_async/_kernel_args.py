"""The copy kernel's argument layer: validate tensors, placements, regions and block tables,
and turn them into the plain integers the C kernel and the torch fallback take.

Everything here runs before the first byte is copied, so a rejected call leaves every
destination untouched (see :mod:`lmkv_async.kernel`).
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor

from .errors import CopyBoundsError, InvalidInputError, LayoutMismatchError
from .memory import RegionArg

_ITEMSIZES = (1, 2, 4, 8)
_ADDR_LIMIT = 1 << 64


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


