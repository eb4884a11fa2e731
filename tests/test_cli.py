"""The ``lmkv`` command line, run as real subprocesses against real lmcache servers.

Every command goes through ``python -m lmkv_async`` (what the ``lmkv`` console
script calls, see ``lmkv_async/__main__.py``), with ``--json`` where the output
is checked, and the exit codes of :data:`lmkv_async.cli.EXIT_CODES`. Runtime:
each call pays an interpreter start with torch (~1-2 s on 2 cores); the servers
are the suite's shared ones except for the private API-key server.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import tomllib
import torch

pytest.importorskip("typer")  # the cli extra; nox's test extra installs it
pytest.importorskip("rich")

import lmkv_async as lmkv
from lmkv_async.cli import EXIT_CODES, ExitCode
from lmkv_async.testing import LocalServer, free_port

ROOT = Path(__file__).resolve().parent.parent
LAYOUT_ARG = "2,2,64,bfloat16,16"
LAYOUT = lmkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                       block_size=16)
C = 256  # the servers' chunk size


class Result:
    def __init__(self, proc: subprocess.CompletedProcess[str]) -> None:
        self.code = proc.returncode
        self.out = proc.stdout
        self.err = proc.stderr

    def json(self) -> Any:
        lines = [ln for ln in self.out.splitlines() if ln.strip()]
        assert len(lines) == 1, f"expected one JSON document, got {self.out!r}"
        return json.loads(lines[0])

    def __repr__(self) -> str:
        return f"<exit {self.code}\nstdout: {self.out}\nstderr: {self.err}>"


def lmkv_cli(*args: str, stdin: str | None = None, timeout: float = 90) -> Result:
    """``python -m lmkv_async ARGS``; stdin is closed (not a tty) unless given."""
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    env.pop("LMCACHE_API_KEY", None)
    env.pop("LMCACHE_API_KEY_FILE", None)
    proc = subprocess.run([sys.executable, "-m", "lmkv_async", *args], input=stdin or "",
                          capture_output=True, text=True, timeout=timeout, env=env)
    return Result(proc)


def at(server: LocalServer, *, model: str = "lmkv-cli-test") -> list[str]:
    return ["--url", server.url, "--http-url", server.http_url, "--model", model]


def assert_one_line_error(r: Result, code: ExitCode, *needles: str) -> None:
    assert r.code == code, r
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmkv: error: "), r
    assert "Traceback" not in r.err
    for needle in needles:
        assert needle in lines[0], r


@pytest.fixture
def srv(server_factory: Callable[..., LocalServer]) -> LocalServer:
    return server_factory("0.5.6")


def store(server: LocalServer, model: str, token_lists: Sequence[list[int]]) -> None:
    async def go() -> None:
        async with lmkv.connect(server.url, server.http_url, model, layout=LAYOUT) as ctx:
            for toks in token_lists:
                kv = torch.randn(2, 2, len(toks), 128).to(torch.bfloat16)
                await ctx.store(kv, toks)

    asyncio.run(go())


# --------------------------------------------------------------------------- packaging


def test_console_script_and_extra_are_declared() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["scripts"]["lmkv"] == "lmkv_async.__main__:main"
    names = {d.split(">")[0].split("=")[0].split("[")[0].strip() for d in meta["dependencies"]}
    # no CLI deps in the core (blake3: the server's chunk hash, for the fleet's index)
    assert names == {"torch", "pyzmq", "httpx", "anyio", "msgpack", "blake3"}
    cli = {d.split(">")[0].strip() for d in meta["optional-dependencies"]["cli"]}
    assert {"typer", "rich"} <= cli
    from lmkv_async.__main__ import main

    assert callable(main)


def test_without_the_extra_one_line_names_it_and_the_library_still_imports() -> None:
    # typer (and rich) made unimportable: `import lmkv_async` works, `lmkv` says why not.
    block = "import sys; sys.modules['typer'] = None; sys.modules['rich'] = None; "
    lib = subprocess.run([sys.executable, "-c", block + "import lmkv_async, lmkv_async.sync, "
                          "lmkv_async.metrics; print('ok')"],
                         capture_output=True, text=True, timeout=60)
    assert lib.returncode == 0 and lib.stdout.strip() == "ok", lib.stderr
    cli = subprocess.run([sys.executable, "-c", block + "from lmkv_async.__main__ import main; "
                          "sys.exit(main(['ping']))"], capture_output=True, text=True, timeout=60)
    assert cli.returncode == ExitCode.NOT_AVAILABLE == 5
    assert cli.stderr.strip() == ("lmkv: error: the lmkv command line needs the 'cli' extra: "
                                  "pip install 'lmkv_async[cli]'")


def test_version_help_and_usage_errors() -> None:
    r = lmkv_cli("--version")
    assert r.code == 0 and r.out.strip() == f"lmkv_async {lmkv.__version__}", r
    r = lmkv_cli("--help")
    assert r.code == 0 and all(c in r.out for c in ("ping", "status", "lookup", "events",
                                                    "bench", "server")), r
    r = lmkv_cli("frobnicate")
    assert_one_line_error(r, ExitCode.USAGE, "frobnicate")
    r = lmkv_cli("bench", "--layout", "2,2,64,int3,16", "--json")
    assert r.code == ExitCode.USAGE, r
    assert r.json()["error"]["exit_code"] == 2 and "dtype" in r.json()["error"]["message"]
    assert set(EXIT_CODES) == {int(c) for c in ExitCode}


# --------------------------------------------------------------------------- errors


def test_unreachable_server_one_line_exit_3_traceback_only_with_debug() -> None:
    dead = ["--url", f"tcp://127.0.0.1:{free_port()}",
            "--http-url", f"http://127.0.0.1:{free_port()}", "--timeout", "1"]
    r = lmkv_cli(*dead, "ping")
    assert_one_line_error(r, ExitCode.UNREACHABLE, "ServerUnavailableError")
    assert r.out == ""
    r = lmkv_cli(*dead, "status", "--json")
    assert r.code == ExitCode.UNREACHABLE, r
    err = r.json()["error"]
    assert err["exit_code"] == 3 and err["type"] and "\n" not in err["message"]
    r = lmkv_cli(*dead, "--debug", "ping")
    assert r.code == ExitCode.UNREACHABLE and "Traceback (most recent call last)" in r.err, r
    assert r.err.strip().splitlines()[-1].startswith("lmkv: error: ")


def test_wrong_api_key_is_exit_4(server_factory: Callable[..., LocalServer]) -> None:
    srv = server_factory("0.5.7rc2", api_key="the-right-key")
    r = lmkv_cli(*at(srv), "--api-key", "a-wrong-key", "status")
    assert_one_line_error(r, ExitCode.AUTH, "AuthenticationError")
    assert "a-wrong-key" not in r.err and "the-right-key" not in r.err
    r = lmkv_cli(*at(srv), "--api-key", "the-right-key", "status", "--json")
    assert r.code == 0, r
    assert r.json()["server"]["version"].startswith("0.5.7")


# --------------------------------------------------------------------------- commands


def test_ping(srv: LocalServer) -> None:
    r = lmkv_cli(*at(srv), "ping", "--json", "--count", "2", "--interval", "0")
    assert r.code == 0, r
    doc = r.json()
    assert doc["url"] == srv.url and len(doc["rounds"]) == 2
    for row in doc["rounds"]:
        assert row["healthy"] is True and row["version"].startswith("0.5.6")
        assert row["http_ms"] > 0 and row["zmq_ms"] > 0
    r = lmkv_cli(*at(srv), "ping")
    assert r.code == 0 and "healthy" in r.out and "zmq" in r.out, r


def test_status_json_and_table(srv: LocalServer) -> None:
    r = lmkv_cli(*at(srv, model="lmkv-cli-status"), "--json", "status")
    assert r.code == 0, r
    doc = r.json()
    s = doc["server"]
    assert s["version"].startswith("0.5.6") and s["dialect"] and s["chunk_size"] == C
    assert s["transport"] == "shm" and isinstance(s["capabilities"], list)
    st = doc["status"]
    assert st["healthy"] is True
    for key in ("active_sessions", "objects", "read_locked", "write_locked",
                "memory_used_bytes", "memory_total_bytes"):
        assert isinstance(st[key], int), (key, st)
    assert st["memory_total_bytes"] > 0
    r = lmkv_cli(*at(srv), "status")
    assert r.code == 0, r
    for label in ("version", "dialect", "capabilities", "transport", "chunk size", "sessions",
                  "read locks", "objects", "memory"):
        assert label in r.out, (label, r)


def test_lookup_from_stdin_and_file(srv: LocalServer, tmp_path: Path) -> None:
    model = f"lmkv-cli-lookup-{time.monotonic_ns()}"
    cached = list(range(10_000, 10_000 + 2 * C + 7))
    other = list(range(50_000, 50_000 + C))
    store(srv, model, [cached])
    r = lmkv_cli(*at(srv, model=model), "lookup", "--layout", LAYOUT_ARG, "--json",
                 stdin=json.dumps(cached))
    assert r.code == 0, r
    doc = r.json()
    assert doc["chunk_size"] == C
    assert doc["results"] == [{"index": 0, "tokens": len(cached), "hit_tokens": 2 * C,
                               "hit_chunks": 2, "full_chunks": 2}]
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"tokens": [cached, other]}))
    r = lmkv_cli(*at(srv, model=model), "lookup", str(path))  # layout: the probe layout
    assert r.code == 0, r
    assert r.out.splitlines() == [f"[0] {2 * C} of {len(cached)} tokens cached (2 of 2 chunks "
                                  f"of {C})", f"[1] 0 of {C} tokens cached (0 of 1 chunks of {C})"]
    # another salt is another namespace
    r = lmkv_cli(*at(srv, model=model), "lookup", "--salt", "x", "--json", str(path))
    assert [row["hit_tokens"] for row in r.json()["results"]] == [0, 0]
    # bad input: exit 2, one line
    path.write_text("[1, 2, ")
    assert_one_line_error(lmkv_cli(*at(srv), "lookup", str(path)), ExitCode.USAGE, "not JSON")
    assert_one_line_error(lmkv_cli(*at(srv), "lookup", str(tmp_path / "nope.json")),
                          ExitCode.USAGE, "cannot read")
    assert_one_line_error(lmkv_cli(*at(srv), "lookup", stdin='["a"]'), ExitCode.USAGE,
                          "token ids")


def test_bench_json(srv: LocalServer) -> None:
    r = lmkv_cli(*at(srv, model="lmkv-cli-bench"), "bench", "--json", "--layout", LAYOUT_ARG,
                 "-t", str(2 * C), "-n", "6", "-c", "3")
    assert r.code == 0, r
    doc = r.json()
    assert doc["tokens"] == 2 * C and doc["concurrency"] == 3 and doc["chunk_size"] == C
    assert doc["bytes_per_request"] == 2 * 2 * 2 * C * 128 * 2
    assert [x["op"] for x in doc["results"]] == ["store", "retrieve", "lookup"]
    for x in doc["results"]:
        assert x["requests"] == 6 and x["errors"] == 0 and x["ops_per_s"] > 0
        assert 0 < x["p50_ms"] <= x["p90_ms"] <= x["p99_ms"] <= x["max_ms"]
    by_op = {x["op"]: x for x in doc["results"]}
    # every retrieve found all it stored: the same bytes came back
    assert by_op["retrieve"]["bytes"] == by_op["store"]["bytes"] == 6 * doc["bytes_per_request"]
    r = lmkv_cli(*at(srv), "bench", "--op", "lookup", "--layout", LAYOUT_ARG, "-t", str(C),
                 "-n", "2")
    assert r.code == 0 and "lookup" in r.out and "ops/s" in r.out, r
    assert_one_line_error(lmkv_cli(*at(srv), "bench", "--layout", LAYOUT_ARG, "-t", "10"),
                          ExitCode.USAGE, "less than one chunk")


def test_events(srv: LocalServer, server_factory: Callable[..., LocalServer]) -> None:
    r = lmkv_cli(*at(srv), "events", "--count", "1", "--json")
    assert r.code == 0, r
    first = r.json()
    assert first["reason"] == "start" and first["discard"] is True, first
    old = server_factory("0.5.2")  # no KV-event stream in 0.5.2
    assert_one_line_error(lmkv_cli(*at(old), "events", "--count", "1"),
                          ExitCode.NOT_AVAILABLE, "UnsupportedOperationError")


def test_server_command_starts_serves_and_stops_on_sigterm() -> None:
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-m", "lmkv_async", "server", "--json",
                             "--version", "0.5.6", "--l1-size-gb", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        started = json.loads(proc.stdout.readline() or "{}")
        assert started.get("event") == "started", (started, proc.poll())
        assert started["url"].startswith("tcp://127.0.0.1:")
        assert started["http_url"].startswith("http://127.0.0.1:")
        r = lmkv_cli("--url", started["url"], "--http-url", started["http_url"], "ping",
                     "--json")
        assert r.code == 0 and r.json()["rounds"][0]["version"] == started["version"], r
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == {"event": "stopped",
                                                       "pid": started["pid"], "exit_code": 0}
    deadline = time.monotonic() + 10
    while _alive(started["pid"]):
        assert time.monotonic() < deadline, "the server outlived `lmkv server`"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
