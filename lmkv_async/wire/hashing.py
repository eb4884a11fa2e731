"""LMCache's chunk hash chain (sans-IO): which object names a token prefix.

The server names the object of chunk ``i`` by ``h_i = blake3(h_{i-1} || be32(tokens_i))``
with ``h_{-1} = NONE_HASH = blake3(be64(0) || be32(0))`` over complete chunks only
(compat.md §10). The hash ignores the model, the world size and the salt: those are
separate fields of the server's object key. KV-event records carry these hashes, so
the fleet's prefix index needs them for its own stores (which emit no event) and to
check a root chunk.

``blake3`` (the Rust-backed PyPI package, in the ``fleet`` extra) is used when it is
importable. Without it a pure-Python BLAKE3 keeps the results right, at about a
millisecond per chunk: fine for a few stores, too slow for a hot path.
"""

from __future__ import annotations

import importlib
import struct
from collections.abc import Callable, Sequence
from typing import Any

from .keys import token_bytes

__all__ = ["HAVE_NATIVE_BLAKE3", "NONE_HASH", "blake3_digest", "chunk_hashes", "hash_chunk"]

_native_blake3: Any
try:  # the optional fast path (imported by name: it has no stubs everywhere)
    _native_blake3 = importlib.import_module("blake3").blake3
except ImportError:  # pragma: no cover - depends on the environment
    _native_blake3 = None

HAVE_NATIVE_BLAKE3 = _native_blake3 is not None

# ---------------------------------------------------------------- pure-Python BLAKE3
_IV = (0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A,
       0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19)
_PERM = (2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8)
_CHUNK_START, _CHUNK_END, _PARENT, _ROOT = 1, 2, 4, 8
_M32 = 0xFFFFFFFF
_BLOCK_LEN, _CHUNK_LEN = 64, 1024


def _compress(cv: Sequence[int], block: Sequence[int], counter: int, block_len: int,
              flags: int) -> list[int]:
    s = [*cv[:8], *_IV[:4], counter & _M32, (counter >> 32) & _M32, block_len, flags]
    m = list(block)

    def g(a: int, b: int, c: int, d: int, x: int, y: int) -> None:
        s[a] = (s[a] + s[b] + x) & _M32
        v = s[d] ^ s[a]
        s[d] = ((v >> 16) | (v << 16)) & _M32
        s[c] = (s[c] + s[d]) & _M32
        v = s[b] ^ s[c]
        s[b] = ((v >> 12) | (v << 20)) & _M32
        s[a] = (s[a] + s[b] + y) & _M32
        v = s[d] ^ s[a]
        s[d] = ((v >> 8) | (v << 24)) & _M32
        s[c] = (s[c] + s[d]) & _M32
        v = s[b] ^ s[c]
        s[b] = ((v >> 7) | (v << 25)) & _M32

    for rnd in range(7):
        g(0, 4, 8, 12, m[0], m[1])
        g(1, 5, 9, 13, m[2], m[3])
        g(2, 6, 10, 14, m[4], m[5])
        g(3, 7, 11, 15, m[6], m[7])
        g(0, 5, 10, 15, m[8], m[9])
        g(1, 6, 11, 12, m[10], m[11])
        g(2, 7, 8, 13, m[12], m[13])
        g(3, 4, 9, 14, m[14], m[15])
        if rnd < 6:
            m = [m[i] for i in _PERM]
    return [s[i] ^ s[i + 8] for i in range(8)] + [s[i + 8] ^ cv[i] for i in range(8)]


def _words(block: bytes) -> tuple[int, ...]:
    return struct.unpack("<16I", block.ljust(_BLOCK_LEN, b"\0"))


def _chunk_cv(data: bytes, counter: int, root: bool) -> list[int]:
    """Chaining value of one 1 KiB chunk (or its root output when ``root``)."""
    cv: list[int] = list(_IV)
    blocks = [data[i:i + _BLOCK_LEN] for i in range(0, len(data), _BLOCK_LEN)] or [b""]
    for i, block in enumerate(blocks):
        flags = (_CHUNK_START if i == 0 else 0) | (_CHUNK_END if i == len(blocks) - 1 else 0)
        if root and i == len(blocks) - 1:
            flags |= _ROOT
        cv = _compress(cv, _words(block), counter, len(block), flags)[:8]
    return cv


def _pure_blake3(data: bytes) -> bytes:
    chunks = [data[i:i + _CHUNK_LEN] for i in range(0, len(data), _CHUNK_LEN)] or [b""]
    if len(chunks) == 1:
        return struct.pack("<8I", *_chunk_cv(chunks[0], 0, root=True))
    # Merge chunk CVs the way the reference implementation's stack does:
    # a left subtree is always the largest power of two of chunks.
    def subtree(lo: int, hi: int, root: bool) -> list[int]:
        if hi - lo == 1:
            return _chunk_cv(chunks[lo], lo, root=root)
        split = 1
        while split * 2 < hi - lo:
            split *= 2
        left = subtree(lo, lo + split, False)
        right = subtree(lo + split, hi, False)
        flags = _PARENT | (_ROOT if root else 0)
        return _compress(_IV, (*left, *right), 0, _BLOCK_LEN, flags)[:8]

    return struct.pack("<8I", *subtree(0, len(chunks), True))


def _native_digest(data: bytes) -> bytes:
    assert _native_blake3 is not None
    out: bytes = _native_blake3(data).digest()
    return out


#: ``blake3(data) -> 32 bytes``: the native package when installed, else pure Python.
blake3_digest: Callable[[bytes], bytes] = _native_digest if HAVE_NATIVE_BLAKE3 else _pure_blake3

#: The parent of a sequence's first chunk (the server's ``NONE_HASH`` for blake3).
NONE_HASH: bytes = blake3_digest((0).to_bytes(8, "big", signed=True) + (0).to_bytes(4, "big"))


def hash_chunk(parent: bytes | None, packed_tokens: bytes) -> bytes:
    """The object hash of one chunk: ``blake3(parent || packed_tokens)``.

    ``parent`` is the previous chunk's hash, or None for the first chunk;
    ``packed_tokens`` the chunk's tokens as big-endian uint32 (``token_bytes``).
    """
    return blake3_digest((NONE_HASH if parent is None else parent) + packed_tokens)


def chunk_hashes(tokens: Sequence[int], chunk_size: int, *, packed: bytes | None = None
                 ) -> list[bytes]:
    """Hashes of every complete chunk of ``tokens``, in order (a trailing partial
    chunk has no object). ``packed`` may pass ``token_bytes(tokens)`` already made."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    data = token_bytes(tokens) if packed is None else packed
    step = 4 * chunk_size
    out: list[bytes] = []
    parent: bytes | None = None
    for i in range(len(tokens) // chunk_size):
        parent = hash_chunk(parent, data[i * step:(i + 1) * step])
        out.append(parent)
    return out
