"""GPU transfers: chunk objects in the server's SHM pool <-> CUDA tensors and paged GPU caches.

One :class:`GpuTransfers` per session, made on the first CUDA transfer (so CPU-only
programs never touch CUDA), does the moving: registration of the pool with CUDA, the
pinned staging fallback, ordering on a dedicated stream, waiting without blocking the
loop, and cancellation that waits for queued copies (:mod:`._cuda_transfers` says how).
This module is the face the operations use: :func:`is_cuda`, the checks of device
tensors, and the builders of one :class:`DeviceCopy` per operation for dense tensors
and paged caches.

Validation is the CPU path's: shapes and dtypes in :mod:`.validate`, slot ranges
against the pool through :func:`._kernel_args._check_placements`, destination
overlap and storage extent through the same helpers the C kernel's callers use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ._cuda_transfers import DeviceCopy, GpuTransfers, HostRegistration
from ._kernel_args import _check_extent, _check_no_overlap
from .errors import CopyBoundsError, LayoutMismatchError, TransportUnavailableError

__all__ = [
    "DeviceCopy",
    "GpuTransfers",
    "HostRegistration",
    "check_device_tensors",
    "is_cuda",
    "transfers",
]


def is_cuda(t: object) -> bool:
    """Whether ``t`` is a tensor on a CUDA device."""
    return isinstance(t, Tensor) and t.device.type == "cuda"


# ---------------------------------------------------------------------- validation
def check_device_tensors(tensors: Sequence[Tensor], what: str) -> torch.device:
    """All of ``tensors`` on one CUDA device; CUDA usable. Returns the device."""
    if not torch.cuda.is_available():
        raise TransportUnavailableError(f"{what} is on CUDA but CUDA is not available")
    dev = tensors[0].device
    for i, t in enumerate(tensors):
        if t.device != dev:
            raise LayoutMismatchError(f"{what}[{i}] is on {t.device}, {what}[0] on {dev}")
    return dev


def _check_dst(t: Tensor, name: str) -> None:
    _check_no_overlap(name, t.shape, t.stride())
    _check_extent(name, t, t.shape, t.stride())


# ---------------------------------------------------------------------- builders
def transfers(session: Any) -> GpuTransfers:
    """The session's :class:`GpuTransfers` (made on first use)."""
    gpu: GpuTransfers | None = session.gpu
    if gpu is None:
        gpu = session.gpu = GpuTransfers(session)
    return gpu


def dense_sink(session: Any, out: Tensor, chunk_tokens: int,
               result: list[Tensor]) -> DeviceCopy:
    """Retrieve into a CUDA ``out`` ``[P, L, >=n, D]``: ``out[:, :, k*C:(k+1)*C] = chunk_k``."""
    dev = check_device_tensors([out], "out")
    _check_dst(out, "out")
    P, L, _, D = out.shape
    it = out.element_size()
    C = chunk_tokens

    def per_chunk(k: int, nb: int, host: Tensor) -> None:
        ntok = nb // (P * L * D * it)
        src = host.view(out.dtype).view(P, L, ntok, D)
        # non_blocking: a DMA from registered/pinned memory; torch lands it in a
        # contiguous temporary on this stream and scatters it on the device.
        out[:, :, k * C: k * C + ntok].copy_(src, non_blocking=True)

    return DeviceCopy(transfers(session), dev, h2d=True, tensors=[out], geometry=(P, L, D, it),
                      tokens=None, chunk_tokens=C, per_chunk=per_chunk,
                      done=lambda hit: result.append(out[:, :, : hit * C]))


def dense_source(session: Any, src: Tensor, chunk_tokens: int) -> DeviceCopy:
    """Store from a CUDA ``src`` ``[P, L, n, D]``: ``chunk_k = src[:, :, k*C:(k+1)*C]``."""
    dev = check_device_tensors([src], "kv")
    P, L, T, D = src.shape
    it = src.element_size()
    C = chunk_tokens

    def per_chunk(k: int, nb: int, host: Tensor) -> None:
        ntok = nb // (P * L * D * it)
        dst = host.view(src.dtype).view(P, L, ntok, D)
        dst.copy_(src[:, :, k * C: k * C + ntok], non_blocking=True)

    return DeviceCopy(transfers(session), dev, h2d=False, tensors=[src], geometry=(P, L, D, it),
                      tokens=T, chunk_tokens=C, per_chunk=per_chunk)


def _paged_geometry(caches: Sequence[Tensor]) -> tuple[int, int, int, int, int]:
    """(P, NH, BS, HS, itemsize) of HND ``[NB, P, NH, BS, HS]`` or MLA ``[NB, BS, D]``."""
    c = caches[0]
    if c.dim() == 5:
        _, P, NH, BS, HS = c.shape
    else:
        (_, BS, HS), P, NH = c.shape, 1, 1
    return P, NH, BS, HS, c.element_size()


