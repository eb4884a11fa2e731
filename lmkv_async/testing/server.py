"""Start, stop and poke a real local lmcache MP server, as a child process.

Used by the test suite, the demo and the benchmarks. It launches the server
with the Python interpreter of an environment where ``lmcache`` is installed
(never this one: ``lmkv_async`` does not import ``lmcache``), binds it to
127.0.0.1 only, and waits until it really serves requests.

How each version is launched (both accept the same flags used here)::

    0.5.3+ : <python> -m lmcache.cli.main server  <flags>   (what ``lmcache server`` runs)
    <=0.5.2: <python> -m lmcache.v1.multiprocess.http_server <flags>
             (the 0.5.2 ``lmcache`` CLI fails to import without ``openai``)

    flags  : --host 127.0.0.1 --port Z --http-host 127.0.0.1 --http-port H
             --supported-transfer-mode M --chunk-size C --l1-size-gb G
             --eviction-policy LRU --shm-name NAME|""  [extra_args...]

SHM is on with ``--shm-name lmkv_<pid>_<port>`` (the server creates
``/dev/shm/lmcache_l1_pool_lmkv_<pid>_<port>``) and off with ``--shm-name ""``
(pickle transport). The empty name is passed explicitly because 0.5.2
auto-names a pool when the flag is absent.

Readiness means: ``GET /healthcheck`` answers 200 **and** a ZMQ round trip
works. The ZMQ probe sends op 21 with no payload, which is ``noop`` (reply
``"OK"``) on 0.5.0-0.5.2 and ``get_chunk_size`` (reply: an int) on 0.5.3+;
both are side-effect free, so the probe is safe on either table. HTTP alone
is not enough: on 0.5.2 the ZMQ loop can be dead while HTTP says "healthy".

The environment of the child gets ``DO_NOT_TRACK=1`` and
``LMCACHE_TRACK_USAGE=false`` (lmcache's usage telemetry opt-outs), the
telemetry URL pointed at a closed local port, the banner off and the Hugging
Face hub offline. Server stdout and stderr go to a log file.

A start takes about 4.5-5 s on a 2-core machine (mostly importing torch and
lmcache); a SIGTERM stop about 2-4 s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import zmq

from ..errors import ProtocolError
from ..wire import requests
from ..wire.frames import decode_reply, encode_request, pack

__all__ = [
    "KNOWN_VERSIONS",
    "LocalServer",
    "LocalServerError",
    "ServerConfig",
    "env_var_for",
    "find_server_python",
    "free_port",
    "server_env",
]

#: Versions this launcher has been tested with (any 0.5.x starts the same way).
KNOWN_VERSIONS = ("0.5.2", "0.5.6", "0.5.7rc2")

_SHM_POOL_PREFIX = "lmcache_l1_pool_"
_DEV_SHM = Path("/dev/shm")
_TRANSFER_MODES = ("auto", "engine_driven", "lmcache_driven")


class LocalServerError(RuntimeError):
    """A local lmcache server could not be started or did not behave.

    Deliberately outside the :class:`~lmkv_async.KVCacheError` tree: it is about
    the test harness, not about talking to a server.
    """


def _version_tuple(version: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in version.split("-")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


@dataclass(frozen=True)
class ServerConfig:
    """How to launch one lmcache MP server.

    Attributes:
        version: lmcache version in the environment, e.g. ``"0.5.6"`` or
            ``"0.5.2"``; it selects the launch command.
        python: Interpreter of the environment that has that lmcache installed.
        shm: ``True`` for an SHM pool (unique ``--shm-name``), ``False`` for the
            pickle transport (``--shm-name ""``).
        transfer_mode: ``auto``, ``engine_driven`` or ``lmcache_driven``.
        chunk_size: Tokens per chunk (``--chunk-size``).
        l1_size_gb: L1 size in GiB (``--l1-size-gb``).
        extra_args: More server flags, appended last, e.g.
            ``("--max-gpu-workers", "2")``.
        api_key: Start the server with this HTTP API key (lmcache >= 0.5.7: a 0600 key
            file is written and passed as ``--api-key-file``); the server's own HTTP
            helpers below send it. Never shown in a repr.
    """

    version: str
    python: str
    shm: bool = True
    transfer_mode: str = "auto"
    chunk_size: int = 256
    l1_size_gb: float = 1.0
    extra_args: tuple[str, ...] = field(default=())
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.transfer_mode not in _TRANSFER_MODES:
            raise ValueError(
                f"transfer_mode must be one of {_TRANSFER_MODES}, got {self.transfer_mode!r}"
            )
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")
        if self.l1_size_gb <= 0:
            raise ValueError(f"l1_size_gb must be positive, got {self.l1_size_gb}")
        if not isinstance(self.extra_args, tuple):
            raise TypeError("extra_args must be a tuple of strings")

    @property
    def uses_cli(self) -> bool:
        """Whether this version is launched through ``lmcache.cli.main server``."""
        return _version_tuple(self.version) >= (0, 5, 3)


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` a moment ago.

    The port is not reserved; a start that loses the race is retried with new
    ports by :meth:`LocalServer.start` when the ports were not given explicitly.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def env_var_for(version: str) -> str:
    """The environment variable naming the interpreter for ``version``.

    ``"0.5.6"`` -> ``LMKV_LMCACHE_PYTHON_056``; ``"0.5.7rc2"`` ->
    ``LMKV_LMCACHE_PYTHON_057RC2``.
    """
    return "LMKV_LMCACHE_PYTHON_" + version.replace(".", "").upper()


def find_server_python(version: str) -> str | None:
    """The interpreter of an environment with ``lmcache==version``, from the environment.

    Reads :func:`env_var_for` (e.g. ``$LMKV_LMCACHE_PYTHON_056``); nothing is
    guessed from the file system. Returns ``None`` when the variable is unset or
    does not name an executable.
    """
    value = os.environ.get(env_var_for(version))
    if value and os.access(value, os.X_OK):
        return value
    return None


def server_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for an lmcache child process: telemetry off, no network calls.

    Args:
        base: Environment to start from (default: ``os.environ``).
    """
    env = dict(os.environ if base is None else base)
    env.update(
        {
            "DO_NOT_TRACK": "1",
            "LMCACHE_TRACK_USAGE": "false",
            # Belt and braces: should tracking ever be on, it goes nowhere.
            "LMCACHE_USAGE_TRACK_URL": "http://127.0.0.1:9/",
            "LMCACHE_DISABLE_BANNER": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


class LocalServer:
    """One lmcache MP server child process on 127.0.0.1.

    Usage::

        cfg = ServerConfig(version="0.5.6", python=find_server_python("0.5.6"))
        with LocalServer(cfg) as srv:
            ...  # srv.url, srv.http_url

    Ports are fixed for the lifetime of the object, so :meth:`restart` brings
    the server back on the same address. Only the process started here is ever
    signalled (by PID), and only this server's SHM segment is ever removed.
    """

    def __init__(
        self,
        config: ServerConfig,
        *,
        zmq_port: int | None = None,
        http_port: int | None = None,
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        """Prepare (not start) a server.

        Args:
            config: What to launch.
            zmq_port: ZMQ port; a free one on 127.0.0.1 if ``None``.
            http_port: HTTP port; a free one on 127.0.0.1 if ``None``.
            log_path: File that receives the server's stdout/stderr (appended
                to across restarts); a new temp file if ``None``.
        """
        self.config = config
        self._ports_fixed = zmq_port is not None or http_port is not None
        self.zmq_port: int = zmq_port if zmq_port is not None else free_port()
        self.http_port: int = http_port if http_port is not None else free_port()
        while self.http_port == self.zmq_port:
            self.http_port = free_port()
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"lmkv-server-{config.version}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        else:
            self.log_path = Path(log_path)
        self._proc: subprocess.Popen[bytes] | None = None
        self._shm_name: str | None = None
        self._key_file: Path | None = None  # written at start, removed at stop
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._headers = headers
        self.start_seconds: float | None = None
        #: ``/version`` as reported by the running server, e.g. ``"0.5.6-g3e11e108"``.
        self.reported_version: str | None = None
        #: Reply to the ZMQ probe: ``"OK"`` (0.5.0-0.5.2 table) or the chunk size.
        self.probe_reply: object = None

    # ------------------------------------------------------------------ addresses
    @property
    def url(self) -> str:
        """ZMQ URL, ``tcp://127.0.0.1:<port>``."""
        return f"tcp://127.0.0.1:{self.zmq_port}"

    @property
    def http_url(self) -> str:
        """HTTP base URL, ``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def pid(self) -> int | None:
        """PID of the server process, or ``None`` if never started or reaped."""
        return self._proc.pid if self._proc is not None else None

    @property
    def shm_segment(self) -> str | None:
        """Name of the SHM pool under ``/dev/shm`` (``lmcache_l1_pool_<name>``), or ``None``."""
        return None if self._shm_name is None else _SHM_POOL_PREFIX + self._shm_name

    def is_running(self) -> bool:
        """Whether the process exists and has not exited (a frozen one counts)."""
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        """The argv used to start the server (for logs and bug reports)."""
        cfg = self.config
        if cfg.uses_cli:
            argv = [cfg.python, "-m", "lmcache.cli.main", "server"]
        else:
            argv = [cfg.python, "-m", "lmcache.v1.multiprocess.http_server"]
        argv += [
            "--host", "127.0.0.1",
            "--port", str(self.zmq_port),
            "--http-host", "127.0.0.1",
            "--http-port", str(self.http_port),
            "--supported-transfer-mode", cfg.transfer_mode,
            "--chunk-size", str(cfg.chunk_size),
            "--l1-size-gb", repr(float(cfg.l1_size_gb)),
            "--eviction-policy", "LRU",
            "--shm-name", self._shm_name or "",
        ]  # fmt: skip
        if self._key_file is not None:
            argv += ["--api-key-file", str(self._key_file)]
        argv += list(cfg.extra_args)
        return argv

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 120) -> None:
        """Start the server and wait until HTTP and ZMQ both answer.

        Raises:
            LocalServerError: if the process exits early or is not ready within
                ``timeout`` seconds (the message carries the log tail). The
                process is stopped before raising.
        """
        if self.is_running():
            raise LocalServerError(f"server already running (pid {self.pid})")
        attempts = 1 if self._ports_fixed else 3
        for attempt in range(attempts):
            try:
                self._start_once(timeout)
                return
            except LocalServerError as exc:
                if attempt + 1 < attempts and "address already in use" in str(exc).lower():
                    # Lost the free-port race: pick new ports and try again.
                    self.zmq_port, self.http_port = free_port(), free_port()
                    continue
                raise

    def _start_once(self, timeout: float) -> None:
        cfg = self.config
        self._shm_name = f"lmkv_{os.getpid()}_{self.zmq_port}" if cfg.shm else None
        # A stale segment of the same name (e.g. from a SIGKILLed run) would be
        # reused by the server; remove it first.
        self._remove_segment()
        if cfg.api_key is not None and self._key_file is None:
            fd, key_name = tempfile.mkstemp(prefix="lmkv-server-key-")  # mode 0600
            with os.fdopen(fd, "w") as f:
                f.write(cfg.api_key + "\n")
            self._key_file = Path(key_name)
        argv = self.command()
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== lmkv_async.testing: {' '.join(argv)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=server_env(),
                close_fds=True,
            )
        try:
            self._wait_ready(t0 + timeout)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0

    def _fail(self, why: str) -> LocalServerError:
        return LocalServerError(
            f"lmcache {self.config.version} server {why}\n"
            f"command: {' '.join(self.command())}\n"
            f"log ({self.log_path}), last lines:\n{self.log_tail()}"
        )

    def _wait_ready(self, deadline: float) -> None:
        proc = self._proc
        assert proc is not None
        http_ok = False
        with httpx.Client(timeout=2.0, trust_env=False, headers=self._headers) as client:
            while True:
                rc = proc.poll()
                if rc is not None:
                    raise self._fail(f"exited with code {rc} during start-up")
                if time.monotonic() > deadline:
                    raise self._fail("was not ready before the start timeout")
                if not http_ok:
                    with contextlib.suppress(httpx.HTTPError):
                        http_ok = client.get(self.http_url + "/healthcheck").status_code == 200
                    if not http_ok:
                        time.sleep(0.2)
                        continue
                reply = self._zmq_probe(timeout=min(2.0, max(0.1, deadline - time.monotonic())))
                if reply is not None:
                    self.probe_reply = reply
                    with contextlib.suppress(httpx.HTTPError, ValueError):
                        self.reported_version = str(client.get(self.http_url + "/version").json())
                    return
                time.sleep(0.2)

    def probe(self, timeout: float = 2.0) -> object:
        """One ZMQ round trip (op 21) on a fresh socket.

        Returns ``"OK"`` (0.5.0-0.5.2 table), the chunk size (0.5.3+), or
        ``None`` if nothing valid came back within ``timeout`` seconds (dead,
        frozen or wedged request loop).
        """
        return self._zmq_probe(timeout)

    def _zmq_probe(self, timeout: float) -> object:
        """Send the detection probe on a fresh DEALER; return its result or ``None``."""
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        uid = int.from_bytes(os.urandom(4), "little")
        request = requests.probe()
        try:
            sock.connect(self.url)
            sock.send_multipart(encode_request(uid, request.op_id, request.payloads))
            if not sock.poll(int(timeout * 1000), zmq.POLLIN):
                return None
            frames = sock.recv_multipart()
        finally:
            sock.close(linger=0)
        try:
            reply = decode_reply(frames, expected_op=pack(request.op_id))
            result = reply.result()
        except ProtocolError:
            return None
        if reply.uid_frame != pack(uid):
            return None
        if result == "OK" or (isinstance(result, int) and not isinstance(result, bool)):
            return result
        return None

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM the server (SIGKILL after ``timeout`` s), reap it, remove its SHM segment.

        Safe to call more than once, on a frozen, killed or never-started server.
        """
        proc = self._proc
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                    # A SIGSTOPped process only acts on SIGTERM once continued.
                    proc.send_signal(signal.SIGCONT)
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    proc.wait(timeout=30)
            else:
                proc.wait()
        self._proc = None
        self._remove_segment()
        if self._key_file is not None:
            with contextlib.suppress(FileNotFoundError):
                self._key_file.unlink()
            self._key_file = None

    def kill(self) -> None:
        """SIGKILL the server and reap it.

        Its SHM segment is left for :meth:`stop` or :meth:`restart` to remove
        (lmcache's resource tracker child may already unlink it).
        """
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        proc.wait(timeout=30)

    def freeze(self) -> None:
        """SIGSTOP the server: it keeps its sockets but answers nothing.

        Returns once the kernel reports the process stopped (a signal is delivered
        asynchronously; on a loaded machine a request sent right after the kill
        could otherwise still be answered).
        """
        self._signal(signal.SIGSTOP)
        self._wait_state(stopped=True)

    def resume(self) -> None:
        """SIGCONT a frozen server (returns once it runs again)."""
        self._signal(signal.SIGCONT)
        self._wait_state(stopped=False)

    def _wait_state(self, *, stopped: bool, timeout: float = 5.0) -> None:
        assert self._proc is not None
        stat = Path(f"/proc/{self._proc.pid}/stat")
        give_up = time.monotonic() + timeout
        while time.monotonic() < give_up:
            try:
                # field 3, after the parenthesised command name (which may hold spaces)
                state = stat.read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                return  # no procfs view: the signal was sent, that is all we can do
            if (state in ("T", "t")) == stopped:
                return
            time.sleep(0.005)
        raise LocalServerError(
            f"server pid {self._proc.pid} did not {'stop' if stopped else 'resume'} "
            f"within {timeout:.0f}s")

    def _signal(self, sig: signal.Signals) -> None:
        if not self.is_running():
            raise LocalServerError("server is not running")
        assert self._proc is not None
        self._proc.send_signal(sig)

    def restart(self, timeout: float = 120) -> None:
        """Stop (or reap a killed) server and start it again on the same ports."""
        self.stop()
        self._ports_fixed = True
        self.start(timeout=timeout)

    def _remove_segment(self) -> None:
        seg = self.shm_segment
        if seg is not None:
            with contextlib.suppress(FileNotFoundError):
                (_DEV_SHM / seg).unlink()

    # ------------------------------------------------------------------ HTTP helpers
    def _get_json(self, path: str, timeout: float) -> Any:
        with httpx.Client(timeout=timeout, trust_env=False, headers=self._headers) as client:
            response = client.get(self.http_url + path)
            response.raise_for_status()
            return response.json()

    def status(self, timeout: float = 10) -> dict[str, Any]:
        """``GET /status`` as a dict."""
        data = self._get_json("/status", timeout)
        if not isinstance(data, dict):
            raise LocalServerError(f"/status returned {type(data).__name__}, not an object")
        return data

    def config_json(self, timeout: float = 10) -> dict[str, Any]:
        """``GET /config`` as a dict."""
        data = self._get_json("/config", timeout)
        if not isinstance(data, dict):
            raise LocalServerError(f"/config returned {type(data).__name__}, not an object")
        return data

    def version(self, timeout: float = 10) -> str:
        """``GET /version``, e.g. ``"0.5.6-g3e11e108"``."""
        return str(self._get_json("/version", timeout))

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log."""
        try:
            data = self.log_path.read_bytes()
        except OSError as exc:
            return f"<cannot read log: {exc}>"
        return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> LocalServer:
        if not self.is_running():
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        cfg = self.config
        return (
            f"LocalServer(version={cfg.version!r}, shm={cfg.shm}, mode={cfg.transfer_mode!r}, "
            f"url={self.url!r}, http_url={self.http_url!r}, pid={self.pid})"
        )


