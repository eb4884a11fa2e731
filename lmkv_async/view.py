"""Zero-copy reads: :class:`RetrieveView`, tensors over the server's SHM slots.

``async with ctx.retrieve_view(tokens) as view:`` holds the server's read lock
on the hit chunks for as long as the block runs; ``view.tensors`` are views of
the chunk objects in the server's pool, and ``await view.copy_to(out)`` copies
them out with the copy kernel. When the block ends (normally, by an exception
or by cancellation) the retrieve's release steps run (``commit_retrieve``, then
the lookup's own steps, :mod:`._release`), after which the server may evict
the objects and reuse their memory. So the tensors are handed out as
:class:`ViewTensor` objects that check their view on every torch operation:
after the block they raise :class:`~lmkv_async.errors.ViewClosedError` instead
of reading memory that may hold another object by then.

The guard covers every torch operation on the tensors and on the views derived
from them (slices, ``view``/``reshape`` without a copy: anything that still
points into the pool). Results that own their memory (``clone()``,
``x + 1``, ``copy_`` into a plain tensor) are plain tensors and stay usable.
Escapes torch cannot intercept -- ``data_ptr()`` passed to foreign code,
``untyped_storage()``, ``numpy()`` -- are the caller's responsibility.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import kernel
from .errors import InvalidInputError, ViewClosedError
from .memory import Region, offload

__all__ = ["RetrieveView", "ViewTensor"]

log = logging.getLogger("lmkv_async")


class _Guard:
    """Open/closed state shared by a view and every tensor derived from it."""

    __slots__ = ("expires_at", "reason", "region")

    def __init__(self, region: Region, expires_at: float) -> None:
        self.region = region
        self.expires_at = expires_at  # time.monotonic() past which the lock may be gone
        self.reason: str | None = None  # why it is closed; None while open

    def check(self) -> None:
        if self.reason is not None:
            raise ViewClosedError(self.reason)
        if time.monotonic() >= self.expires_at:
            # Conservative: measured from when our lookup was sent, before the
            # server took the lock, so the server's TTL has not expired earlier.
            raise ViewClosedError(
                "the server's read lock TTL has run out while the retrieve_view block was "
                "still running: the server may have evicted the objects and reused their "
                "memory (keep blocks shorter than RetrieveView.safe_hold_s)")

    def covers(self, t: torch.Tensor) -> bool:
        # Anything whose storage lies in the SHM pool is guarded, so a view of a view
        # cannot escape by being returned as a plain tensor.
        if t.device.type != "cpu" or t.is_meta:
            return False
        ptr = t.untyped_storage().data_ptr()
        return self.region.address <= ptr < self.region.address + self.region.size


def _guards(obj: Any, found: list[_Guard]) -> None:
    if isinstance(obj, ViewTensor):
        g = obj.__dict__.get("_lmkv_guard")
        if g is not None:
            found.append(g)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _guards(x, found)
    elif isinstance(obj, dict):
        for x in obj.values():
            _guards(x, found)


def _mutates(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether ``func`` would write into a guarded tensor (best effort, by torch's naming:
    in-place methods end in ``_``, and ``out=`` names a destination)."""
    name = getattr(func, "__name__", "")
    if name == "__setitem__" or (name.endswith("_") and not name.endswith("__")):
        # The tensor written in place is the first argument (self).
        return bool(args) and isinstance(args[0], ViewTensor)
    out = kwargs.get("out")
    found: list[_Guard] = []
    _guards(out, found)
    return bool(found)


def _rewrap(obj: Any, guard: _Guard) -> Any:
    if isinstance(obj, torch.Tensor) and not isinstance(obj, ViewTensor):
        if guard.covers(obj):
            return _guarded(obj, guard)
        return obj
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_rewrap(x, guard) for x in obj)
    if isinstance(obj, list):
        return [_rewrap(x, guard) for x in obj]
    return obj


def _guarded(t: torch.Tensor, guard: _Guard) -> ViewTensor:
    v = t.as_subclass(ViewTensor)
    v.__dict__["_lmkv_guard"] = guard
    return v


