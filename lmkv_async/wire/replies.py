"""Typed views of the replies on the SDK path, validated (sans-IO): the one reply module.

Everything here comes from the network, so shapes, dtypes, offsets and lengths
are checked against what the client registered and mapped before any memory is
touched (protocol reference §3.3, §4.7-4.10, §6.3).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard, TypeVar, cast

import torch

from ..errors import ProtocolError
from .frames import NO_RESULT

__all__ = [
    "PrepareRetrieve",
    "PrepareStore",
    "RegisterReply",
    "Slot",
    "SlotSpec",
    "as_bool",
    "as_optional_count",
    "check_chunk_tensors",
    "has_slots",
    "parse_prepare_retrieve",
    "parse_prepare_store",
    "parse_register",
]


@dataclass(frozen=True)
class SlotSpec:
    """What every slot of this registration must look like."""

    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch."
    itemsize: int
    pool_size: int

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for dim in self.shape:
            n *= dim
        return n


@dataclass(frozen=True)
class Slot:
    """A validated slot: ``[offset, offset + length)`` lies inside the pool."""

    offset: int
    length: int


@dataclass(frozen=True)
class RegisterReply:
    """``{shm_name, pool_size}``; ``shm_name == ""`` means no SHM (inline data).

    0.5.7 adds ``null_block_id`` (multi-group caches); it is tolerated and unused.
    """

    shm_name: str
    pool_size: int

    @property
    def has_shm(self) -> bool:
        return bool(self.shm_name) and self.pool_size > 0


@dataclass(frozen=True)
class PrepareStore:
    """SHM: slots for the chunks not yet cached; pickle server: ``shm=False``."""

    shm: bool
    slots: tuple[Slot, ...]
    chunk_indices: tuple[int, ...]


@dataclass(frozen=True)
class PrepareRetrieve:
    """``success`` False means an object went missing; ``data`` is pickle bytes."""

    success: bool
    data: bytes
    slots: tuple[Slot, ...]
    shm: bool


F = TypeVar("F", bound=Callable[..., Any])


def _names_op(op: str) -> Callable[[F], F]:
    """Errors raised while parsing this op's reply name the op."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def parse(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except ProtocolError as exc:
                if exc.op is None:
                    exc.op = op
                raise

        return cast(F, parse)

    return wrap


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _map(value: object, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ProtocolError(f"{what}: expected a map, got {type(value).__name__}")
    return value


@_names_op("register_kv_cache_engine_driven_context")
def parse_register(result: object) -> RegisterReply:
    """Parse the registration reply."""
    m = _map(result, "register reply")
    name, size = m.get("shm_name"), m.get("pool_size")
    if not isinstance(name, str) or not _is_int(size) or size < 0:
        raise ProtocolError(f"register reply has bad shm_name/pool_size: {dict(m)!r}")
    if "/" in name or "\x00" in name:
        raise ProtocolError(f"register reply has an unusable shm_name {name!r}")
    return RegisterReply(name, size)


def validate_slot(raw: object, spec: SlotSpec) -> Slot:
    """Check one slot descriptor against the registered layout and the mapping."""
    m = _map(raw, "slot descriptor")
    offset, length, shape, dtype = (m.get(k) for k in ("offset", "length", "shape", "dtype"))
    if not _is_int(offset) or not _is_int(length):
        raise ProtocolError(f"slot offset/length must be ints: {dict(m)!r}")
    if not isinstance(shape, Sequence) or isinstance(shape, (str, bytes)):
        raise ProtocolError(f"slot shape must be a list: {dict(m)!r}")
    if tuple(shape) != spec.shape:
        raise ProtocolError(f"slot shape {list(shape)} != registered {list(spec.shape)}")
    if dtype != spec.dtype:
        raise ProtocolError(f"slot dtype {dtype!r} != registered {spec.dtype!r}")
    if length != spec.nbytes:
        raise ProtocolError(f"slot length {length} != {spec.nbytes} bytes of the layout")
    if offset < 0 or offset + length > spec.pool_size:
        raise ProtocolError(
            f"slot [{offset}, {offset + length}) lies outside the pool of {spec.pool_size} bytes"
        )
    return Slot(offset, length)


def _slots(raw: object, spec: SlotSpec | None) -> tuple[Slot, ...]:
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
        raise ProtocolError("slots must be a list")
    if raw and spec is None:
        raise ProtocolError("server sent SHM slots but no SHM pool is mapped")
    assert spec is not None or not raw
    return tuple(validate_slot(s, spec) for s in raw) if spec is not None else ()


def _check_disjoint(slots: Sequence[Slot]) -> None:
    ordered = sorted(slots, key=lambda s: s.offset)
    for a, b in itertools.pairwise(ordered):
        if a.offset + a.length > b.offset:
            raise ProtocolError(f"slots overlap at offsets {a.offset} and {b.offset}")


@_names_op("prepare_store")
def parse_prepare_store(result: object, spec: SlotSpec | None, n_chunks: int) -> PrepareStore:
    """Parse ``{context: {slots, chunk_indices}}`` (SHM) or ``{context: {}}`` (pickle)."""
    ctx = _map(_map(result, "prepare_store reply").get("context"), "prepare_store context")
    if "slots" not in ctx:
        return PrepareStore(shm=False, slots=(), chunk_indices=())
    slots = _slots(ctx.get("slots"), spec)
    idx = ctx.get("chunk_indices")
    if not isinstance(idx, Sequence) or isinstance(idx, (str, bytes)):
        raise ProtocolError("chunk_indices must be a list")
    if len(idx) != len(slots):
        raise ProtocolError(f"{len(slots)} slots but {len(idx)} chunk indices")
    if any(not _is_int(i) or not 0 <= i < n_chunks for i in idx):
        raise ProtocolError(f"chunk_indices {list(idx)} out of range [0, {n_chunks})")
    if len(set(idx)) != len(idx):
        raise ProtocolError(f"duplicate chunk_indices {list(idx)}")
    _check_disjoint(slots)
    return PrepareStore(shm=True, slots=slots, chunk_indices=tuple(idx))


@_names_op("prepare_retrieve")
def parse_prepare_retrieve(
    result: object, spec: SlotSpec | None, n_chunks: int
) -> PrepareRetrieve:
    """Parse ``{success, data, context}``; SHM must give one slot per chunk, in order."""
    m = _map(result, "prepare_retrieve reply")
    success, data = m.get("success"), m.get("data", b"")
    ctx = _map(m.get("context", {}), "prepare_retrieve context")
    if not isinstance(success, bool):
        raise ProtocolError("prepare_retrieve success must be a bool")
    if not isinstance(data, (bytes, bytearray)):
        raise ProtocolError("prepare_retrieve data must be bytes")
    shm = "slots" in ctx
    slots = _slots(ctx.get("slots", ()), spec)
    if success and shm and len(slots) != n_chunks:
        raise ProtocolError(f"prepare_retrieve returned {len(slots)} slots for {n_chunks} chunks")
    if success and not shm and not data:
        raise ProtocolError("prepare_retrieve succeeded with neither slots nor data")
    return PrepareRetrieve(success=success, data=bytes(data), slots=slots, shm=shm)


def as_bool(result: object, what: str) -> bool:
    """A bool result (commit_*, ping)."""
    if not isinstance(result, bool):
        raise ProtocolError(f"{what}: expected a bool, got {result!r}")
    return result


def as_optional_count(result: object, what: str) -> int | None:
    """``int | None`` results (prefetch status, in chunks); None while running."""
    if result is NO_RESULT or result is None:
        return None
    if not _is_int(result) or result < 0:
        raise ProtocolError(f"{what}: expected a chunk count, got {result!r}")
    return result


def has_slots(raw: object) -> bool:
    """Whether a raw ``prepare_*`` reply carries SHM slots (checked before parsing,
    to tell "SHM server, but our mapping failed" from a malformed reply)."""
    context = raw.get("context") if isinstance(raw, Mapping) else None
    return isinstance(context, Mapping) and "slots" in context


def check_chunk_tensors(
    tensors: Sequence[torch.Tensor], count: int, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    """Inline retrieve data must be ``count`` contiguous chunks of the registered layout."""
    if len(tensors) != count:
        raise ProtocolError(f"inline reply holds {len(tensors)} chunks, expected {count}",
                            op="prepare_retrieve")
    for t in tensors:
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            raise ProtocolError(
                f"inline chunk {tuple(t.shape)} {t.dtype} does not match the layout "
                f"{shape} {dtype}", op="prepare_retrieve")
