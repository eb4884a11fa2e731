"""The one exception tree of lmkv_async.

Every error raised by the library derives from :class:`KVCacheError`, so one
``except lmkv_async.KVCacheError`` catches them all::

    KVCacheError
    ├── InvalidInputError (also ValueError)        bad input; nothing was sent
    │   └── LayoutMismatchError                    kv/caches do not fit the layout
    ├── LayoutNotFoundError (lmkv_async.layout)    layout=None and none registered
    ├── LocalServerError (lmkv_async.local_server) the embedded server failed to start
    ├── ClosedError                                the context is closed
    ├── TransportUnavailableError                  transport="shm" but SHM cannot be used
    ├── CopyBoundsError                            a copy would leave its mapping/tensor
    └── ServerError                                something about the server
        ├── ServerTimeoutError (also TimeoutError) no reply within the deadline
        ├── ServerUnavailableError (also ConnectionError)
        │                                          the server went away / is unreachable
        ├── ProtocolError                          a reply that does not fit the protocol
        └── UnsupportedServerError                 version or mode we cannot talk to

The server never sends error replies (a failed request is simply never
answered), so a :class:`ServerTimeoutError` is the only signal for many
server-side failures; it is never turned into a silent cache miss.
"""

from __future__ import annotations

__all__ = [
    "ClosedError",
    "CopyBoundsError",
    "InvalidInputError",
    "KVCacheError",
    "LayoutMismatchError",
    "ProtocolError",
    "ServerError",
    "ServerTimeoutError",
    "ServerUnavailableError",
    "TransportUnavailableError",
    "UnsupportedServerError",
]


class KVCacheError(Exception):
    """Root of every error raised by lmkv_async."""


class InvalidInputError(KVCacheError, ValueError):
    """The caller's input is invalid; it was rejected before any server traffic."""


class LayoutMismatchError(InvalidInputError):
    """A tensor or paged cache does not match the context's :class:`KVLayout`."""


class ClosedError(KVCacheError):
    """The context (or transport) has been closed."""


class TransportUnavailableError(KVCacheError):
    """The requested transfer path (e.g. ``transport="shm"``) cannot be used."""


class CopyBoundsError(KVCacheError):
    """A copy would read or write outside the mapping or tensor it belongs to.

    Offsets in slot descriptors come from the network, so every range is
    checked before memory is touched; a violation raises this instead.
    """


class ServerError(KVCacheError):
    """Base of errors about the server and its replies.

    ``op`` names the operation and ``server`` the address, where known.
    """

    def __init__(self, message: str, *, op: str | None = None, server: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.op = op
        self.server = server

    def __str__(self) -> str:
        # Built on demand: the op is sometimes filled in by an outer layer.
        where = [f"op={self.op}"] if self.op else []
        if self.server:
            where.append(f"server={self.server}")
        return f"{self.message} ({', '.join(where)})" if where else self.message


class ServerTimeoutError(ServerError, TimeoutError):
    """No reply arrived within the deadline.

    The MP server never replies on failure, so this also covers requests the
    server rejected. ``timeout`` is the deadline in seconds and ``elapsed``
    how long the request had been pending.
    """

    def __init__(
        self,
        message: str,
        *,
        op: str | None = None,
        server: str | None = None,
        timeout: float | None = None,
        elapsed: float | None = None,
    ) -> None:
        detail = message
        if timeout is not None:
            detail += f"; deadline {timeout:.3g}s"
        if elapsed is not None:
            detail += f", pending {elapsed:.3g}s"
        super().__init__(detail, op=op, server=server)
        self.timeout = timeout
        self.elapsed = elapsed


class ServerUnavailableError(ServerError, ConnectionError):
    """The server disconnected, was killed, or cannot be reached."""


class ProtocolError(ServerError):
    """A reply was malformed or inconsistent (bad msgpack, wrong op echo, bad slot)."""


class UnsupportedServerError(ServerError):
    """The server's version or configuration cannot serve this client."""
