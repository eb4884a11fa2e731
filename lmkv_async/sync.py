"""A blocking facade with the names of lmcache's ``lmcache.sdk.kvcache``.

Code written against the official SDK's functional API migrates with one line::

    from lmcache.sdk import kvcache                 # before
    from lmkv_async import sync as kvcache          # after

    ctx = kvcache.connect(url, http_url, "my-model", layout=LAYOUT)
    kvcache.store(ctx, kv, tokens)                  # -> StoreResult
    kv = kvcache.retrieve(ctx, tokens)              # tensor, or None on a miss
    kvcache.close(ctx)

or, as a context manager (methods mirror the functions)::

    with kvcache.connect(url, http_url, "my-model", layout=LAYOUT) as ctx:
        ctx.store(kv, tokens)
        n = ctx.lookup(tokens)

Every call runs the async client (:class:`~lmkv_async.AsyncKVContext`) on one
event loop that lives in its own thread, one per process, reached through
anyio's blocking portal (:func:`anyio.from_thread.start_blocking_portal`). The
loop is started by the first :func:`connect`, shared by every thread and every
context, and stopped at interpreter exit (after closing contexts still open)
only if it was started; importing this module starts nothing. Because the loop
has its own thread, the facade works from plain scripts, from many threads at
once, and from a thread that is itself running an event loop (a Jupyter cell,
code inside ``asyncio.run``): that thread simply blocks until the answer comes.
In async code, prefer the async API, which does not block the caller's loop.

Differences from the official SDK (``docs/migration.md`` lists them all):
``connect`` takes the geometry as ``layout=`` (or discovers it, as the SDK
does), ``store`` returns a :class:`~lmkv_async.StoreResult` instead of a bool,
failures raise the typed :class:`~lmkv_async.KVCacheError` tree instead of
returning ``None``/``False``, and :func:`lookup` is public.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch

from . import _loop_thread
from .context import AsyncKVContext
from .context import connect as _aconnect
from .errors import ClosedError
from .fanout import ItemResult
from .layout import KVLayout
from .results import StoreResult
from .validate import Tokens

if TYPE_CHECKING:
    from .wire.dialect import Dialect

__all__ = [
    "SyncKVContext",
    "close",
    "connect",
    "lookup",
    "retrieve",
    "shutdown",
    "store",
]

T = TypeVar("T")

#: How long interpreter exit waits for contexts still open to close.
EXIT_CLOSE_TIMEOUT = _loop_thread.EXIT_CLOSE_TIMEOUT


def _run(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Run ``await fn(*args)`` on the client loop and block until it is done.

    If the waiting thread is interrupted (``KeyboardInterrupt``), the async call
    is cancelled, so it runs its release steps, and the interrupt propagates.
    """
    portal = _loop_thread.portal()
    if threading.current_thread() is _loop_thread.thread():
        raise RuntimeError(
            "lmkv_async.sync was called from its own event loop thread, which would "
            "deadlock; await the AsyncKVContext (SyncKVContext.aio) there instead")
    future: Future[T] = portal.start_task_soon(fn, *args)
    try:
        return future.result()
    except BaseException:
        future.cancel()
        raise


def shutdown(timeout: float = EXIT_CLOSE_TIMEOUT) -> None:
    """Close every context still open and stop the loop thread, if one was started.

    Called at interpreter exit; call it yourself to stop the thread earlier. A
    later :func:`connect` starts a new one. Contexts are closed concurrently,
    for at most ``timeout`` seconds in all. (The loop is the one trio callers
    share too: their contexts and fleets still open are closed as well.)
    """
    _loop_thread.stop(timeout)