class ViewTensor(torch.Tensor):
    """A read-only tensor over a server SHM slot, valid only inside its view's block.

    Every torch operation first checks the view: after the ``retrieve_view``
    block it raises :class:`~lmkv_async.errors.ViewClosedError`; in-place
    operations, ``__setitem__`` and ``out=`` into it raise
    :class:`~lmkv_async.errors.InvalidInputError` (writing would change the
    server's cached object for every reader).
    """

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Check the view, refuse writes, then run ``func`` as on a plain tensor."""
        kwargs = kwargs or {}
        found: list[_Guard] = []
        _guards(args, found)
        _guards(kwargs, found)
        for g in found:
            g.check()
        if found and _mutates(func, args, kwargs):
            raise InvalidInputError(
                f"retrieve_view tensors are read-only ({getattr(func, '__name__', func)} "
                "would write into the server's cached object); clone() it or use copy_to()")
        with torch._C.DisableTorchFunctionSubclass():
            ret = func(*args, **kwargs)
        return _rewrap(ret, found[0]) if found else ret


class RetrieveView:
    """What ``async with ctx.retrieve_view(tokens) as view`` yields.

    Attributes:
        num_tokens: hit length in tokens (a multiple of ``chunk_size``; 0 on a miss).
        num_chunks: hit length in chunks (``len(view.tensors)``).
        chunk_size: tokens per chunk object.
        safe_hold_s: the longest the block should run, in seconds from the view's
            lookup: 0.9 of the server's read-lock TTL (``--l1-read-ttl-seconds``).
            Past it a warning is logged; past the TTL itself the tensors raise.
    """

    def __init__(
        self,
        chunks: list[tuple[int, int]],
        *,
        chunk_size: int,
        chunk_shape: tuple[int, ...],
        dtype: torch.dtype,
        region: Region,
        started: float,
        read_ttl: float,
    ) -> None:
        self._chunks = chunks
        self.chunk_size = chunk_size
        self.num_chunks = len(chunks)
        self.num_tokens = len(chunks) * chunk_size
        self._shape = chunk_shape
        self._dtype = dtype
        self._region = region
        self._started = started
        self.read_ttl = read_ttl
        self.safe_hold_s = 0.9 * read_ttl
        self._guard = _Guard(region, started + read_ttl)
        self._tensors: tuple[ViewTensor, ...] | None = None
        self._nbytes = 1
        for dim in chunk_shape:
            self._nbytes *= dim
        self._nbytes *= dtype.itemsize

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<RetrieveView {self.num_tokens} tokens in {self.num_chunks} chunks, {state}>"

    @property
    def closed(self) -> bool:
        """True once the block has ended (the tensors raise from then on)."""
        return self._guard.reason is not None

    @property
    def held_s(self) -> float:
        """Seconds since the view's lookup took the server's read locks."""
        return time.monotonic() - self._started

    @property
    def tensors(self) -> tuple[ViewTensor, ...]:
        """One read-only ``chunk_shape`` tensor per hit chunk, in token order
        (``[2, L, C, D]``, or ``[L, C, D]`` for MLA): views of the server's slots."""
        self._guard.check()
        if self._tensors is None:
            self._tensors = tuple(self._tensor(addr) for _, addr in self._chunks)
        return self._tensors

    def _tensor(self, addr: int) -> ViewTensor:
        # The slot range was checked against the pool when the reply was parsed.
        buf = (ctypes.c_char * self._nbytes).from_address(addr)
        t = torch.frombuffer(buf, dtype=torch.uint8).view(self._dtype).view(self._shape)
        return _guarded(t, self._guard)

    async def copy_to(self, out: torch.Tensor) -> torch.Tensor:
        """Copy the hit into ``out`` ``[P, L, >=num_tokens, D]`` with the copy kernel;
        returns ``out[:, :, :num_tokens]``. Large copies run in a worker thread, and
        the await returns only once the copy is done (the lock stays held meanwhile)."""
        self._guard.check()
        if not isinstance(out, torch.Tensor) or out.dim() != 4:
            raise InvalidInputError("out must be a [P, L, T, D] tensor")
        if out.dtype != self._dtype:
            raise InvalidInputError(f"out is {out.dtype}, the view holds {self._dtype}")
        if out.shape[2] < self.num_tokens:
            raise InvalidInputError(
                f"out holds {out.shape[2]} tokens, the view has {self.num_tokens}")
        dst = out[:, :, : self.num_tokens]
        if self.num_chunks:
            await offload(kernel.chunks_to_dense, dst, self._chunks,
                          chunk_tokens=self.chunk_size, region=self._region,
                          nbytes=self._nbytes * self.num_chunks)
        self._guard.check()  # the lock may have run out during a very long copy
        return dst

    def _close(self, reason: str) -> None:
        if self._guard.reason is None:  # the first reason is the one users need to see
            self._guard.reason = reason
        self._tensors = None
