"""AsyncKVContext and connect: the public face of one LMCache MP server.

Arguments are checked here, before any traffic; the server session lives in
:mod:`._session` and the RPC sequences in :mod:`._ops`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Literal

import torch

from . import _loop_thread, _ops, cuda, kernel
from ._background import Background, require_event_loop
from ._connect import Connecting, check_connect_args
from ._session import Session, TransportMode
from ._view_block import ViewBlock
from .errors import InvalidInputError, TransportUnavailableError
from .events import KVEventStream, require_kv_events
from .fanout import ItemResult, run_bounded
from .http import resolve_api_key
from .layout import KVLayout
from .memory import RegionArg, output_pool
from .metrics import OpStats
from .results import StoreResult
from .transport import Transport
from .validate import (
    Tokens,
    check_kv,
    check_out,
    check_paged,
    check_salt,
    check_tokens,
)
from .wire.dialect import Dialect

__all__ = ["AsyncKVContext", "StoreResult", "TransportMode", "connect"]

log = logging.getLogger("lmkv_async")

_MODEL_NAME = re.compile(r"^[^@\x00]+$")


class AsyncKVContext:
    """An open connection to one LMCache MP server for one model and layout.

    Create it with :func:`connect`. All methods are coroutines and may be
    awaited concurrently from many tasks; every call has a deadline
    (``timeout=None`` means the context default, never "wait forever").
    """

    def __init__(self, session: Session) -> None:
        """Wrap an opened :class:`~lmkv_async._session.Session` (use :func:`connect`)."""
        self._s = session
        self.url = session.url
        self.http_url = session.http_url
        self.model_name = session.model_name
        self.timeout = session.timeout
        self.instance_id = session.instance_id
        #: per-operation counters and latency histograms (:meth:`stats`)
        self.metrics = OpStats()
        self._stats = self.metrics

    def __repr__(self) -> str:
        s = self._s
        return (f"<AsyncKVContext {self.model_name!r} at {self.url} ({s.http_url}), "
                f"lmcache {s.server_version or '?'}, {s.mode}, {s.state}>")

    __str__ = __repr__

    # ------------------------------------------------------------------ properties
    @property
    def _transport(self) -> Transport:
        return self._s.transport

    @property
    def chunk_size(self) -> int:
        """Tokens per server object (``--chunk-size``)."""
        return self._s.chunk_size

    @property
    def layout(self) -> KVLayout:
        """The KV geometry in use (explicit or discovered)."""
        return self._s.layout

    @property
    def transport(self) -> Literal["shm", "pickle"]:
        """The transfer path really in use: ``"shm"`` or ``"pickle"`` (inline data:
        pickled tensors up to 0.5.6, the tensor envelope from 0.5.7)."""
        return self._s.mode

    @property
    def server_version(self) -> str:
        """The server's ``/version`` string, e.g. ``"0.5.6-g3e11e108"``."""
        return self._s.server_version

    @property
    def dialect(self) -> Dialect:
        """The wire dialect chosen for this server."""
        return self._s.d

    @property
    def capabilities(self) -> frozenset[str]:
        """Optional features the server has, e.g. ``{"kv_events", "api_keys"}``
        (names in :mod:`lmkv_async.wire.dialect`, ``CAP_*``)."""
        return self._s.capabilities

    @property
    def untested_server(self) -> bool:
        """True when the server is newer than the newest release lmkv_async is tested with."""
        return self._s.untested_newer

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` has started."""
        return self._s.state in ("closing", "closed")

    # ------------------------------------------------------------------ lifecycle
    async def aclose(self) -> None:
        """Finish in-flight release steps, unregister, and close everything.

        Idempotent, shielded and bounded. Operations still running get a few
        seconds (:data:`lmkv_async._session.CLOSE_BUDGET`) to finish their release
        steps before the registration is dropped, since unregistering with a
        reservation outstanding would publish it (protocol reference §6.6); the
        whole close takes at most :data:`lmkv_async._session.CLOSE_TOTAL` seconds
        against a server that answers nothing. The caller's cancellation (an
        anyio cancel scope, ``asyncio.timeout``, ``Task.cancel``) does not cut
        the cleanup short: ``aclose()`` waits for it, then re-raises the
        cancellation. A second call, concurrent or after a cancelled one, waits
        for the same cleanup. See ``docs/operations.md`` for what may remain on
        a server that never answered.
        """
        await self._s.shutdown(unregister=True)

    async def __aenter__(self) -> AsyncKVContext:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ lookup
    async def lookup(self, tokens: Tokens, *, cache_salt: str = "",
                     timeout: float | None = None) -> int:
        """Length in tokens of the longest cached prefix of ``tokens``.

        A multiple of :attr:`chunk_size`; 0 on a miss or when ``tokens`` is
        shorter than one chunk. Moves no data and leaves no lock behind.
        """
        toks = check_tokens(tokens)
        salt = check_salt(cache_salt)
        deadline = self._s.deadline(timeout)
        self._s.check_open()
        n = len(toks) // self.chunk_size * self.chunk_size
        if n == 0:
            return 0
        with self._stats.measure("lookup"):
            return await _ops.lookup(self._s, toks, salt, n, deadline)

    # ------------------------------------------------------------------ retrieve
    async def retrieve(
        self,
        tokens: Tokens,
        *,
        out: torch.Tensor | None = None,
        cache_salt: str = "",
        timeout: float | None = None,
    ) -> torch.Tensor | None:
        """The KV of the longest cached prefix of ``tokens``, or None on a miss.

        Returns a ``[P, L, n, D]`` tensor with ``n`` the hit length in tokens (a
        multiple of :attr:`chunk_size`). With ``out`` (a ``[P, L, >=T, D]`` CPU
        tensor of the layout's dtype, ``T`` the full-chunk length of ``tokens``)
        the data is written into it and the view ``out[:, :, :n]`` is returned.
        Without it the result comes from :data:`lmkv_async.memory.output_pool`:
        anonymous memory advised for transparent huge pages and pre-faulted, and
        reused once an earlier result is freed, so steady-state retrieves do not
        pay the 4 KiB page-fault cliff (``LMKV_OUTPUT_POOL_BYTES`` caps the pool).
        If the call is cancelled, ``out`` may have been partly written.
        """
        toks = check_tokens(tokens)
        salt = check_salt(cache_salt)
        deadline = self._s.deadline(timeout)
        C = self.chunk_size
        n = len(toks) // C * C
        if out is not None:
            check_out(out, self.layout, n)
        self._s.check_open()
        if n == 0:
            return None
        layout = self.layout
        result: list[torch.Tensor] = []

        def cpu_sink(hit: int, chunks: list[tuple[int, int]], region: RegionArg) -> None:
            dst = out if out is not None else output_pool.empty(
                (layout.planes, layout.num_layers, hit * C, layout.hidden_dim), layout.dtype)
            view = dst[:, :, : hit * C]
            kernel.chunks_to_dense(view, chunks, chunk_tokens=C, region=region)
            result.append(view)

        sink: _ops.Sink | cuda.DeviceCopy = cpu_sink
        if cuda.is_cuda(out):
            assert out is not None
            sink = cuda.dense_sink(self._s, out, C, result)  # DMA on the GPU side

        with self._stats.measure("retrieve") as m:
            hit = await _ops.retrieve(self._s, toks, n, salt, sink, deadline)
            m.nbytes = hit * C * layout.token_bytes()
        return result[0] if hit else None

    def retrieve_view(self, tokens: Tokens, *, cache_salt: str = "",
                      timeout: float | None = None) -> ViewBlock:
        """Zero-copy read: ``async with ctx.retrieve_view(tokens) as view:``.

        Inside the block, ``view.tensors`` are read-only views of the server's
        SHM slots, one ``[P, L, C, D]`` tensor per hit chunk, and
        ``await view.copy_to(out)`` copies them with the copy kernel;
        ``view.num_tokens`` is the hit length (0 on a miss: no tensors). The
        server's read lock on the hit chunks is held while the block runs and
        released when it ends, by any exit (normal, exception, cancellation).
        After the block the tensors raise
        :class:`~lmkv_async.errors.ViewClosedError`.

        Keep blocks short: the server frees read locks after its read TTL
        (``--l1-read-ttl-seconds``, 300 s by default) and may then reuse the
        memory. Past ``view.safe_hold_s`` (0.9 of the TTL) a warning is logged;
        past the TTL the tensors raise. While a view of a prefix is open, other
        retrieves of the same prefix on this context wait for it (the server
        keys pending reads by prefix, not by request). ``timeout`` bounds the
        opening (lookup and ``prepare_retrieve``), not the block.

        Raises:
            TransportUnavailableError: the context does not use SHM (nothing sent).
        """
        toks = check_tokens(tokens)
        salt = check_salt(cache_salt)
        deadline = self._s.deadline(timeout)
        self._s.check_open()
        if self._s.mode != "shm":
            raise TransportUnavailableError(
                "retrieve_view needs the server's SHM pool; this context uses inline data "
                f"(transport {self._s.mode!r})")
        return ViewBlock(self._s, self._stats, toks, salt, deadline)

    async def retrieve_blocks(
        self,
        tokens: Tokens,
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int] | torch.Tensor,
        *,
        cache_salt: str = "",
        timeout: float | None = None,
    ) -> int:
        """Retrieve the cached prefix of ``tokens`` straight into a paged engine cache.

        ``kv_caches`` is one HND tensor ``[NB, P, NH, BS, HS]`` per layer and
        ``block_ids[j]`` the block holding tokens ``[j*BS, (j+1)*BS)``. Chunk
        objects are copied into the blocks in one pass (no intermediate
        ``[P, L, T, D]`` tensor). Returns the hit length in tokens; blocks past
        it are untouched. The caches may live on a GPU (all layers on one device).
        """
        toks = check_tokens(tokens)
        salt = check_salt(cache_salt)
        deadline = self._s.deadline(timeout)
        C = self.chunk_size
        n = len(toks) // C * C
        bids = check_paged(kv_caches, block_ids, self.layout, n)
        self._s.check_open()
        if n == 0:
            return 0
        dtype = self.layout.dtype

        def cpu_sink(hit: int, chunks: list[tuple[int, int]], region: RegionArg) -> None:
            kernel.chunks_to_paged(chunks, kv_caches, bids, num_tokens=hit * C, chunk_tokens=C,
                                   dtype=dtype, region=region)

        sink: _ops.Sink | cuda.DeviceCopy = cpu_sink
        if cuda.is_cuda(kv_caches[0]):
            sink = cuda.paged_sink(self._s, kv_caches, bids, C)

        with self._stats.measure("retrieve_blocks") as m:
            hit = await _ops.retrieve(self._s, toks, n, salt, sink, deadline)
            m.nbytes = hit * C * self.layout.token_bytes()
        return hit * C

    # ------------------------------------------------------------------ store
    async def store(
        self,
        kv: torch.Tensor,
        tokens: Tokens,
        *,
        cache_salt: str = "",
        timeout: float | None = None,
    ) -> StoreResult:
        """Store the KV of ``tokens``: ``kv`` is ``[P, L, T, D]`` with ``T = len(tokens)``.

        Only whole chunks are stored; tokens past the last full chunk are not
        (reported as ``ignored_tokens``). Chunks already cached are not sent
        again. Once the server has handed out slots, the copy and commit run to
        completion even if the caller is cancelled, so ``kv`` may still be read
        briefly after a cancellation. ``kv`` may be a CUDA tensor (``docs/gpu.md``).
        """
        toks = check_tokens(tokens)
        salt = check_salt(cache_salt)
        check_kv(kv, self.layout, len(toks))
        deadline = self._s.deadline(timeout)
        self._s.check_open()
        C = self.chunk_size
        n = len(toks) // C * C
        src = kv[:, :, :n]

        def cpu_chunks(chunks: list[tuple[int, int]], region: RegionArg) -> None:
            kernel.dense_to_chunks(src, chunks, chunk_tokens=C, region=region)

        to_chunks: _ops.ToChunks | cuda.DeviceCopy = cpu_chunks
        to_dense: Callable[[], torch.Tensor] = lambda: src  # noqa: E731
        if cuda.is_cuda(src):
            to_chunks = cuda.dense_source(self._s, src, C)
            to_dense = src.cpu  # inline data is pickled from CPU tensors (worker thread)
        return await self._store("store", toks, salt, to_chunks, to_dense, deadline)

    async def store_blocks(
        self,
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int] | torch.Tensor,
        tokens: Tokens,
        *,
        cache_salt: str = "",
        timeout: float | None = None,
    ) -> StoreResult:
        """Store KV straight from a paged engine cache.

        ``kv_caches`` is one HND tensor ``[NB, P, NH, BS, HS]`` per layer (as
        vLLM keeps them) and ``block_ids[j]`` the block holding tokens
        ``[j*BS, (j+1)*BS)``; at least ``ceil(n / BS)`` ids are needed for the
        ``n`` full-chunk tokens. On SHM, blocks are copied into the server's
        slots in one pass. Same result and guarantees as :meth:`store`.
        """
        toks = check_tokens(tokens)
        salt = check_salt(cache_salt)
        deadline = self._s.deadline(timeout)
        C = self.chunk_size
        n = len(toks) // C * C
        bids = check_paged(kv_caches, block_ids, self.layout, n)
        self._s.check_open()
        layout = self.layout

        def cpu_chunks(chunks: list[tuple[int, int]], region: RegionArg) -> None:
            kernel.paged_to_chunks(kv_caches, bids, chunks, num_tokens=n, chunk_tokens=C,
                                   dtype=layout.dtype, region=region)

        def cpu_dense() -> torch.Tensor:
            dense = output_pool.empty(
                (layout.planes, layout.num_layers, n, layout.hidden_dim), layout.dtype)
            kernel.paged_to_dense(dense, kv_caches, bids)
            return dense

        to_chunks: _ops.ToChunks | cuda.DeviceCopy = cpu_chunks
        to_dense: Callable[[], torch.Tensor] = cpu_dense
        if cuda.is_cuda(kv_caches[0]):
            to_chunks = cuda.paged_source(self._s, kv_caches, bids, n, C)
            to_dense = lambda: cuda.paged_to_cpu_dense(kv_caches, bids, n)  # noqa: E731

        return await self._store("store_blocks", toks, salt, to_chunks, to_dense, deadline)

    async def _store(
        self,
        op: str,
        toks: list[int],
        salt: str,
        to_chunks: _ops.ToChunks | cuda.DeviceCopy,
        to_dense: Callable[[], torch.Tensor],
        deadline: float,
    ) -> StoreResult:
        C = self.chunk_size
        total = len(toks) // C
        ignored = len(toks) - total * C
        if total == 0:
            return StoreResult(0, 0, C, ignored)
        with self._stats.measure(op) as m:
            written = await _ops.store(self._s, toks, total, salt, to_chunks, to_dense, deadline)
            m.nbytes = written * C * self.layout.token_bytes()
        return StoreResult(total, written, C, ignored)

    # ------------------------------------------------------------------ fan-out
    async def lookup_many(
        self,
        token_lists: Sequence[Tokens],
        *,
        cache_salt: str = "",
        max_in_flight: int = 32,
        timeout: float | None = None,
    ) -> list[ItemResult[int]]:
        """:meth:`lookup` for many sequences, at most ``max_in_flight`` at once.

        Returns one :class:`ItemResult` per input, in input order; ``value`` is
        the cached prefix length in tokens, or ``error`` holds that item's error.
        """
        return await run_bounded(
            token_lists,
            lambda toks: self.lookup(toks, cache_salt=cache_salt, timeout=timeout),
            max_in_flight,
        )

    async def retrieve_many(
        self,
        token_lists: Sequence[Tokens],
        *,
        outs: Sequence[torch.Tensor | None] | None = None,
        cache_salt: str = "",
        max_in_flight: int = 32,
        timeout: float | None = None,
    ) -> list[ItemResult[torch.Tensor | None]]:
        """:meth:`retrieve` for many sequences (``outs[i]`` is item i's buffer, or None).

        One :class:`ItemResult` per input, in order; ``value`` is the tensor, or
        None on a miss; ``error`` holds that item's error.
        """
        if outs is not None and len(outs) != len(token_lists):
            raise InvalidInputError(f"{len(outs)} outs for {len(token_lists)} token lists")
        pairs = list(zip(token_lists, outs or [None] * len(token_lists), strict=True))
        return await run_bounded(
            pairs,
            lambda p: self.retrieve(p[0], out=p[1], cache_salt=cache_salt, timeout=timeout),
            max_in_flight,
        )

    async def store_many(
        self,
        items: Sequence[tuple[torch.Tensor, Tokens]],
        *,
        cache_salt: str = "",
        max_in_flight: int = 32,
        timeout: float | None = None,
    ) -> list[ItemResult[StoreResult]]:
        """:meth:`store` for many ``(kv, tokens)`` pairs; one :class:`ItemResult` each."""
        return await run_bounded(
            items,
            lambda it: self.store(it[0], it[1], cache_salt=cache_salt, timeout=timeout),
            max_in_flight,
        )

    # ------------------------------------------------------------------ KV events
    def kv_events(self, *, cursor: int = 0, max_events: int = 256,
                  resume: bool = True) -> KVEventStream:
        """The server's KV-event stream (lmcache >= 0.5.6): see :class:`KVEventStream`.

        ``async for ev in ctx.kv_events():`` yields ``KVStored``, ``KVRemoved`` and
        ``KVResync`` records on a socket of its own; leaving the loop (or
        ``async with``) cancels the subscription. It does not end with the
        context: close it yourself. Stores made through this client (engine-driven)
        produce no ``KVStored`` event (compat.md §14.5); evictions of them do
        produce ``KVRemoved``.

        Raises:
            UnsupportedOperationError: the server's release has no stream (nothing
                is sent: 0.5.2 would die on the op's name).
            ClosedError: the context is closed.
        """
        self._s.check_open()
        require_kv_events(self._s.d, self._s.capabilities, self.url, self._s.server_version)
        return KVEventStream(self.url, self._s.d, self.model_name, cursor=cursor,
                             max_events=max_events, timeout=self.timeout,
                             heartbeat_interval=self._s.heartbeat_interval or 10.0,
                             resume=resume)

    # ------------------------------------------------------------------ maintenance
    def stats(self) -> dict[str, Any]:
        """A snapshot of per-operation counters and latency histograms: calls, errors by
        type, timeouts, cancellations, bytes moved, in flight, latency quantiles.

        Once a CUDA tensor was used, ``"gpu"`` holds the GPU path's counters, among
        them ``"path"``: ``"registered"`` or ``"staging"`` (the fallback, with
        ``"fallback_reason"``). Numbers (and those labels) only: no keys, tokens or
        tensors. For OpenTelemetry, pass :attr:`metrics` to
        :func:`lmkv_async.metrics.register_otel`.
        """
        snap = self._stats.snapshot()
        if self._s.gpu is not None:  # only once a CUDA tensor was used: CPU output unchanged
            snap["gpu"] = self._s.gpu.snapshot()
        return snap

    async def status(self) -> dict[str, Any]:
        """The server's ``/status`` (locks, sessions, registrations).

        Raises:
            ClosedError: the context is closed.
        """
        self._s.check_open()
        return await self._s.http.status()


def connect(
    url: str,
    http_url: str,
    model_name: str,
    *,
    layout: KVLayout | None = None,
    timeout: float = 10.0,
    transport: TransportMode = "auto",
    sockets: int = 1,
    shm_dir: str = "/dev/shm",
    heartbeat_interval: float | None = None,
    prefault: bool = True,
    api_key: str | None = None,
) -> Connecting[AsyncKVContext]:
    """Connect to an LMCache MP server and register a context for ``model_name``.

    Use as ``async with connect(...) as ctx:`` or ``ctx = await connect(...)``
    followed by ``await ctx.aclose()``.

    Args:
        url: the server's ZMQ endpoint, e.g. ``"tcp://127.0.0.1:5555"``
            (a bare ``host:port`` gets ``tcp://``).
        http_url: the server's HTTP API, e.g. ``"http://127.0.0.1:8080"``.
        model_name: the server-side model namespace.
        layout: explicit geometry; ``None`` discovers it from ``/status``
            (``cache_context_meta``, as registered by an inference engine).
        timeout: default deadline in seconds for each operation.
        transport: ``"auto"`` (SHM when the server offers it and the segment
            can be mapped, else inline data), ``"shm"`` (raise
            :class:`TransportUnavailableError` instead of degrading) or ``"inline data"``.
        sockets: DEALER sockets to spread operations over (useful with a server
            started with ``--max-gpu-workers N``).
        shm_dir: where the server's SHM segments are visible.
        heartbeat_interval: seconds between ``ping`` heartbeats; ``None`` picks
            ``min(10, reap_timeout / 4)``; ``0`` disables them.
        prefault: pre-fault the SHM pool's pages once at connect.
        api_key: the HTTP API key (lmcache >= 0.5.7 with ``--api-key-file``); None
            reads ``$LMCACHE_API_KEY_FILE``, ``$LMCACHE_API_KEY``, then the legacy
            ``$LMCACHE_HTTP_API_KEY_FILE`` / ``$LMCACHE_HTTP_API_KEY``. It is sent on
            every HTTP call as ``Authorization: Bearer`` and never logged or shown.

    Raises:
        InvalidInputError: bad arguments (nothing is sent).
        AuthenticationError: the server answered 401 (key missing or wrong).
        UnsupportedServerError: an unsupported version, or a server in
            ``lmcache_driven`` mode (the message names the flag to change).
        LayoutNotFoundError: ``layout=None`` and no engine registered one.
        TransportUnavailableError: ``transport="shm"`` without usable SHM.
        ServerTimeoutError, ServerUnavailableError: the server did not answer.
    """
    args = check_connect_args(url, http_url, model_name, layout=layout, timeout=timeout,
                              transport=transport, sockets=sockets,
                              heartbeat_interval=heartbeat_interval)
    url, timeout = args.url, args.timeout
    key = resolve_api_key(api_key)

    async def factory(background: Background | None) -> AsyncKVContext:
        require_event_loop("connect")
        session = Session(
            url, http_url, model_name, layout=layout, timeout=timeout, transport=transport,
            sockets=sockets, shm_dir=shm_dir, heartbeat_interval=heartbeat_interval,
            prefault=prefault, api_key=key, background=background,
        )
        await session.open()
        ctx = AsyncKVContext(session)
        # opened for the blocking facade: close it at exit if left open
        _loop_thread.track_if_on_loop(ctx)
        return ctx

    return Connecting(factory, name=f"context {url}")
