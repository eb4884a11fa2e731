"""A fake lmcache MP server that misbehaves on demand, and the pytest fixtures that run it.

The fake is a real ZMQ ROUTER (a blocking socket polled in its own thread) plus a
tiny ``http.server`` answering ``/version`` ("0.5.6-gfake", or "0.5.2-gfake" when it
speaks the 0.5.2 op table), ``/config`` and ``/status`` (each can be replaced or
made a 404). It hands out a real SHM segment it created itself, larger than the pool
it announces, all of it filled with a sentinel byte (so a write past the announced
pool lands in a tail that is compared too), and behaves like a small in-memory
lmcache by default; a test overrides the reply to one operation with
:meth:`FakeLMCache.on` (``tests/test_hostile.py`` makes it lie in every way it can).

Fixtures (a plugin: ``tests/conftest.py`` loads this module):

* ``fake_factory(**kwargs)`` -- start a :class:`FakeLMCache`; every fake it made is
  stopped when the test ends. It is the one place fakes come from, so the one place
  that fails the test when a fake's handler raised (the request then went unanswered:
  the test's own bug, which would otherwise show up only as a client timeout) or when
  the client sent an op frame that is not an int of the table the fake speaks (a
  string op would kill a 0.5.2 server's loop). Errors seen by the end of the test's
  body fail the test itself; later ones (release steps that trail) fail its teardown.
* ``fake`` -- one default fake (0.5.6 table, SHM).
* ``short_cleanup`` -- ``CLEANUP_TIMEOUT`` cut to :data:`CLEANUP`, so release steps
  and late-reply windows do not wait 30 s (``pytest.mark.usefixtures("short_cleanup")``).

Timing bounds come from ``timing.SLACK`` (``$LMKV_TEST_SLACK``); waits poll.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.server
import json
import os
import pickle
import secrets
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import msgpack
import pytest
import torch
import zmq
from timing import SETTLE, SLACK, eventually

import lmkv_async as lmkv
import lmkv_async._session as lmkv_session
from lmkv_async.wire import DIALECT_052, DIALECT_056

# ----------------------------------------------------------------------------- constants

LOOKUP, QUERY, WAIT, FREE, END = 8, 9, 10, 12, 13
REGISTER, UNREGISTER, PREP_STORE, COMMIT_STORE = 14, 15, 16, 17
PREP_RETRIEVE, COMMIT_RETRIEVE, PING, NOOP, GET_EXPERIMENTAL = 18, 19, 22, 24, 32
VALID_OPS = frozenset(DIALECT_056.op_ids.values())
#: wire op id -> the 0.5.6 id the fake records, per dialect it can speak
_CANONICAL = {
    "0.5.6": {i: i for i in DIALECT_056.op_ids.values()},
    "0.5.2": {DIALECT_052.op_ids[n]: DIALECT_056.op_ids[n] for n in DIALECT_052.op_ids},
}
DIALECTS = list(_CANONICAL)

C = 256
LAYOUT = lmkv.KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, dtype=torch.float32,
                       block_size=16)
SHAPE = (2, LAYOUT.num_layers, C, LAYOUT.hidden_dim)
SLOT = C * LAYOUT.token_bytes()            # 32 KiB per chunk object
POOL = 4 << 20                             # 4 MiB announced pool
TAIL = 256 << 10                           # sentinel bytes in the segment past the pool
GUARD = 4 * SLOT                           # the allocator leaves the first 128 KiB alone
SENTINEL = 0xA5
SHORT = 0.5                                # per-call deadline for the silent cases
TIMEOUT = SHORT + 2 + 2 * SLACK            # context default: well past SHORT + SLACK
CLEANUP = 1.0 + SLACK                      # lmkv_async._session.CLEANUP_TIMEOUT (short_cleanup)

NO_RESULT = object()  # handler result meaning "two-frame reply"
NOT_FOUND = object()  # an HTTP path answered with 404

# ----------------------------------------------------------------------------- fake server


@dataclass
class Req:
    """One request as the fake received it."""

    identity: bytes
    uid_frame: bytes
    op_frame: bytes
    op: object
    args: list[Any]
    raw_args: list[bytes]
    t: float

    @property
    def rid(self) -> str | None:
        """The request_id this request belongs to, where it carries one."""
        if not self.args:
            return None
        a0 = self.args[0]
        if isinstance(a0, dict):
            rid = a0.get("request_id")
            return rid if isinstance(rid, str) else None
        if self.op in (QUERY, WAIT, END) and isinstance(a0, str):
            return a0
        return None


#: An override: ``fn(req, fake) -> frames | None`` (None: never reply) or a Later.
Handler = Callable[[Req, "FakeLMCache"], Any]


@dataclass
class Later:
    """Send ``frames`` after ``delay`` seconds."""

    delay: float
    frames: list[bytes]


@dataclass
class Hold:
    """Send ``frames`` once the test sets ``gate`` (a reply held back at will)."""

    gate: threading.Event
    frames: list[bytes]


@dataclass
class Multi:
    """Several replies to one request, in order (each a frame list or a :class:`Later`)."""

    replies: list[Any]


def _chunk_key(model: str, salt: str, tokens: list[int], i: int) -> tuple[Any, ...]:
    return (model, salt, tuple(tokens[: (i + 1) * C]))


class _HttpHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        fake: FakeLMCache = self.server.fake  # type: ignore[attr-defined]
        body = fake.http_body(self.path)
        if body is NOT_FOUND:
            self.send_response(404)
            self.end_headers()
            return
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class FakeLMCache:
    """A misbehaving-on-demand lmcache MP server (ZMQ ROUTER + HTTP + SHM).

    ``dialect`` is the op table it speaks ("0.5.6" or "0.5.2"); requests are
    recorded with 0.5.6 ids either way. The segment is ``pool_size + TAIL`` bytes
    unless ``segment_size`` says otherwise; the registration announces ``pool_size``.
    """

    def __init__(self, *, shm: bool = True, pool_size: int = POOL,
                 segment_size: int | None = None, dialect: str = "0.5.6") -> None:
        self.shm = shm
        self.dialect = dialect
        self.canonical = _CANONICAL[dialect]
        self.seg: shared_memory.SharedMemory | None = None
        if shm:
            name = f"lmkv_fake_{os.getpid()}_{secrets.token_hex(4)}"
            size = pool_size + TAIL if segment_size is None else segment_size
            self.seg = shared_memory.SharedMemory(name=name, create=True, size=size)
            self.register_result: dict[str, Any] = {"shm_name": self.seg.name,
                                                    "pool_size": pool_size}
        else:
            self.register_result = {"shm_name": "", "pool_size": 0}
        self.pool_size = int(self.register_result["pool_size"])
        mp: dict[str, Any] = {"chunk_size": C, "supported_transfer_mode": "auto",
                              "worker_reap_timeout_seconds": 120, "shm_name": "fake"}
        if dialect == "0.5.6":
            mp["session_ttl_seconds"] = 600  # a 0.5.6-only key
        self.config: dict[str, Any] = {"mp": mp}
        #: path -> body (or NOT_FOUND) replacing the default HTTP answer
        self.http: dict[str, Any] = {}
        #: delayed or held replies not sent yet
        self.replies_pending = 0
        self._lock = threading.Lock()
        self.received: list[Req] = []
        self.overrides: dict[int, list[tuple[Handler, int | None]]] = {}
        self.registered: set[int] = set()
        #: op frames that did not decode to an int of the 0.5.6 table (never reset)
        self.bad_ops: list[object] = []
        self.reset()
        #: exceptions raised by ``_handle`` (the request then goes unanswered; never reset)
        self.handler_errors: list[str] = []
        self._reported = (0, 0)  # (bad_ops, handler_errors) already reported
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-lmcache-zmq", daemon=True)
        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HttpHandler)
        self._httpd.fake = self  # type: ignore[attr-defined]
        self._http_thread = threading.Thread(target=self._httpd.serve_forever, args=(0.02,),
                                             name="fake-lmcache-http", daemon=True)
        self.port = 0

    # -- lifecycle ------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def start(self) -> FakeLMCache:
        self._http_thread.start()
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(10)
        self._httpd.shutdown()
        self._httpd.server_close()
        self._http_thread.join(10)
        if self.seg is not None:
            self.seg.close()
            with contextlib.suppress(FileNotFoundError):
                self.seg.unlink()

    def reset(self) -> None:
        """Forget cache state, overrides and records; refill the segment with the sentinel."""
        with self._lock:
            self.received.clear()
            self.overrides.clear()
        self.cache: dict[tuple[Any, ...], Any] = {}   # chunk key -> offset (SHM) / tensor
        self.pending: dict[tuple[Any, ...], list[tuple[tuple[Any, ...], Any]]] = {}
        self.jobs: dict[str, int] = {}
        self._next = GUARD
        if self.seg is not None:
            self.seg.buf[:] = bytes([SENTINEL]) * self.seg.size

    def _run(self) -> None:
        # A plain blocking ROUTER polled level-triggered, in its own thread: a fake that
        # lost a wake-up would fail the client's test, not its own, so it has none of
        # zmq.asyncio's edge-triggered FD handling to get wrong.
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        self.port = sock.bind_to_random_port("tcp://127.0.0.1")
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        #: replies not due yet, in the order they were made: (due, gate, frames)
        waiting: list[tuple[float, threading.Event | None, list[bytes]]] = []
        self._ready.set()
        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                due = [w for w in waiting if (w[1].is_set() if w[1] else w[0] <= now)]
                for w in sorted(due, key=lambda w: w[0]):  # stable: equal delays keep order
                    waiting.remove(w)
                    sock.send_multipart(w[2])
                    with self._lock:
                        self.replies_pending -= 1
                timers = [w[0] - now for w in waiting if w[1] is None]
                wait_ms = max(0.0, min([0.005, *timers])) * 1000
                if not poller.poll(wait_ms):
                    continue
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._answer(sock, frames, waiting)
        finally:
            sock.close(0)
            ctx.term()

    def _answer(self, sock: zmq.Socket[bytes], frames: list[bytes],
                waiting: list[tuple[float, threading.Event | None, list[bytes]]]) -> None:
        try:
            reply = self._handle(frames)
        except Exception as exc:  # a broken handler is the test's bug: keep serving, report it
            with self._lock:
                self.handler_errors.append(repr(exc))
            return
        for item in reply.replies if isinstance(reply, Multi) else [reply]:
            if item is None:
                continue
            if isinstance(item, (Later, Hold)):
                with self._lock:
                    self.replies_pending += 1
                if isinstance(item, Later):
                    waiting.append((time.monotonic() + item.delay, None, [frames[0], *item.frames]))
                else:
                    waiting.append((time.monotonic(), item.gate, [frames[0], *item.frames]))
            else:
                sock.send_multipart([frames[0], *item])

    # -- HTTP ---------------------------------------------------------------------------
    def http_body(self, path: str) -> Any:
        if path in self.http:
            return self.http[path]
        if path == "/version":
            return f"{self.dialect}-gfake"
        if path == "/config":
            return self.config
        if path == "/status":
            return {"active_sessions": 0,
                    "registered_non_cuda_instance_ids": sorted(self.registered)}
        return NOT_FOUND

    # -- requests -----------------------------------------------------------------------
    def _handle(self, frames: list[bytes]) -> Any:
        identity, uid_frame, op_frame, *raw_args = frames
        try:
            wire_op = msgpack.unpackb(op_frame, raw=False)
        except Exception:
            wire_op = op_frame
        valid = type(wire_op) is int and wire_op in self.canonical
        op = self.canonical[wire_op] if valid else wire_op
        args = [msgpack.unpackb(a, raw=False, strict_map_key=False) for a in raw_args]
        req = Req(identity, uid_frame, op_frame, op, args, raw_args, time.monotonic())
        with self._lock:
            self.received.append(req)
            if not valid:
                self.bad_ops.append(wire_op)
            handlers = self.overrides.get(op) if type(op) is int else None
            handler: Handler | None = None
            if handlers:
                handler, times = handlers[0]
                if times is not None:
                    if times <= 1:
                        handlers.pop(0)
                    else:
                        handlers[0] = (handler, times - 1)
        if type(op) is not int or op not in VALID_OPS:
            return None  # what a 0.5.2 loop would do, minus dying
        if handler is not None:
            return handler(req, self)
        return self.frames(req, self.default(req))

    def on(self, op: int, handler: Handler, *, times: int | None = 1) -> None:
        """Override the reply to ``op`` for the next ``times`` requests (None: always)."""
        with self._lock:
            self.overrides.setdefault(op, []).append((handler, times))

    def clear_overrides(self) -> None:
        with self._lock:
            self.overrides.clear()

    @staticmethod
    def frames(req: Req, result: Any) -> list[bytes]:
        """A well-formed reply: echoed uid and op, plus the result unless it is None."""
        head = [req.uid_frame, req.op_frame]
        return head if result is NO_RESULT else [*head, msgpack.packb(result, use_bin_type=True)]

    def _alloc(self) -> int:
        off = self._next
        if off + SLOT > self.pool_size:
            raise RuntimeError("fake pool exhausted; call reset()")
        self._next += SLOT
        return off

    def default(self, req: Req) -> Any:
        """What a well-behaved lmcache 0.5.6 would answer (updates the fake's state)."""
        op, args = req.op, req.args
        if op == REGISTER:
            self.registered.add(int(args[0]["instance_id"]))
            return self.register_result
        if op == UNREGISTER:
            self.registered.discard(int(args[0]))
            return NO_RESULT
        if op == PING:
            return True
        if op == NOOP:
            return "OK"
        if op == GET_EXPERIMENTAL:
            return []  # no experimental feature (the KV-event stream) switched on
        if op == 21:
            return C
        if op in (FREE, END):
            return NO_RESULT
        if op in (QUERY, WAIT):
            return self.jobs.pop(args[0], 0)
        key = args[0]
        model, salt, toks = key["model_name"], key["cache_salt"], list(key["token_ids"])
        start, end = key["start"], key["end"]
        if op == LOOKUP:
            hit = 0
            while hit < end // C and _chunk_key(model, salt, toks, hit) in self.cache:
                hit += 1
            self.jobs[key["request_id"]] = hit
            return NO_RESULT
        ident = (args[1], model, salt, tuple(toks), start, end)
        if op == PREP_STORE:
            if not self.shm:
                return {"context": {}}
            slots, idx, staged = [], [], []
            for i in range(start // C, end // C):
                ck = _chunk_key(model, salt, toks, i)
                if ck in self.cache:
                    continue
                off = self._alloc()
                slots.append(slot(off))
                idx.append(i - start // C)
                staged.append((ck, off))
            if staged:
                self.pending[ident] = staged
            return {"context": {"slots": slots, "chunk_indices": idx}}
        if op == COMMIT_STORE:
            data = args[2]
            if data:
                tensors = pickle.loads(data)
                for j, t in enumerate(tensors):
                    self.cache.setdefault(_chunk_key(model, salt, toks, start // C + j), t)
                return True
            staged = self.pending.pop(ident, None)
            if not staged:
                return False
            for ck, off in staged:
                self.cache[ck] = off
            return True
        if op == PREP_RETRIEVE:
            objs = [self.cache.get(_chunk_key(model, salt, toks, i))
                    for i in range(start // C, end // C)]
            if any(o is None for o in objs):
                return {"success": False, "data": b"", "context": {}}
            if self.shm:
                return {"success": True, "data": b"",
                        "context": {"slots": [slot(o) for o in objs]}}
            return {"success": True, "data": pickle.dumps(list(objs)), "context": {}}
        if op == COMMIT_RETRIEVE:
            return True
        return None

    # -- inspection ---------------------------------------------------------------------
    def unreported_problems(self) -> list[str]:
        """Bad op frames and handler errors not reported by an earlier call, as messages."""
        with self._lock:
            ops_seen, errors_seen = self._reported
            ops, errors = self.bad_ops[ops_seen:], self.handler_errors[errors_seen:]
            self._reported = (len(self.bad_ops), len(self.handler_errors))
        problems = []
        if ops:
            problems.append(f"non-integer or unknown op frames sent: {ops!r}")
        if errors:
            problems.append(f"the fake's handlers raised: {errors!r}")
        return problems

    def requests(self) -> list[Req]:
        with self._lock:
            return list(self.received)

    def last_rid(self, kind: str) -> str:
        rids = [r.rid for r in self.requests() if r.rid and r.rid.startswith(f"lmkv-{kind}-")]
        assert rids, f"no {kind} request seen"
        return rids[-1]

    def ops_for(self, rid: str) -> list[int]:
        return [r.op for r in self.requests() if r.rid == rid]  # type: ignore[misc]

    async def wait_ops(self, rid: str, expected: list[int], timeout: float | None = None
                       ) -> None:
        """Wait until the ops recorded for ``rid`` are ``expected`` (releases may trail)."""
        await eventually(lambda: self.ops_for(rid) == expected,
                         SETTLE + CLEANUP if timeout is None else timeout,
                         what=lambda: f"ops for {rid}: {self.ops_for(rid)} != {expected}")

    def pings_from(self, instance_id: int) -> list[float]:
        """Arrival times of the pings carrying ``instance_id``."""
        return [r.t for r in self.requests() if r.op == PING and r.args
                and r.args[0] == instance_id]

    def segment(self) -> torch.Tensor:
        """A copy of the whole segment as uint8."""
        assert self.seg is not None
        return torch.frombuffer(bytearray(self.seg.buf), dtype=torch.uint8)

    def read_slot(self, offset: int) -> torch.Tensor:
        assert self.seg is not None
        raw = bytearray(self.seg.buf[offset: offset + SLOT])
        return torch.frombuffer(raw, dtype=LAYOUT.dtype).view(SHAPE)

    def write_slot(self, offset: int, chunk: torch.Tensor) -> None:
        assert self.seg is not None
        c = chunk.contiguous()
        self.seg.buf[offset: offset + SLOT] = ctypes.string_at(c.data_ptr(), SLOT)


def slot(at: int, **changes: Any) -> dict[str, Any]:
    """A well-formed slot descriptor at offset ``at``, with fields replaced by ``changes``."""
    d: dict[str, Any] = {"offset": at, "length": SLOT, "shape": list(SHAPE),
                         "dtype": "float32"}
    d.update(changes)
    return d


_FAKES: dict[str, FakeLMCache] = {}


def open_ctx(fake: FakeLMCache, **kwargs: Any) -> Any:
    """``lmkv.connect`` to ``fake`` with the fake's layout and short deadlines."""
    opts: dict[str, Any] = {"layout": LAYOUT, "timeout": TIMEOUT, "heartbeat_interval": 0}
    opts.update(kwargs)
    _FAKES[fake.url] = fake
    return lmkv.connect(fake.url, fake.http_url, "hostile", **opts)


def ctx_fake(ctx: lmkv.AsyncKVContext) -> FakeLMCache:
    """The fake a context opened by :func:`open_ctx` talks to."""
    return _FAKES[ctx.url]


# ----------------------------------------------------------------------------- fixtures

#: the fakes each running test made (the fixture fills it; the call hook reads it)
_MADE = pytest.StashKey[list[FakeLMCache]]()


@pytest.fixture
def short_cleanup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Release steps and late-reply windows wait CLEANUP_TIMEOUT (30 s); keep tests short."""
    monkeypatch.setattr(lmkv_session, "CLEANUP_TIMEOUT", CLEANUP)


@pytest.fixture
def fake_factory(request: pytest.FixtureRequest) -> Iterator[Callable[..., FakeLMCache]]:
    """``fake_factory(**kwargs)``: a started :class:`FakeLMCache`, checked and stopped at
    the end of the test (see the module docstring)."""
    fakes = request.node.stash.setdefault(_MADE, [])

    def make(**kwargs: Any) -> FakeLMCache:
        fake = FakeLMCache(**kwargs).start()
        fakes.append(fake)
        return fake

    try:
        yield make
    finally:
        for fake in fakes:
            fake.stop()
        problems = [p for fake in fakes for p in fake.unreported_problems()]
        fakes.clear()
        assert not problems, "\n".join(problems)


@pytest.fixture
def fake(fake_factory: Callable[..., FakeLMCache]) -> FakeLMCache:
    """One default fake: the 0.5.6 op table, an SHM pool."""
    return fake_factory()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """Fail the test itself (not only its teardown) on a fake's problem seen by now."""
    yield
    problems = [p for fake in item.stash.get(_MADE, []) for p in fake.unreported_problems()]
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)
