"""Server dialects: which integer op ids a given lmcache server speaks, and how.

lmcache 0.5.0-0.5.2 number operations with ``enum.auto()``; 0.5.3+ use a table
shifted by 3 from ``store`` on (frozen as "legacy ids" in 0.5.6). Some ids mean a
*different* operation with the *same arity* in the other table, and a 0.5.2
server's request loop dies for good on any op it cannot decode (a string name or
an unknown int). So a dialect is chosen once at connect and only its integer ids
are ever sent (compat.md §2, §11, §12).

0.5.7 keeps the 0.5.6 ids but changes payloads silently (compat.md §14): the
key's tokens travel as ``token_bytes``, ``prepare_store`` and
``free_lookup_locks`` take a third frame, and inline (non-SHM) data is a typed
msgpack tensor envelope instead of pickle. Every such difference is a field
of :class:`Dialect`, read by the request builders in :mod:`.requests`.

Version policy (:func:`resolve_version`): a known release gets its dialect; a
release newer than :data:`NEWEST_TESTED` gets the newest dialect and is flagged,
so the caller can warn and say so in timeouts; older than 0.5.0 is refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "CAP_API_KEYS",
    "CAP_COORDINATOR",
    "CAP_KV_EVENTS",
    "DIALECT_052",
    "DIALECT_056",
    "DIALECT_057",
    "NEWEST_TESTED",
    "PROBE_OP_ID",
    "Dialect",
    "VersionInfo",
    "dialect_for_version",
    "dialect_from_config",
    "dialect_from_probe",
    "parse_version",
    "resolve_version",
]

# Operation names used by the client, in one place.
OPS = (
    "lookup",
    "query_prefetch_status",
    "wait_prefetch_status",
    "free_lookup_locks",
    "end_session",
    "register_kv_cache_engine_driven_context",
    "unregister_kv_cache_engine_driven_context",
    "prepare_store",
    "commit_store",
    "prepare_retrieve",
    "commit_retrieve",
    "clear",
    "get_chunk_size",
    "ping",
    "noop",
    "get_experimental",
)


#: Optional server features (``AsyncKVContext.capabilities``).
CAP_KV_EVENTS = "kv_events"  # the streaming op subscribe_kv_events (>= 0.5.6)
CAP_API_KEYS = "api_keys"  # HTTP API keys (>= 0.5.7)
CAP_COORDINATOR = "coordinator"  # --coordinator-url reporting (>= 0.5.7)


@dataclass(frozen=True)
class Dialect:
    """The wire facts that differ between server releases."""

    name: str
    op_ids: Mapping[str, int] = field(repr=False)
    #: ``clear`` takes a ``force`` payload frame (0.5.6) or none (<= 0.5.5).
    clear_takes_force: bool
    #: ``num_physical_slots`` other than the chunk size is honoured (>= 0.5.5).
    honours_physical_slots: bool
    #: ``free_lookup_locks`` only releases the hit its session recorded, with lock
    #: owners (0.5.6); before that it frees anonymously whatever range it is given.
    bounded_free: bool = False
    #: How the key carries its tokens: a msgpack int array, or big-endian uint32
    #: bytes (0.5.7).
    key_tokens: Literal["token_ids", "token_bytes"] = "token_ids"
    #: ``prepare_store`` takes ``skipped_chunks`` and ``free_lookup_locks`` takes
    #: ``extra_ranges`` as a required third frame (0.5.7).
    third_frames: bool = False
    #: Inline (non-SHM) tensor data: pickled list (<= 0.5.6) or tensor envelope.
    inline_codec: Literal["pickle", "envelope"] = "pickle"
    #: Ops sent by their string name (no integer id exists for them).
    named_ops: frozenset[str] = frozenset()
    #: Optional features this release has (``CAP_*``).
    capabilities: frozenset[str] = frozenset()
    #: ``get_experimental`` lists the KV-event stream when it is on (0.5.6 only:
    #: 0.5.7rc2 answers ``[]`` although the stream exists, compat.md §14.5).
    experimental_reliable: bool = False

    def op_id(self, op: str) -> int | str:
        """What goes in the op frame for ``op``: its integer id, or its name for the
        ops that only exist by name (KeyError if this release lacks it)."""
        if op in self.named_ops:
            return op
        return self.op_ids[op]

    def has_op(self, op: str) -> bool:
        """Whether this release serves ``op``."""
        return op in self.named_ops or op in self.op_ids

    def op_name(self, op_id: int) -> str | None:
        """Reverse lookup, for messages."""
        for name, value in self.op_ids.items():
            if value == op_id:
                return name
        return None


DIALECT_052 = Dialect(
    name="0.5.0-0.5.2",
    op_ids={
        "lookup": 5,
        "query_prefetch_status": 6,
        "wait_prefetch_status": 7,
        "free_lookup_locks": 9,
        "end_session": 10,
        "register_kv_cache_engine_driven_context": 11,
        "unregister_kv_cache_engine_driven_context": 12,
        "prepare_store": 13,
        "commit_store": 14,
        "prepare_retrieve": 15,
        "commit_retrieve": 16,
        "clear": 17,
        "get_chunk_size": 18,
        "ping": 19,
        "noop": 21,
    },
    clear_takes_force=False,
    honours_physical_slots=False,
)

DIALECT_056 = Dialect(
    name="0.5.6",
    op_ids={
        "lookup": 8,
        "query_prefetch_status": 9,
        "wait_prefetch_status": 10,
        "free_lookup_locks": 12,
        "end_session": 13,
        "register_kv_cache_engine_driven_context": 14,
        "unregister_kv_cache_engine_driven_context": 15,
        "prepare_store": 16,
        "commit_store": 17,
        "prepare_retrieve": 18,
        "commit_retrieve": 19,
        "clear": 20,
        "get_chunk_size": 21,
        "ping": 22,
        "noop": 24,
        "get_experimental": 32,
    },
    clear_takes_force=True,
    honours_physical_slots=True,
    bounded_free=True,
    named_ops=frozenset({"subscribe_kv_events"}),
    capabilities=frozenset({CAP_KV_EVENTS}),
    experimental_reliable=True,
)

DIALECT_057 = Dialect(
    name="0.5.7",
    op_ids=DIALECT_056.op_ids,
    clear_takes_force=True,
    honours_physical_slots=True,
    bounded_free=True,
    key_tokens="token_bytes",
    third_frames=True,
    inline_codec="envelope",
    named_ops=frozenset({"subscribe_kv_events"}),
    capabilities=frozenset({CAP_KV_EVENTS, CAP_API_KEYS, CAP_COORDINATOR}),
)

#: The newest release the test suite runs against (as 0.5.7rc2).
NEWEST_TESTED = (0, 5, 7)

# 0.5.3-0.5.5 share the 0.5.6 id table but not its clear payload / slot rules.
_DIALECT_053 = Dialect(
    name="0.5.3-0.5.4",
    op_ids=DIALECT_056.op_ids,
    clear_takes_force=False,
    honours_physical_slots=False,
)
_DIALECT_055 = Dialect(
    name="0.5.5",
    op_ids=DIALECT_056.op_ids,
    clear_takes_force=False,
    honours_physical_slots=True,
)

_VERSION_RE = re.compile(r"^\s*v?(\d+)\.(\d+)\.(\d+)((?:a|b|rc|\.dev|\.post)\d*)?")


def parse_version(text: str) -> tuple[int, int, int] | None:
    """Parse ``"0.5.6-g3e11e108"`` (or a JSON-quoted form) into ``(0, 5, 6)``."""
    match = _VERSION_RE.match(text.strip().strip('"'))
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2)), int(match.group(3))


def dialect_for_version(version: tuple[int, int, int]) -> Dialect | None:
    """The dialect for a release, or None for releases we cannot speak (< 0.5.0).

    Pre-releases count as their release (``0.5.7rc2`` speaks 0.5.7).
    """
    if version < (0, 5, 0):
        return None
    if version <= (0, 5, 2):
        return DIALECT_052
    if version <= (0, 5, 4):
        return _DIALECT_053
    if version == (0, 5, 5):
        return _DIALECT_055
    if version == (0, 5, 6):
        return DIALECT_056
    return DIALECT_057


@dataclass(frozen=True)
class VersionInfo:
    """What :func:`resolve_version` decided about a server's ``/version``."""

    text: str
    version: tuple[int, int, int]
    #: None: older than 0.5.0, which this client cannot speak.
    dialect: Dialect | None
    #: Newer than :data:`NEWEST_TESTED`: spoken with the newest dialect, untested.
    untested_newer: bool


