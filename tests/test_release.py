"""The pure release rules (lmkv_async._release) and the version policy, without a server."""

from __future__ import annotations

import pytest

from lmkv_async._release import Prepared, lookup_release, retrieve_release
from lmkv_async._session import heartbeat_interval_for
from lmkv_async.wire.dialect import (
    CAP_API_KEYS,
    CAP_KV_EVENTS,
    DIALECT_052,
    DIALECT_056,
    DIALECT_057,
    NEWEST_TESTED,
    dialect_for_version,
    dialect_from_config,
    parse_version,
    resolve_version,
)


def test_lookup_never_sent_releases_nothing() -> None:
    plan = lookup_release(lookup_sent=False, hit=None, free_hit=True, bounded_free=True,
                          looked_up_chunks=4)
    assert (plan.consume, plan.free, plan.end_session) == (False, 0, False)


@pytest.mark.parametrize("free_hit", [True, False])
def test_known_hit(free_hit: bool) -> None:
    plan = lookup_release(lookup_sent=True, hit=3, free_hit=free_hit, bounded_free=False,
                          looked_up_chunks=4)
    assert plan == type(plan)(consume=False, free=3 if free_hit else 0, end_session=True)


def test_miss_frees_nothing_but_ends_the_session() -> None:
    plan = lookup_release(lookup_sent=True, hit=0, free_hit=True, bounded_free=True,
                          looked_up_chunks=4)
    assert (plan.consume, plan.free, plan.end_session) == (False, 0, True)


def test_unknown_hit_bounded_free_frees_the_whole_range() -> None:
    # 0.5.6+: the server bounds the free by the hit it recorded, so the whole range is safe
    plan = lookup_release(lookup_sent=True, hit=None, free_hit=False, bounded_free=True,
                          looked_up_chunks=4)
    assert (plan.consume, plan.free, plan.end_session) == (True, 4, True)


def test_unknown_hit_anonymous_free_frees_what_it_learns() -> None:
    # 0.5.2: an anonymous free of the whole range could strip another client's locks
    plan = lookup_release(lookup_sent=True, hit=None, free_hit=True, bounded_free=False,
                          looked_up_chunks=4)
    assert (plan.consume, plan.free, plan.end_session) == (True, "learned", True)


@pytest.mark.parametrize(
    ("prepared", "commit", "lookup_holds"),
    [
        (Prepared.NONE, False, True),
        (Prepared.SENT, True, False),
        (Prepared.SHM, True, False),
        (Prepared.INLINE, False, False),
        (Prepared.FAILED, False, True),
    ],
)
def test_retrieve_release(prepared: Prepared, commit: bool, lookup_holds: bool) -> None:
    plan = retrieve_release(prepared)
    assert (plan.commit_retrieve, plan.lookup_holds_locks) == (commit, lookup_holds)


# ---------------------------------------------------------------------- version policy
@pytest.mark.parametrize(
    ("text", "version"),
    [("0.5.7rc2-gbf85b41f", (0, 5, 7)), ('"0.5.6-g3e11e108"', (0, 5, 6)), ("v0.5.2", (0, 5, 2)),
     ("0.6.0.dev3", (0, 6, 0)), ("0.5.8a1", (0, 5, 8)), ("not a version", None)],
)
def test_parse_version_with_prerelease_tags(text: str, version: tuple[int, ...] | None) -> None:
    assert parse_version(text) == version


def test_known_release_gets_its_dialect() -> None:
    for text, dialect in (("0.5.2-gcd2c0d6a", DIALECT_052), ("0.5.6-g3e11e108", DIALECT_056),
                          ("0.5.7rc2-gbf85b41f", DIALECT_057)):
        info = resolve_version(text)
        assert info is not None and info.dialect is dialect and not info.untested_newer


@pytest.mark.parametrize("text", ["0.5.8", "0.6.0", "1.0.0rc1"])
def test_newer_release_gets_newest_dialect_flagged(text: str) -> None:
    info = resolve_version(text)
    assert info is not None
    assert info.dialect is DIALECT_057 and info.untested_newer
    assert info.version > NEWEST_TESTED


def test_older_than_050_is_refused_and_garbage_falls_back() -> None:
    info = resolve_version("0.4.9")
    assert info is not None and info.dialect is None
    assert dialect_for_version((0, 4, 9)) is None
    assert resolve_version("") is None and resolve_version("dev") is None


def test_config_fallback_recognises_057() -> None:
    assert dialect_from_config({"mp": {"kv_load_policy": "x", "session_ttl_seconds": 1}}) \
        is DIALECT_057
    assert dialect_from_config({"mp": {"session_ttl_seconds": 1, "enable": True}}) \
        is DIALECT_056
    assert dialect_from_config({"mp": {}}) is DIALECT_052
    assert dialect_from_config({}) is None


def test_capabilities_by_version() -> None:
    assert DIALECT_052.capabilities == frozenset()
    assert CAP_KV_EVENTS in DIALECT_056.capabilities
    assert CAP_API_KEYS not in DIALECT_056.capabilities
    assert {CAP_KV_EVENTS, CAP_API_KEYS} <= DIALECT_057.capabilities
    assert DIALECT_056.experimental_reliable and not DIALECT_057.experimental_reliable


@pytest.mark.parametrize(("reap", "interval"),
                         [(None, 10.0), (120.0, 10.0), (30.0, 7.5), (8.0, 2.0), (2.0, 1.0)])
def test_heartbeat_interval_from_reap_timeout(reap: float | None, interval: float) -> None:
    assert heartbeat_interval_for(reap) == interval
