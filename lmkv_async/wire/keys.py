"""Encoding of ``IPCCacheServerKey`` and the registration payload (sans-IO).

The key is a 10-entry msgpack map keyed by field name (the server rejects the
array form). Portable rules (compat.md §12): always send all 10 fields with
``num_kv_readers=1``; ``worker_id`` is nil for lookup/free and an int for
transfers; ``token_ids`` is the full prefix from position 0.

The tokens dominate the size of every key and are resent on every RPC of an
operation, so :class:`KeyEncoder` packs each prefix once. 0.5.2-0.5.6 take them
as ``token_ids`` (a msgpack int array, 1-5 bytes per token); 0.5.7 as
``token_bytes`` (bin, big-endian uint32, 4 bytes per token; compat.md §14.3).
Both hash the same bytes, so keys name the same objects on every release.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack

from .dialect import Dialect
from .frames import pack

__all__ = [
    "MAX_SALT_LEN",
    "SALT_FORBIDDEN",
    "KeyEncoder",
    "RegisterPayload",
    "encode_register",
]

SALT_FORBIDDEN = frozenset("@/\\\x00")
MAX_SALT_LEN = 128

_K_MODEL = pack("model_name")
_K_WS = pack("world_size")
_K_WID = pack("worker_id")
_K_TOK = pack("token_ids")
_K_TOKB = pack("token_bytes")
_K_START = pack("start")
_K_END = pack("end")
_K_RID = pack("request_id")
_K_SALT = pack("cache_salt")
_K_CFG = pack("request_configs")
_K_READERS = pack("num_kv_readers")
_NIL = b"\xc0"
_MAP10 = b"\x8a"


def _pack_token_array(tokens: Sequence[int]) -> bytes:
    data: bytes = msgpack.packb(list(tokens))
    return data


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Tokens as big-endian uint32 bytes (each must be in ``[0, 2**32)``)."""
    arr = array("I", tokens)  # "I" is 4 bytes on every Linux ABI we run on
    if sys.byteorder == "little":
        arr.byteswap()
    return arr.tobytes()


def _pack_token_bytes(tokens: Sequence[int]) -> bytes:
    data: bytes = msgpack.packb(token_bytes(tokens), use_bin_type=True)
    return data


class KeyEncoder:
    """Encodes keys for one token sequence; token prefixes are packed once each."""

    __slots__ = ("_cache", "_field", "_model", "_pack", "_salt", "_tokens", "_ws")

    def __init__(
        self,
        dialect: Dialect,
        model_name: str,
        world_size: int,
        tokens: Sequence[int],
        cache_salt: str = "",
    ) -> None:
        if dialect.key_tokens == "token_bytes":
            self._field, self._pack = _K_TOKB, _pack_token_bytes
        else:
            self._field, self._pack = _K_TOK, _pack_token_array
        self._model = pack(model_name)
        self._ws = pack(world_size)
        self._salt = pack(cache_salt)
        self._tokens = tokens
        self._cache: dict[int, bytes] = {}

    def _tokens_frame(self, length: int) -> bytes:
        frame = self._cache.get(length)
        if frame is None:
            frame = self._pack(self._tokens[:length])
            self._cache[length] = frame
        return frame

    def identity(self, prefix_len: int) -> bytes:
        """What the server's key equality sees of ``tokens[:prefix_len]`` besides the
        context's constants: salt and tokens (``request_id`` is not compared)."""
        return self._salt + self._tokens_frame(prefix_len)

    def encode(
        self,
        *,
        prefix_len: int,
        start: int,
        end: int,
        request_id: str,
        worker_id: int | None,
        num_kv_readers: int = 1,
    ) -> bytes:
        """One key frame carrying ``tokens[:prefix_len]``."""
        return b"".join(
            (
                _MAP10,
                _K_MODEL,
                self._model,
                _K_WS,
                self._ws,
                _K_WID,
                _NIL if worker_id is None else pack(worker_id),
                self._field,
                self._tokens_frame(prefix_len),
                _K_START,
                pack(start),
                _K_END,
                pack(end),
                _K_RID,
                pack(request_id),
                _K_SALT,
                self._salt,
                _K_CFG,
                _NIL,
                _K_READERS,
                pack(num_kv_readers),
            )
        )


@dataclass(frozen=True)
class RegisterPayload:
    """``RegisterEngineDrivenContextPayload`` (protocol reference §3.2)."""

    instance_id: int
    model_name: str
    world_size: int
    block_size: int
    num_layers: int
    hidden_dim_size: int
    dtype_str: str
    use_mla: bool
    num_physical_slots: int | None


def encode_register(p: RegisterPayload) -> bytes:
    """Encode the registration payload as a map (0.5.2 ignores num_physical_slots)."""
    return pack(
        {
            "instance_id": p.instance_id,
            "model_name": p.model_name,
            "world_size": p.world_size,
            "block_size": p.block_size,
            "num_layers": p.num_layers,
            "hidden_dim_size": p.hidden_dim_size,
            "dtype_str": p.dtype_str,
            "use_mla": p.use_mla,
            "num_physical_slots": p.num_physical_slots,
        }
    )
