"""LMCache's coordinator (lmcache >= 0.5.7): fleet membership and the key directory.

``lmcache coordinator`` serves HTTP. Servers started with ``--coordinator-url``
register with it (``POST /instances``), heartbeat, and, with
``--coordinator-event-reporting``, post their cache events, which feed its key
directory. :class:`CoordinatorClient` reads two of its routes:

* ``GET /instances``: ``{"instances": [{instance_id, ip, http_port, mq_port, ...}]}``.
  ``mq_port`` is 0 unless P2P is on, so the ZMQ endpoint of a discovered server is
  read from that server's own ``GET /config`` (``mp.port``);
* ``POST /directory/lookup`` with ``{token_ids, model_name, world_size, cache_salt}``:
  one result per complete chunk and rank, in order, each with its placements
  ``[{instance_id, incarnation, tier, backend, size_bytes, shared}]``. The
  coordinator hashes the tokens itself (its ``--chunk-size`` must equal the
  servers').

What the directory sees is measured in docs/fleet.md. The fleet turns placements
into a prefix per instance: the chunks ``0..k-1`` that all have an L1 placement
of that instance.

Trust: a coordinator lists whatever registered with it. Listed servers the fleet
was not configured with join only as ``Fleet(discover=...)`` allows (the default
allows none): joining sends them the fleet's API key and opens a data path. The
coordinator itself is sent no key (the 0.5.7 coordinator checks none); the
servers' key goes only to configured or allowed servers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx

from ._background import Job
from ._fleet_host import CoordinatedFleet
from .errors import (
    AuthenticationError,
    ProtocolError,
    ServerTimeoutError,
    ServerUnavailableError,
)
from .http import ApiKey, HttpClient

__all__ = ["CoordinatorClient", "FleetCoordinator", "Instance", "allowed",
           "attach_coordinator", "prefix_by_instance"]

log = logging.getLogger("lmkv_async.coordinator")


class Instance:
    """One server as the coordinator lists it."""

    __slots__ = ("http_port", "instance_id", "ip", "mq_port")

    def __init__(self, instance_id: str, ip: str, http_port: int, mq_port: int) -> None:
        self.instance_id = instance_id
        self.ip = ip
        self.http_port = http_port
        self.mq_port = mq_port

    @property
    def http_url(self) -> str:
        """The server's HTTP API."""
        return f"http://{self.ip}:{self.http_port}"

    def __repr__(self) -> str:
        return f"Instance({self.instance_id!r}, {self.ip}:{self.http_port})"


def prefix_by_instance(results: Sequence[Any], chunks: int) -> dict[str, int]:
    """Longest prefix (in chunks) per instance from ``/directory/lookup`` results.

    ``results`` are in chunk order, ``len(results) // chunks`` per chunk (one per
    rank); a chunk counts for an instance when every rank's key has an L1
    placement of that instance.
    """
    if chunks <= 0 or not results:
        return {}
    per_chunk = len(results) // chunks
    if per_chunk * chunks != len(results):
        raise ProtocolError(f"{len(results)} directory results for {chunks} chunks")
    prefix: dict[str, int] = {}
    alive: set[str] | None = None
    for i in range(chunks):
        holders: set[str] | None = None
        for r in results[i * per_chunk:(i + 1) * per_chunk]:
            if not isinstance(r, Mapping):
                raise ProtocolError("a directory result is not an object")
            here = {str(p.get("instance_id")) for p in r.get("placements") or []
                    if isinstance(p, Mapping) and p.get("tier", "l1") == "l1"}
            holders = here if holders is None else holders & here
        holders = holders or set()
        alive = holders if alive is None else alive & holders
        if not alive:
            break
        for inst in alive:
            prefix[inst] = i + 1
    return prefix


