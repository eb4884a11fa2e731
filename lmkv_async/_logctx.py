"""What a log record of this package belongs to: ``record.op``, ``record.server``,
``record.request_id``.

Each operation runs in a task of its own (``Session.run``), and its RPC sequence
calls :func:`bind` when it picks its request id; release steps are tasks created
from there, so they inherit the binding (a context variable copies into new
tasks). :class:`ContextFilter`, installed on every logger of the package by
:func:`install`, copies the binding onto each record, so a handler can format
``%(op)s %(server)s %(request_id)s`` or ship them as structured fields. Outside
an operation the three are ``None``.

Only identifiers go there: the op name, the server URL and the request id the
client made up (``lmkv-<op>-<uuid>``), never a key, a token or a tensor.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar

__all__ = ["FIELDS", "LOGGER_NAMES", "ContextFilter", "bind", "current", "install"]

#: The record attributes the filter sets.
FIELDS = ("op", "server", "request_id")

#: Every logger the package logs to (tests/test_logging.py checks the sources for others).
LOGGER_NAMES = (
    "lmkv_async",
    "lmkv_async.cli",
    "lmkv_async.coordinator",
    "lmkv_async.cuda",
    "lmkv_async.events",
    "lmkv_async.fleet",
    "lmkv_async.shm",
    "lmkv_async.transport",
    "lmkv_async.vllm_events",
)

_context: ContextVar[tuple[str | None, str | None, str | None]] = ContextVar(
    "lmkv_async_log_context", default=(None, None, None))


def bind(*, op: str | None, server: str | None, request_id: str | None = None) -> None:
    """Bind the current task (and tasks it creates from now on) to an operation."""
    _context.set((op, server, request_id))


def current() -> dict[str, str | None]:
    """The binding of the current task, as ``{field: value}``."""
    return dict(zip(FIELDS, _context.get(), strict=True))


class ContextFilter(logging.Filter):
    """Sets ``op``, ``server`` and ``request_id`` on each record (an ``extra=`` value wins)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in zip(FIELDS, _context.get(), strict=True):
            if not hasattr(record, name):
                setattr(record, name, value)
        return True


_FILTER = ContextFilter()


def install() -> None:
    """Put the filter on every logger of :data:`LOGGER_NAMES` (idempotent).

    A logger's filters see only the records logged to that logger itself, not
    those of its children, hence one per name rather than one on ``lmkv_async``.
    """
    for name in LOGGER_NAMES:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
