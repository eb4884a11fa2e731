"""Fixtures for the lmkv_async test suite: real lmcache servers and the anyio backend.

Server fixtures (all start real ``lmcache`` processes from the server
environments; see ``servers.py``):

* ``server`` -- session-scoped, parametrized over ``0.5.2-shm``,
  ``0.5.2-pickle``, ``0.5.6-shm``, ``0.5.6-pickle`` (transfer mode ``auto``).
  Tests sharing it must use their own model names and leave nothing behind
  (check with ``servers.assert_no_leaks``). pytest groups tests by parameter,
  so only one of the four runs at a time.
* ``server_factory(version, *, shm=True, transfer_mode="auto", chunk_size=256,
  l1_size_gb=1.0, extra_args=(), private=False, api_key=None)`` -- one-off servers: shared
  between tests with an identical configuration unless ``private=True``; a
  private server belongs to the test (kill/freeze/restart it freely) and is
  stopped when the test ends.
* ``register_engine(server, model=..., **geometry)`` -- an lmcache-driven CPU
  registration with ``server`` until the test ends
  (:func:`lmkv_async.testing.registered_engine`); returns its
  :class:`~lmkv_async.testing.EngineRegistration`.
* ``server_pool`` -- the session's :class:`servers.ServerPool`.
* ``fake_factory(**kwargs)``, ``fake``, ``short_cleanup`` -- a fake lmcache server
  that misbehaves on demand (``fake_lmcache.py``, loaded as a plugin).

Async tests use anyio's pytest plugin: ``@pytest.mark.anyio`` (backend: asyncio).

Set ``LMKV_REQUIRE_INSTALLED=1`` (the nox ``tests`` session does) to refuse to
run unless ``lmkv_async`` and its compiled ``_copy`` extension are imported from
an installed copy rather than this source tree.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Helpers live next to this file; with --import-mode=importlib the directory is
# not on sys.path by itself.
_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

from servers import (  # noqa: E402
    SERVER_IDS,
    VERSIONS,
    ServerPool,
    ServerSpec,
)

import lmkv_async  # noqa: E402
from lmkv_async.testing import (  # noqa: E402
    EngineRegistration,
    LocalServer,
    find_server_python,
    registered_engine,
)

_REPO = _HERE.parent

#: The fake lmcache server's fixtures (``fake_factory``, ``fake``, ``short_cleanup``) and
#: the hook that fails a test on a problem of its fake: see ``fake_lmcache.py``.
pytest_plugins = ["fake_lmcache"]


def _installed_check() -> str | None:
    """Why the imported lmkv_async is not an installed build, or ``None`` if it is."""
    pkg_dir = Path(lmkv_async.__file__).resolve().parent
    if pkg_dir == (_REPO / "lmkv_async").resolve():
        return f"lmkv_async was imported from the source tree ({pkg_dir}), not an installed copy"
    try:
        copy_mod = importlib.import_module("lmkv_async._copy")
    except ImportError as exc:
        return f"the compiled extension lmkv_async._copy is not importable: {exc}"
    copy_file = Path(getattr(copy_mod, "__file__", "") or "").resolve()
    if not copy_file.is_relative_to(pkg_dir):
        return f"lmkv_async._copy comes from {copy_file}, outside {pkg_dir}"
    return None


def pytest_sessionstart(session: pytest.Session) -> None:
    if os.environ.get("LMKV_REQUIRE_INSTALLED") == "1":
        why = _installed_check()
        if why is not None:
            pytest.exit(f"LMKV_REQUIRE_INSTALLED=1: {why}", returncode=4)


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = [f"lmkv_async: {Path(lmkv_async.__file__).resolve().parent}"]
    for version in VERSIONS:
        lines.append(f"lmcache {version} server python: {find_server_python(version)}")
    return lines


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """anyio's pytest plugin runs ``@pytest.mark.anyio`` tests on asyncio."""
    return "asyncio"


@pytest.fixture(scope="session")
def server_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerPool]:
    """All servers of the session; every one is stopped by PID at the end."""
    log_dir_env = os.environ.get("LMKV_SERVER_LOG_DIR")
    if log_dir_env:
        log_dir = Path(log_dir_env)
        log_dir.mkdir(parents=True, exist_ok=True)
    else:
        log_dir = tmp_path_factory.mktemp("lmcache-servers")
    pool = ServerPool(log_dir=log_dir)
    try:
        yield pool
    finally:
        pool.stop_all()


@pytest.fixture(scope="session", params=SERVER_IDS, ids=list(SERVER_IDS))
def server(request: pytest.FixtureRequest, server_pool: ServerPool) -> Iterator[LocalServer]:
    """A shared real server per configuration (``0.5.x-shm`` / ``0.5.x-pickle``, mode auto)."""
    spec = ServerSpec.from_id(request.param)
    srv = server_pool.get(spec)
    server_pool.pin(spec)
    try:
        yield srv
    finally:
        server_pool.unpin(spec)
        # Free the slot before pytest moves on to the next parameter.
        server_pool.stop(spec)


@pytest.fixture
def server_factory(server_pool: ServerPool) -> Iterator[Callable[..., LocalServer]]:
    """Make one-off servers; see the module docstring for the arguments."""
    pinned: list[ServerSpec] = []
    private_servers: list[LocalServer] = []

    def make(
        version: str,
        *,
        shm: bool = True,
        transfer_mode: str = "auto",
        chunk_size: int = 256,
        l1_size_gb: float = 1.0,
        extra_args: tuple[str, ...] = (),
        private: bool = False,
        api_key: str | None = None,
    ) -> LocalServer:
        spec = ServerSpec(
            version=version,
            shm=shm,
            transfer_mode=transfer_mode,
            chunk_size=chunk_size,
            l1_size_gb=l1_size_gb,
            extra_args=tuple(extra_args),
            api_key=api_key,
        )
        if private:
            srv = server_pool.private(spec)
            private_servers.append(srv)
            return srv
        srv = server_pool.get(spec)
        server_pool.pin(spec)
        pinned.append(spec)
        return srv

    try:
        yield make
    finally:
        for srv in private_servers:
            server_pool.stop_private(srv)
        for spec in pinned:
            server_pool.unpin(spec)


@pytest.fixture
def register_engine() -> Iterator[Callable[..., EngineRegistration]]:
    """``register_engine(server, model=..., num_layers=2, ...)``: lmcache-driven registration
    (:func:`lmkv_async.testing.registered_engine`).

    The registration lives until the test ends (or until the caller stops it
    with ``reg.proc.stdin.close()``).
    """
    with contextlib.ExitStack() as stack:

        def register(server: LocalServer, **kwargs: Any) -> EngineRegistration:
            return stack.enter_context(registered_engine(server, **kwargs))

        yield register


@pytest.fixture
def seen_ids(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """Instance ids of every session made during the test (a connect cut short included)."""
    from lmkv_async import _session

    ids: set[int] = set()
    real_init = _session.Session.__init__

    def spy(self: _session.Session, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        ids.add(self.instance_id)

    monkeypatch.setattr(_session.Session, "__init__", spy)
    return ids