def paged_sink(session: Any, caches: Sequence[Tensor], block_ids: list[int], chunk_tokens: int,
               ) -> DeviceCopy:
    """Retrieve into paged GPU caches: each chunk object lands in a device temporary
    (one DMA), then one ``index_copy_`` per layer puts its blocks in place."""
    layers = tuple(caches)
    dev = check_device_tensors(layers, "kv_caches")
    for i, c in enumerate(layers):
        _check_dst(c, f"kv_caches[{i}]")
    P, NH, BS, HS, it = _paged_geometry(layers)
    L, D, C = len(layers), NH * HS, chunk_tokens
    if C % BS:
        raise LayoutMismatchError(f"chunk_tokens={C} must be a multiple of the block size {BS}")
    views = [c.view(c.shape[0], 1, 1, BS, HS) if c.dim() == 3 else c for c in layers]
    table: list[Tensor] = []

    def per_chunk(k: int, nb: int, host: Tensor) -> None:
        if not table:
            table.append(torch.tensor(block_ids, dtype=torch.int64).to(dev, non_blocking=True))
        ntok = nb // (P * L * D * it)
        land = torch.empty((P, L, ntok, D), dtype=layers[0].dtype, device=dev)
        land.view(torch.uint8).view(-1).copy_(host, non_blocking=True)
        b0, nblk = k * C // BS, ntok // BS
        idx = table[0][b0: b0 + nblk]
        for layer, cache in enumerate(views):
            blocks = land[:, layer].view(P, nblk, BS, NH, HS).permute(1, 0, 3, 2, 4)
            cache.index_copy_(0, idx, blocks)

    return DeviceCopy(transfers(session), dev, h2d=True, tensors=layers,
                      geometry=(P, L, D, it), tokens=None, chunk_tokens=C, per_chunk=per_chunk)


def paged_source(session: Any, caches: Sequence[Tensor], block_ids: list[int], num_tokens: int,
                 chunk_tokens: int) -> DeviceCopy:
    """Store from paged GPU caches: gather a chunk's blocks into a device temporary,
    then one DMA into its slot."""
    layers = tuple(caches)
    dev = check_device_tensors(layers, "kv_caches")
    P, NH, BS, HS, it = _paged_geometry(layers)
    L, D, C = len(layers), NH * HS, chunk_tokens
    if C % BS:
        raise LayoutMismatchError(f"chunk_tokens={C} must be a multiple of the block size {BS}")
    views = [c.view(c.shape[0], 1, 1, BS, HS) if c.dim() == 3 else c for c in layers]
    table: list[Tensor] = []

    def per_chunk(k: int, nb: int, host: Tensor) -> None:
        if not table:
            table.append(torch.tensor(block_ids, dtype=torch.int64).to(dev, non_blocking=True))
        ntok = nb // (P * L * D * it)
        nblk = -(-ntok // BS)
        if ntok % BS:
            raise CopyBoundsError("a partial block in a store chunk")  # C % BS == 0
        land = torch.empty((P, L, ntok, D), dtype=layers[0].dtype, device=dev)
        idx = table[0][k * C // BS: k * C // BS + nblk]
        for layer, cache in enumerate(views):
            g = cache.index_select(0, idx)  # [nblk, P, NH, BS, HS]
            land[:, layer].view(P, nblk, BS, NH, HS).copy_(g.permute(1, 0, 3, 2, 4))
        host.copy_(land.view(torch.uint8).view(-1), non_blocking=True)

    return DeviceCopy(transfers(session), dev, h2d=False, tensors=layers,
                      geometry=(P, L, D, it), tokens=num_tokens, chunk_tokens=C,
                      per_chunk=per_chunk)


def paged_to_cpu_dense(caches: Sequence[Tensor], block_ids: list[int], num_tokens: int,
                       ) -> Tensor:
    """``[P, L, n, D]`` CPU copy of the first ``n`` tokens of paged GPU caches (for the
    inline-data store path, which must pickle CPU tensors anyway). Blocking: run it in
    a worker thread."""
    layers = tuple(caches)
    P, NH, BS, HS, _ = _paged_geometry(layers)
    dev = layers[0].device
    nblk = -(-num_tokens // BS)
    idx = torch.tensor(block_ids[:nblk], dtype=torch.int64, device=dev)
    views = [c.view(c.shape[0], 1, 1, BS, HS) if c.dim() == 3 else c for c in layers]
    per_layer = [
        c.index_select(0, idx).permute(1, 0, 3, 2, 4).reshape(P, nblk * BS, NH * HS)
        [:, :num_tokens] for c in views
    ]
    return torch.stack(per_layer, dim=1).cpu()
