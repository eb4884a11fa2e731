"""Republish LMCache's KV events as vLLM's KV-event stream, so vLLM-event routers see
LMCache's CPU tier.

Routers such as NVIDIA Dynamo's KV router, llm-d's KV-cache indexer and SGLang's
router learn what is cached from vLLM's ZMQ stream of msgpack ``EventBatch``\\es.
:class:`VllmEventPublisher` turns one fleet member's LMCache event stream into
exactly that stream: a PUB socket sending ``[topic, seq, payload]`` and a ROUTER
socket answering replay requests from a sequence number (the message layout is in
:mod:`lmkv_async.wire.events`). One publisher per server, like one vLLM engine per
endpoint: a consumer keys what it learns by endpoint (Dynamo: by the worker id it
was given for that endpoint, so give it the id of the engine that loads from this
server; docs/routers.md).

A router runs at its engines' block size ``B``; LMCache stores chunks of ``C``
tokens (``B`` must divide ``C``). Each chunk is announced as ``C/B`` blocks of
``B`` tokens, named by ``hash_mode`` (:mod:`lmkv_async._vllm_hash`):

* ``"dynamo"``: a chain derived from LMCache's hashes (Dynamo matches prompts
  by hashing ``token_ids`` itself); at ``B == C`` these are LMCache's hashes;
* ``"vllm"``: vLLM's ``sha256_cbor`` block hash under ``hash_seed``, which
  llm-d and vllm-router recompute from the prompt.

Mapping:

* the ``KVStored`` records of one store -> one batch of ``BlockStored``, parents
  before children (a record whose parent is not announced yet waits for it);
* ``KVRemoved`` -> ``BlockRemoved`` of exactly the blocks that chunk was announced as;
* a ``KVResync`` that discards (restart, lost range) -> ``AllBlocksCleared``
  (``reset="clear"``) or ``BlockRemoved`` of every announced block
  (``reset="remove"``: for a publisher sharing its worker id with the engine's
  own stream, as Dynamo 1.6.1 clears the engine's GPU blocks too on a clear);
* stores made through the fleet (engine-driven, no LMCache event) -> ``BlockStored``
  from the fleet's own bookkeeping.

Background work (following the member's stream, noting subscriptions, answering
replays) runs as jobs of a :class:`~lmkv_async._background.Background` the
publisher owns, the same on asyncio and trio: ``async with publisher:`` enters
its task group in the caller's task, ``await publisher.start()`` hosts it in a
task of its own, and :meth:`VllmEventPublisher.aclose` ends it.

Command line (one publisher per ``--server``; ports count up from ``--port``)::

    python -m lmkv_async.vllm_events --model m --layers 32 --kv-heads 8 --head-dim 128 \\
        --server gpu-0=tcp://127.0.0.1:5555,http://127.0.0.1:8080 --port 5557 \\
        --router-block-size 16 --hash-mode dynamo
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import anyio
import zmq

from . import _zsock
from ._background import Background, Job
from ._shield import Once
from ._vllm_hash import (
    VLLM_DEFAULT_SEED,
    HashMode,
    dynamo_chunk_blocks,
    external_hash,
    vllm_block_hash,
    vllm_none_hash,
)
from ._waits import wait_event
from .errors import ClosedError, InvalidInputError, KVCacheError, UnsupportedOperationError
from .wire.events import (
    KVRemoved,
    KVResync,
    KVStored,
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmEvent,
    decode_replay_request,
    encode_replay_end,
    encode_replay_item,
    encode_seq,
    encode_vllm_batch,
)
from .wire.hashing import hash_chunk
from .wire.keys import token_bytes

if TYPE_CHECKING:
    from .fleet import Fleet, FleetMember

__all__ = ["VllmEventPublisher", "dynamo_workers_arg", "main", "publish_fleet"]

log = logging.getLogger("lmkv_async.vllm_events")

Record = KVStored | KVRemoved | KVResync

_NOBLOCK = int(zmq.NOBLOCK)


#: ``ipc://`` paths are Unix socket paths: at most this many bytes (``sun_path`` less its NUL)
_IPC_PATH_MAX = 107


def _check_endpoint(name: str, endpoint: object) -> None:
    """A clear error for an endpoint ZMQ would refuse at bind time (after the first
    socket is already bound)."""
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise InvalidInputError(f"{name} must be a ZMQ address such as 'tcp://127.0.0.1:5557'")
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        size = len(path.encode())
        if size > _IPC_PATH_MAX:
            raise InvalidInputError(
                f"{name}: an ipc:// path holds at most {_IPC_PATH_MAX} bytes, this one "
                f"{size} ({path!r}); use a shorter directory such as /tmp")


class VllmEventPublisher:
    """vLLM's KV-event stream (PUB + replay ROUTER) for one fleet member.

    Args:
        member: the :class:`~lmkv_async.fleet.FleetMember` whose events to publish
            (the fleet must be open and the member joined).
        endpoint: PUB address to bind, e.g. ``"tcp://127.0.0.1:5557"``.
        replay_endpoint: ROUTER address to bind for replays, or None.
        topic: the first frame of every PUB message (vLLM's ``topic``).
        encoding: ``"map"`` (named fields: vLLM 0.26 and later, the default) or
            ``"array"`` (positional events: older vLLM, llm-d 0.8).
        block_hash_format: ``"int"`` (low 64 bits, vLLM's default and what Dynamo
            reads) or ``"bytes"`` (all 32).
        block_size: the router's block size ``B`` (must divide the chunk size);
            None: the chunk size.
        hash_mode: ``"dynamo"`` or ``"vllm"`` (see the module docstring).
        hash_seed: the vLLM hash seed (vLLM's ``PYTHONHASHSEED``, else
            ``"vllm-none-hash"``), for ``hash_mode="vllm"``.
        reset: what a discarding resync sends: ``"clear"`` or ``"remove"``.
        buffer_steps: batches kept for replay.
        data_parallel_rank: the batch's ``data_parallel_rank`` field.
        worker_id: the consumer-side worker id this stream belongs to (the engine
            that loads from this server); only reported, see
            :func:`dynamo_workers_arg`.
        max_waiting: records kept while they wait for their parent.
    """

    def __init__(self, member: FleetMember, *, endpoint: str,
                 replay_endpoint: str | None = None, topic: str = "",
                 encoding: Literal["array", "map"] = "map",
                 block_hash_format: Literal["int", "bytes"] = "int",
                 block_size: int | None = None, hash_mode: HashMode = "dynamo",
                 hash_seed: str = VLLM_DEFAULT_SEED,
                 reset: Literal["clear", "remove"] = "clear",
                 buffer_steps: int = 10_000, data_parallel_rank: int = 0,
                 worker_id: int | None = None, max_waiting: int = 4096) -> None:
        if encoding not in ("array", "map") or block_hash_format not in ("int", "bytes"):
            raise InvalidInputError(
                "encoding must be 'array'|'map', block_hash_format 'int'|'bytes'")
        if hash_mode not in ("dynamo", "vllm"):
            raise InvalidInputError("hash_mode must be 'dynamo' or 'vllm'")
        if reset not in ("clear", "remove"):
            raise InvalidInputError("reset must be 'clear' or 'remove'")
        if block_size is not None and (type(block_size) is not int or block_size <= 0):
            raise InvalidInputError("block_size must be a positive int or None")
        if not isinstance(hash_seed, str):
            raise InvalidInputError("hash_seed must be a string")
        if worker_id is not None and (type(worker_id) is not int or worker_id < 0):
            raise InvalidInputError("worker_id must be a non-negative int or None")
        _check_endpoint("endpoint", endpoint)
        if replay_endpoint is not None:
            _check_endpoint("replay_endpoint", replay_endpoint)
        self.member = member
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.worker_id = worker_id
        self.hash_mode: HashMode = hash_mode
        self._topic = topic.encode()
        self._encoding: Literal["array", "map"] = encoding
        self._fmt: Literal["int", "bytes"] = block_hash_format
        self._reset = reset
        self._dp = data_parallel_rank
        self._B = block_size
        self._none = vllm_none_hash(hash_seed)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        #: LMCache chunk hash -> the block hashes it was announced as (raw 32 bytes)
        self._announced: dict[bytes, tuple[bytes, ...]] = {}
        #: parent chunk hash -> records waiting for it to be announced
        self._waiting: dict[bytes, list[KVStored]] = {}
        self._n_waiting = 0
        self._max_waiting = max_waiting
        # The process-wide context: one I/O thread, and no context of ours to terminate.
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        #: where the jobs run: entered by ``async with``, hosted by a plain start()
        self._bg = Background(f"vllm-events {member.name}")
        self._entered = False
        self._started = False
        self._jobs: list[Job[None]] = []
        #: the close runs once; every aclose() waits for it (shielded)
        self._closer = Once()
        self.published = 0  # batches
        self.blocks = 0  # BlockStored block hashes sent
        self.subscriptions = 0  # subscribe messages received (XPUB drops duplicates)
        #: made on first use: an anyio.Event needs a running event loop
        self._subscribed: anyio.Event | None = None
        self._check_block_size()

    def __repr__(self) -> str:
        return (f"<VllmEventPublisher {self.member.name} {self.endpoint} "
                f"B={self._B} {self.hash_mode} seq={self._seq}>")

    @property
    def block_size(self) -> int:
        """The router block size in use (0 until the chunk size is known)."""
        return self._B or self.member.fleet.chunk_size

    def _check_block_size(self) -> None:
        C = self.member.fleet.chunk_size
        if self._B is not None and C and C % self._B:
            raise InvalidInputError(
                f"block_size {self._B} does not divide the chunk size {C}")

    async def start(self) -> VllmEventPublisher:
        """Bind the sockets and start following the member's events.

        The publisher's background work then runs in a task of its own (hosted:
        an asyncio task, a trio system task) until :meth:`aclose`; ``async with``
        runs it inside the caller's block instead.
        """
        self._bind()
        try:
            await self._bg.host()
        except BaseException:
            self._close_sockets()
            raise
        self._start_jobs()
        return self

    async def __aenter__(self) -> VllmEventPublisher:
        self._bind()
        try:
            await self._bg.__aenter__()
        except BaseException:
            self._close_sockets()
            raise
        self._entered = True
        self._start_jobs()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: Any) -> None:
        try:
            await self.aclose()
        finally:
            if self._entered:  # the group was entered in this (the caller's) task
                self._entered = False
                await self._bg.__aexit__(exc_type, exc, tb)

    def _bind(self) -> None:
        """Check, then bind the sockets (closing them again if a bind fails)."""
        if self._started or self._closer.started:
            raise ClosedError("a VllmEventPublisher is started once (make a new one)")
        self._check_block_size()  # before any socket: a bad size sends nothing
        try:
            # XPUB: sends exactly what a PUB does, and also tells us when a consumer's
            # subscription arrived (wait_subscribed), which a PUB cannot. Plain sockets
            # awaited through anyio (:mod:`._zsock`): the same on asyncio and trio.
            self._pub = zmq.Socket(self._ctx, zmq.XPUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(self.endpoint)
            if self.replay_endpoint:
                self._replay = zmq.Socket(self._ctx, zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.replay_endpoint)
        except BaseException:
            self._close_sockets()
            raise
        self._started = True

    def _start_jobs(self) -> None:
        bg = self._bg
        self._jobs.append(bg.start_soon(self._watch_subscriptions, name="lmkv-vllm-subs"))
        if self._replay is not None:
            self._jobs.append(bg.start_soon(self._serve_replay, name="lmkv-vllm-replay"))
        self._jobs.append(bg.start_soon(self._follow, name="lmkv-vllm-follow"))
        self.member.fleet._own_store_listeners.append(self._on_own_store)

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                _zsock.close(sock)
        self._pub = self._replay = None

    async def aclose(self) -> None:
        """Stop the background work, close the sockets and end the publisher's task
        group. Idempotent, shielded and bounded: the caller's cancellation does not
        cut it short (it is raised again afterwards)."""
        await self._closer.run(self._teardown)

    async def _teardown(self) -> None:
        with contextlib.suppress(ValueError):
            self.member.fleet._own_store_listeners.remove(self._on_own_store)
        for job in self._jobs:
            job.cancel()
        for job in self._jobs:  # each ends at its next await (its stream closes itself)
            await job.wait()
        self._jobs.clear()
        self._close_sockets()
        # Hosted: ends the host task and waits for it; entered: __aexit__ ends the group.
        await self._bg.aclose()

    def _subscribed_event(self) -> anyio.Event:
        if self._subscribed is None:
            self._subscribed = anyio.Event()
            if self.subscriptions:
                self._subscribed.set()
        return self._subscribed

    async def wait_subscribed(self, timeout: float) -> None:
        """Wait until a consumer has subscribed (batches before that are only in the
        replay buffer: PUB/SUB delivers nothing to a subscriber that has not joined).

        Raises :class:`TimeoutError` after ``timeout`` seconds.
        """
        if not await wait_event(self._subscribed_event(), timeout):
            raise TimeoutError(f"no consumer subscribed within {timeout} s")

    # ------------------------------------------------------------------ translation
    def _blocks_of(self, rec: KVStored, packed: bytes, n: int) -> list[bytes] | None:
        """Raw block hashes of one chunk record, or None if its parent is unknown."""
        parent = rec.parent_block_hash
        h = rec.block_hashes[0]
        if self.hash_mode == "dynamo":
            return dynamo_chunk_blocks(parent, h, packed, n)
        if parent is None:
            prev = self._none
        else:
            announced = self._announced.get(parent)
            if announced is None:
                return None
            prev = announced[-1]
        toks = rec.token_ids
        B = len(toks) // n
        out: list[bytes] = []
        for j in range(n):
            prev = vllm_block_hash(prev, toks[j * B:(j + 1) * B])
            out.append(prev)
        return out

    def _store(self, rec: KVStored, out: list[VllmEvent], verify_root: bool = True) -> None:
        """Announce one single-chunk record, then any record that waited for it."""
        stack = [rec]
        C = self.member.fleet.chunk_size
        B = self._B or C
        while stack:
            r = stack.pop()
            h = r.block_hashes[0]
            if h in self._announced or len(r.token_ids) != C:
                continue
            parent = r.parent_block_hash
            packed = token_bytes(r.token_ids)
            if parent is None and verify_root and hash_chunk(None, packed) != h:
                # The server lost the parent: this chunk is not a sequence's first,
                # and a router would take it for one. Unreachable; not announced.
                log.debug("record %d has no known parent; not announced", r.seq)
                continue
            if parent is not None and parent not in self._announced:
                self._wait(parent, r)
                continue
            n = C // B
            raw = self._blocks_of(r, packed, n)
            if raw is None:  # pragma: no cover - the parent check above covers it
                continue
            self._announced[h] = tuple(raw)
            ext_parent = None
            if parent is not None:
                ext_parent = external_hash(self._announced[parent][-1], self._fmt)
            out.append(VllmBlockStored(
                block_hashes=tuple(external_hash(x, self._fmt) for x in raw),
                parent_block_hash=ext_parent, token_ids=r.token_ids, block_size=B,
                medium=r.medium))
            self.blocks += n
            children = self._waiting.pop(h, None)
            if children:
                self._n_waiting -= len(children)
                stack.extend(reversed(children))

    def _wait(self, parent: bytes, rec: KVStored) -> None:
        if self._n_waiting >= self._max_waiting:
            # Bounded: a record whose parent never comes (announced before this
            # publisher started, or removed) must not grow memory forever.
            oldest = next(iter(self._waiting))
            self._n_waiting -= len(self._waiting.pop(oldest))
        self._waiting.setdefault(parent, []).append(rec)
        self._n_waiting += 1

    def _split(self, rec: KVStored) -> Iterable[KVStored]:
        """Records as single chunks (the server sends one chunk a record; be safe)."""
        if len(rec.block_hashes) == 1:
            yield rec
            return
        C = self.member.fleet.chunk_size
        parent = rec.parent_block_hash
        for i, h in enumerate(rec.block_hashes):
            yield KVStored(rec.seq, rec.model_name, (h,), parent,
                           rec.token_ids[i * C:(i + 1) * C], rec.medium)
            parent = h

    def _removed(self, hashes: Iterable[bytes]) -> list[VllmEvent]:
        gone: list[int | bytes] = []
        for h in hashes:
            blocks = self._announced.pop(h, None)
            if blocks is not None:
                gone.extend(external_hash(x, self._fmt) for x in blocks)
        return [VllmBlockRemoved(tuple(gone), "CPU")] if gone else []

    def translate(self, records: Sequence[Record], *, _own: bool = False) -> list[VllmEvent]:
        """vLLM events for LMCache records (one store's worth: one batch).

        Updates what was announced; stored records come out parents first.
        """
        out: list[VllmEvent] = []
        if not self.member.fleet.chunk_size:
            return out
        for ev in records:
            if isinstance(ev, KVStored):
                if ev.token_ids:
                    for r in self._split(ev):
                        self._store(r, out, verify_root=not _own)
            elif isinstance(ev, KVRemoved):
                out.extend(self._removed(ev.block_hashes))
            elif ev.discard:
                self._waiting.clear()
                self._n_waiting = 0
                if not self._announced:
                    continue  # a consumer has nothing of ours to forget
                if self._reset == "clear":
                    self._announced.clear()
                    out.append(VllmAllBlocksCleared())
                else:
                    out.extend(self._removed(list(self._announced)))
        return out

    def _on_own_store(self, name: str, hashes: Sequence[bytes], tokens: Sequence[int]) -> None:
        if name != self.member.name:
            return
        C = self.member.fleet.chunk_size
        recs: list[Record] = []
        parent: bytes | None = None
        for i, h in enumerate(hashes):
            recs.append(KVStored(0, self.member.fleet.model_name, (h,), parent,
                                 tuple(tokens[i * C:(i + 1) * C]), "CPU"))
            parent = h
        # The fleet hashed these itself from the start of the sequence: a None
        # parent is a true first chunk, no need to re-hash it.
        self.publish(self.translate(recs, _own=True))

    def publish(self, events: Sequence[VllmEvent]) -> None:
        """Send one ``EventBatch`` (nothing when ``events`` is empty)."""
        if not events or self._pub is None:
            return
        payload = encode_vllm_batch(time.time(), events, data_parallel_rank=self._dp,
                                    encoding=self._encoding)
        seq = self._seq
        self._seq += 1
        try:
            self._pub.send_multipart([self._topic, encode_seq(seq), payload], _NOBLOCK)
        except zmq.Again:  # PUB drops at its high-water mark, as vLLM's does
            log.debug("PUB queue full; batch %d only in the replay buffer", seq)
        self._buffer.append((seq, payload))
        self.published += 1
        # The send may have processed the socket's pending commands, consuming the
        # edge of its descriptor that the subscription job waits on: read what came.
        self._take_subscriptions()

    # ------------------------------------------------------------------ jobs
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
                await anyio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            try:
                async with stream:
                    while True:
                        recs: list[Record] = [await stream.next()]
                        # The rest of the server batch already received: one store's
                        # records travel together, so they become one vLLM batch.
                        while stream._pending:
                            recs.append(await stream.next())
                        if self.member.fleet.chunk_size:
                            self._check_block_size()
                        self.publish(self.translate(recs))
                        delay = 0.1
            except UnsupportedOperationError as exc:
                log.warning("%s records no KV events: %s", self.member.name, exc)
                return
            except InvalidInputError as exc:  # the chunk size became known only now
                log.error("publisher for %s stops: %s", self.member.name, exc)
                return
            except KVCacheError as exc:
                log.info("event stream of %s failed (%s); resubscribing", self.member.name, exc)
                await anyio.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _take_subscriptions(self) -> None:
        """Count the (un)subscribe messages the XPUB holds (non-blocking)."""
        sock = self._pub
        if sock is None:
            return
        while True:
            try:
                msg = sock.recv(_NOBLOCK)
            except zmq.Again:
                return
            if msg[:1] == b"\x01":
                self.subscriptions += 1
                self._subscribed_event().set()

    async def _watch_subscriptions(self) -> None:
        sock = self._pub
        assert sock is not None
        fd = int(sock.getsockopt(zmq.FD))
        try:
            while True:
                # Every wait right after a read that found nothing: the FD is
                # edge-triggered (publish() reads too, after each send).
                self._take_subscriptions()
                await anyio.wait_readable(fd)
        except (anyio.ClosedResourceError, zmq.ZMQError):
            return

    async def _serve_replay(self) -> None:
        sock = self._replay
        assert sock is not None
        while True:
            frames = await _zsock.recv_multipart(sock)
            start = decode_replay_request(frames)
            if start is None:
                log.debug("ignoring a malformed replay request (%d frames)", len(frames))
                continue
            ident = bytes(frames[0])
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await _zsock.send_multipart(sock, encode_replay_item(ident, seq, payload))
            await _zsock.send_multipart(sock, encode_replay_end(ident))


async def publish_fleet(fleet: Fleet, *, host: str = "127.0.0.1", port: int = 5557,
                        worker_ids: Mapping[str, int] | None = None,
                        **kwargs: object) -> list[VllmEventPublisher]:
    """One publisher per member, in member order: member ``i`` publishes on port
    ``port + 2*i`` and answers replays on ``port + 2*i + 1``.

    ``worker_ids``: member name -> the router's worker id for the engine that loads
    from that server (default: the member's position). Other keyword arguments go
    to every :class:`VllmEventPublisher`; a bad one raises before any socket opens.
    """
    ids = dict(worker_ids or {})
    pubs = []
    for i, member in enumerate(fleet.members.values()):
        pub = VllmEventPublisher(member, endpoint=f"tcp://{host}:{port + 2 * i}",
                                 replay_endpoint=f"tcp://{host}:{port + 2 * i + 1}",
                                 worker_id=ids.get(member.name, i),
                                 **kwargs)  # type: ignore[arg-type]
        pubs.append(pub)
    started: list[VllmEventPublisher] = []
    try:
        for pub in pubs:
            started.append(await pub.start())
    except BaseException:
        for pub in started:
            await pub.aclose()
        raise
    return started


def dynamo_workers_arg(pubs: Sequence[VllmEventPublisher]) -> str:
    """The ``--workers`` value of Dynamo's standalone indexer for these publishers:
    ``"<worker_id>=<PUB endpoint>,..."`` (each publisher's worker id, else its index)."""
    return ",".join(f"{p.worker_id if p.worker_id is not None else i}={p.endpoint}"
                    for i, p in enumerate(pubs))


def main(argv: list[str] | None = None) -> int:
    """``python -m lmkv_async.vllm_events``: publish until SIGINT/SIGTERM."""
    import torch

    from .fleet import Fleet
    from .layout import KVLayout

    p = argparse.ArgumentParser(prog="python -m lmkv_async.vllm_events",
                                description="LMCache KV events as vLLM's KV-event stream")
    p.add_argument("--server", action="append", required=True,
                   help="NAME=ZMQ_URL,HTTP_URL[,WORKER_ID] (repeat; publishers in this "
                        "order; WORKER_ID: the router's id of the engine loading from it)")
    p.add_argument("--model", required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--kv-heads", type=int, required=True)
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--block-size", type=int, default=16, help="the engines' KV layout")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument("--port", type=int, default=5557,
                   help="first PUB port; replay = PUB + 1; the next server + 2")
    p.add_argument("--topic", default="")
    p.add_argument("--encoding", choices=("array", "map"), default="map")
    p.add_argument("--block-hash-format", choices=("int", "bytes"), default="int")
    p.add_argument("--router-block-size", type=int, default=None,
                   help="the router's block size (divides the chunk size; default: chunk)")
    p.add_argument("--hash-mode", choices=("dynamo", "vllm"), default="dynamo")
    p.add_argument("--hash-seed", default=VLLM_DEFAULT_SEED,
                   help="vLLM's PYTHONHASHSEED (hash mode vllm)")
    p.add_argument("--reset", choices=("clear", "remove"), default="clear")
    args = p.parse_args(argv)
    servers: dict[str, tuple[str, str]] = {}
    worker_ids: dict[str, int] = {}
    for spec in args.server:
        name, _, rest = spec.partition("=")
        parts = rest.split(",")
        if not name or len(parts) not in (2, 3) or (len(parts) == 3 and not parts[2].isdigit()):
            p.error(f"bad --server {spec!r}")
        servers[name] = (parts[0], parts[1])
        if len(parts) == 3:
            worker_ids[name] = int(parts[2])
    layout = KVLayout(num_layers=args.layers, num_kv_heads=args.kv_heads,
                      head_dim=args.head_dim, dtype=getattr(torch, args.dtype),
                      block_size=args.block_size, world_size=args.world_size)

    async def run() -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            await serve(signals)

    async def serve(signals: Any) -> None:
        async with Fleet(servers, model_name=args.model, layout=layout) as fleet:
            pubs = await publish_fleet(fleet, host=args.host, port=args.port,
                                       worker_ids=worker_ids, topic=args.topic,
                                       encoding=args.encoding,
                                       block_hash_format=args.block_hash_format,
                                       block_size=args.router_block_size,
                                       hash_mode=args.hash_mode, hash_seed=args.hash_seed,
                                       reset=args.reset)
            for pub in pubs:
                print(f"{pub.member.name}: worker {pub.worker_id} PUB {pub.endpoint} "
                      f"replay {pub.replay_endpoint}", flush=True)
            print(f"dynamo --workers {dynamo_workers_arg(pubs)}", flush=True)
            try:
                async for _ in signals:  # SIGINT or SIGTERM: stop
                    break
            finally:
                for pub in pubs:
                    await pub.aclose()

    anyio.run(run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
