"""Request and reply frames of the MP ZMQ protocol (sans-IO).

Request: ``[msgpack(uid), msgpack(op_id), msgpack(arg1), ...]``, one frame per
declared argument. Reply: ``[uid, op]`` echoed byte for byte, plus
``msgpack(result)`` only when the result is not None. The server never sends an
error reply (protocol reference §2.2, §2.3, §2.5).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgpack

from ..errors import ProtocolError

__all__ = ["NO_RESULT", "Reply", "decode_reply", "encode_request", "pack", "unpack_result"]


class _NoResult:
    """Marker for a two-frame reply (the handler returned None)."""

    _instance: _NoResult | None = None

    def __new__(cls) -> _NoResult:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NO_RESULT"

    def __bool__(self) -> bool:
        return False


NO_RESULT = _NoResult()


def pack(obj: object) -> bytes:
    """msgpack-encode one frame the way msgspec does (str as str, bytes as bin)."""
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


def encode_request(uid: int, op_id: int | str, payloads: Sequence[bytes]) -> list[bytes]:
    """Frames of one request. ``payloads`` are already-encoded argument frames.

    ``op_id`` is an integer id from the server's dialect, or an op name for the
    few ops that exist only by name on releases that accept names (a string op
    kills a <= 0.5.5 server's request loop, so only a dialect may hand one out).
    """
    if uid < 0:
        raise ValueError("uid must be a non-negative int (the official client decodes it as int)")
    if isinstance(op_id, bool) or not isinstance(op_id, (int, str)):
        raise TypeError("op must be an integer id (or a name) from the server's dialect")
    return [pack(uid), pack(op_id), *payloads]


@dataclass(frozen=True)
class Reply:
    """A decoded reply frame set. ``result`` is NO_RESULT for a two-frame reply."""

    uid_frame: bytes
    op_frame: bytes
    result_frame: bytes | None

    def result(self) -> object:
        """Decode the result frame (NO_RESULT if absent)."""
        if self.result_frame is None:
            return NO_RESULT
        return unpack_result(self.result_frame)


def unpack_result(frame: bytes) -> object:
    """Decode a msgpack result frame; malformed bytes raise ProtocolError."""
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"malformed msgpack in reply: {exc!s}") from None


def decode_reply(frames: Sequence[bytes], *, expected_op: bytes | None = None) -> Reply:
    """Split reply frames; check the frame count and (optionally) the op echo."""
    if len(frames) < 2:
        raise ProtocolError(f"reply has {len(frames)} frame(s); at least 2 expected")
    if len(frames) > 3:
        raise ProtocolError(f"reply has {len(frames)} frames; at most 3 expected")
    uid_frame, op_frame = bytes(frames[0]), bytes(frames[1])
    if expected_op is not None and op_frame != expected_op:
        raise ProtocolError(
            f"reply echoes op frame {op_frame.hex()} but the request sent {expected_op.hex()}"
        )
    return Reply(uid_frame, op_frame, bytes(frames[2]) if len(frames) == 3 else None)
