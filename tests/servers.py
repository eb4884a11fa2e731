"""Real lmcache servers for the test suite: a lazily started pool and leak checks.

Import from test modules as ``from servers import ...`` (``conftest.py`` puts
this directory on ``sys.path``; the suite runs with ``--import-mode=importlib``
against the installed ``lmkv_async``).

* :class:`ServerPool` starts servers on first use, shares identical
  configurations across tests, and caps how many run at once (2 cores).
* :func:`assert_no_leaks` checks ``/status`` for sessions, locks and
  engine-driven registrations left behind (blocking; for sync tests).
* :func:`assert_quiescent` does the same from async code, for a server or for
  a context that is still registered: unregistering makes the server sweep a
  context's pending SHM reads and writes, so a missing ``commit_retrieve`` or
  ``commit_store`` only shows while the context is open.
* :func:`checked_context` opens a context and runs both checks around it.

Server interpreters come from :func:`lmkv_async.testing.find_server_python`
(``$LMKV_LMCACHE_PYTHON_056`` / ``_052`` / ``_057RC2``, which ``nox -s tests`` sets). A
missing one fails the tests that need it, unless
``LMKV_ALLOW_MISSING_SERVERS=1``, in which case they are skipped.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import pytest
from timing import SETTLE, SLACK

import lmkv_async as lmkv
from lmkv_async.testing import (
    LocalServer,
    ServerConfig,
    env_var_for,
    find_server_python,
)

VERSIONS = ("0.5.2", "0.5.6", "0.5.7rc2")
#: ids of the parametrized ``server`` fixture
SERVER_IDS = (
    "0.5.2-shm", "0.5.2-pickle", "0.5.6-shm", "0.5.6-pickle", "0.5.7rc2-shm", "0.5.7rc2-pickle",
)

#: Shared servers kept running at once, besides the one the current test pins.
MAX_SHARED_SERVERS = int(os.environ.get("LMKV_MAX_SHARED_SERVERS", "2"))


def allow_missing_servers() -> bool:
    """Whether a missing server environment skips (instead of failing) tests."""
    return os.environ.get("LMKV_ALLOW_MISSING_SERVERS", "") == "1"


def server_python(version: str) -> str:
    """Interpreter of the lmcache ``version`` env; fails (or skips, if allowed) when absent."""
    python = find_server_python(version)
    if python is None:
        # Name the variable find_server_python really reads (it is upper-cased:
        # 0.5.7rc2 -> ..._057RC2); a lower-case hint sent people to the wrong one.
        msg = (
            f"no lmcache {version} server environment: set {env_var_for(version)} to its "
            "python (nox -s tests builds the env and sets it); "
            "LMKV_ALLOW_MISSING_SERVERS=1 turns this into a skip"
        )
        if allow_missing_servers():
            pytest.skip(msg)
        pytest.fail(msg, pytrace=False)
    return python


@dataclass(frozen=True)
class ServerSpec:
    """Hashable description of a server; equal specs share one pooled server."""

    version: str
    shm: bool = True
    transfer_mode: str = "auto"
    chunk_size: int = 256
    l1_size_gb: float = 1.0
    extra_args: tuple[str, ...] = ()
    api_key: str | None = field(default=None, repr=False)

    @classmethod
    def from_id(cls, server_id: str) -> ServerSpec:
        """``"0.5.6-shm"`` -> ``ServerSpec("0.5.6", shm=True)``."""
        version, transport = server_id.split("-")
        if transport not in ("shm", "pickle"):
            raise ValueError(server_id)
        return cls(version=version, shm=transport == "shm")

    @property
    def label(self) -> str:
        """Short name for logs, e.g. ``0.5.6-shm-auto``."""
        extra = ("+" + "_".join(a.lstrip("-") for a in self.extra_args)) if self.extra_args else ""
        extra = extra.replace("/", "_")[:60]  # a flag's value may be a path
        keyed = "+key" if self.api_key else ""
        mode = "shm" if self.shm else "pickle"
        return f"{self.version}-{mode}-{self.transfer_mode}{extra}{keyed}"

    def config(self) -> ServerConfig:
        """The :class:`ServerConfig` (resolves the interpreter; may fail/skip)."""
        return ServerConfig(
            version=self.version,
            python=server_python(self.version),
            shm=self.shm,
            transfer_mode=self.transfer_mode,
            chunk_size=self.chunk_size,
            l1_size_gb=self.l1_size_gb,
            extra_args=self.extra_args,
            api_key=self.api_key,
        )


@dataclass
class ServerPool:
    """Session-wide set of running servers, started lazily, stopped by PID at the end.

    Shared servers are keyed by :class:`ServerSpec`. Servers pinned by the
    running test (or by the parametrized ``server`` fixture) are never evicted;
    when more than :data:`MAX_SHARED_SERVERS` unpinned ones run, the least
    recently used is stopped. Private servers belong to one test and are
    stopped when it ends.
    """

    log_dir: Path
    max_shared: int = MAX_SHARED_SERVERS
    _shared: dict[ServerSpec, LocalServer] = field(default_factory=dict)
    _last_used: dict[ServerSpec, float] = field(default_factory=dict)
    _pinned: dict[ServerSpec, int] = field(default_factory=dict)
    _private: list[LocalServer] = field(default_factory=list)
    start_times: list[tuple[str, float]] = field(default_factory=list)

    def _new(self, spec: ServerSpec, tag: str) -> LocalServer:
        n = len(self.start_times)
        return LocalServer(spec.config(), log_path=self.log_dir / f"{n:03d}-{tag}-{spec.label}.log")

    def _start(self, server: LocalServer, spec: ServerSpec) -> None:
        server.start()
        self.start_times.append((spec.label, server.start_seconds or 0.0))

    def get(self, spec: ServerSpec) -> LocalServer:
        """A running shared server for ``spec`` (started, or restarted, if needed)."""
        server = self._shared.get(spec)
        if server is None:
            self._evict(keep=spec)
            server = self._new(spec, "shared")
            self._shared[spec] = server
        if not server.is_running():
            self._start(server, spec)
        self._last_used[spec] = time.monotonic()
        return server

    def pin(self, spec: ServerSpec) -> None:
        """Protect ``spec``'s server from eviction until :meth:`unpin`."""
        self._pinned[spec] = self._pinned.get(spec, 0) + 1

    def unpin(self, spec: ServerSpec) -> None:
        """Undo one :meth:`pin`."""
        left = self._pinned.get(spec, 0) - 1
        if left > 0:
            self._pinned[spec] = left
        else:
            self._pinned.pop(spec, None)

    def stop(self, spec: ServerSpec) -> None:
        """Stop and forget the shared server for ``spec``, if any."""
        server = self._shared.pop(spec, None)
        self._last_used.pop(spec, None)
        if server is not None:
            server.stop()

    def _evict(self, keep: ServerSpec) -> None:
        unpinned = [s for s in self._shared if s not in self._pinned and s != keep]
        while len(unpinned) >= self.max_shared:
            oldest = min(unpinned, key=lambda s: self._last_used.get(s, 0.0))
            unpinned.remove(oldest)
            self.stop(oldest)

    def private(self, spec: ServerSpec) -> LocalServer:
        """A new server only the caller uses (it may kill/freeze/restart it)."""
        server = self._new(spec, "private")
        self._private.append(server)
        self._start(server, spec)
        return server

    def stop_private(self, server: LocalServer) -> None:
        """Stop a private server and forget it."""
        server.stop()
        with contextlib.suppress(ValueError):
            self._private.remove(server)

    def running(self) -> list[LocalServer]:
        """All servers of this pool that are currently running."""
        return [s for s in [*self._shared.values(), *self._private] if s.is_running()]

    def stop_all(self) -> None:
        """Stop every server (SIGTERM by PID, SIGKILL fallback) and remove SHM pools."""
        for spec in list(self._shared):
            self.stop(spec)
        for server in list(self._private):
            self.stop_private(server)