class SyncKVContext:
    """A blocking handle on an :class:`~lmkv_async.AsyncKVContext` (from :func:`connect`).

    Every method blocks the calling thread until the server answered and may be
    called from many threads at once; errors are the same typed
    :class:`~lmkv_async.KVCacheError` subclasses the async API raises. Usable as
    a context manager (``with connect(...) as ctx:``), which closes it on exit.
    """

    def __init__(self, aio: AsyncKVContext, generation: int) -> None:
        """Wrap an open async context on the facade's loop ``generation`` (use :func:`connect`)."""
        self._aio = aio
        self._generation = generation
        self._pid = os.getpid()

    def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn`` on the loop this context lives on, or raise ClosedError if it is gone."""
        if (self._pid != os.getpid() or self._generation != _loop_thread.generation()
                or not _loop_thread.running()):
            if self._aio.closed:
                raise ClosedError("context is closed")
            raise ClosedError(
                "this context's event loop is gone (the process forked, or "
                "lmkv_async.sync.shutdown() ran); connect again")
        return _run(fn)

    def __repr__(self) -> str:
        return f"<SyncKVContext of {self._aio!r}>"

    # ------------------------------------------------------------------ properties
    @property
    def aio(self) -> AsyncKVContext:
        """The underlying async context; await it only on the facade's own loop."""
        return self._aio

    @property
    def url(self) -> str:
        """The ZMQ endpoint (``tcp://...``)."""
        return self._aio.url

    @property
    def http_url(self) -> str:
        """The HTTP API URL."""
        return self._aio.http_url

    @property
    def model_name(self) -> str:
        """The server-side model namespace."""
        return self._aio.model_name

    @property
    def instance_id(self) -> int:
        """The id this context registered under."""
        return self._aio.instance_id

    @property
    def chunk_size(self) -> int:
        """Tokens per server object (``--chunk-size``); as the SDK's ``ctx.chunk_size``."""
        return self._aio.chunk_size

    @property
    def layout(self) -> KVLayout:
        """The KV geometry in use."""
        return self._aio.layout

    @property
    def transport(self) -> Literal["shm", "pickle"]:
        """The transfer path in use."""
        return self._aio.transport

    @property
    def server_version(self) -> str:
        """The server's ``/version``."""
        return self._aio.server_version

    @property
    def dialect(self) -> Dialect:
        """The wire dialect chosen for the server."""
        return self._aio.dialect

    @property
    def capabilities(self) -> frozenset[str]:
        """Optional server features (see :attr:`AsyncKVContext.capabilities`)."""
        return self._aio.capabilities

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has started."""
        return self._aio.closed

    # ------------------------------------------------------------------ operations
    def store(self, kv: torch.Tensor, tokens: Tokens, cache_salt: str = "", *,
              timeout: float | None = None) -> StoreResult:
        """Store the KV of ``tokens`` (``kv``: ``[P, L, T, D]``); see :meth:`AsyncKVContext.store`.

        Returns a :class:`~lmkv_async.StoreResult` (the SDK returns a bool).
        """
        async def op() -> StoreResult:
            return await self._aio.store(kv, tokens, cache_salt=cache_salt, timeout=timeout)
        return self._call(op)

    def retrieve(self, tokens: Tokens, cache_salt: str = "", *, out: torch.Tensor | None = None,
                 timeout: float | None = None) -> torch.Tensor | None:
        """The cached prefix's KV ``[P, L, n, D]``, or None on a miss; see
        :meth:`AsyncKVContext.retrieve`."""
        async def op() -> torch.Tensor | None:
            return await self._aio.retrieve(tokens, out=out, cache_salt=cache_salt,
                                            timeout=timeout)
        return self._call(op)

    def lookup(self, tokens: Tokens, cache_salt: str = "", *,
               timeout: float | None = None) -> int:
        """Length in tokens of the longest cached prefix; see :meth:`AsyncKVContext.lookup`."""
        async def op() -> int:
            return await self._aio.lookup(tokens, cache_salt=cache_salt, timeout=timeout)
        return self._call(op)

    def store_many(self, items: Sequence[tuple[torch.Tensor, Tokens]], cache_salt: str = "", *,
                   max_in_flight: int = 32,
                   timeout: float | None = None) -> list[ItemResult[StoreResult]]:
        """Many stores, overlapped on the loop; one :class:`~lmkv_async.ItemResult` each."""
        async def op() -> list[ItemResult[StoreResult]]:
            return await self._aio.store_many(items, cache_salt=cache_salt,
                                              max_in_flight=max_in_flight, timeout=timeout)
        return self._call(op)

    def lookup_many(self, token_lists: Sequence[Tokens], cache_salt: str = "", *,
                    max_in_flight: int = 32,
                    timeout: float | None = None) -> list[ItemResult[int]]:
        """Many lookups, overlapped on the loop; one :class:`~lmkv_async.ItemResult` each."""
        async def op() -> list[ItemResult[int]]:
            return await self._aio.lookup_many(token_lists, cache_salt=cache_salt,
                                               max_in_flight=max_in_flight, timeout=timeout)
        return self._call(op)

    def retrieve_many(self, token_lists: Sequence[Tokens], cache_salt: str = "", *,
                      outs: Sequence[torch.Tensor | None] | None = None,
                      max_in_flight: int = 32,
                      timeout: float | None = None) -> list[ItemResult[torch.Tensor | None]]:
        """Many retrieves, overlapped on the loop; one :class:`~lmkv_async.ItemResult` each."""
        async def op() -> list[ItemResult[torch.Tensor | None]]:
            return await self._aio.retrieve_many(token_lists, outs=outs, cache_salt=cache_salt,
                                                 max_in_flight=max_in_flight, timeout=timeout)
        return self._call(op)

    def status(self) -> dict[str, Any]:
        """The server's ``GET /status``."""
        return self._call(self._aio.status)

    def close(self) -> None:
        """Release everything and unregister; idempotent (as :meth:`AsyncKVContext.aclose`)."""
        if self._aio.closed:
            return
        try:
            self._call(self._aio.aclose)
        finally:
            _loop_thread.forget(self._aio)

    def __enter__(self) -> SyncKVContext:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def connect(url: str, http_url: str, model_name: str, timeout: float = 60.0,
            **lmkv_options: Any) -> SyncKVContext:
    """Connect and register, blocking; the official SDK's ``kvcache.connect`` signature.

    ``timeout`` (60 s, as in the SDK) is the default deadline of every later
    call. ``lmkv_options`` go to :func:`lmkv_async.connect` unchanged:
    ``layout=KVLayout(...)`` (without it the layout is discovered from an
    engine's registration, as the SDK requires), ``transport``, ``api_key``,
    ``sockets``, ``heartbeat_interval``, ... The first call starts the facade's
    event-loop thread.

    Raises the errors of :func:`lmkv_async.connect`.
    """
    async def op() -> SyncKVContext:
        # runs on the loop, so generation() is this loop's
        aio = await _aconnect(url, http_url, model_name, timeout=timeout, **lmkv_options)
        return SyncKVContext(aio, _loop_thread.generation())
    return _run(op)


def store(ctx: SyncKVContext, kv: torch.Tensor, tokens: Tokens, cache_salt: str = "", *,
          timeout: float | None = None) -> StoreResult:
    """``kvcache.store(ctx, kv, tokens, cache_salt)``: see :meth:`SyncKVContext.store`."""
    return ctx.store(kv, tokens, cache_salt, timeout=timeout)


def retrieve(ctx: SyncKVContext, tokens: Tokens, cache_salt: str = "", *,
             out: torch.Tensor | None = None,
             timeout: float | None = None) -> torch.Tensor | None:
    """``kvcache.retrieve(ctx, tokens, cache_salt)``: see :meth:`SyncKVContext.retrieve`."""
    return ctx.retrieve(tokens, cache_salt, out=out, timeout=timeout)


def lookup(ctx: SyncKVContext, tokens: Tokens, cache_salt: str = "", *,
           timeout: float | None = None) -> int:
    """Cached prefix length in tokens (the SDK has no public lookup); see
    :meth:`SyncKVContext.lookup`."""
    return ctx.lookup(tokens, cache_salt, timeout=timeout)


def close(ctx: SyncKVContext) -> None:
    """``kvcache.close(ctx)``: see :meth:`SyncKVContext.close`."""
    ctx.close()
