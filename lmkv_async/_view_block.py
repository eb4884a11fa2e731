"""``ctx.retrieve_view(...)``: the ``async with`` block around a zero-copy read.

The block opens the retrieve sequence up to the copy (:func:`._ops.open_view`),
hands out a :class:`~.view.RetrieveView` over the slots, and ends the hold when it
exits by any path; the release steps run in the hold's tracked job.
"""

from __future__ import annotations

import logging
import time
from types import TracebackType

import anyio

from . import _ops
from ._background import Job
from ._session import Session
from .errors import InvalidInputError
from .memory import Region
from .metrics import OpStats
from .view import RetrieveView

__all__ = ["ViewBlock"]

log = logging.getLogger("lmkv_async")


class ViewBlock:
    """``ctx.retrieve_view(...)``: an async context manager yielding a :class:`RetrieveView`."""

    def __init__(self, session: Session, stats: OpStats, toks: list[int], salt: str,
                 deadline: float) -> None:
        self._s = session
        self._stats = stats
        self._toks = toks
        self._salt = salt
        self._deadline = deadline
        self._hold: _ops.ViewHold | None = None
        self._view: RetrieveView | None = None
        #: the safe-hold warning: a job of the session's group that sleeps, then warns
        self._timer: Job[None] | None = None

    async def __aenter__(self) -> RetrieveView:
        if self._hold is not None:
            raise InvalidInputError("a retrieve_view block cannot be entered twice")
        s = self._s
        C = s.chunk_size
        n = len(self._toks) // C * C
        layout = s.layout
        region = Region(0, 0)
        if n == 0 or s.pool is None:
            chunks: list[tuple[int, int]] = []
            started = time.monotonic()
        else:
            with self._stats.measure("retrieve_view") as m:
                self._hold, chunks, region = await _ops.open_view(
                    s, self._toks, n, self._salt, self._deadline)
                m.nbytes = len(chunks) * C * layout.token_bytes()
            started = self._hold.started
        # The region is the pool the slots were handed out from: after a server
        # restart during the opening, that is the new pool, not the one seen here first.
        view = RetrieveView(
            chunks, chunk_size=C, chunk_shape=layout.chunk_shape(C), dtype=layout.dtype,
            region=region, started=started, read_ttl=s.read_ttl)
        self._view = view
        if self._hold is not None:
            # aclose() ends open views (and then unmaps the pool): the tensors must
            # raise from then on, not touch unmapped memory
            self._hold.on_end.append(lambda: self._end(
                "the context was closed while the retrieve_view block was running"))
        if chunks and s.background.running:
            # Not s.spawn(): close must not wait for a timer. The group's end cancels it
            # if the block outlives the context.
            delay = max(0.0, view.safe_hold_s - view.held_s)
            self._timer = s.background.start_soon(self._warn_long_hold, delay,
                                                  name="lmkv-view-hold-timer")
        return view

    def _end(self, reason: str) -> None:
        """Stop the timer and close the view (its tensors raise from now on)."""
        if self._timer is not None:
            self._timer.cancel()
        if self._view is not None:
            self._view._close(reason)

    async def _warn_long_hold(self, delay: float) -> None:
        await anyio.sleep(delay)
        view = self._view
        if view is not None and not view.closed:
            log.warning(
                "a retrieve_view block has held the server's read locks for %.0f s, past "
                "the safe hold of %.0f s (the server's read TTL is %.0f s): its tensors will "
                "raise ViewClosedError once the TTL runs out", view.held_s, view.safe_hold_s,
                view.read_ttl)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Synchronous on purpose: nothing here can be interrupted by a cancellation,
        # and the release steps run in the hold's (tracked, shielded) job.
        self._end("the retrieve_view block has ended: the server's read lock is "
                  "released and the slot memory may be reused")
        if self._hold is not None:
            self._hold.release()
