"""Block hashes for routers: vLLM's ``sha256_cbor`` chain and the LMCache-derived chain.

A KV-aware router matches the hashes in a ``BlockStored`` event against what it
knows, block by block at *its* block size ``B``. LMCache names a whole chunk
(``C`` tokens, ``B`` divides ``C``) by one BLAKE3 hash, so the publisher splits
every chunk into ``C/B`` blocks and names each block one of two ways:

* ``"dynamo"``: a chain derived from LMCache's own hashes. Dynamo's indexer
  matches prompts by hashing the event's ``token_ids`` itself; the block hashes
  only have to name each prefix uniquely and consistently (a parent is found by
  its hash). The last block of a chunk is named by the chunk's LMCache hash (so
  at ``B == C`` the stream is what it always was); block ``j`` before it by
  ``blake2b(name of block j-1 || tokens of block j)``, starting from the parent
  chunk's LMCache hash. Every name is a function of the whole token prefix, and
  a chunk's blocks need only its parent's hash, never the parent's tokens.
* ``"vllm"``: vLLM's prefix-cache hash (``--prefix-caching-hash-algo
  sha256_cbor``), which llm-d's KV-cache manager and vllm-router recompute from
  the prompt: ``sha256(canonical CBOR of [parent, tokens, extra_keys])`` with the
  first parent ``sha256(canonical CBOR of the seed string)``. vLLM's seed is
  ``PYTHONHASHSEED`` when set, else ``"vllm-none-hash"`` (vLLM 0.33 for
  cryptographic hashes). ``extra_keys`` is ``None``: LMCache's records carry no
  LoRA, multimodal or salt key.

Both are written here from those definitions (the CBOR encoder covers the one
shape vLLM hashes: an array of a byte string, an array of non-negative ints and
null); tests/test_vllm_hash.py checks the vLLM chain against vLLM's own code.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Literal

from .errors import InvalidInputError

__all__ = [
    "VLLM_DEFAULT_SEED",
    "HashMode",
    "dynamo_chunk_blocks",
    "external_hash",
    "vllm_block_hash",
    "vllm_block_hashes",
    "vllm_none_hash",
]

HashMode = Literal["dynamo", "vllm"]

#: vLLM's seed of the first block's parent when ``PYTHONHASHSEED`` is not set.
VLLM_DEFAULT_SEED = "vllm-none-hash"

_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")


def _head(major: int, n: int) -> bytes:
    """A CBOR item head in its shortest form (RFC 8949 section 4.2.1, "preferred")."""
    m = major << 5
    if n < 24:
        return bytes((m | n,))
    if n < 0x100:
        return bytes((m | 24,)) + _U8.pack(n)
    if n < 0x10000:
        return bytes((m | 25,)) + _U16.pack(n)
    if n < 0x1_0000_0000:
        return bytes((m | 26,)) + _U32.pack(n)
    return bytes((m | 27,)) + _U64.pack(n)


# Heads for the small ints that dominate token ids are built once.
_SMALL = [_head(0, i) for i in range(0x10000)]


def _cbor_uint(n: int) -> bytes:
    if 0 <= n < 0x10000:
        return _SMALL[n]
    if n < 0:
        raise InvalidInputError("token ids must be non-negative")
    return _head(0, n)


def vllm_none_hash(seed: str = VLLM_DEFAULT_SEED) -> bytes:
    """The parent of a sequence's first block: ``sha256(cbor(seed))``."""
    data = seed.encode()
    return hashlib.sha256(_head(3, len(data)) + data).digest()


def vllm_block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """vLLM's ``hash_block_tokens(sha256_cbor, parent, tokens, None)``: 32 bytes."""
    body = b"".join([b"\x83", _head(2, len(parent)), parent, _head(4, len(tokens)),
                     *map(_cbor_uint, tokens), b"\xf6"])
    return hashlib.sha256(body).digest()


def vllm_block_hashes(tokens: Sequence[int], block_size: int, *,
                      seed: str = VLLM_DEFAULT_SEED, parent: bytes | None = None
                      ) -> list[bytes]:
    """vLLM's hashes of every full block of ``tokens`` (``parent``: the hash before the
    first block, default the seed's root), as a router computes them from a prompt."""
    if not isinstance(block_size, int) or block_size <= 0:
        raise InvalidInputError("block_size must be a positive int")
    prev = vllm_none_hash(seed) if parent is None else parent
    out: list[bytes] = []
    for i in range(len(tokens) // block_size):
        prev = vllm_block_hash(prev, tokens[i * block_size:(i + 1) * block_size])
        out.append(prev)
    return out


def dynamo_chunk_blocks(parent: bytes | None, chunk_hash: bytes, packed: bytes,
                        n_blocks: int) -> list[bytes]:
    """The ``"dynamo"`` names of one chunk's ``n_blocks`` blocks (see the module doc).

    ``packed``: the chunk's tokens as big-endian uint32 (what LMCache hashes);
    ``parent``: the parent chunk's LMCache hash, None for a first chunk.
    """
    if n_blocks == 1:
        return [chunk_hash]
    step = len(packed) // n_blocks
    prev = b"\0" * 32 if parent is None else parent
    out: list[bytes] = []
    for j in range(n_blocks - 1):
        prev = hashlib.blake2b(prev + packed[j * step:(j + 1) * step], digest_size=32).digest()
        out.append(prev)
    out.append(chunk_hash)
    return out


def external_hash(h: bytes, fmt: Literal["int", "bytes"]) -> int | bytes:
    """A block hash on the wire: vLLM's ``maybe_convert_block_hash`` (low 64 bits of
    the big-endian value with ``"int"``, vLLM's default), or the bytes."""
    if fmt == "bytes":
        return h
    return int.from_bytes(h[-8:], "big")
