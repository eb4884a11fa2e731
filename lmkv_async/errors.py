"""The one exception tree of lmkv_async.

Every error raised by the library derives from :class:`KVCacheError`, so one
``except lmkv_async.KVCacheError`` catches them all::

    KVCacheError
    ├── InvalidInputError (also ValueError)        bad input; nothing was sent
    │   └── LayoutMismatchError                    kv/caches do not fit the layout
    ├── LayoutNotFoundError                        layout=None and none registered
    ├── ClosedError                                the context is closed
    │   └── ViewClosedError                        a retrieve_view tensor used after its block
    ├── TransportUnavailableError                  transport="shm" but SHM cannot be used
    ├── CopyBoundsError                            a copy would leave its mapping/tensor
    └── ServerError                                something about the server
        ├── ServerTimeoutError (also TimeoutError) no reply within the deadline
        ├── ServerUnavailableError (also ConnectionError)
        │                                          the server went away / is unreachable
        ├── AuthenticationError                    HTTP 401: API key missing or wrong
        ├── ProtocolError                          a reply that does not fit the protocol
        ├── UnsupportedServerError                 version or mode we cannot talk to
        └── UnsupportedOperationError              this server release lacks the operation

The server never sends error replies (a failed request is simply never
answered), so a :class:`ServerTimeoutError` is the only signal for many
server-side failures; it is never turned into a silent cache miss.

Context (``op``, ``server``, ``request_id``) is given when an error is raised;
:func:`with_context` is the one place that fills in what an inner layer could not
know, without overwriting what it did know. Errors of the test harness
(:class:`lmkv_async.testing.LocalServerError`) are not part of this tree.
"""

from __future__ import annotations

from typing import TypeVar

import zmq

__all__ = [
    "AuthenticationError",
    "ClosedError",
    "CopyBoundsError",
    "InvalidInputError",
    "KVCacheError",
    "LayoutMismatchError",
    "LayoutNotFoundError",
    "ProtocolError",
    "ServerError",
    "ServerTimeoutError",
    "ServerUnavailableError",
    "TransportUnavailableError",
    "UnsupportedOperationError",
    "UnsupportedServerError",
    "ViewClosedError",
    "from_zmq_error",
    "with_context",
]


class KVCacheError(Exception):
    """Root of every error raised by lmkv_async."""


class InvalidInputError(KVCacheError, ValueError):
    """The caller's input is invalid; it was rejected before any server traffic."""


class LayoutMismatchError(InvalidInputError):
    """A tensor or paged cache does not match the context's :class:`KVLayout`."""


class LayoutNotFoundError(KVCacheError):
    """``layout=None`` but the server has no layout registered for this model."""


class ClosedError(KVCacheError):
    """The context (or transport) has been closed."""


class ViewClosedError(ClosedError):
    """A :meth:`~lmkv_async.AsyncKVContext.retrieve_view` tensor was used after its block
    ended (or after the server's read-lock TTL ran out): the server may have reused the
    memory, so nothing is read from it."""


class TransportUnavailableError(KVCacheError):
    """The requested transfer path (e.g. ``transport="shm"``) cannot be used."""


class CopyBoundsError(KVCacheError):
    """A copy would read or write outside the mapping or tensor it belongs to.

    Offsets in slot descriptors come from the network, so every range is
    checked before memory is touched; a violation raises this instead.
    """


class ServerError(KVCacheError):
    """Base of errors about the server and its replies.

    ``op`` names the operation, ``server`` the address and ``request_id`` the
    server-side session of the operation, where known.
    """

    def __init__(
        self,
        message: str,
        *,
        op: str | None = None,
        server: str | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.op = op
        self.server = server
        self.request_id = request_id

    def __str__(self) -> str:
        where = [f"op={self.op}"] if self.op else []
        if self.server:
            where.append(f"server={self.server}")
        if self.request_id:
            where.append(f"request_id={self.request_id}")
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
        request_id: str | None = None,
        timeout: float | None = None,
        elapsed: float | None = None,
    ) -> None:
        detail = message
        if timeout is not None:
            detail += f"; deadline {timeout:.3g}s"
        if elapsed is not None:
            detail += f", pending {elapsed:.3g}s"
        super().__init__(detail, op=op, server=server, request_id=request_id)
        self.timeout = timeout
        self.elapsed = elapsed


class ServerUnavailableError(ServerError, ConnectionError):
    """The server disconnected, was killed, or cannot be reached."""


class AuthenticationError(ServerError):
    """The HTTP API answered 401: the API key is missing or not accepted.

    A configuration error: it is raised at once and never retried. The key
    itself never appears in the message.
    """


class ProtocolError(ServerError):
    """A reply was malformed or inconsistent (bad msgpack, wrong op echo, bad slot)."""


class UnsupportedServerError(ServerError):
    """The server's version or configuration cannot serve this client."""


class UnsupportedOperationError(ServerError):
    """The server's release lacks this operation; nothing was sent.

    Older servers answer an unknown operation with silence (a full deadline),
    and some frames kill their request loop, so the check is made client-side
    from the detected version.
    """


E = TypeVar("E", bound=BaseException)


def with_context(
    exc: E, *, op: str | None = None, server: str | None = None, request_id: str | None = None
) -> E:
    """Fill in the context an inner layer did not know; never overwrite what it set."""
    if isinstance(exc, ServerError):
        if exc.op is None:
            exc.op = op
        if exc.server is None:
            exc.server = server
        if exc.request_id is None:
            exc.request_id = request_id
    return exc


def from_zmq_error(exc: zmq.ZMQError, *, op: str | None, server: str | None) -> KVCacheError:
    """Map a ``zmq.ZMQError`` into the tree.

    ``ETERM``/``ENOTSOCK`` mean our own socket or context was closed; anything
    else (host unreachable, a refused send) means the server cannot be reached.
    """
    if exc.errno in (zmq.ETERM, zmq.ENOTSOCK):
        return ClosedError(f"transport closed ({exc.strerror})")
    return ServerUnavailableError(f"ZMQ error: {exc.strerror}", op=op, server=server)
