"""The fleet's prefix index: which server holds which chunk, fed by events and own stores.

Pure data structure, no I/O. Chunks are named by LMCache's object hash
(:mod:`.wire.hashing`), which is the same on every server, so one table of
*edges* ``(parent hash, packed chunk tokens) -> hash`` is shared by the whole
fleet and a query walks it chunk by chunk with dictionary lookups: no hashing
on the query path. Presence is kept per server: ``hash -> salts``.

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

from collections.abc import Iterable, Sequence

from .wire.hashing import chunk_hashes, hash_chunk
from .wire.keys import token_bytes

__all__ = ["PrefixIndex"]

_EVENT_SALT = ""  # records name no salt; see the module docstring

EdgeKey = tuple[bytes | None, bytes]


class PrefixIndex:
    """Per-server chunk presence plus the fleet-wide edge table (see module docstring)."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self._step = 4 * chunk_size
        self._edges: dict[EdgeKey, bytes] = {}
        self._edge_of: dict[bytes, EdgeKey] = {}
        self._present: dict[str, dict[bytes, set[str]]] = {}
        #: how many servers hold each hash (edges are dropped at zero)
        self._refs: dict[bytes, int] = {}

    # ------------------------------------------------------------------ updates
    def _add(self, server: str, h: bytes, salt: str, edge: EdgeKey | None) -> None:
        table = self._present.setdefault(server, {})
        salts = table.get(h)
        if salts is None:
            table[h] = {salt}
            self._refs[h] = self._refs.get(h, 0) + 1
        else:
            salts.add(salt)
        if edge is not None and h not in self._edge_of:
            self._edges[edge] = h
            self._edge_of[h] = edge

    def _drop(self, server: str, h: bytes) -> None:
        table = self._present.get(server)
        if table is None or table.pop(h, None) is None:
            return
        left = self._refs.get(h, 1) - 1
        if left > 0:
            self._refs[h] = left
            return
        self._refs.pop(h, None)
        edge = self._edge_of.pop(h, None)
        if edge is not None:
            self._edges.pop(edge, None)

    def add_event(self, server: str, block_hashes: Sequence[bytes], parent: bytes | None,
                  token_ids: Sequence[int]) -> None:
        """Apply a ``KVStored`` record of ``server``."""
        step = self.chunk_size
        packed = token_bytes(token_ids) if token_ids else b""
        n = len(token_ids) // step
        for i, h in enumerate(block_hashes):
            edge: EdgeKey | None = None
            if i < n:
                chunk = packed[i * self._step:(i + 1) * self._step]
                if parent is None and i == 0 and hash_chunk(None, chunk) != h:
                    edge = None  # the server did not know this chunk's parent
                else:
                    edge = (parent, chunk)
            self._add(server, h, _EVENT_SALT, edge)
            parent = h

    def add_own(self, server: str, tokens: Sequence[int], salt: str, num_chunks: int,
                *, hashes: Sequence[bytes] | None = None) -> list[bytes]:
        """Record the first ``num_chunks`` chunks of ``tokens`` as stored on ``server``
        with ``salt``; returns their hashes."""
        packed = token_bytes(tokens[: num_chunks * self.chunk_size])
        hs = list(hashes) if hashes is not None else chunk_hashes(
            tokens[: num_chunks * self.chunk_size], self.chunk_size, packed=packed)
        parent: bytes | None = None
        for i, h in enumerate(hs[:num_chunks]):
            self._add(server, h, salt, (parent, packed[i * self._step:(i + 1) * self._step]))
            parent = h
        return hs[:num_chunks]

    def remove(self, server: str, block_hashes: Iterable[bytes]) -> None:
        """Apply a ``KVRemoved`` record of ``server``."""
        for h in block_hashes:
            self._drop(server, h)

    def discard(self, server: str) -> None:
        """Forget everything about ``server`` (a restart or a lost range)."""
        for h in list(self._present.get(server, ())):
            self._drop(server, h)
        self._present.pop(server, None)

    # ------------------------------------------------------------------ queries
    def longest(self, packed: bytes, num_chunks: int, salt: str,
                servers: Sequence[str]) -> dict[str, int]:
        """Cached prefix length in chunks of the query (``packed`` = ``token_bytes``)
        on each of ``servers``."""
        result = dict.fromkeys(servers, 0)
        alive = [(s, self._present.get(s, {})) for s in servers]
        parent: bytes | None = None
        step = self._step
        edges = self._edges
        for i in range(num_chunks):
            h = edges.get((parent, packed[i * step:(i + 1) * step]))
            if h is None:
                break
            still = []
            for name, table in alive:
                salts = table.get(h)
                if salts is not None and salt in salts:
                    result[name] = i + 1
                    still.append((name, table))
            if not still:
                break
            alive = still
            parent = h
        return result

    def holds(self, server: str, h: bytes) -> bool:
        """Whether ``server`` is recorded as holding object ``h`` (any salt)."""
        return h in self._present.get(server, {})

    def size(self, server: str | None = None) -> int:
        """Number of (server, chunk) entries, for one server or all."""
        if server is not None:
            return len(self._present.get(server, {}))
        return sum(len(t) for t in self._present.values())

    @property
    def edges(self) -> int:
        """Number of known chunk edges (fleet-wide)."""
        return len(self._edges)
