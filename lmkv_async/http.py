"""HTTP side of the server: ``/version``, ``/config``, ``/status``, ``/healthcheck``, API keys.

Used at connect (version and mode detection, chunk size, layout discovery) and
for diagnostics. Not a liveness signal for the ZMQ loop: on 0.5.2 the request
loop can die while ``/healthcheck`` keeps answering (compat.md §2.1).

API keys (lmcache >= 0.5.7, compat.md §14.8) are sent on every call as
``Authorization: Bearer``; sending one to a server without keys is harmless. A
401 is a configuration error: :class:`AuthenticationError`, raised at once. The
key is held in an :class:`ApiKey`, whose ``repr`` and ``str`` never show it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import httpx

from .errors import (
    AuthenticationError,
    InvalidInputError,
    ProtocolError,
    ServerTimeoutError,
    ServerUnavailableError,
)

__all__ = ["ApiKey", "HttpClient", "resolve_api_key"]

#: Environment variables the server's own package reads, in its order (compat.md §14.8).
API_KEY_FILE_ENV = "LMCACHE_API_KEY_FILE"
API_KEY_ENV = "LMCACHE_API_KEY"
LEGACY_API_KEY_FILE_ENV = "LMCACHE_HTTP_API_KEY_FILE"
LEGACY_API_KEY_ENV = "LMCACHE_HTTP_API_KEY"


class ApiKey:
    """An API key that never shows itself in a repr, a log line or a message."""

    __slots__ = ("_value", "source")

    def __init__(self, value: str, source: str) -> None:
        self._value = value
        #: where it came from ("argument" or an environment variable's name)
        self.source = source

    def reveal(self) -> str:
        """The key itself, for the Authorization header only."""
        return self._value

    def __repr__(self) -> str:
        return f"ApiKey(<redacted>, source={self.source!r})"

    __str__ = __repr__


def _read_key_file(path: str, var: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"cannot read the API key file named by ${var}: "
                                f"{type(exc).__name__}") from None
    lines = text.strip().splitlines()
    if len(lines) != 1 or not lines[0].strip():
        raise InvalidInputError(f"the API key file named by ${var} must hold exactly one line")
    return lines[0].strip()


def resolve_api_key(
    explicit: str | None, environ: Mapping[str, str] | None = None
) -> ApiKey | None:
    """The key to send: ``explicit`` first, else the server package's variables.

    Order: ``$LMCACHE_API_KEY_FILE`` (one line, stripped), ``$LMCACHE_API_KEY``,
    then the legacy ``$LMCACHE_HTTP_API_KEY_FILE`` and ``$LMCACHE_HTTP_API_KEY``
    (read only when both new ones are unset or empty). Empty keys are rejected.
    """
    if explicit is not None:
        if not isinstance(explicit, str) or not explicit.strip():
            raise InvalidInputError("api_key must be a non-empty string")
        if not explicit.isascii() or len(explicit.strip().splitlines()) != 1:
            raise InvalidInputError("api_key must be one line of ASCII")
        return ApiKey(explicit.strip(), "argument")
    env = os.environ if environ is None else environ
    for file_var, key_var in ((API_KEY_FILE_ENV, API_KEY_ENV),
                              (LEGACY_API_KEY_FILE_ENV, LEGACY_API_KEY_ENV)):
        if env.get(file_var):
            return ApiKey(_read_key_file(env[file_var], file_var), file_var)
        if env.get(key_var, "").strip():
            return ApiKey(env[key_var].strip(), key_var)
    return None


class HttpClient:
    """A thin ``httpx.AsyncClient`` wrapper with typed errors and the API key."""

    def __init__(self, base_url: str, *, timeout: float, api_key: ApiKey | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key.reveal()}"} if api_key else {}
        self.has_api_key = api_key is not None
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=timeout,
                                         trust_env=False, headers=headers)

    def __repr__(self) -> str:
        return f"HttpClient({self.base_url!r}, api_key={'set' if self.has_api_key else 'none'})"

    async def get_json(self, path: str, *, timeout: float | None = None) -> Any:
        """GET ``path`` and decode JSON, mapping failures onto the error tree."""
        op = f"GET {path}"
        try:
            resp = await self._client.get(
                path, timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT
            )
        except httpx.TimeoutException:
            raise ServerTimeoutError("HTTP request timed out", op=op, server=self.base_url,
                                     timeout=timeout) from None
        except httpx.TransportError as exc:
            raise ServerUnavailableError(f"HTTP request failed: {type(exc).__name__}: {exc!s}",
                                         op=op, server=self.base_url) from None
        if resp.status_code == 401:
            why = ("the API key was not accepted" if self.has_api_key else
                   "the server requires an API key: pass connect(api_key=...) or set "
                   f"${API_KEY_ENV} / ${API_KEY_FILE_ENV}")
            raise AuthenticationError(f"HTTP 401: {why}", op=op, server=self.base_url)
        if resp.status_code == 404:
            raise ProtocolError("endpoint not found", op=op, server=self.base_url)
        if resp.status_code >= 400:
            raise ServerUnavailableError(f"HTTP {resp.status_code}", op=op, server=self.base_url)
        try:
            return resp.json()
        except ValueError:
            raise ProtocolError("response is not JSON", op=op, server=self.base_url) from None

    async def version(self) -> str:
        """``GET /version``, e.g. ``"0.5.6-g3e11e108"``."""
        value = await self.get_json("/version")
        return str(value)

    async def config(self) -> dict[str, Any]:
        """``GET /config``."""
        value = await self.get_json("/config")
        if not isinstance(value, dict):
            raise ProtocolError("/config is not an object", op="GET /config",
                                server=self.base_url)
        return value

    async def status(self) -> dict[str, Any]:
        """``GET /status`` (locks, sessions, registrations, layouts)."""
        value = await self.get_json("/status")
        if not isinstance(value, dict):
            raise ProtocolError("/status is not an object", op="GET /status",
                                server=self.base_url)
        return value

    async def healthcheck(self, *, timeout: float | None = None) -> bool:
        """``GET /healthcheck`` (public, no key needed): True when the server reports healthy."""
        try:
            value = await self.get_json("/healthcheck", timeout=timeout)
        except (ServerUnavailableError, ServerTimeoutError):
            return False
        return isinstance(value, dict) and value.get("status") == "healthy"

    async def aclose(self) -> None:
        """Close the underlying client."""
        await self._client.aclose()