# --------------------------------------------------------------------------- leak checks


def leak_report(status: dict[str, Any], allowed_instance_ids: Iterable[int] = ()) -> list[str]:
    """Problems found in one ``/status`` snapshot (empty list: no leaks)."""
    problems: list[str] = []
    if status.get("active_sessions", 0) != 0:
        problems.append(f"active_sessions={status.get('active_sessions')}")
    l1 = status.get("storage_manager", {}).get("l1_manager", {})
    for name in ("read_locked_count", "write_locked_count"):
        if l1.get(name, 0) != 0:
            problems.append(f"storage_manager.l1_manager.{name}={l1.get(name)}")
    allowed = {int(i) for i in allowed_instance_ids}
    left = sorted(set(int(i) for i in status.get("registered_non_cuda_instance_ids", [])) - allowed)
    if left:
        problems.append(f"registered_non_cuda_instance_ids left: {left}")
    return problems


def assert_no_leaks(
    server: LocalServer,
    *,
    allowed_instance_ids: Iterable[int] = (),
    timeout: float = SETTLE,
) -> None:
    """Assert the server holds no sessions, L1 locks or stray engine-driven registrations.

    Polls ``/status`` for up to ``timeout`` seconds (cleanup RPCs may still be
    in flight on the server's worker threads) before failing. It blocks the
    thread: from async code with a context open use :func:`assert_quiescent`.
    """
    allowed = list(allowed_instance_ids)
    deadline = time.monotonic() + timeout
    while True:
        problems = leak_report(server.status(), allowed)
        if not problems:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"server {server!r} leaks: " + "; ".join(problems))
        time.sleep(0.1)