class CoordinatorClient:
    """A thin async client of the coordinator's HTTP API (typed errors, bounded)."""

    def __init__(self, url: str, *, timeout: float, api_key: ApiKey | None = None) -> None:
        self.url = url.rstrip("/")
        self._timeout = timeout
        headers = {"Authorization": f"Bearer {api_key.reveal()}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=self.url, timeout=timeout, trust_env=False,
                                         headers=headers)
        #: set after a failure; the fleet then answers with direct lookups
        self.down_since: float | None = None

    def __repr__(self) -> str:
        return f"CoordinatorClient({self.url!r})"

    async def _call(self, method: str, path: str, *, timeout: float,
                    json: object = None) -> Any:
        op = f"{method} {path}"
        try:
            resp = await self._client.request(method, path, json=json, timeout=timeout)
        except httpx.TimeoutException:
            self.down_since = time.monotonic()  # the last failure
            raise ServerTimeoutError("coordinator did not answer", op=op, server=self.url,
                                     timeout=timeout) from None
        except httpx.TransportError as exc:
            self.down_since = time.monotonic()  # the last failure
            raise ServerUnavailableError(f"coordinator unreachable: {type(exc).__name__}",
                                         op=op, server=self.url) from None
        if resp.status_code == 401:
            raise AuthenticationError("HTTP 401 from the coordinator", op=op, server=self.url)
        if resp.status_code >= 400:
            raise ProtocolError(f"HTTP {resp.status_code}: {resp.text[:200]}", op=op,
                                server=self.url)
        self.down_since = None
        try:
            return resp.json()
        except ValueError:
            raise ProtocolError("response is not JSON", op=op, server=self.url) from None

    async def instances(self) -> list[Instance]:
        """``GET /instances``."""
        body = await self._call("GET", "/instances", timeout=self._timeout)
        items = body.get("instances") if isinstance(body, Mapping) else None
        if not isinstance(items, list):
            raise ProtocolError("/instances has no list", op="GET /instances", server=self.url)
        out = []
        for it in items:
            if isinstance(it, Mapping) and it.get("instance_id") and it.get("ip"):
                out.append(Instance(str(it["instance_id"]), str(it["ip"]),
                                    int(it.get("http_port", 0)), int(it.get("mq_port", 0))))
        return out

    async def directory_lookup(self, tokens: list[int], *, model_name: str, world_size: int,
                               cache_salt: str, timeout: float) -> tuple[int, list[Any]]:
        """``POST /directory/lookup`` (tokens form): ``(chunks, results)``."""
        body = await self._call("POST", "/directory/lookup", timeout=timeout, json={
            "token_ids": tokens, "model_name": model_name, "world_size": world_size,
            "cache_salt": cache_salt})
        if not isinstance(body, Mapping) or not isinstance(body.get("results"), list):
            raise ProtocolError("directory lookup has no results", op="POST /directory/lookup",
                                server=self.url)
        return int(body.get("chunks", 0)), list(body["results"])

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._client.aclose()


class FleetCoordinator:
    """The fleet's view of its coordinator: instance ids mapped to member names."""

    #: after a failure, the directory is not asked again for this long (seconds)
    RETRY_AFTER = 1.0
    #: members unknown to the coordinator are looked for again at most this often
    REMAP_EVERY = 5.0

    def __init__(self, fleet: CoordinatedFleet, client: CoordinatorClient) -> None:
        self.fleet = fleet
        self.client = client
        #: coordinator instance_id -> member name
        self.names: dict[str, str] = {}
        #: the background mapping, a job of the fleet's group
        self._remap: Job[None] | None = None
        self._last_remap = 0.0

    def mapped(self) -> list[str]:
        """Member names the coordinator's directory speaks for."""
        return [n for n in self.names.values() if n in self.fleet.members]

    def usable(self) -> bool:
        """False for :data:`RETRY_AFTER` seconds after a failed call."""
        down = self.client.down_since
        return down is None or time.monotonic() - down > self.RETRY_AFTER

    def remap_soon(self) -> None:
        """Map members that have no instance id yet, in the background (rate-limited)."""
        if len(self.mapped()) == len(self.fleet.members):
            return
        if self._remap is not None and not self._remap.done():
            return
        if time.monotonic() - self._last_remap < self.REMAP_EVERY:
            return
        bg = self.fleet.background
        if not bg.running:
            return  # the fleet is closing
        self._last_remap = time.monotonic()
        self._remap = bg.start_soon(self.map_members, name="lmkv-coordinator-remap")

    async def lookup(self, toks: list[int], salt: str, deadline: float) -> dict[str, int]:
        """Prefix length in tokens per member name, from the directory."""
        f = self.fleet
        left = deadline - time.monotonic()
        if left <= 0:
            raise ServerTimeoutError("deadline expired", op="POST /directory/lookup",
                                     server=self.client.url, timeout=0.0)
        chunks, results = await self.client.directory_lookup(
            toks, model_name=f.model_name, world_size=f.layout.world_size, cache_salt=salt,
            timeout=left)
        by_inst = prefix_by_instance(results, chunks)
        C = f.chunk_size
        return {self.names[i]: n * C for i, n in by_inst.items() if i in self.names}

    async def map_members(self) -> None:
        """Learn each member's coordinator instance id from its ``/config``."""
        for name, member in self.fleet.members.items():
            if name in self.names.values():
                continue
            # A configured (or allowed) member: it may see the fleet's key.
            http = HttpClient(member.http_url, timeout=self.fleet.connect_timeout,
                              api_key=self.fleet.api_key)
            try:
                config = await http.config()
            except Exception as exc:  # a down member is mapped on a later call
                log.debug("cannot read /config of %s: %s", name, exc)
                continue
            finally:
                await _close_http(http)
            inst = (config.get("mp") or {}).get("instance_id")
            if inst:
                self.names[str(inst)] = name

    async def aclose(self) -> None:
        """Stop the background mapping and close the HTTP client."""
        if self._remap is not None:
            self._remap.cancel()
            await self._remap.wait()
        await self.client.aclose()