def resolve_version(text: str) -> VersionInfo | None:
    """Apply the version policy to a ``/version`` string.

    Returns None when the text does not parse (the caller then falls back to
    ``/config`` keys, then to a ZMQ probe).
    """
    version = parse_version(text)
    if version is None:
        return None
    return VersionInfo(text, version, dialect_for_version(version),
                       untested_newer=version > NEWEST_TESTED)


def dialect_from_config(config: Mapping[str, Any]) -> Dialect | None:
    """Infer the dialect from the keys of ``GET /config`` -> ``mp`` (compat.md §11)."""
    mp = config.get("mp")
    if not isinstance(mp, Mapping):
        return None
    if ("kv_load_policy" in mp or "grpc_server_mode" in mp) and "enable" not in mp:
        return DIALECT_057
    if "session_ttl_seconds" in mp:
        return DIALECT_056
    if "transport" in mp:
        return _DIALECT_055
    if "enable" in mp:
        return _DIALECT_053
    return DIALECT_052


def dialect_from_probe(result: object) -> Dialect | None:
    """Interpret the reply to op 21 with no payload (safe on every table).

    ``"OK"`` means 21 is ``noop`` (0.5.0-0.5.2); an int means ``get_chunk_size``
    (0.5.3+). We cannot tell 0.5.3-0.5.6 apart this way, so assume the most
    conservative newer table (no clear payload, no physical slots).
    """
    if result == "OK":
        return DIALECT_052
    if isinstance(result, int) and not isinstance(result, bool):
        return _DIALECT_053
    return None


PROBE_OP_ID = 21
"""The one op id that is harmless on every supported table (compat.md §11)."""
