"""vLLM-format publisher: decoded by a decoder written independently from vLLM's
published schema (msgspec Structs, not lmkv_async's encoder), against real servers."""

from __future__ import annotations

import asyncio
import itertools
import random
import subprocess
import sys
import time
from typing import Any

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio
from storer import LmcacheStorer, astore

import lmkv_async as lmkv
from lmkv_async.testing import free_port
from lmkv_async.vllm_events import VllmEventPublisher
from lmkv_async.wire.events import (
    KVRemoved,
    KVStored,
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    encode_vllm_batch,
)
from lmkv_async.wire.hashing import chunk_hashes

LAYOUT = lmkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                       block_size=16)
C = 256


# --- vLLM's schema (vllm/distributed/kv_events.py), written out here: positional form
class ArrBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class ArrEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class BlockStored(ArrEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(ArrEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(ArrEvent):
    pass


class ArrKVBatch(ArrBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# --- the map form (vLLM after its PR 42892): events are tagged maps, the batch positional
class MapEvent(msgspec.Struct, omit_defaults=True, tag_field="type", tag=True):
    pass


class MBlockStored(MapEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class MBlockRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class MAllBlocksCleared(MapEvent, tag="AllBlocksCleared"):
    pass


class MapKVBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[MBlockStored | MBlockRemoved | MAllBlocksCleared]
    data_parallel_rank: int | None = None


ARR = msgspec.msgpack.Decoder(ArrKVBatch)
MAP = msgspec.msgpack.Decoder(MapKVBatch)


def low64(h: bytes) -> int:
    return int.from_bytes(h, "big") & (2**64 - 1)


def test_encoding_both_forms_decode_with_the_published_schema() -> None:
    evs = [VllmBlockStored((1, 2**64 - 1), None, (5, 6), 256, "CPU"),
           VllmBlockRemoved((7,), "CPU"), VllmAllBlocksCleared()]
    a = ARR.decode(encode_vllm_batch(1.5, evs, data_parallel_rank=2))
    assert a.ts == 1.5 and a.data_parallel_rank == 2
    assert a.events == [BlockStored([1, 2**64 - 1], None, [5, 6], 256, None, "CPU", None),
                        BlockRemoved([7], "CPU"), AllBlocksCleared()]
    m = MAP.decode(encode_vllm_batch(2.0, evs, encoding="map"))
    assert m.events == [MBlockStored([1, 2**64 - 1], None, [5, 6], 256, None, "CPU", None),
                        MBlockRemoved([7], "CPU"), MAllBlocksCleared()]
    b = ARR.decode(encode_vllm_batch(0.0, [VllmBlockStored((b"\x01" * 32,), b"\x02" * 32,
                                                           (1,), 16, "CPU")]))
    assert b.events[0].block_hashes == [b"\x01" * 32]


async def _recv(sub: zmq.asyncio.Socket, timeout: float = 10.0) -> list[bytes]:
    if not await sub.poll(int(timeout * 1000)):
        raise AssertionError("nothing published")
    return list(await sub.recv_multipart())


@pytest.mark.anyio
@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_publisher_republishes_lmcache_events(server_factory: Any, encoding: str) -> None:
    srv = server_factory("0.5.7rc2", l1_size_gb=0.2)
    model = f"vllm-{time.monotonic_ns()}"
    pub_port, rep_port = free_port(), free_port()
    storer = LmcacheStorer(srv, model)
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    dec = ARR if encoding == "array" else MAP
    try:
        async with lmkv.Fleet({"gpu-0": (srv.url, srv.http_url)}, model_name=model,
                              layout=LAYOUT) as fleet:
            pub = VllmEventPublisher(fleet["gpu-0"], endpoint=f"tcp://127.0.0.1:{pub_port}",
                                     replay_endpoint=f"tcp://127.0.0.1:{rep_port}",
                                     topic="kv", encoding=encoding)  # type: ignore[arg-type]
            async with pub:
                sub.connect(f"tcp://127.0.0.1:{pub_port}")
                await asyncio.sleep(0.3)  # PUB/SUB joins late
                seq = random.Random(3).choices(range(2**31), k=2 * C)
                await astore(storer, seq)
                want = chunk_hashes(seq, C)
                stored = {}
                seqs = []
                while len(stored) < 2:
                    topic, seqno, payload = await _recv(sub)
                    assert topic == b"kv" and len(seqno) == 8
                    seqs.append(int.from_bytes(seqno, "big"))
                    for ev in dec.decode(payload).events:
                        assert type(ev).__name__.endswith("BlockStored")
                        stored[ev.block_hashes[0]] = ev
                assert set(stored) == {low64(h) for h in want}
                first, second = stored[low64(want[0])], stored[low64(want[1])]
                assert first.parent_block_hash is None
                assert second.parent_block_hash == low64(want[0])
                assert first.token_ids == seq[:C] and second.token_ids == seq[C:]
                assert first.block_size == C and first.medium == "CPU"
                assert first.lora_id is None
                # Stores through the fleet emit no LMCache event; the publisher
                # announces them from the fleet's own bookkeeping.
                own = random.Random(4).choices(range(2**31), k=C)
                await fleet["gpu-0"].store(torch.zeros(2, 2, C, 128, dtype=torch.bfloat16), own)
                topic, seqno, payload = await _recv(sub)
                seqs.append(int.from_bytes(seqno, "big"))
                (ev,) = dec.decode(payload).events
                assert ev.block_hashes == [low64(chunk_hashes(own, C)[0])]
                # Removals: clear the server.
                ctx_ = await fleet["gpu-0"].context()
                await ctx_._s.rpc(ctx_._s.transport.pick(),
                                  lmkv.wire.requests.clear(ctx_._s.d, force=True),
                                  time.monotonic() + 5)
                topic, seqno, payload = await _recv(sub)
                seqs.append(int.from_bytes(seqno, "big"))
                (ev,) = dec.decode(payload).events
                assert type(ev).__name__.endswith("BlockRemoved")
                assert set(ev.block_hashes) == {low64(h) for h in want} | {
                    low64(chunk_hashes(own, C)[0])}
                assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # gap-free
                # Replay from the second batch: a ROUTER answering [b"", seq].
                rep = ctx.socket(zmq.DEALER)
                rep.setsockopt(zmq.LINGER, 0)
                rep.connect(f"tcp://127.0.0.1:{rep_port}")
                await rep.send_multipart([b"", (seqs[1]).to_bytes(8, "big")])
                got = []
                while True:
                    frames = await asyncio.wait_for(rep.recv_multipart(), 5)
                    assert frames[0] == b""
                    n = int.from_bytes(frames[1], "big", signed=True)
                    if n == -1:
                        assert frames[2] == b""
                        break
                    dec.decode(frames[2])
                    got.append(n)
                assert got == seqs[1:]
                rep.close()
    finally:
        sub.close()
        ctx.term()
        await asyncio.to_thread(storer.close)


def test_cli_entry_point_help() -> None:
    out = subprocess.run([sys.executable, "-m", "lmkv_async.vllm_events", "--help"],
                         capture_output=True, text=True, timeout=120, check=True)
    assert "--server" in out.stdout and "--encoding" in out.stdout
    assert "--router-block-size" in out.stdout and "--hash-mode" in out.stdout


# --- translation at the router's block size (no server: a stand-in member)
class _Fleet:
    model_name = "m"

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self._own_store_listeners: list[Any] = []


class _Member:
    name = "s"

    def __init__(self, chunk_size: int = 64) -> None:
        self.fleet = _Fleet(chunk_size)


def _pub(**kw: Any) -> VllmEventPublisher:
    return VllmEventPublisher(_Member(kw.pop("chunk", 64)), endpoint="inproc://x",  # type: ignore[arg-type]
                              **kw)


def _records(toks: list[int], C: int = 64) -> list[KVStored]:
    hs = chunk_hashes(toks, C)
    return [KVStored(i, "m", (hs[i],), hs[i - 1] if i else None,
                     tuple(toks[i * C:(i + 1) * C]), "CPU") for i in range(len(hs))]


def test_block_size_must_divide_the_chunk_and_bad_arguments_are_typed() -> None:
    for bad in ({"block_size": 24}, {"block_size": 0}, {"block_size": 16.0},
                {"hash_mode": "sha"}, {"reset": "drop"}, {"encoding": "json"},
                {"worker_id": -1}, {"block_hash_format": "hex"}):
        with pytest.raises(lmkv.errors.InvalidInputError):
            _pub(**bad)
    assert _pub(block_size=16).block_size == 16 and _pub().block_size == 64


def test_an_ipc_path_too_long_to_bind_is_refused_before_any_socket() -> None:
    """ZMQ would refuse it only at bind time, after the PUB socket is already bound."""
    long_dir = "/tmp/" + "d" * 120
    member = _Member()
    for kw in ({"endpoint": f"ipc://{long_dir}/pub"},
               {"endpoint": "ipc:///tmp/pub", "replay_endpoint": f"ipc://{long_dir}/rep"},
               {"endpoint": "127.0.0.1:5557"}):
        with pytest.raises(lmkv.errors.InvalidInputError, match="endpoint"):
            VllmEventPublisher(member, **kw)  # type: ignore[arg-type]
    ok = VllmEventPublisher(member, endpoint="ipc:///tmp/" + "p" * 90)  # type: ignore[arg-type]
    assert ok.endpoint.endswith("p" * 90)


def test_parents_first_one_batch_exact_removals_and_resets() -> None:
    C, B = 64, 16
    toks = random.Random(5).choices(range(2**31), k=3 * C)
    recs = _records(toks)
    pub = _pub(block_size=B)
    evs = pub.translate([recs[2], recs[1], recs[0]])  # out of order, one store
    assert [type(e) for e in evs] == [VllmBlockStored] * 3
    stored: list[VllmBlockStored] = evs  # type: ignore[assignment]
    assert [e.token_ids for e in stored] == [tuple(toks[i * C:(i + 1) * C]) for i in range(3)]
    assert all(len(e.block_hashes) == C // B and e.block_size == B for e in stored)
    assert stored[0].parent_block_hash is None
    for a, b in itertools.pairwise(stored):
        assert b.parent_block_hash == a.block_hashes[-1]
    # The last block of a chunk is named by the chunk's LMCache hash (low 64 bits).
    assert [e.block_hashes[-1] for e in stored] == [low64(r.block_hashes[0]) for r in recs]
    assert len({h for e in stored for h in e.block_hashes}) == 3 * C // B
    # Announced once: the same record again sends nothing.
    assert pub.translate([recs[1]]) == []
    # Removal of chunk 1: exactly its four blocks.
    (rm,) = pub.translate([KVRemoved(9, "m", (recs[1].block_hashes[0],), "CPU")])
    assert isinstance(rm, VllmBlockRemoved) and rm.block_hashes == stored[1].block_hashes
    assert pub.translate([KVRemoved(9, "m", (recs[1].block_hashes[0],), "CPU")]) == []
    # Resync that discards: a clear, or removals of what is left with reset="remove".
    from lmkv_async.wire.events import KVResync
    resync = KVResync("restart", 2, 0, True, True)
    assert pub.translate([resync]) == [VllmAllBlocksCleared()]
    pub2 = _pub(block_size=B, reset="remove")
    pub2.translate(recs)
    (rm2,) = pub2.translate([resync])
    assert isinstance(rm2, VllmBlockRemoved)
    assert set(rm2.block_hashes) == {h for e in stored for h in e.block_hashes}


def test_orphans_wait_for_their_parent_and_lost_parents_are_not_announced() -> None:
    C = 64
    toks = random.Random(6).choices(range(2**31), k=2 * C)
    recs = _records(toks)
    pub = _pub(block_size=16)
    assert pub.translate([recs[1]]) == []  # waits for chunk 0
    evs = pub.translate([recs[0]])
    assert len(evs) == 2 and evs[0].parent_block_hash is None  # type: ignore[union-attr]
    # The server sent None as the parent of a chunk that is not a first chunk.
    lost = KVStored(3, "m", (chunk_hashes(toks[C:] + toks, C)[1],), None,
                    tuple(toks[:C]), "CPU")
    assert _pub(block_size=16).translate([lost]) == []
    # At B == C, in dynamo mode, the stream is LMCache's hashes as before.
    pub3 = _pub()
    evs = pub3.translate(recs)
    assert [e.block_hashes for e in evs] == [  # type: ignore[union-attr]
        (low64(r.block_hashes[0]),) for r in recs]
