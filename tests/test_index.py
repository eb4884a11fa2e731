"""The fleet's prefix index (lmkv_async._index) against a plain model of what it was told.

No server: ``tests/test_fleet.py::test_index_agrees_with_real_lookups_seeded`` checks the
index against real lookups. Here a model that keeps every edge with its tokens (the
index before issue 26) answers the same queries after every random operation.
"""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import Sequence

import pytest

from lmkv_async import _index
from lmkv_async._index import PrefixIndex
from lmkv_async.wire.hashing import chunk_hashes, hash_chunk
from lmkv_async.wire.keys import token_bytes

C = 4  # a small chunk keeps the model test fast; the index does not care


class Model:
    """Edges ``(parent hash, packed tokens) -> hash`` kept whole, presence as sets."""

    def __init__(self) -> None:
        self.edges: dict[tuple[bytes | None, bytes], bytes] = {}
        self.edge_of: dict[bytes, tuple[bytes | None, bytes]] = {}
        self.present: dict[str, dict[bytes, set[str]]] = {}

    def add(self, server: str, h: bytes, salt: str, edge: tuple[bytes | None, bytes] | None
            ) -> None:
        self.present.setdefault(server, {}).setdefault(h, set()).add(salt)
        if edge is not None and h not in self.edge_of:
            old = self.edges.get(edge)
            if old is not None and old != h:
                del self.edge_of[old]  # a later edge for the same parent and tokens wins
            self.edges[edge] = h
            self.edge_of[h] = edge

    def drop(self, server: str, h: bytes) -> None:
        if self.present.get(server, {}).pop(h, None) is None:
            return
        if any(h in t for t in self.present.values()):
            return
        edge = self.edge_of.pop(h, None)
        if edge is not None and self.edges.get(edge) == h:
            del self.edges[edge]

    def add_event(self, server: str, hs: Sequence[bytes], parent: bytes | None,
                  toks: Sequence[int]) -> None:
        packed = token_bytes(toks)
        for i, h in enumerate(hs):
            edge = None
            if i < len(toks) // C:
                chunk = packed[i * 4 * C:(i + 1) * 4 * C]
                if not (parent is None and i == 0 and hash_chunk(None, chunk) != h):
                    edge = (parent, chunk)
            self.add(server, h, "", edge)
            parent = h

    def add_own(self, server: str, toks: Sequence[int], salt: str, n: int,
                hs: Sequence[bytes]) -> None:
        packed = token_bytes(toks[: n * C])
        parent: bytes | None = None
        for i, h in enumerate(hs[:n]):
            self.add(server, h, salt, (parent, packed[i * 4 * C:(i + 1) * 4 * C]))
            parent = h

    def longest(self, packed: bytes, n: int, salt: str, servers: Sequence[str]
                ) -> dict[str, int]:
        out = dict.fromkeys(servers, 0)
        alive = list(servers)
        parent: bytes | None = None
        for i in range(n):
            h = self.edges.get((parent, packed[i * 4 * C:(i + 1) * 4 * C]))
            if h is None:
                break
            alive = [s for s in alive if salt in self.present.get(s, {}).get(h, ())]
            for s in alive:
                out[s] = i + 1
            parent = h
        return out


def _fake(rng: random.Random) -> bytes:
    return rng.randbytes(32)


