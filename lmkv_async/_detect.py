"""What kind of server this is: release, dialect, chunk size, limits, capabilities.

Detection reads the server once, at connect (and again for the fleet's light
sessions), and returns plain facts; :mod:`._session` keeps them for the
session's life. The order (compat.md §11, §14.7): ``/version``, else the
``/config`` keys, else a harmless ZMQ probe (op 21) for the dialect; then
``get_chunk_size`` for the chunk size; then ``get_experimental`` where it is
reliable, for the capabilities.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import zmq

from ._background import Background
from .errors import (
    InvalidInputError,
    KVCacheError,
    ProtocolError,
    ServerTimeoutError,
    UnsupportedServerError,
)
from .http import HttpClient
from .layout import KVLayout, discover_layout
from .transport import Connection
from .wire import requests
from .wire.dialect import (
    CAP_KV_EVENTS,
    NEWEST_TESTED,
    Dialect,
    dialect_from_config,
    dialect_from_probe,
    resolve_version,
)
from .wire.requests import Request

__all__ = ["DEFAULT_READ_TTL", "ServerFacts", "detect_over_http", "probe_dialect",
           "read_chunk_size", "refine_capabilities", "request_loop_answers"]

log = logging.getLogger("lmkv_async")

#: ``--l1-read-ttl-seconds`` default (0.5.2 .. 0.5.7), used when ``/config`` lacks it
DEFAULT_READ_TTL = 300.0

NEWEST = ".".join(map(str, NEWEST_TESTED))

#: one request on the session's socket within an absolute deadline (``Session.rpc``)
Rpc = Callable[[Request, float], Awaitable[object]]


@dataclass
class ServerFacts:
    """What ``/version`` and ``/config`` say (``None``/0: not said)."""

    server_version: str = ""
    dialect: Dialect | None = None
    #: the server is newer than the newest release we test
    untested_newer: bool = False
    chunk_size: int = 0
    #: the server's L1 read-lock TTL (``--l1-read-ttl-seconds``; compat.md §6.6)
    read_ttl: float = DEFAULT_READ_TTL
    #: the server's normal pool is one thread (``/config mp.max_cpu_workers == 1``)
    ordered_normal_pool: bool = False
    #: ``--worker-reap-timeout-seconds`` (a pinging instance is dropped after it)
    reap_timeout: float | None = None
    #: ``--worker-registration-grace-seconds`` (the same for one that never pinged)
    registration_grace: float | None = None
    layout: KVLayout | None = None


def _positive(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


async def detect_over_http(http: HttpClient, http_url: str, model_name: str,
                           layout: KVLayout | None) -> ServerFacts:
    """Version, mode, chunk size, limits and (when not given) the layout over HTTP."""
    facts = ServerFacts(layout=layout)
    try:
        facts.server_version = await http.version()
    except ProtocolError:
        facts.server_version = ""
    config = await http.config()
    info = resolve_version(facts.server_version) if facts.server_version else None
    if info is not None:
        if info.dialect is None:
            raise UnsupportedServerError(
                f"lmcache {facts.server_version} is older than 0.5.0", server=http_url)
        facts.dialect = info.dialect
        facts.untested_newer = info.untested_newer
        if info.untested_newer:
            log.warning(
                "lmcache %s at %s is newer than the newest release lmkv_async is tested "
                "with (%s); speaking the %s dialect", facts.server_version, http_url,
                NEWEST, info.dialect.name)
    else:
        facts.dialect = dialect_from_config(config)
    mp = config.get("mp") or {}
    if mp.get("supported_transfer_mode") == "lmcache_driven":
        raise UnsupportedServerError(
            "the server runs --supported-transfer-mode lmcache_driven, which has no handler "
            "for the engine-driven operations this client uses; restart it with "
            "--supported-transfer-mode auto (or engine_driven)",
            server=http_url,
        )
    # /config mp.chunk_size is only a fallback: on 0.5.7 it can be stale after an
    # engine negotiated another size (compat.md §14.4); get_chunk_size decides.
    chunk = mp.get("chunk_size")
    if isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0:
        facts.chunk_size = chunk
    l1 = (config.get("storage_manager") or {}).get("l1_manager_config") or {}
    ttl = _positive(l1.get("read_ttl_seconds")) if isinstance(l1, dict) else None
    if ttl is not None:
        facts.read_ttl = ttl
    # One normal-pool thread (the default on every release) runs lookup and
    # query_prefetch_status in arrival order, so the query may follow the lookup
    # without waiting for its ack; with more threads it could overtake it, read 0
    # and leave the lookup's locks behind (protocol reference §2.6).
    workers = mp.get("max_cpu_workers")
    facts.ordered_normal_pool = isinstance(workers, int) and workers == 1
    facts.reap_timeout = _positive(mp.get("worker_reap_timeout_seconds"))
    facts.registration_grace = _positive(mp.get("worker_registration_grace_seconds"))
    if facts.layout is None:
        facts.layout = discover_layout(await http.status(), model_name)
    return facts


async def read_chunk_size(rpc: Rpc, d: Dialect, hinted: int, layout: KVLayout,
                          deadline: float, url: str, http_url: str) -> int:
    """The chunk size from ``get_chunk_size`` (the portable rule, compat.md §14.7;
    ``negotiate_chunk_size`` is never sent), checked against the layout.

    ``hinted`` is ``/config``'s value (0: none), used where the op does not exist.
    """
    chunk_size = hinted
    if d.has_op("get_chunk_size"):
        raw = await rpc(requests.get_chunk_size(d), deadline)
        if isinstance(raw, int) and not isinstance(raw, bool) and raw > 0:
            if chunk_size and raw != chunk_size:
                log.warning("the server's get_chunk_size (%d) differs from /config "
                            "mp.chunk_size (%d); using %d", raw, chunk_size, raw)
            chunk_size = raw
        else:
            raise ProtocolError(f"get_chunk_size answered {raw!r}", op="get_chunk_size",
                                server=url)
    if chunk_size <= 0:
        raise ProtocolError("the server reports no chunk size", server=http_url)
    if chunk_size % layout.block_size != 0:
        raise InvalidInputError(
            f"chunk size {chunk_size} is not a multiple of block_size {layout.block_size}")
    return chunk_size


async def probe_dialect(conn: Connection, timeout: float, url: str) -> Dialect:
    """The dialect from op 21 with no payload (harmless on every table, compat.md §11)."""
    result = await conn.probe(requests.probe(), timeout=timeout)
    dialect = dialect_from_probe(result)
    if dialect is None:
        raise UnsupportedServerError(f"cannot identify the server from {result!r}", server=url)
    return dialect


async def request_loop_answers(http: HttpClient, zmq_context: zmq.Context[Any],
                                url: str, background: Background) -> bool | None:
    """Whether the server's ZMQ request loop answers a probe; None when HTTP is down too.

    A 0.5.2 server's request loop dies for good on an op it cannot decode, while
    its HTTP API keeps reporting healthy (compat.md §12.11). If HTTP answers but
    a harmless op-21 probe on a fresh socket does not, the loop is dead.
    """
    if not await http.healthcheck():
        return None
    probe = Connection(zmq_context, url, -1)
    probe.start(background)
    try:
        answered = await probe.wait_connected(2.0)
        if answered:
            await probe.probe(requests.probe(), timeout=2.0)
    except KVCacheError:
        answered = False
    finally:
        probe.close()
    return answered


async def refine_capabilities(rpc: Rpc, d: Dialect, deadline: float) -> frozenset[str]:
    """Capabilities from the version table, confirmed by ``get_experimental`` where
    that is reliable (0.5.6; 0.5.7rc2 answers ``[]`` although it has the stream)."""
    caps = set(d.capabilities)
    if d.experimental_reliable and CAP_KV_EVENTS in caps:
        try:
            raw = await rpc(requests.get_experimental(d), deadline)
        except ServerTimeoutError:
            raw = None
        if isinstance(raw, list) and "kv_event_stream" not in raw:
            caps.discard(CAP_KV_EVENTS)
    return frozenset(caps)
