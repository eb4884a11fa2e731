"""The fleet's prefix index: which server holds which chunk, fed by events and own stores.

Pure data structure, no I/O, sized for a router in front of hundreds of servers
(``benchmarks/bench_index.py``: under 256 bytes per (server, chunk) entry all
included, sub-millisecond queries at 256 servers x 10,000 chunks each).

Chunks are named by LMCache's object hash (:mod:`.wire.hashing`), the same on every
server. The index knows a chunk by a 64-bit *key* (the first 8 bytes of that hash)
and reaches it by its *edge*: the 64-bit digest ``siphash(packed chunk tokens) XOR
parent key`` (the parent of a first chunk is a key no hash can have). One table maps
edge digests to ``key | presence << 64`` (one Python int), another maps keys to
their edge digest (for removals by hash). A query walks the edges chunk by chunk:
one SipHash of 1 KiB and one dictionary lookup per chunk; the tokens themselves are
never kept.

Presence of a chunk, for one salt, is the set of *member numbers* (a small int per
server, reused after a ``discard``) holding it: a single member ``m`` is stored as
``2m + 2`` (a cached small int up to 127 servers, 32 bytes beyond) and two or more as
the bitmap ``2 * bits + 1``; 0 is nobody. Salt ``""`` lives in the edge table's
value; other salts (interned to small ids) in a side table of the chunks that have
any. Each server keeps the list of keys it took up (stale keys are skipped and the
list compacted once it is twice the live count), so ``discard(server)`` costs what
it removes.

Collisions: keys are 64 bits of BLAKE3 (the server's hash), digests 64 bits of
SipHash-1-3 (Python's ``hash`` of bytes, keyed with a per-process random key; an
interpreter built with another string hash gets BLAKE2b). For one parent, two
different chunks share a digest only if their SipHashes collide; across all ``n``
chunks held, some pair of keys or digests coincides with probability about
``n**2 / 2**65`` (1.4e-7 at 2.2 million), and a query chunk matches an edge it is
not with probability ``n / 2**64`` (1e-13). Either makes the index report a longer
prefix on some server than it holds: ``best()`` then routes to a server that
recomputes part of the prefix. No wrong KV can come back: a retrieve names objects
by the server's own hash. Whatever the index was told it keeps exactly (a later
edge told for the same parent and tokens wins, as before).

Where entries come from:

* ``KVStored`` events (lmcache-driven stores): the record carries the hash, its
  parent and the tokens, so the edge is known. A record whose parent is None is
  the first chunk of a sequence only if ``blake3(NONE_HASH || tokens)`` equals
  its hash (the server also sends None when it lost the parent); otherwise it is
  kept as present but unreachable by a walk. Records carry no salt (measured:
  the server drops it), so they count for ``cache_salt=""``.
* stores made through the fleet (engine-driven: they emit no event): the fleet
  hashes the tokens itself and records every chunk with its salt.
* ``KVRemoved`` events drop the hashes from that server for every salt (the
  record does not say which salt's object went, so this errs towards a miss).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from hashlib import blake2b

from .wire.hashing import chunk_hashes, hash_chunk
from .wire.keys import token_bytes

__all__ = ["PrefixIndex"]

_EVENT_SALT = ""  # records name no salt; see the module docstring
_M64 = (1 << 64) - 1
#: The "parent key" of a first chunk: outside every key's range [0, 2**64), so no
#: told hash can make a child's edge look like a root's (keys of edgeless chunks
#: sit at ``key + _EDGELESS``, apart from both).
_ROOT = 1 << 64
_EDGELESS = 1 << 65
_NO_SALTS: dict[int, int] = {}

if sys.hash_info.algorithm.startswith("siphash"):
    #: 64 bits of SipHash of a chunk's packed tokens, keyed per process (see docstring)
    _digest: Callable[[bytes], int] = hash
else:  # pragma: no cover - interpreters built with another string hash
    def _digest(chunk: bytes) -> int:
        return int.from_bytes(blake2b(chunk, digest_size=8).digest(), "big", signed=True)


def _key(h: bytes) -> int:
    """The 64-bit key of an object hash (BLAKE3: its first 8 bytes)."""
    if len(h) == 32:
        return int.from_bytes(h[:8], "big")
    # Other lengths (tests, foreign hashers): a digest, so no prefix can alias.
    return int.from_bytes(blake2b(h, digest_size=8, person=b"lmkv-key").digest(), "big")


# ---------------------------------------------------------------- presence values
def _has(p: int, m: int) -> bool:
    if p & 1:
        return bool((p >> (m + 1)) & 1)
    return p == 2 * m + 2


def _with(p: int, m: int) -> int:
    if not p:
        return 2 * m + 2
    if p & 1:
        return p | (2 << m)
    other = (p >> 1) - 1
    return p if other == m else (2 << other) | (2 << m) | 1


def _without(p: int, m: int) -> int:
    if p == 2 * m + 2:
        return 0
    if not p & 1 or not (p >> (m + 1)) & 1:
        return p
    bits = (p >> 1) & ~(1 << m)
    if bits & (bits - 1):
        return (bits << 1) | 1
    return 2 * bits.bit_length()  # one member left: 2m + 2 with m = bit_length - 1


def _bits(p: int) -> int:
    if p & 1:
        return p >> 1
    return 1 << ((p >> 1) - 1) if p else 0


class PrefixIndex:
    """Chunk presence per server plus the fleet-wide edge table (see module docstring)."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self._step = 4 * chunk_size
        #: edge digest -> key | presence("") << 64; a chunk with no known edge sits
        #: under ``key + _EDGELESS`` (no walk computes it)
        self._child: dict[int, int] = {}
        #: key -> where the chunk sits in ``_child``
        self._home: dict[int, int] = {}
        #: key -> {salt id: presence}, only for chunks held under a salt other than ""
        self._salted: dict[int, dict[int, int]] = {}
        self._salt_ids: dict[str, int] = {_EVENT_SALT: 0}
        self._edgeless = 0
        #: server name <-> member number; per member the keys it took up (see docstring)
        self._member: dict[str, int] = {}
        self._names: list[str | None] = []
        self._held: list[list[int]] = []
        self._count: list[int] = []
        self._mask_key: tuple[str, ...] | None = None
        self._mask = 0

    # ------------------------------------------------------------------ members
    def _number(self, server: str) -> int:
        m = self._member.get(server)
        if m is None:
            try:
                m = self._names.index(None)
                self._names[m] = server
                self._held[m], self._count[m] = [], 0
            except ValueError:
                m = len(self._names)
                self._names.append(server)
                self._held.append([])
                self._count.append(0)
            self._member[server] = m
            self._mask_key = None
        return m

    def _holds(self, m: int, key: int, value: int) -> bool:
        if _has(value >> 64, m):
            return True
        salted = self._salted.get(key)
        return salted is not None and any(_has(p, m) for p in salted.values())

    def _holds_key(self, m: int, key: int) -> bool:
        home = self._home.get(key)
        return home is not None and self._holds(m, key, self._child[home])

    # ------------------------------------------------------------------ updates
    def _add(self, m: int, key: int, sid: int, edge: int | None) -> None:
        child, home_of = self._child, self._home
        home = home_of.get(key)
        if home is None:
            if edge is None:
                home = key + _EDGELESS
                self._edgeless += 1
            else:
                self._unseat(edge, key)
                home = edge
            home_of[key] = home
            value = key
            held = False
        else:
            value = child[home]
            held = self._holds(m, key, value)
            if home >= _EDGELESS and edge is not None:  # the edge is learnt now
                del child[home]
                self._edgeless -= 1
                self._unseat(edge, key)
                home_of[key] = home = edge
        if sid == 0:
            value = key | _with(value >> 64, m) << 64
        else:
            salted = self._salted.setdefault(key, {})
            salted[sid] = _with(salted.get(sid, 0), m)
        child[home] = value
        if not held:
            self._held[m].append(key)
            self._count[m] += 1

    def _unseat(self, edge: int, key: int) -> None:
        """Make room for ``key`` at ``edge``: a chunk already there (the same parent
        and tokens told under another hash) loses its edge, as a later edge wins."""
        value = self._child.pop(edge, None)
        if value is not None and value & _M64 != key:
            other = value & _M64
            self._child[other + _EDGELESS] = value
            self._home[other] = other + _EDGELESS
            self._edgeless += 1

    def _drop(self, m: int, key: int) -> bool:
        """Forget ``key`` on member ``m`` for every salt; whether it was held."""
        home = self._home.get(key)
        if home is None:
            return False
        value = self._child[home]
        p = value >> 64
        held = _has(p, m)
        p = _without(p, m)
        salted = self._salted.get(key)
        if salted is not None:
            for sid, q in list(salted.items()):
                if _has(q, m):
                    held = True
                    q = _without(q, m)
                    if q:
                        salted[sid] = q
                    else:
                        del salted[sid]
            if not salted:
                del self._salted[key]
                salted = None
        if not held:
            return False
        if p or salted is not None:
            self._child[home] = key | p << 64
        else:  # nobody holds it: the chunk and its edge go
            del self._child[home]
            del self._home[key]
            if home >= _EDGELESS:
                self._edgeless -= 1
        self._count[m] -= 1
        return True

    def add_event(self, server: str, block_hashes: Sequence[bytes], parent: bytes | None,
                  token_ids: Sequence[int]) -> None:
        """Apply a ``KVStored`` record of ``server``."""
        m = self._number(server)
        step = self._step
        n = len(token_ids) // self.chunk_size
        packed = token_bytes(token_ids) if n else b""
        up = _ROOT if parent is None else _key(parent)
        for i, h in enumerate(block_hashes):
            edge: int | None = None
            if i < n:
                chunk = packed[i * step:(i + 1) * step]
                if parent is None and i == 0 and hash_chunk(None, chunk) != h:
                    edge = None  # the server did not know this chunk's parent
                else:
                    edge = _digest(chunk) ^ up
            up = _key(h)
            self._add(m, up, 0, edge)

    def add_own(self, server: str, tokens: Sequence[int], salt: str, num_chunks: int,
                *, hashes: Sequence[bytes] | None = None) -> list[bytes]:
        """Record the first ``num_chunks`` chunks of ``tokens`` as stored on ``server``
        with ``salt``; returns their hashes."""
        raw = token_bytes(tokens[: num_chunks * self.chunk_size])
        hs = list(hashes) if hashes is not None else chunk_hashes(
            tokens[: num_chunks * self.chunk_size], self.chunk_size, packed=raw)
        m = self._number(server)
        sid = self._salt_ids.setdefault(salt, len(self._salt_ids))
        step, up = self._step, _ROOT
        for i, h in enumerate(hs[:num_chunks]):
            edge = _digest(raw[i * step:(i + 1) * step]) ^ up
            up = _key(h)
            self._add(m, up, sid, edge)
        return hs[:num_chunks]

    def remove(self, server: str, block_hashes: Iterable[bytes]) -> None:
        """Apply a ``KVRemoved`` record of ``server``."""
        m = self._member.get(server)
        if m is None:
            return
        for h in block_hashes:
            self._drop(m, _key(h))
        held = self._held[m]
        if len(held) > 2 * self._count[m] + 64:
            # Stale keys (removed, or twice after a re-add): keep each live one once.
            self._held[m] = [k for k in dict.fromkeys(held) if self._holds_key(m, k)]

    def discard(self, server: str) -> None:
        """Forget everything about ``server`` (a restart or a lost range)."""
        m = self._member.pop(server, None)
        if m is None:
            return
        for key in self._held[m]:
            self._drop(m, key)
        self._held[m], self._count[m] = [], 0
        self._names[m] = None  # the number is free for the next server
        self._mask_key = None

    # ------------------------------------------------------------------ queries
    def _members(self, servers: Sequence[str]) -> int:
        names = tuple(servers)
        if names != self._mask_key:
            mask = 0
            for s in names:
                m = self._member.get(s)
                if m is not None:
                    mask |= 1 << m
            self._mask_key, self._mask = names, mask
        return self._mask

    def longest(self, packed: bytes, num_chunks: int, salt: str,
                servers: Sequence[str]) -> dict[str, int]:
        """Cached prefix length in chunks of the query (``packed`` = ``token_bytes``)
        on each of ``servers``."""
        result = dict.fromkeys(servers, 0)
        alive = self._members(servers)
        sid = self._salt_ids.get(salt)
        if not alive or sid is None:
            return result
        names, child, salted = self._names, self._child, self._salted
        step, up, depth = self._step, _ROOT, 0
        while depth < num_chunks:
            value = child.get(_digest(packed[depth * step:(depth + 1) * step]) ^ up)
            if value is None:
                break
            key = value & _M64
            p = value >> 64 if sid == 0 else salted.get(key, _NO_SALTS).get(sid, 0)
            now = alive & _bits(p)
            if now != alive:
                gone = alive & ~now
                while gone and depth:  # these servers' prefix ends before this chunk
                    low = gone & -gone
                    result[names[low.bit_length() - 1]] = depth  # type: ignore[index]
                    gone ^= low
                alive = now
                if not alive:
                    return result
            depth += 1
            up = key
        while alive:
            low = alive & -alive
            result[names[low.bit_length() - 1]] = depth  # type: ignore[index]
            alive ^= low
        return result

    def holds(self, server: str, h: bytes) -> bool:
        """Whether ``server`` is recorded as holding object ``h`` (any salt)."""
        m = self._member.get(server)
        return m is not None and self._holds_key(m, _key(h))

    def size(self, server: str | None = None) -> int:
        """Number of (server, chunk) entries, for one server or all."""
        if server is not None:
            m = self._member.get(server)
            return 0 if m is None else self._count[m]
        return sum(self._count)

    @property
    def edges(self) -> int:
        """Number of known chunk edges (fleet-wide)."""
        return len(self._child) - self._edgeless
