"""``lmkv server``: a local lmcache server for trying things, until Ctrl-C or SIGTERM."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Annotated, Any, NoReturn

import typer

from ._exits import UsageProblem
from ._options import DebugOpt, JsonOpt
from ._output import Output, one_line


class _Stop(Exception):
    pass


def server(
    version: Annotated[str, typer.Option("--version", help="lmcache version to start.")
                       ] = "0.5.6",
    python: Annotated[str | None, typer.Option(
        "--python", help="Interpreter with that lmcache installed; default: "
                         "$LMKV_LMCACHE_PYTHON_<tag>.")] = None,
    shm: Annotated[bool, typer.Option("--shm/--no-shm", help="SHM pool on or off.")] = True,
    chunk_size: Annotated[int, typer.Option("--chunk-size", min=1)] = 256,
    l1_size_gb: Annotated[float, typer.Option("--l1-size-gb", min=0.01)] = 1.0,
    zmq_port: Annotated[int | None, typer.Option("--zmq-port", help="Default: a free port.")
                        ] = None,
    http_port: Annotated[int | None, typer.Option("--http-port", help="Default: a free port.")
                         ] = None,
    start_timeout: Annotated[float, typer.Option("--start-timeout", min=1.0)] = 120.0,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> int:
    """Start a local lmcache server on 127.0.0.1 for trying things; Ctrl-C or SIGTERM stops it.

    It prints the url and http_url to pass to other commands (``--json``: one
    ``{"event": "started", ...}`` line, then ``{"event": "stopped", ...}``).
    """
    from ..testing import LocalServer, LocalServerError, ServerConfig, env_var_for
    from ..testing import find_server_python as find

    out = Output(json_out, debug)
    interpreter = python or find(version)
    if not interpreter:
        return out.fail(UsageProblem(
            f"no interpreter for lmcache {version}: pass --python or set ${env_var_for(version)}"))
    if not os.access(interpreter, os.X_OK):
        return out.fail(UsageProblem(f"--python {interpreter} is not an executable"))
    try:
        config = ServerConfig(version=version, python=interpreter, shm=shm,
                              chunk_size=chunk_size, l1_size_gb=l1_size_gb)
    except (ValueError, TypeError) as exc:
        return out.fail(UsageProblem(str(exc)))
    srv = LocalServer(config, zmq_port=zmq_port, http_port=http_port)

    def on_term(signum: int, frame: Any) -> NoReturn:
        raise _Stop()

    previous = signal.signal(signal.SIGTERM, on_term)
    code = 0
    info: dict[str, Any] = {}
    try:
        try:
            srv.start(timeout=start_timeout)
        except LocalServerError as exc:
            return out.fail(LocalServerError(f"{one_line(exc)} (log: {srv.log_path})"))
        info = {"event": "started", "version": srv.reported_version, "url": srv.url,
                "http_url": srv.http_url, "pid": srv.pid, "shm": shm,
                "shm_segment": srv.shm_segment, "log": str(srv.log_path)}
        if out.json:
            out.emit(info)
        else:
            out.print(f"lmcache {srv.reported_version} server running (pid {srv.pid})\n"
                      f"  url       {srv.url}\n  http_url  {srv.http_url}\n"
                      f"  log       {srv.log_path}\n"
                      f"try: lmkv --url {srv.url} --http-url {srv.http_url} status\n"
                      "Ctrl-C to stop")
            sys.stdout.flush()
        while srv.is_running():
            time.sleep(0.5)
        code = out.fail(LocalServerError(f"the server exited on its own (log: {srv.log_path})"))
    except (KeyboardInterrupt, _Stop):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        srv.stop()
    if out.json:
        out.emit({"event": "stopped", "pid": info.get("pid"), "exit_code": code})
    elif code == 0:
        out.print("stopped")
    return code