def test_index_answers_what_the_model_answers_seeded() -> None:
    rng = random.Random(20261205)
    servers = [f"s{i}" for i in range(6)]
    salts = ["", "", "tenant-a", "tenant-b"]
    pieces = [[rng.randrange(2**32) for _ in range(C)] for _ in range(6)]

    def seq() -> list[int]:
        return [t for _ in range(rng.randint(1, 6)) for t in rng.choice(pieces)]

    idx, model = PrefixIndex(C), Model()
    told: list[tuple[str, bytes]] = []
    for step in range(1500):
        op = rng.random()
        server = rng.choice(servers)
        toks = seq()
        n = len(toks) // C
        if op < 0.35:  # an event: a whole sequence, a tail with its parent, or a lost parent
            hs = chunk_hashes(toks, C)
            cut = rng.randrange(n)
            how = rng.random()
            if how < 0.4:
                args: tuple[Sequence[bytes], bytes | None, list[int]] = (hs, None, toks)
            elif how < 0.8:
                args = (hs[cut:], hs[cut - 1] if cut else None, toks[cut * C:])
            else:  # the server lost the parent, or reused old hashes for new tokens
                fake = [_fake(rng) for _ in hs] if rng.random() < 0.3 else hs
                args = (fake[cut:], None, toks[cut * C:])
            idx.add_event(server, *args)
            model.add_event(server, *args)
            told += [(server, h) for h in args[0]]
        elif op < 0.6:  # a store through the fleet, with its salt; now and then told hashes
            salt = rng.choice(salts)
            k = rng.randint(1, n)
            given = [_fake(rng) for _ in range(k)] if rng.random() < 0.2 else None
            hs = idx.add_own(server, toks, salt, k, hashes=given)
            assert given is not None or hs == chunk_hashes(toks, C)[:k]
            model.add_own(server, toks, salt, k, hs)
            told += [(server, h) for h in hs]
        elif op < 0.9 and told:
            picked = [rng.choice(told) for _ in range(rng.randint(1, 4))]
            for s, h in picked:
                idx.remove(s, [h])
                model.drop(s, h)
        elif op < 0.93:
            idx.discard(server)
            for h in list(model.present.get(server, {})):
                model.drop(server, h)
            model.present.pop(server, None)
        for _ in range(3):
            q = seq()
            ask = rng.sample(servers, rng.randint(1, len(servers)))
            salt = rng.choice(salts)
            packed = token_bytes(q)
            want = model.longest(packed, len(q) // C, salt, ask)
            assert idx.longest(packed, len(q) // C, salt, ask) == want, (step, salt)
        for s in servers:
            held = model.present.get(s, {})
            assert idx.size(s) == len(held), step
            for h in list(held)[:5]:
                assert idx.holds(s, h)
        assert idx.size() == sum(len(t) for t in model.present.values())
        assert idx.edges == len(model.edges), step


def test_removal_and_discard_touch_only_what_they_remove() -> None:
    idx = PrefixIndex(C)
    rng = random.Random(5)
    seqs = [[rng.randrange(2**32) for _ in range(8 * C)] for _ in range(200)]
    for s in seqs:
        idx.add_own("big", s, "", 8)
    idx.add_own("small", seqs[0], "", 8)
    m = idx._member["big"]
    # Store and evict the same chunks over and over: the server's key list stays
    # within twice what it holds (plus a constant), so discard stays proportional.
    for _ in range(30):
        for s in seqs[:100]:
            idx.remove("big", chunk_hashes(s, C))
        for s in seqs[:100]:
            idx.add_own("big", s, "", 8)
        assert len(idx._held[m]) <= 2 * idx.size("big") + 64 + 8
    assert idx.size("big") == 1600
    idx.discard("small")
    assert idx.size("small") == 0 and idx.size("big") == 1600
    assert idx.longest(token_bytes(seqs[0]), 8, "", ["big", "small"]) == {"big": 8, "small": 0}


def test_member_numbers_are_reused_without_stale_presence() -> None:
    idx = PrefixIndex(C)
    a, b = [1] * (2 * C), [2] * (2 * C)
    idx.add_own("x", a, "", 2)
    idx.add_own("keep", b, "t", 2)
    number = idx._member["x"]
    idx.discard("x")
    idx.add_own("y", b, "", 1)
    assert idx._member["y"] == number  # the freed number went to the next server
    assert idx.longest(token_bytes(a), 2, "", ["x", "y"]) == {"x": 0, "y": 0}
    assert idx.longest(token_bytes(b), 2, "", ["y", "keep"]) == {"y": 1, "keep": 0}
    assert idx.longest(token_bytes(b), 2, "t", ["y", "keep"]) == {"y": 0, "keep": 2}
    assert idx.longest(token_bytes(b), 2, "nobody-used-this", ["keep"]) == {"keep": 0}


def test_a_digest_collision_keeps_what_each_server_was_told(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Force every chunk to one digest: the later edge wins the walk, and dropping
    # either chunk leaves the other's presence (and the winner's edge) alone.
    monkeypatch.setattr(_index, "_digest", lambda chunk: 7)
    idx = PrefixIndex(C)
    a, b = [1] * C, [2] * C
    ha = idx.add_own("x", a, "", 1)[0]
    hb = idx.add_own("y", b, "", 1)[0]
    assert idx.holds("x", ha) and idx.holds("y", hb) and idx.edges == 1
    assert idx.longest(token_bytes(b), 1, "", ["x", "y"]) == {"x": 0, "y": 1}
    idx.remove("x", [ha])
    assert idx.longest(token_bytes(b), 1, "", ["x", "y"]) == {"x": 0, "y": 1}
    assert idx.size() == 1 and idx.edges == 1


def test_traced_memory_per_entry_stays_under_256_bytes() -> None:
    # The issue-26 budget, checked small: 8 servers x 150 prompts of 8 chunks over 50
    # shared first chunks (the benchmark's fleet); bytes Python allocates per entry.
    first = [[10**6 + 256 * i + t for t in range(256)] for i in range(50)]
    idx = PrefixIndex(256)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for j in range(150):
            for s in range(8):
                own = 10**7 + (s * 150 + j) * 7 * 256
                toks = first[j % 50] + list(range(own, own + 7 * 256))
                idx.add_event(f"s{s}", chunk_hashes(toks, 256), None, toks)
        del toks
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert idx.size() == 8 * (150 * 7 + 50)
    assert used / idx.size() < 256, used / idx.size()
