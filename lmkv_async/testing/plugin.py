"""pytest plugin: a real lmcache server per test session.

Enable it in your own suite with ``-p lmkv_async.testing.plugin`` (or
``pytest_plugins = ["lmkv_async.testing.plugin"]`` in a ``conftest.py``), then::

    @pytest.mark.anyio
    async def test_my_service(lmcache_server):
        async with lmkv_async.connect(lmcache_server.url, lmcache_server.http_url,
                                      "my-model", layout=LAYOUT) as ctx:
            ...

Options (command line, or the same names in the ``[pytest]`` ini section):

* ``--lmcache-version`` (ini ``lmcache_version``): e.g. ``0.5.6`` (default);
* ``--lmcache-python`` (ini ``lmcache_python``): the server interpreter;
  default: ``$LMKV_LMCACHE_PYTHON_<tag>`` (see :func:`find_server_python`);
* ``--lmcache-shm`` / ``--lmcache-no-shm``: SHM pool on (default) or off.

The server is started on first use, bound to 127.0.0.1, and stopped by PID at
the end of the session. Without an interpreter the fixture fails with a message
that says which variable to set.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .server import LocalServer, ServerConfig, env_var_for, find_server_python

__all__ = ["lmcache_server", "pytest_addoption"]


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register the plugin's options."""
    group = parser.getgroup("lmcache", "real lmcache server (lmkv_async.testing)")
    group.addoption("--lmcache-version", default=None, help="lmcache version (default 0.5.6)")
    group.addoption("--lmcache-python", default=None, help="interpreter with lmcache installed")
    group.addoption("--lmcache-no-shm", action="store_true", default=False,
                    help="start the server without an SHM pool")
    parser.addini("lmcache_version", "lmcache version for lmcache_server", default="0.5.6")
    parser.addini("lmcache_python", "interpreter with lmcache installed", default="")


@pytest.fixture(scope="session")
def lmcache_server(request: pytest.FixtureRequest) -> Iterator[LocalServer]:
    """A running real lmcache server for the whole test session."""
    config = request.config
    version = config.getoption("--lmcache-version") or config.getini("lmcache_version")
    python: str | None = (config.getoption("--lmcache-python") or config.getini("lmcache_python")
                          or find_server_python(version))
    if not python:
        pytest.fail(f"no interpreter for lmcache {version}: pass --lmcache-python or set "
                    f"${env_var_for(version)}", pytrace=False)
    server = LocalServer(ServerConfig(version=version, python=python,
                                      shm=not config.getoption("--lmcache-no-shm")))
    server.start()
    try:
        yield server
    finally:
        server.stop()
