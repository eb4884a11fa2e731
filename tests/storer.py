"""LmcacheStorer: lmcache-driven stores on command, through ``server_scripts/lmcache_store.py``.

The script runs in the server's environment and stores through lmcache's own vLLM
worker adapter, the path that makes the server log ``stored`` KV events (stores by
this library or the official SDK are engine-driven and log none).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import anyio

from lmkv_async.testing import LocalServer, server_env
from lmkv_async.testing.engine import REGISTER_SCRIPT

STORE_SCRIPT = Path(__file__).resolve().parent / "server_scripts" / "lmcache_store.py"


class LmcacheStorer:
    """``lmcache_store.py``: lmcache-driven stores on command (what vLLM's adapter does)."""

    def __init__(self, server: LocalServer, model: str) -> None:
        self.log = open(server.log_path.parent / f"storer-{model}-{server.zmq_port}.log", "wb")
        self.proc = subprocess.Popen(
            [server.config.python, str(STORE_SCRIPT), "--url", server.url, "--model", model,
             "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "64",
             "--block-size", "16", "--num-blocks", "256"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=self._env(),
            text=True)
        line = self._line(120)
        assert line.startswith("READY "), line
        self.instance_id = int(json.loads(line[6:])["instance_id"])

    @staticmethod
    def _env() -> dict[str, str]:
        # The script reuses register_cpu_engine's helpers: that script ships with
        # lmkv_async.testing, so its folder goes on the child's path.
        env = server_env()
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(REGISTER_SCRIPT.parent), env.get("PYTHONPATH")]))
        return env

    def _line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line:
                return line.strip()
            if self.proc.poll() is not None:
                break
        self.log.flush()
        log = Path(self.log.name).read_text(errors="replace")[-4000:]
        raise AssertionError(
            f"lmcache_store.py said nothing (rc={self.proc.poll()}); its stderr:\n{log}")

    def store(self, tokens: list[int], salt: str = "") -> None:
        assert self.proc.stdin is not None
        # A fresh request id each time: the server caches a session's chunk hashes
        # by request id, so a reused id would store new tokens under old hashes.
        self.proc.stdin.write(json.dumps({"op": "store", "id": f"s-{uuid.uuid4().hex}",
                                          "tokens": tokens, "salt": salt}) + "\n")
        self.proc.stdin.flush()
        line = self._line(60)
        assert line.startswith("OK "), line

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.log.close()


async def astore(storer: LmcacheStorer, tokens: list[int], salt: str = "") -> None:
    await anyio.to_thread.run_sync(storer.store, tokens, salt)  # asyncio or trio
