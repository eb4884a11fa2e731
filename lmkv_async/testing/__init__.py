"""Real LMCache servers for test suites: :class:`LocalServer` and a pytest plugin.

For users who test their own async services against a real ``lmcache server``
(and for this project's own tests, demo and benchmarks)::

    from lmkv_async.testing import LocalServer, ServerConfig

    cfg = ServerConfig(version="0.5.6", python="/path/to/env/bin/python")
    with LocalServer(cfg) as srv:
        ...  # srv.url, srv.http_url; srv.kill(), srv.freeze(), srv.resume(), srv.restart()

The interpreter is the one the caller names, or the one an environment
variable names (:func:`find_server_python`, e.g. ``$LMKV_LMCACHE_PYTHON_056``);
nothing is guessed and nothing happens at import time. The pytest plugin
(``-p lmkv_async.testing.plugin``) adds an ``lmcache_server`` fixture; see
``docs/testing.md``. Errors of this module are :class:`LocalServerError`,
outside the library's :class:`~lmkv_async.KVCacheError` tree.
"""

from .coordinator import LocalCoordinator
from .engine import EngineRegistration, registered_engine, unlink_engine_segments
from .server import (
    KNOWN_VERSIONS,
    LocalServer,
    LocalServerError,
    ServerConfig,
    env_var_for,
    find_server_python,
    free_port,
    server_env,
)

__all__ = [
    "KNOWN_VERSIONS",
    "EngineRegistration",
    "LocalCoordinator",
    "LocalServer",
    "LocalServerError",
    "ServerConfig",
    "env_var_for",
    "find_server_python",
    "free_port",
    "registered_engine",
    "server_env",
    "unlink_engine_segments",
]
