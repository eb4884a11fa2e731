"""KV events (sans-IO): LMCache's event batches in, vLLM's KV-event messages out.

**LMCache side** (``subscribe_kv_events``, lmcache >= 0.5.6; compat.md §14.5). The
streaming op answers with one batch at once and one more after each
``[uid, b"", b"ack"]`` control frame; ``[uid, b"", b"cancel"]`` ends it, and the end is a
two-frame reply ``[uid, op]``. A batch is a msgpack map ``{enabled, incarnation,
next_cursor, lost, events}``; each record ``{seq, kind: "stored"|"removed", medium,
model_name, block_hashes: [bin32], parent_block_hash, token_ids}``. Records name no
salt (the server's object key has one, the record drops it) and are filtered to the
subscribed model. :func:`decode_batch` checks every field and raises
:class:`~lmkv_async.errors.ProtocolError` on anything else.

**vLLM side** (``vllm/distributed/kv_events.py``, reimplemented from its published
schema). A ZMQ PUB message is ``[topic, seq (8 bytes, big-endian), payload]``; the
payload is a msgpack ``EventBatch`` ``[ts, events, data_parallel_rank]``. Events are
tagged structs ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name)``, ``BlockRemoved(block_hashes, medium)`` and
``AllBlocksCleared()``: positional arrays with the tag first (``encoding="array"``,
vLLM <= 0.23, what Dynamo, llm-d, SGLang and AIBrix decode) or maps with a ``"type"``
key (``encoding="map"``, vLLM after its PR 42892). The replay socket is a ROUTER: a
request ``[b"", start_seq (8 bytes)]`` is answered with ``[b"", seq, payload]`` per
buffered batch and ends with ``[b"", -1 (8 bytes, signed), b""]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

from ..errors import ProtocolError
from .frames import pack

__all__ = [
    "END_SEQ",
    "EventBatch",
    "KVEvent",
    "KVRemoved",
    "KVResync",
    "KVStored",
    "ResyncReason",
    "VllmAllBlocksCleared",
    "VllmBlockRemoved",
    "VllmBlockStored",
    "VllmEvent",
    "control_frames",
    "decode_batch",
    "decode_replay_request",
    "encode_replay_end",
    "encode_replay_item",
    "encode_seq",
    "encode_vllm_batch",
    "external_block_hash",
    "is_stream_end",
]


# ------------------------------------------------------------------ LMCache records
@dataclass(frozen=True, slots=True)
class KVStored:
    """Chunks were stored in the server's CPU tier (lmcache-driven stores only).

    ``block_hashes`` are LMCache object hashes (32 bytes each, chained:
    :mod:`.hashing`); ``parent_block_hash`` is the hash of the chunk before the first
    one, or None for a sequence's first chunk (or when the server did not know it);
    ``token_ids`` are the tokens of those chunks (one chunk per record, measured).
    """

    seq: int
    model_name: str
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    medium: str


@dataclass(frozen=True, slots=True)
class KVRemoved:
    """Chunks left the server's CPU tier (eviction, ``clear``, ``DELETE /cache/objects``)."""

    seq: int
    model_name: str
    block_hashes: tuple[bytes, ...]
    medium: str


ResyncReason = Literal["start", "restart", "lost", "disconnected", "resumed"]


@dataclass(frozen=True, slots=True)
class KVResync:
    """Where the stream stands; yielded before the records it concerns.

    * ``"start"``: the first batch of a subscription;
    * ``"restart"``: the server has a new incarnation (it restarted: its CPU tier is new);
    * ``"lost"``: records after the cursor are no longer in the server's log (a slow
      reader, or a cursor from another incarnation);
    * ``"disconnected"``: the connection was lost; the stream is resubscribing;
    * ``"resumed"``: resubscribed after a disconnect with nothing missed.

    ``discard``: what was learned from this server before is void (drop it).
    ``complete``: what is kept plus the records that follow describe the server's
    event-visible state exactly; False means something was missed.
    """

    reason: ResyncReason
    incarnation: int | None
    cursor: int
    discard: bool
    complete: bool


