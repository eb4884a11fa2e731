"""Republish LMCache's KV events as vLLM's KV-event stream, so vLLM-event routers see
LMCache's CPU tier.

Routers such as NVIDIA Dynamo's KV router, llm-d's KV-cache indexer and SGLang's
router learn what is cached from vLLM's ZMQ stream of msgpack ``EventBatch``\\es.
:class:`VllmEventPublisher` turns one fleet member's LMCache event stream into
exactly that stream: a PUB socket sending ``[topic, seq, payload]`` and a ROUTER
socket answering replay requests from a sequence number (the message layout is in
:mod:`lmkv_async.wire.events`). One publisher per server, like one vLLM engine per
endpoint: a consumer keys what it learns by endpoint.

Mapping (docs/fleet.md has the full table):

* ``KVStored`` -> ``BlockStored(block_hashes, parent_block_hash, token_ids,
  block_size=chunk size, lora_id=None, medium="CPU", lora_name=None)``;
* ``KVRemoved`` -> ``BlockRemoved(block_hashes, medium="CPU")``, only for hashes this
  publisher announced (like LMCache's own vLLM adapter does);
* a ``KVResync`` that discards (restart, lost range) -> ``BlockRemoved`` of every
  announced hash, so consumers withdraw them;
* stores made through the fleet (engine-driven, no LMCache event) -> ``BlockStored``
  from the fleet's own bookkeeping.

Hashes are LMCache's 32-byte object hashes; ``block_hash_format="int"`` sends their
low 64 bits as vLLM does with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``. Records name
no salt, so no ``extra_keys`` are sent.

Command line (one publisher per ``--server``; ports count up from ``--port``)::

    python -m lmkv_async.vllm_events --model m --layers 32 --kv-heads 8 --head-dim 128 \\
        --server gpu-0=tcp://127.0.0.1:5555,http://127.0.0.1:8080 --port 5557
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import zmq
import zmq.asyncio

from .errors import KVCacheError, UnsupportedOperationError
from .wire.events import (
    KVRemoved,
    KVResync,
    KVStored,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmEvent,
    decode_replay_request,
    encode_replay_end,
    encode_replay_item,
    encode_seq,
    encode_vllm_batch,
    external_block_hash,
)

if TYPE_CHECKING:
    from .fleet import Fleet, FleetMember

__all__ = ["VllmEventPublisher", "main", "publish_fleet"]

log = logging.getLogger("lmkv_async.vllm_events")


class VllmEventPublisher:
    """vLLM's KV-event stream (PUB + replay ROUTER) for one fleet member.

    Args:
        member: the :class:`~lmkv_async.fleet.FleetMember` whose events to publish
            (the fleet must be open and the member joined).
        endpoint: PUB address to bind, e.g. ``"tcp://127.0.0.1:5557"``.
        replay_endpoint: ROUTER address to bind for replays, or None.
        topic: the first frame of every PUB message (vLLM's ``topic``).
        encoding: ``"array"`` (positional events, vLLM <= 0.23 and what most
            consumers decode) or ``"map"`` (named fields, newer vLLM).
        block_hash_format: ``"int"`` (low 64 bits) or ``"bytes"`` (all 32).
        buffer_steps: batches kept for replay.
        data_parallel_rank: the batch's ``data_parallel_rank`` field.
    """

    def __init__(self, member: FleetMember, *, endpoint: str,
                 replay_endpoint: str | None = None, topic: str = "",
                 encoding: Literal["array", "map"] = "array",
                 block_hash_format: Literal["int", "bytes"] = "int",
                 buffer_steps: int = 10_000, data_parallel_rank: int = 0) -> None:
        if encoding not in ("array", "map") or block_hash_format not in ("int", "bytes"):
            raise ValueError("encoding must be 'array'|'map', block_hash_format 'int'|'bytes'")
        self.member = member
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._encoding: Literal["array", "map"] = encoding
        self._fmt: Literal["int", "bytes"] = block_hash_format
        self._dp = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._announced: set[bytes] = set()
        self._ctx = zmq.asyncio.Context.instance()
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.published = 0  # batches

    def __repr__(self) -> str:
        return f"<VllmEventPublisher {self.member.name} {self.endpoint} seq={self._seq}>"

    async def start(self) -> VllmEventPublisher:
        """Bind the sockets and start following the member's events."""
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(self.endpoint)
        if self.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(self.replay_endpoint)
            self._tasks.append(asyncio.create_task(self._serve_replay(),
                                                   name="lmkv-vllm-replay"))
        self._tasks.append(asyncio.create_task(self._follow(), name="lmkv-vllm-follow"))
        self.member.fleet._own_store_listeners.append(self._on_own_store)
        return self

    async def aclose(self) -> None:
        """Stop and close the sockets."""
        with contextlib.suppress(ValueError):
            self.member.fleet._own_store_listeners.remove(self._on_own_store)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close()
        self._pub = self._replay = None

    async def __aenter__(self) -> VllmEventPublisher:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ translation
    def _ext(self, h: bytes) -> int | bytes:
        return external_block_hash(h, self._fmt)

    def translate(self, ev: KVStored | KVRemoved | KVResync) -> list[VllmEvent]:
        """vLLM events for one LMCache record (updates what was announced)."""
        if isinstance(ev, KVStored):
            fresh = [h for h in ev.block_hashes if h not in self._announced]
            if not fresh or not ev.token_ids:
                return []
            self._announced.update(fresh)
            parent = ev.parent_block_hash
            return [VllmBlockStored(
                block_hashes=tuple(self._ext(h) for h in fresh),
                parent_block_hash=None if parent is None else self._ext(parent),
                token_ids=ev.token_ids, block_size=self.member.fleet.chunk_size,
                medium=ev.medium)]
        if isinstance(ev, KVRemoved):
            gone = [h for h in ev.block_hashes if h in self._announced]
            if not gone:
                return []
            self._announced.difference_update(gone)
            return [VllmBlockRemoved(tuple(self._ext(h) for h in gone), "CPU")]
        if ev.discard and self._announced:
            gone = sorted(self._announced)
            self._announced.clear()
            return [VllmBlockRemoved(tuple(self._ext(h) for h in gone), "CPU")]
        return []

    def _on_own_store(self, name: str, hashes: Sequence[bytes], tokens: Sequence[int]) -> None:
        if name != self.member.name:
            return
        C = self.member.fleet.chunk_size
        events: list[VllmEvent] = []
        parent: bytes | None = None
        for i, h in enumerate(hashes):
            rec = KVStored(0, self.member.fleet.model_name, (h,), parent,
                           tuple(tokens[i * C:(i + 1) * C]), "CPU")
            events.extend(self.translate(rec))
            parent = h
        self.publish(events)

    def publish(self, events: Sequence[VllmEvent]) -> None:
        """Send one ``EventBatch`` (nothing when ``events`` is empty)."""
        if not events or self._pub is None:
            return
        payload = encode_vllm_batch(time.time(), events, data_parallel_rank=self._dp,
                                    encoding=self._encoding)
        seq = self._seq
        self._seq += 1
        try:
            self._pub.send_multipart([self._topic, encode_seq(seq), payload], zmq.NOBLOCK)
        except zmq.Again:  # PUB drops at its high-water mark, as vLLM's does
            log.debug("PUB queue full; batch %d only in the replay buffer", seq)
        self._buffer.append((seq, payload))
        self.published += 1

    # ------------------------------------------------------------------ tasks
    async def _follow(self) -> None:
        delay = 0.1
        while True:
            try:
                stream = self.member.kv_events(max_events=1024)
            except UnsupportedOperationError as exc:
                log.warning("%s has no KV-event stream: %s", self.member.name, exc)
                return
            except KVCacheError as exc:  # not joined yet
                log.debug("publisher for %s waits: %s", self.member.name, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            try:
                async with stream:
                    while True:
                        ev = await stream.next()
                        self.publish(self.translate(ev))  # one batch a record
                        delay = 0.1
            except UnsupportedOperationError as exc:
                log.warning("%s records no KV events: %s", self.member.name, exc)
                return
            except KVCacheError as exc:
                log.info("event stream of %s failed (%s); resubscribing", self.member.name, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _serve_replay(self) -> None:
        sock = self._replay
        assert sock is not None
        while True:
            frames = await sock.recv_multipart()
            start = decode_replay_request(frames)
            if start is None:
                log.debug("ignoring a malformed replay request (%d frames)", len(frames))
                continue
            ident = bytes(frames[0])
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await sock.send_multipart(encode_replay_item(ident, seq, payload))
            await sock.send_multipart(encode_replay_end(ident))


async def publish_fleet(fleet: Fleet, *, host: str = "127.0.0.1", port: int = 5557,
                        **kwargs: object) -> list[VllmEventPublisher]:
    """One publisher per member, in member order: member ``i`` publishes on port
    ``port + 2*i`` and answers replays on ``port + 2*i + 1``."""
    pubs = []
    for i, member in enumerate(fleet.members.values()):
        pub = VllmEventPublisher(member, endpoint=f"tcp://{host}:{port + 2 * i}",
                                 replay_endpoint=f"tcp://{host}:{port + 2 * i + 1}",
                                 **kwargs)  # type: ignore[arg-type]
        pubs.append(await pub.start())
    return pubs


def main(argv: list[str] | None = None) -> int:
    """``python -m lmkv_async.vllm_events``: publish until SIGINT/SIGTERM."""
    import torch

    from .fleet import Fleet
    from .layout import KVLayout

    p = argparse.ArgumentParser(prog="python -m lmkv_async.vllm_events",
                                description="LMCache KV events as vLLM's KV-event stream")
    p.add_argument("--server", action="append", required=True,
                   help="NAME=ZMQ_URL,HTTP_URL (repeat; publishers in this order)")
    p.add_argument("--model", required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--kv-heads", type=int, required=True)
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument("--port", type=int, default=5557,
                   help="first PUB port; replay = PUB + 1; the next server + 2")
    p.add_argument("--topic", default="")
    p.add_argument("--encoding", choices=("array", "map"), default="array")
    p.add_argument("--block-hash-format", choices=("int", "bytes"), default="int")
    args = p.parse_args(argv)
    servers: dict[str, tuple[str, str]] = {}
    for spec in args.server:
        name, _, rest = spec.partition("=")
        parts = rest.split(",")
        if not name or len(parts) != 2:
            p.error(f"bad --server {spec!r}")
        servers[name] = (parts[0], parts[1])
    layout = KVLayout(num_layers=args.layers, num_kv_heads=args.kv_heads,
                      head_dim=args.head_dim, dtype=getattr(torch, args.dtype),
                      block_size=args.block_size, world_size=args.world_size)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with Fleet(servers, model_name=args.model, layout=layout) as fleet:
            pubs = await publish_fleet(fleet, host=args.host, port=args.port,
                                       topic=args.topic, encoding=args.encoding,
                                       block_hash_format=args.block_hash_format)
            for pub in pubs:
                print(f"{pub.member.name}: PUB {pub.endpoint} replay {pub.replay_endpoint}",
                      flush=True)
            await stop.wait()
            for pub in pubs:
                await pub.aclose()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
