"""What ``connect()`` checks before any traffic, and the handle it returns.

``connect(...)`` (:mod:`.context`) validates its arguments here, then builds the
session (detection and registration: :mod:`._session`, :mod:`._detect`) when
the handle is awaited or entered.

Entered (``async with connect(...) as ctx``), the handle opens the context's task
group in the caller's task first (:class:`~._background.Background`), so the
context's background work lives inside the caller's block and ends with it.
Awaited (``ctx = await connect(...)``), the context hosts its group itself and
``aclose()`` ends it: on trio in a system task (see ``docs/getting-started.md``).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

from ._background import Background
from .errors import InvalidInputError
from .layout import KVLayout
from .validate import check_timeout

__all__ = ["ConnectArgs", "Connecting", "check_connect_args"]

_MODEL_NAME = re.compile(r"^[^@\x00]+$")


class _Closable(Protocol):
    async def aclose(self) -> None: ...


C = TypeVar("C", bound=_Closable)


@dataclass(frozen=True)
class ConnectArgs:
    """``connect()``'s arguments once checked (the URL normalised)."""

    url: str
    timeout: float


def check_connect_args(
    url: object,
    http_url: object,
    model_name: object,
    *,
    layout: object,
    timeout: float,
    transport: object,
    sockets: object,
    heartbeat_interval: object,
) -> ConnectArgs:
    """Raise :class:`InvalidInputError` for a bad argument; nothing is sent."""
    if not isinstance(url, str) or not url:
        raise InvalidInputError("url must be a non-empty string")
    if "://" not in url:
        url = f"tcp://{url}"
    if url.startswith(("grpc://", "grpc+unix://")):
        raise InvalidInputError("gRPC endpoints are not supported yet; start the server with "
                                "its default ZMQ transport and pass its tcp:// URL")
    if not url.startswith(("tcp://", "ipc://")):
        raise InvalidInputError(f"url must be a tcp:// or ipc:// ZMQ endpoint, got {url!r}")
    if not isinstance(http_url, str) or not http_url.startswith(("http://", "https://")):
        raise InvalidInputError(f"http_url must be an http(s) URL, got {http_url!r}")
    if not isinstance(model_name, str) or not _MODEL_NAME.match(model_name):
        raise InvalidInputError("model_name must be a non-empty string without '@'")
    if layout is not None and not isinstance(layout, KVLayout):
        raise InvalidInputError("layout must be a KVLayout or None")
    if transport not in ("auto", "shm", "pickle"):
        raise InvalidInputError(f"transport must be 'auto', 'shm' or 'pickle', got {transport!r}")
    if isinstance(sockets, bool) or not isinstance(sockets, int) or sockets < 1:
        raise InvalidInputError("sockets must be a positive int")
    if heartbeat_interval is not None and (
        isinstance(heartbeat_interval, bool)
        or not isinstance(heartbeat_interval, (int, float))
        or not heartbeat_interval >= 0
    ):
        raise InvalidInputError(
            f"heartbeat_interval must be None, 0 (off) or a positive number of seconds, "
            f"got {heartbeat_interval!r}"
        )
    return ConnectArgs(url, check_timeout(timeout, 10.0))


class Connecting(Generic[C]):
    """``connect(...)`` result: await it, or use it as ``async with``.

    ``factory(background)`` builds the object; ``background`` is None when awaited
    (the object hosts its own task group) and the entered group under ``async with``.
    """

    def __init__(self, factory: Callable[[Background | None], Awaitable[C]],
                 name: str = "context") -> None:
        self._factory = factory
        self._name = name
        self._ctx: C | None = None
        self._bg: Background | None = None

    def __await__(self) -> Generator[Any, None, C]:
        return self._factory(None).__await__()

    async def within(self, background: Background) -> C:
        """Open the object with its background work in ``background``, a group someone
        else owns and keeps open for longer (a fleet, for its members' contexts)."""
        return await self._factory(background)

    async def __aenter__(self) -> C:
        bg = Background(self._name)
        await bg.__aenter__()
        try:
            self._ctx = await self._factory(bg)
        except BaseException as exc:
            # the factory undid its own work; the group has nothing left but to end
            await bg.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self._bg = bg
        return self._ctx

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._ctx is not None:
                await self._ctx.aclose()
        finally:
            if self._bg is not None:
                await self._bg.__aexit__(exc_type, exc, tb)
