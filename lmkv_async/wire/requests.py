"""One request builder per operation: typed arguments and the dialect in, frames out.

A :class:`Request` is data: the op name (for messages), what goes in the op
frame, and the exact payload frames after ``[uid, op]``. The transport adds
the uid and sends it; nothing else assembles payload lists. Frame layouts are
the ones measured in the protocol reference (appendix A) and compat.md §4 and
§14.2; where releases differ, the difference is a :class:`Dialect` field.

Keys are built by :class:`~.keys.KeyEncoder` (which packs each token prefix
once) and passed in as encoded bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .dialect import PROBE_OP_ID, Dialect
from .frames import pack
from .keys import RegisterPayload, encode_register

__all__ = [
    "Request",
    "clear",
    "commit_retrieve",
    "commit_store",
    "end_session",
    "free_lookup_locks",
    "get_chunk_size",
    "get_experimental",
    "lookup",
    "noop",
    "ping",
    "prepare_retrieve",
    "prepare_store",
    "probe",
    "query_prefetch_status",
    "register",
    "subscribe_kv_events",
    "unregister",
    "wait_prefetch_status",
]

_EMPTY_ARRAY = pack([])


@dataclass(frozen=True, slots=True)
class Request:
    """One request: ``[uid, op_frame, *payloads]`` once the transport adds a uid."""

    op: str
    op_id: int | str
    payloads: tuple[bytes, ...]


def _req(d: Dialect, op: str, *payloads: bytes) -> Request:
    return Request(op, d.op_id(op), payloads)


def probe() -> Request:
    """Op 21 with no payload: ``noop`` on 0.5.0-0.5.2, ``get_chunk_size`` on 0.5.3+.

    The one request that is harmless on every table (compat.md §11); dialect-free
    because it is what detects the dialect.
    """
    return Request("probe", PROBE_OP_ID, ())


def register(d: Dialect, payload: RegisterPayload) -> Request:
    """``register_kv_cache_engine_driven_context(payload)``."""
    return _req(d, "register_kv_cache_engine_driven_context", encode_register(payload))


def unregister(d: Dialect, instance_id: int) -> Request:
    """``unregister_kv_cache_engine_driven_context(instance_id)``."""
    return _req(d, "unregister_kv_cache_engine_driven_context", pack(instance_id))


def ping(d: Dialect, instance_id: int) -> Request:
    """``ping(instance_id)``: the registration heartbeat."""
    return _req(d, "ping", pack(instance_id))


def noop(d: Dialect) -> Request:
    """``noop()``."""
    return _req(d, "noop")


def get_experimental(d: Dialect) -> Request:
    """``get_experimental()``: the experimental features a 0.5.6 server has on."""
    return _req(d, "get_experimental")


def get_chunk_size(d: Dialect) -> Request:
    """``get_chunk_size()`` (0.5.3+; on 0.5.7 it freezes the server's chunk size)."""
    return _req(d, "get_chunk_size")


def clear(d: Dialect, *, force: bool = False) -> Request:
    """``clear`` with its ``force`` frame where the release requires one."""
    if d.clear_takes_force:
        return _req(d, "clear", pack(force))
    return _req(d, "clear")


def lookup(d: Dialect, key: bytes, world_size: int) -> Request:
    """``lookup(key, tp_size)``; the key must have ``start=0`` (compat.md §14.4)."""
    return _req(d, "lookup", key, pack(world_size))


def query_prefetch_status(d: Dialect, request_id: str) -> Request:
    """``query_prefetch_status(request_id)``: the lookup's hit count, or nil while running."""
    return _req(d, "query_prefetch_status", pack(request_id))


def wait_prefetch_status(d: Dialect, request_id: str, budget: float) -> Request:
    """``wait_prefetch_status(request_id, seconds)``: a bounded server-side wait."""
    return _req(d, "wait_prefetch_status", pack(request_id), pack(float(budget)))


def free_lookup_locks(
    d: Dialect,
    key: bytes,
    world_size: int,
    extra_ranges: Sequence[tuple[int, int]] = (),
) -> Request:
    """``free_lookup_locks(key, tp_size[, extra_ranges])``.

    0.5.7 requires the third frame (``[]`` for none); without it the server
    stays silent and the locks stay held until their TTL (compat.md §14.6).
    Older releases take exactly two frames, so ``extra_ranges`` must be empty.
    """
    if d.third_frames:
        return _req(d, "free_lookup_locks", key, pack(world_size),
                    pack([[int(a), int(b)] for a, b in extra_ranges]))
    if extra_ranges:
        raise ValueError(f"free_lookup_locks on {d.name} takes no extra_ranges")
    return _req(d, "free_lookup_locks", key, pack(world_size))


def end_session(d: Dialect, request_id: str) -> Request:
    """``end_session(request_id)``: drops the server's per-request session."""
    return _req(d, "end_session", pack(request_id))


def prepare_store(d: Dialect, key: bytes, instance_id: int) -> Request:
    """``prepare_store(key, instance_id[, skipped_chunks])``.

    0.5.7 requires ``skipped_chunks``; it is ``[]`` for a single-group
    registration, which is the only kind this client makes.
    """
    if d.third_frames:
        return _req(d, "prepare_store", key, pack(instance_id), _EMPTY_ARRAY)
    return _req(d, "prepare_store", key, pack(instance_id))


def commit_store(d: Dialect, key: bytes, instance_id: int, data: bytes = b"") -> Request:
    """``commit_store(key, instance_id, data)``: ``b""`` after an SHM prepare, else the
    inline tensors encoded by :func:`~.tensors.encode_inline` for this dialect."""
    return _req(d, "commit_store", key, pack(instance_id), pack(data))


def prepare_retrieve(d: Dialect, key: bytes, instance_id: int) -> Request:
    """``prepare_retrieve(key, instance_id)``: slots (SHM) or inline data, under read locks."""
    return _req(d, "prepare_retrieve", key, pack(instance_id))


def commit_retrieve(d: Dialect, key: bytes, instance_id: int) -> Request:
    """``commit_retrieve(key, instance_id)``: releases the pending SHM read."""
    return _req(d, "commit_retrieve", key, pack(instance_id))


def subscribe_kv_events(
    d: Dialect, instance_id: int, model_name: str, cursor: int, max_events: int
) -> Request:
    """``subscribe_kv_events(instance_id, model_name, cursor, max_events)`` (by name).

    A streaming op: the first batch comes at once, each later one after an
    ``ack`` control frame (compat.md §14.5).
    """
    if not 1 <= max_events <= 1024 or cursor < 0:
        raise ValueError("max_events must be in 1..1024 and cursor >= 0")
    return _req(d, "subscribe_kv_events", pack(instance_id), pack(model_name), pack(cursor),
                pack(max_events))
