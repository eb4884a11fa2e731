"""HTTP side of the server: ``/version``, ``/config``, ``/status``, ``/healthcheck``.

Used at connect (version and mode detection, chunk size, layout discovery) and
for diagnostics. Not a liveness signal for the ZMQ loop: on 0.5.2 the request
loop can die while ``/healthcheck`` keeps answering (compat.md §2.1).
"""

from __future__ import annotations

from typing import Any

import httpx

from .errors import ProtocolError, ServerTimeoutError, ServerUnavailableError

__all__ = ["HttpClient"]


class HttpClient:
    """A thin ``httpx.AsyncClient`` wrapper with typed errors."""

    def __init__(self, base_url: str, *, timeout: float) -> None:
        self.base_url = base_url.rstrip("/")
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=timeout, trust_env=False)

    async def get_json(self, path: str, *, timeout: float | None = None) -> Any:
        """GET ``path`` and decode JSON, mapping failures onto the error tree."""
        try:
            resp = await self._client.get(
                path, timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT
            )
        except httpx.TimeoutException:
            raise ServerTimeoutError("HTTP request timed out", op=f"GET {path}",
                                     server=self.base_url, timeout=timeout) from None
        except httpx.TransportError as exc:
            raise ServerUnavailableError(f"HTTP request failed: {exc!s}", op=f"GET {path}",
                                         server=self.base_url) from None
        if resp.status_code == 404:
            raise ProtocolError("endpoint not found", op=f"GET {path}", server=self.base_url)
        if resp.status_code >= 400:
            raise ServerUnavailableError(f"HTTP {resp.status_code}", op=f"GET {path}",
                                         server=self.base_url)
        try:
            return resp.json()
        except ValueError:
            raise ProtocolError("response is not JSON", op=f"GET {path}",
                                server=self.base_url) from None

    async def version(self) -> str:
        """``GET /version``, e.g. ``"0.5.6-g3e11e108"``."""
        value = await self.get_json("/version")
        return str(value)

    async def config(self) -> dict[str, Any]:
        """``GET /config``."""
        value = await self.get_json("/config")
        if not isinstance(value, dict):
            raise ProtocolError("/config is not an object", server=self.base_url)
        return value

    async def status(self) -> dict[str, Any]:
        """``GET /status`` (locks, sessions, registrations, layouts)."""
        value = await self.get_json("/status")
        if not isinstance(value, dict):
            raise ProtocolError("/status is not an object", server=self.base_url)
        return value

    async def healthcheck(self) -> bool:
        """``GET /healthcheck``: True when the server reports healthy."""
        try:
            value = await self.get_json("/healthcheck")
        except ServerUnavailableError:
            return False
        return isinstance(value, dict) and value.get("status") == "healthy"

    async def aclose(self) -> None:
        """Close the underlying client."""
        await self._client.aclose()