KVEvent = KVStored | KVRemoved | KVResync


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One decoded ``KVEventBatch``."""

    enabled: bool
    incarnation: int
    next_cursor: int
    lost: bool
    records: tuple[KVStored | KVRemoved, ...]


def _field(m: Mapping[Any, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    if name not in m:
        raise ProtocolError(f"{what} has no {name!r}")
    value = m[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(f"{what}.{name} is {type(value).__name__}")
    return value


def _hashes(value: Any, what: str) -> tuple[bytes, ...]:
    if not isinstance(value, list) or not all(isinstance(h, bytes) for h in value):
        raise ProtocolError(f"{what}.block_hashes is not a list of bin")
    return tuple(value)


def _record(raw: Any) -> KVStored | KVRemoved | None:
    if not isinstance(raw, Mapping):
        raise ProtocolError(f"KV event record is {type(raw).__name__}, not a map")
    what = "KV event record"
    seq = _field(raw, "seq", int, what)
    kind = _field(raw, "kind", str, what)
    model = _field(raw, "model_name", str, what)
    medium = _field(raw, "medium", str, what)
    hashes = _hashes(raw.get("block_hashes"), what)
    if kind == "removed":
        return KVRemoved(seq, model, hashes, medium)
    if kind == "stored":
        parent = raw.get("parent_block_hash")
        if parent is not None and not isinstance(parent, bytes):
            raise ProtocolError(f"{what}.parent_block_hash is {type(parent).__name__}")
        tokens = raw.get("token_ids", [])
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise ProtocolError(f"{what}.token_ids is not a list of ints")
        return KVStored(seq, model, hashes, parent, tuple(tokens), medium)
    return None  # a kind this client does not know: skipped, like the server's own adapter


def decode_batch(frame: bytes) -> EventBatch:
    """Decode one ``subscribe_kv_events`` reply frame."""
    try:
        raw = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"malformed msgpack in KV event batch: {exc!s}") from None
    if not isinstance(raw, Mapping):
        raise ProtocolError(f"KV event batch is {type(raw).__name__}, not a map")
    what = "KV event batch"
    enabled = _field(raw, "enabled", bool, what)
    incarnation = _field(raw, "incarnation", int, what)
    next_cursor = _field(raw, "next_cursor", int, what)
    lost = _field(raw, "lost", bool, what)
    events = _field(raw, "events", list, what)
    records = tuple(r for r in map(_record, events) if r is not None)
    return EventBatch(enabled, incarnation, next_cursor, lost, records)


def control_frames(uid: int, action: Literal["ack", "cancel"]) -> list[bytes]:
    """``[uid, b"", action]``: grant the next batch, or end the stream (an empty op
    frame is how the server tells control frames from requests)."""
    return [pack(uid), b"", action.encode()]


def is_stream_end(frames: Sequence[bytes]) -> bool:
    """A two-frame reply on a stream's uid: the server ended the stream."""
    return len(frames) == 2


# ------------------------------------------------------------------ vLLM side
@dataclass(frozen=True, slots=True)
class VllmBlockStored:
    """vLLM's ``BlockStored``; hashes are ints (low 64 bits) or bytes, see
    :func:`external_block_hash`."""

    block_hashes: tuple[int | bytes, ...]
    parent_block_hash: int | bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class VllmBlockRemoved:
    """vLLM's ``BlockRemoved``."""

    block_hashes: tuple[int | bytes, ...]
    medium: str | None


@dataclass(frozen=True, slots=True)
class VllmAllBlocksCleared:
    """vLLM's ``AllBlocksCleared``: every block this publisher announced is gone."""


VllmEvent = VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared

#: The replay socket's end-of-replay sequence number.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def external_block_hash(h: bytes, fmt: Literal["int", "bytes"] = "int") -> int | bytes:
    """An LMCache hash as vLLM's ``ExternalBlockHash``: with ``"int"``, the low 64 bits of
    its big-endian value (vLLM's own rule with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``);
    with ``"bytes"``, unchanged."""
    if fmt == "bytes":
        return h
    return int.from_bytes(h, "big") & 0xFFFF_FFFF_FFFF_FFFF


def _event_obj(ev: VllmEvent, encoding: Literal["array", "map"]) -> object:
    if isinstance(ev, VllmBlockStored):
        fields: list[tuple[str, object]] = [
            ("block_hashes", list(ev.block_hashes)),
            ("parent_block_hash", ev.parent_block_hash),
            ("token_ids", list(ev.token_ids)),
            ("block_size", ev.block_size),
            ("lora_id", ev.lora_id),
            ("medium", ev.medium),
            ("lora_name", ev.lora_name),
        ]
        tag = "BlockStored"
    elif isinstance(ev, VllmBlockRemoved):
        fields = [("block_hashes", list(ev.block_hashes)), ("medium", ev.medium)]
        tag = "BlockRemoved"
    else:
        fields, tag = [], "AllBlocksCleared"
    if encoding == "array":
        return [tag, *(v for _, v in fields)]
    return {"type": tag, **dict(fields)}


def encode_vllm_batch(
    ts: float,
    events: Sequence[VllmEvent],
    *,
    data_parallel_rank: int = 0,
    encoding: Literal["array", "map"] = "array",
) -> bytes:
    """The msgpack payload of one vLLM ``KVEventBatch`` (the batch itself is positional
    in both encodings; ``encoding`` picks how each event is written)."""
    if encoding not in ("array", "map"):
        raise ValueError("encoding must be 'array' or 'map'")
    body = [float(ts), [_event_obj(e, encoding) for e in events], int(data_parallel_rank)]
    out: bytes = msgpack.packb(body, use_bin_type=True)
    return out


def encode_seq(seq: int) -> bytes:
    """A sequence number frame: 8 bytes, big-endian."""
    return seq.to_bytes(8, "big", signed=True)


def decode_replay_request(frames: Sequence[bytes]) -> int | None:
    """The start sequence of a replay request ``[identity, b"", seq]`` (None if malformed)."""
    if len(frames) != 3 or len(frames[2]) != 8:
        return None
    return int.from_bytes(frames[2], "big")


def encode_replay_item(identity: bytes, seq: int, payload: bytes) -> list[bytes]:
    """One replayed batch for the client behind ``identity``."""
    return [identity, b"", encode_seq(seq), payload]


def encode_replay_end(identity: bytes) -> list[bytes]:
    """The end-of-replay marker."""
    return [identity, b"", END_SEQ, b""]
