"""An engine registered with a local server the way vLLM's lmcache adapter does it.

:func:`registered_engine` runs ``server_scripts/register_cpu_engine.py`` (shipped
next to this module) with the *server's* interpreter: the script imports
``lmcache`` and registers CPU paged caches through lmcache's own vLLM worker
adapter in lmcache-driven mode, which is what lmcache's SDK needs to discover a
layout (``cache_context_meta`` in ``/status``). ``lmkv_async`` never imports the
script, nor ``lmcache``: it is a file run by path in another environment.
"""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .server import LocalServer, LocalServerError, server_env

__all__ = ["REGISTER_SCRIPT", "EngineRegistration", "registered_engine",
           "unlink_engine_segments"]

#: The registration script, run by path with the server's Python (package data, never
#: imported here). Its own docstring gives its command line and its ``READY`` protocol.
REGISTER_SCRIPT = Path(__file__).resolve().parent / "server_scripts" / "register_cpu_engine.py"
_DEV_SHM = Path("/dev/shm")


def unlink_engine_segments(pid: int) -> None:
    """Unlink the ``/dev/shm/lmcache_kv_<pid>_<n>`` KV segments of an engine process.

    lmcache's CPU engine adapter names its segments after its pid and creates them
    exclusively, so segments left by a killed engine make a later process that reuses
    the pid fail with ``FileExistsError``. Call it after the engine exited, and right
    after starting one (before it can have made any).
    """
    prefix = f"lmcache_kv_{pid}_"
    with contextlib.suppress(OSError):
        for entry in _DEV_SHM.iterdir():
            if entry.name.startswith(prefix):
                with contextlib.suppress(OSError):
                    entry.unlink()


@dataclass(frozen=True)
class EngineRegistration:
    """A running registration process and what it reported on its ``READY`` line."""

    #: the script's report: ``pid``, ``instance_ids``, ``lmcache_version``, ``shape``,
    #: ``dtype``, ``shm_segments``, ...
    info: dict[str, Any]
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def instance_ids(self) -> list[int]:
        """lmcache-driven instance ids (``registered_gpu_ids`` on the server)."""
        return [int(i) for i in self.info["instance_ids"]]


@contextlib.contextmanager
def registered_engine(
    server: LocalServer,
    *,
    model: str,
    num_layers: int = 2,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    num_blocks: int = 64,
    dtype: str = "bfloat16",
    world_size: int = 1,
    fill: str = "zeros",
    heartbeat_interval: float = 5.0,
    log_dir: Path | None = None,
    timeout: float = 120.0,
) -> Iterator[EngineRegistration]:
    """Register CPU HND caches ``[NB, 2, NH, BS, HS]`` per layer with ``server`` for the
    ``with`` body (lmcache-driven, as vLLM's adapter does).

    Runs the registration script with ``server.config.python``, waits up to ``timeout``
    seconds for its ``READY`` line, and on exit closes its stdin (it unregisters and
    exits), reaps it, and unlinks any KV segment it left. ``fill`` is ``"zeros"`` or
    ``"arange"`` (a deterministic pattern). The script's stderr goes to a log file in
    ``log_dir`` (default: the server log's directory). The server must run with
    ``transfer_mode`` ``"auto"`` or ``"lmcache_driven"``. Raises
    :class:`LocalServerError`, with the log's tail, if the script does not report ready.
    """
    log_path = (log_dir or server.log_path.parent) / (
        f"register-{model}-{server.zmq_port}-{time.monotonic_ns()}.log")
    argv = [
        server.config.python, str(REGISTER_SCRIPT),
        "--url", server.url,
        "--model", model,
        "--num-layers", str(num_layers),
        "--num-kv-heads", str(num_kv_heads),
        "--head-dim", str(head_dim),
        "--block-size", str(block_size),
        "--num-blocks", str(num_blocks),
        "--dtype", dtype,
        "--world-size", str(world_size),
        "--fill", fill,
        "--heartbeat-interval", str(heartbeat_interval),
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=log, env=server_env())
    # lmcache names the segments after the pid, and creates them with O_EXCL: one left
    # by an earlier process that had this pid (killed before it cleaned up) made the
    # script fail with FileExistsError. The script is still importing torch here, so
    # whatever carries its pid now is stale.
    unlink_engine_segments(proc.pid)
    try:
        info = _read_ready(proc, timeout)
        if info is None:
            proc.kill()
            proc.wait(timeout=30)
            tail = "\n".join(log_path.read_text("utf-8", "replace").splitlines()[-30:])
            raise LocalServerError(
                f"register_cpu_engine.py did not print READY (rc={proc.returncode}) "
                f"against {server!r}\nlog {log_path}:\n{tail}")
        yield EngineRegistration(info=info, proc=proc, log_path=log_path)
    finally:
        _stop(proc)


def _read_ready(proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any] | None:
    """Wait for the ``READY <json>`` line on the child's stdout."""
    lines: queue.Queue[bytes | None] = queue.Queue()

    def pump() -> None:
        # A thread reads: a pipe read has no timeout, and the child may hang.
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, name="register-stdout", daemon=True).start()
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            return None
        if line is None:
            return None
        text = line.decode("utf-8", "replace").strip()
        if text.startswith("READY "):
            info: dict[str, Any] = json.loads(text[len("READY "):])
            return info


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None and proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()  # EOF: the script unregisters and exits
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
    # The script unlinks its /dev/shm/lmcache_kv_<pid>_<n> segments; if it was
    # killed they would stay, so sweep them (this pid only).
    unlink_engine_segments(proc.pid)
