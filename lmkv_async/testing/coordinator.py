"""Start and stop a real ``lmcache coordinator`` (lmcache >= 0.5.7) on 127.0.0.1.

Like :class:`~lmkv_async.testing.LocalServer`: the interpreter of an environment
where lmcache is installed runs ``-m lmcache.cli.main coordinator --host 127.0.0.1
--port P --chunk-size C``; the child gets :func:`server_env` (telemetry off), logs
to a file, and is stopped by PID. Servers join it with :meth:`server_args`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import httpx

from .server import LocalServerError, free_port, server_env

__all__ = ["LocalCoordinator"]


class LocalCoordinator:
    """One ``lmcache coordinator`` child process on 127.0.0.1."""

    def __init__(self, python: str, *, port: int | None = None, chunk_size: int = 256,
                 instance_timeout: float = 30.0, extra_args: tuple[str, ...] = (),
                 log_path: str | os.PathLike[str] | None = None) -> None:
        self.python = python
        self.port = port if port is not None else free_port()
        self.chunk_size = chunk_size
        self.instance_timeout = instance_timeout
        self.extra_args = extra_args
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="lmkv-coordinator-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        else:
            self.log_path = Path(log_path)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The coordinator's base URL."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """PID of the process, or None."""
        return self._proc.pid if self._proc is not None else None

    def command(self) -> list[str]:
        """The argv that starts it."""
        return [self.python, "-m", "lmcache.cli.main", "coordinator", "--host", "127.0.0.1",
                "--port", str(self.port), "--chunk-size", str(self.chunk_size),
                "--instance-timeout", repr(float(self.instance_timeout)), *self.extra_args]

    def server_args(self, *, flush_interval: float = 0.2,
                    instance_id: str | None = None) -> tuple[str, ...]:
        """Flags that make an MP server register with this coordinator and report its
        cache events to it (``ServerConfig.extra_args``)."""
        args: tuple[str, ...] = (
            "--coordinator-url", self.url, "--coordinator-advertise-ip", "127.0.0.1",
            "--coordinator-heartbeat-interval", "1.0", "--coordinator-event-reporting",
            "--coordinator-event-flush-interval", repr(float(flush_interval)))
        if instance_id is not None:
            args += ("--instance-id", instance_id)
        return args

    def is_running(self) -> bool:
        """Whether the process exists and has not exited."""
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 120) -> None:
        """Start it and wait until ``GET /instances`` answers."""
        if self.is_running():
            raise LocalServerError("coordinator already running")
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, env=server_env(),
                                          close_fds=True)
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while True:
                rc = self._proc.poll()
                if rc is not None:
                    raise LocalServerError(f"coordinator exited with code {rc}; log "
                                           f"{self.log_path}:\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.url + "/instances").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    self.stop()
                    raise LocalServerError(f"coordinator not ready; log:\n{self.log_tail()}")
                time.sleep(0.2)

    def instances(self) -> list[dict[str, object]]:
        """``GET /instances``."""
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            body = client.get(self.url + "/instances").json()
        items: list[dict[str, object]] = body.get("instances", [])
        return items

    def stop(self, timeout: float = 15) -> None:
        """SIGTERM (SIGKILL after ``timeout``) and reap."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
                proc.send_signal(signal.SIGCONT)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        self._proc = None

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=30)

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of its log."""
        try:
            text = self.log_path.read_text("utf-8", "replace")
        except OSError as exc:
            return f"<cannot read log: {exc}>"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> LocalCoordinator:
        if not self.is_running():
            self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
