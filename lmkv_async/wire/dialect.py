"""Server dialects: which integer op ids a given lmcache server speaks.

lmcache 0.5.0-0.5.2 number operations with ``enum.auto()``; 0.5.3+ use a table
shifted by 3 from ``store`` on (frozen as "legacy ids" in 0.5.6). Some ids mean a
*different* operation with the *same arity* in the other table, and a 0.5.2
server's request loop dies for good on any op it cannot decode (a string name or
an unknown int). So a dialect is chosen once at connect and only its integer ids
are ever sent (compat.md §2, §11, §12).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DIALECT_052",
    "DIALECT_056",
    "Dialect",
    "dialect_for_version",
    "dialect_from_config",
    "dialect_from_probe",
    "parse_version",
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
)


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

    def op_id(self, op: str) -> int:
        """Integer id of ``op`` in this dialect (KeyError if it has none)."""
        return self.op_ids[op]

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
    },
    clear_takes_force=True,
    honours_physical_slots=True,
    bounded_free=True,
)

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

_VERSION_RE = re.compile(r"^\s*v?(\d+)\.(\d+)\.(\d+)")


def parse_version(text: str) -> tuple[int, int, int] | None:
    """Parse ``"0.5.6-g3e11e108"`` (or a JSON-quoted form) into ``(0, 5, 6)``."""
    match = _VERSION_RE.match(text.strip().strip('"'))
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2)), int(match.group(3))


def dialect_for_version(version: tuple[int, int, int]) -> Dialect | None:
    """The dialect for a release, or None for releases we cannot speak (< 0.5.0)."""
    if version < (0, 5, 0):
        return None
    if version <= (0, 5, 2):
        return DIALECT_052
    if version <= (0, 5, 4):
        return _DIALECT_053
    if version == (0, 5, 5):
        return _DIALECT_055
    return DIALECT_056


def dialect_from_config(config: Mapping[str, Any]) -> Dialect | None:
    """Infer the dialect from the keys of ``GET /config`` -> ``mp`` (compat.md §11)."""
    mp = config.get("mp")
    if not isinstance(mp, Mapping):
        return None
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
