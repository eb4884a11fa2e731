"""What a fleet's members and its coordinator see of the fleet: a narrow interface.

:class:`~lmkv_async.fleet.Fleet` owns its members (:mod:`._fleet_member`) and its
coordinator view (:mod:`.coordinator`); they report back to it through these
protocols instead of importing ``fleet.py``, so the imports run one way only
(fleet -> member, fleet -> coordinator -> this module).

Their background work (health loops, event followers, audits, heartbeats, the
coordinator's remapping) runs as jobs of the fleet's
:class:`~._background.Background`, which they reach through ``background``: the
fleet's close ends whatever of it is left.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal, Protocol

from ._background import Background
from ._index import PrefixIndex
from .http import ApiKey
from .layout import KVLayout

__all__ = ["CoordinatedFleet", "FleetHost", "MemberState", "OwnStoreListener", "Registration",
           "Source"]

MemberState = Literal["joining", "up", "down", "closed"]
Source = Literal["index", "lookup", "coordinator", "down"]
Registration = Literal["auto", "always", "never"]

#: called as ``f(member_name, hashes, tokens)`` after a store through the fleet
OwnStoreListener = Callable[[str, Sequence[bytes], Sequence[int]], None]


class FleetHost(Protocol):
    """The fleet as one of its members sees it (settings, the index, store reports)."""

    @property
    def background(self) -> Background: ...
    @property
    def model_name(self) -> str: ...
    @property
    def layout(self) -> KVLayout: ...
    @property
    def timeout(self) -> float: ...
    @property
    def connect_timeout(self) -> float: ...
    @property
    def data_timeout(self) -> float: ...
    @property
    def events(self) -> bool: ...
    @property
    def registration(self) -> Registration: ...
    @property
    def audit_interval(self) -> float: ...
    @property
    def probe_backoff(self) -> tuple[float, float]: ...
    @property
    def allow_stale_index(self) -> bool: ...
    @property
    def chunk_size(self) -> int: ...
    @property
    def api_key(self) -> ApiKey | None: ...
    @property
    def index(self) -> PrefixIndex: ...
    @property
    def _own_store_listeners(self) -> list[OwnStoreListener]: ...

    def _adopt_chunk_size(self, chunk_size: int) -> None:
        """The first member to join sets the fleet's chunk size (and its index)."""

    async def _note_store(self, name: str, toks: list[int], salt: str,
                          chunks: int) -> list[bytes]:
        """Record a store made through member ``name``; returns the chunks' hashes."""
        ...


class _HasHttpUrl(Protocol):
    @property
    def http_url(self) -> str: ...


class CoordinatedFleet(Protocol):
    """The fleet as its coordinator view sees it (membership, settings)."""

    @property
    def background(self) -> Background: ...
    @property
    def model_name(self) -> str: ...
    @property
    def layout(self) -> KVLayout: ...
    @property
    def chunk_size(self) -> int: ...
    @property
    def connect_timeout(self) -> float: ...
    @property
    def api_key(self) -> ApiKey | None: ...
    @property
    def members(self) -> Mapping[str, _HasHttpUrl]: ...

    def add_member(self, name: str, url: str, http_url: str) -> object:
        """Add a server (it joins in the background once the fleet is open)."""