async def assert_quiescent(
    target: lmkv.AsyncKVContext | LocalServer,
    *,
    allowed_instance_ids: Iterable[int] = (),
    timeout: float = SETTLE,
) -> None:
    """Poll ``/status`` until nothing is held, or fail after ``timeout`` seconds.

    ``target`` is a server, or an open context: then its own registration
    (``ctx.instance_id``) is the only one allowed besides ``allowed_instance_ids``
    and must still be there, and the context must have no release steps left
    running, before the server's read/write locks and sessions are judged. The
    event loop keeps running while it polls, so background release steps finish.
    """
    allowed = {int(i) for i in allowed_instance_ids}
    ctx = target if isinstance(target, lmkv.AsyncKVContext) else None
    if ctx is not None:
        allowed.add(ctx.instance_id)
    deadline = time.monotonic() + timeout
    while True:
        if ctx is not None:
            status = await ctx.status()
            problems = leak_report(status, allowed)
            if ctx.instance_id not in status.get("registered_non_cuda_instance_ids", []):
                problems.append(f"the context's own registration {ctx.instance_id} is gone")
            running = len(ctx._s._tasks)
            if running:
                problems.append(f"{running} operation(s) or release step(s) still running")
        else:
            assert isinstance(target, LocalServer)
            problems = leak_report(await anyio.to_thread.run_sync(target.status), allowed)
        if not problems:
            return
        if time.monotonic() >= deadline:
            where = "registered context" if ctx is not None else "server"
            raise AssertionError(f"{where} {target!r} not quiescent after {timeout:.1f}s: "
                                 + "; ".join(problems))
        await anyio.sleep(0.05)  # either backend: tests run on asyncio and trio


@contextlib.asynccontextmanager
async def checked_context(
    server: LocalServer,
    model: str,
    *,
    allowed_instance_ids: Iterable[int] = (),
    **connect_kwargs: Any,
) -> AsyncIterator[lmkv.AsyncKVContext]:
    """``lmkv.connect`` to ``server``; on a clean exit of the body, check the server is
    quiescent while the context is still registered, then again after ``aclose()``."""
    allowed = list(allowed_instance_ids)
    async with lmkv.connect(server.url, server.http_url, model, **connect_kwargs) as ctx:
        yield ctx
        if not ctx.closed:
            await assert_quiescent(ctx, allowed_instance_ids=allowed)
    await assert_quiescent(server, allowed_instance_ids=allowed)


#: how long a cut operation's cleanup may take to leave nothing on the server
LEFT_NOTHING_WITHIN = 6.0 + SLACK


async def left_on(server: LocalServer, instance_ids: set[int]) -> list[str]:
    """What the server still holds: sessions, locks, and registrations of ``instance_ids``."""
    status = await anyio.to_thread.run_sync(server.status)
    problems = [p for p in leak_report(status) if not p.startswith("registered")]
    regs = {int(i) for i in status.get("registered_non_cuda_instance_ids", [])}
    if regs & instance_ids:
        problems.append(f"registrations left: {sorted(regs & instance_ids)}")
    return problems


async def assert_left_nothing(server: LocalServer, instance_ids: set[int], *,
                              must_have_seen: bool = True) -> None:
    """Poll until ``server`` holds nothing of ours (on asyncio or trio)."""
    assert instance_ids or not must_have_seen, "the test saw no context: it proves nothing"
    deadline = time.monotonic() + LEFT_NOTHING_WITHIN
    while True:
        problems = await left_on(server, instance_ids)
        if not problems:
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"left on the server after {LEFT_NOTHING_WITHIN:.1f}s: " + "; ".join(problems)
            )
        await anyio.sleep(0.1)


T = TypeVar("T")


