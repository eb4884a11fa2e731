"""lmkv_async.testing as users see it: no import-time effects, no guessing, its own errors,
and the pytest plugin driving a real server in a child pytest run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from servers import server_python

import lmkv_async
from lmkv_async.testing import (
    LocalServer,
    LocalServerError,
    ServerConfig,
    env_var_for,
    find_server_python,
    registered_engine,
)


def test_import_registers_nothing() -> None:
    code = textwrap.dedent("""
        import atexit, threading
        import lmkv_async  # torch and friends may register their own hooks: the baseline
        before = (atexit._ncallbacks(), threading.active_count())
        import lmkv_async.testing, lmkv_async.testing.plugin
        print(before == (atexit._ncallbacks(), threading.active_count()))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "True", out.stderr


def test_find_server_python_reads_only_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    # a .nox folder in the working directory is not looked at
    fake = tmp_path / ".nox" / "lmcache-server-056" / "bin"
    fake.mkdir(parents=True)
    (fake / "python").symlink_to(sys.executable)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LMKV_LMCACHE_PYTHON_056", raising=False)
    assert find_server_python("0.5.6") is None
    monkeypatch.setenv("LMKV_LMCACHE_PYTHON_056", sys.executable)
    assert find_server_python("0.5.6") == sys.executable
    monkeypatch.setenv("LMKV_LMCACHE_PYTHON_056", str(tmp_path / "missing"))
    assert find_server_python("0.5.6") is None
    assert env_var_for("0.5.7rc2") == "LMKV_LMCACHE_PYTHON_057RC2"


def test_local_server_error_is_outside_the_library_tree() -> None:
    assert issubclass(LocalServerError, RuntimeError)
    assert not issubclass(LocalServerError, lmkv_async.KVCacheError)


def test_pytest_plugin_runs_a_users_suite_against_a_real_server(tmp_path: Path) -> None:
    python = server_python("0.5.6")
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["lmkv_async.testing.plugin"]\n')
    (tmp_path / "test_user.py").write_text(textwrap.dedent("""
        import pytest, torch, lmkv_async as lmkv

        LAYOUT = lmkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64,
                               dtype=torch.bfloat16, block_size=16)

        @pytest.fixture
        def anyio_backend():
            return "asyncio"

        @pytest.mark.anyio
        async def test_round_trip(lmcache_server):
            async with lmkv.connect(lmcache_server.url, lmcache_server.http_url, "user",
                                    layout=LAYOUT) as ctx:
                tokens = list(range(512))
                kv = torch.randn(2, 2, 512, 128).to(torch.bfloat16)
                assert (await ctx.store(kv, tokens)).written_chunks == 2
                assert await ctx.lookup(tokens) == 512
                out = await ctx.retrieve(tokens)
                assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
            assert lmcache_server.status()["active_sessions"] == 0

        def test_server_is_shared(lmcache_server):
            assert lmcache_server.is_running()
    """))
    # the child imports the same lmkv_async as this process (installed or a source tree)
    pkg_root = str(Path(lmkv_async.__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (pkg_root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "LMKV_LMCACHE_PYTHON_056": python, "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": path}
    env.pop("PYTEST_ADDOPTS", None)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "anyio",
         str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "2 passed" in run.stdout

    # without an interpreter, the fixture fails and names the variable to set
    env.pop("LMKV_LMCACHE_PYTHON_056")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "anyio",
         str(tmp_path / "test_user.py::test_server_is_shared")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "LMKV_LMCACHE_PYTHON_056" in run.stdout


def test_registered_engine_fails_with_the_scripts_log(tmp_path: Path) -> None:
    # An interpreter that exits at once: no READY line, so a LocalServerError naming the
    # script, its exit code and the log's tail.
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\necho 'no lmcache here' >&2\nexit 3\n")
    script.chmod(0o755)
    server = LocalServer(ServerConfig(version="0.5.6", python=str(script)),
                         log_path=tmp_path / "server.log")
    expected = r"(?s)did not print READY \(rc=3\).*no lmcache here"
    with pytest.raises(LocalServerError, match=expected):
        with registered_engine(server, model="m", log_dir=tmp_path, timeout=30):
            pass
    (log,) = tmp_path.glob("register-m-*.log")
    assert "no lmcache here" in log.read_text()