def allowed(inst: Instance, discover: bool | frozenset[str]) -> bool:
    """Whether a server the coordinator lists may join: ``discover`` is True, or names
    its instance id or its ``host:port`` HTTP address."""
    if isinstance(discover, bool):
        return discover
    return inst.instance_id in discover or f"{inst.ip}:{inst.http_port}" in discover


async def attach_coordinator(fleet: CoordinatedFleet, url: str,
                             discover: bool | frozenset[str]) -> FleetCoordinator:
    """Connect ``fleet`` to its coordinator at ``url``; add the servers it lists that the
    fleet does not have yet and ``discover`` allows (named by their instance id).

    A listed server that is not allowed is never contacted: neither its ``/config``
    nor anything else is asked, so the fleet's API key never reaches it.
    """
    # No key for the coordinator: it checks none, and the key is the servers'.
    client = CoordinatorClient(url, timeout=fleet.connect_timeout)
    coord = FleetCoordinator(fleet, client)
    try:
        await _discover(coord, discover)
    except BaseException:
        # A cancelled open: nobody else holds the coordinator view to close it.
        with anyio.CancelScope(shield=True):
            await coord.aclose()
        raise
    return coord


async def _discover(coord: FleetCoordinator, discover: bool | frozenset[str]) -> None:
    fleet, client = coord.fleet, coord.client
    try:
        instances = await client.instances()
    except Exception as exc:
        log.warning("coordinator %s: %s; using the configured servers only", client.url, exc)
        instances = []
    known = {_host_port(m.http_url) for m in fleet.members.values()}
    for inst in instances:
        if (inst.ip, inst.http_port) in known:
            continue
        if not allowed(inst, discover):
            log.info("coordinator lists %s, not allowed by discover: not joined", inst)
            continue
        http = HttpClient(inst.http_url, timeout=fleet.connect_timeout, api_key=fleet.api_key)
        try:
            mp = (await http.config()).get("mp") or {}
        except Exception as exc:
            log.warning("cannot read /config of discovered %s: %s", inst, exc)
            continue
        finally:
            await _close_http(http)
        port = mp.get("port")
        host = mp.get("host") or inst.ip
        if host in ("0.0.0.0", "::", ""):
            host = inst.ip
        if isinstance(port, int) and port > 0:
            fleet.add_member(inst.instance_id, f"tcp://{host}:{port}", inst.http_url)
            coord.names[inst.instance_id] = inst.instance_id
    await coord.map_members()


async def _close_http(http: HttpClient) -> None:
    """Close a short-lived client also when the caller is being cancelled (anyio's
    cancellation is level-triggered: the close's own awaits would raise again)."""
    with anyio.CancelScope(shield=True):
        await http.aclose()


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or 80
