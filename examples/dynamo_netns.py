"""Run Dynamo's standalone KV indexer where nothing outside this machine can reach it.

``python -m dynamo.indexer`` binds its HTTP server to 0.0.0.0 and has no flag to
change that. For tests and local trials this script runs it inside a private
network namespace that has only a loopback interface, and makes its HTTP API
available on a Unix socket instead::

    unshare -n  DYNAMO_PYTHON examples/dynamo_netns.py /tmp/dyn/http.sock -- \\
        --block-size 16 --port 8090 --model-name m --workers 0=ipc:///tmp/dyn/pub-0

(run it as root, or with ``unshare -rn`` as a user). Inside the namespace:

* ``lo`` is brought up (a new namespace starts with it down);
* the indexer is started with the arguments after ``--``;
* a relay forwards each connection on the Unix socket to the indexer's HTTP port
  on 127.0.0.1 (``httpx.AsyncHTTPTransport(uds=...)`` or ``curl --unix-socket``).

The KV-event publishers are reached over ``ipc://`` (Unix sockets are files: they
cross network namespaces, TCP loopback does not). The first line on stdout is a
JSON object ``{"interfaces": [...], "pid": ...}`` once the relay listens; the
script exits with the indexer, and stops it on SIGTERM/SIGINT.

Runs with any Python 3.10+ (standard library only), e.g. the indexer's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_PR_SET_PDEATHSIG = 1
#: a Unix socket's path fits in sockaddr_un.sun_path (108 bytes with the NUL)
_SUN_PATH_MAX = 107


def loopback_up() -> None:
    """``ip link set lo up`` without iproute2 (an ioctl on any socket)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, _SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _relay(uds: str, port: int, child: subprocess.Popen[bytes]) -> int:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", port)
        except OSError:  # the indexer is not listening yet
            w.close()
            return
        await asyncio.gather(_pipe(r, uw), _pipe(ur, w))

    with contextlib.suppress(FileNotFoundError):
        os.unlink(uds)
    server = await asyncio.start_unix_server(handle, path=uds)
    names = [name for _, name in socket.if_nameindex()]
    print(json.dumps({"interfaces": names, "pid": child.pid}), flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    exited = loop.run_in_executor(None, child.wait)
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([exited, stopping], return_when=asyncio.FIRST_COMPLETED)
    if child.poll() is None:
        child.terminate()
        try:
            await asyncio.wait_for(exited, 10)
        except asyncio.TimeoutError:
            child.kill()
    stopping.cancel()
    server.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(uds)
    return child.wait()


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    uds, args = argv[0], argv[2:]
    port = 8090
    if "--port" in args:
        port = int(args[args.index("--port") + 1])
    loopback_up()
    names = [name for _, name in socket.if_nameindex()]
    if names != ["lo"]:
        # Not a private namespace: refuse rather than expose 0.0.0.0.
        print(f"refusing to start: interfaces {names} (run under unshare -n)", file=sys.stderr)
        return 3
    if len(os.fsencode(uds)) > _SUN_PATH_MAX:
        print(f"refusing to start: socket path longer than {_SUN_PATH_MAX} bytes: {uds}",
              file=sys.stderr)
        return 2
    child = subprocess.Popen([sys.executable, "-m", "dynamo.indexer", *args],
                             preexec_fn=_die_with_parent)
    try:
        return asyncio.run(_relay(uds, port, child))
    finally:
        # Whatever ended the relay (an error included), the indexer goes with it.
        if child.poll() is None:
            child.kill()
            child.wait()


def _die_with_parent() -> None:
    """In the indexer's process: SIGKILL it when this script dies, however it dies."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
