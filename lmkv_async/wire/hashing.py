"""LMCache's chunk hash chain (sans-IO): which object names a token prefix.

The server names the object of chunk ``i`` by ``h_i = blake3(h_{i-1} || be32(tokens_i))``
with ``h_{-1} = NONE_HASH = blake3(be64(0) || be32(0))`` over complete chunks only
(compat.md §10). The hash ignores the model, the world size and the salt: those are
separate fields of the server's object key. KV-event records carry these hashes, so
the fleet's prefix index needs them for its own stores (which emit no event) and to
check a root chunk.

BLAKE3 comes from the ``blake3`` package (Rust, a required dependency: every store
through a :class:`~lmkv_async.Fleet` is hashed, and the hash must be the server's).
"""

from __future__ import annotations

from collections.abc import Sequence

from blake3 import blake3

from .keys import token_bytes

__all__ = ["HAVE_NATIVE_BLAKE3", "NONE_HASH", "blake3_digest", "chunk_hashes", "hash_chunk"]

#: Always True: ``blake3`` is a dependency (kept for callers that still test it).
HAVE_NATIVE_BLAKE3 = True


def blake3_digest(data: bytes) -> bytes:
    """``blake3(data)``, 32 bytes."""
    return blake3(data).digest()


#: The parent of a sequence's first chunk (the server's ``NONE_HASH`` for blake3).
NONE_HASH: bytes = blake3_digest((0).to_bytes(8, "big", signed=True) + (0).to_bytes(4, "big"))


def hash_chunk(parent: bytes | None, packed_tokens: bytes) -> bytes:
    """The object hash of one chunk: ``blake3(parent || packed_tokens)``.

    ``parent`` is the previous chunk's hash, or None for the first chunk;
    ``packed_tokens`` the chunk's tokens as big-endian uint32 (``token_bytes``).
    """
    h = blake3(NONE_HASH if parent is None else parent)
    h.update(packed_tokens)
    return h.digest()


def chunk_hashes(tokens: Sequence[int], chunk_size: int, *, packed: bytes | None = None
                 ) -> list[bytes]:
    """Hashes of every complete chunk of ``tokens``, in order (a trailing partial
    chunk has no object). ``packed`` may pass ``token_bytes(tokens)`` already made."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    data = token_bytes(tokens) if packed is None else packed
    view = memoryview(data)
    step = 4 * chunk_size
    out: list[bytes] = []
    parent = NONE_HASH
    for i in range(len(tokens) // chunk_size):
        h = blake3(parent)
        h.update(view[i * step:(i + 1) * step])
        parent = h.digest()
        out.append(parent)
    return out
