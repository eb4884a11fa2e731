"""vLLM-format publisher: decoded by a decoder written independently from vLLM's
published schema (msgspec Structs, not lmkv_async's encoder), against real servers."""

from __future__ import annotations

import asyncio
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
