"""What an operation must release, given how far it got: pure rules, no I/O.

In the spirit of h11's state rules: the operation sequences in :mod:`._ops`
record how far they got, and these functions say which release steps to send.
They are unit-tested without a server (``tests/test_release.py``).

Server facts behind the rules (protocol reference §6, compat.md §6.3, §14.4):

* a ``lookup`` locks the hit it reports and opens a session; its result is
  consumed exactly once by ``query``/``wait_prefetch_status``;
* ``free_lookup_locks`` releases a hit's read locks: on 0.5.6+ bounded by the
  hit the session recorded (so freeing the whole range is safe when the hit is
  unknown), on <= 0.5.2 anonymously, exactly the range given;
* ``prepare_retrieve`` on SHM hands the lookup's locks over to a pending read
  that ``commit_retrieve`` releases; inline (pickle/envelope) it releases them
  itself; a failed prepare leaves them with the lookup;
* every operation ends its session with ``end_session``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["LookupRelease", "Prepared", "lookup_release", "retrieve_release"]


class Prepared(Enum):
    """How far a retrieve got with ``prepare_retrieve``."""

    NONE = "none"  # not sent
    SENT = "sent"  # sent; no usable reply (timeout, cancellation, transport error)
    SHM = "shm"  # SHM slots handed out: a pending read is held
    INLINE = "inline"  # inline data received: the server released the locks itself
    FAILED = "failed"  # success=false: the lookup's locks are still held


@dataclass(frozen=True)
class LookupRelease:
    """Release steps of a lookup, in order."""

    #: send ``wait_prefetch_status`` first, to learn (and consume) what it locked
    consume: bool
    #: chunks to free with ``free_lookup_locks``: a count, ``"learned"`` (what the
    #: consume step reports), or 0 for none
    free: int | str
    end_session: bool


_NOTHING = LookupRelease(consume=False, free=0, end_session=False)


def lookup_release(
    *,
    lookup_sent: bool,
    hit: int | None,
    free_hit: bool,
    bounded_free: bool,
    looked_up_chunks: int,
) -> LookupRelease:
    """Release steps for a lookup that got as far as described.

    ``hit`` is the consumed hit count, None when the result was never consumed
    (the lookup may still be running, or our query's reply was lost).
    ``free_hit`` is False when a later step took the locks over (a successful
    SHM or inline prepare_retrieve).
    """
    if not lookup_sent:
        return _NOTHING
    if hit is None:
        # Unknown hit: consume it so we know what was locked. If our own query had
        # consumed it (reply lost), the wait says 0; a bounded free can then free
        # the whole range, the server limits it to the hit it recorded.
        free: int | str = looked_up_chunks if bounded_free else "learned"
        return LookupRelease(consume=True, free=free, end_session=True)
    return LookupRelease(consume=False, free=hit if free_hit else 0, end_session=True)


@dataclass(frozen=True)
class RetrieveRelease:
    """Release steps of a retrieve, before its lookup's own steps."""

    commit_retrieve: bool
    #: whether the lookup's hit locks are still ours to free
    lookup_holds_locks: bool


def retrieve_release(prepared: Prepared) -> RetrieveRelease:
    """What a retrieve releases, given how far ``prepare_retrieve`` got.

    After a lost prepare reply, ``commit_retrieve`` is sent on the same socket:
    the server's per-identity FIFO runs it after the prepare, and a second
    commit is a no-op.
    """
    return RetrieveRelease(
        commit_retrieve=prepared in (Prepared.SHM, Prepared.SENT),
        lookup_holds_locks=prepared in (Prepared.NONE, Prepared.FAILED),
    )
