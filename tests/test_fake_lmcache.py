"""The fake lmcache server's fixture fails a test whose fake had a handler raise.

A pytest run in a subprocess, on a test file written here, with ``fake_lmcache``
loaded as a plugin the way ``tests/conftest.py`` loads it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lmkv_async

HERE = Path(__file__).resolve().parent

INNER = '''
import msgpack
import zmq
from fake_lmcache import PING
from timing import eventually_sync


def ping(fake):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(fake.url)
        sock.send_multipart([msgpack.packb(7), msgpack.packb(PING), msgpack.packb(0)])
        eventually_sync(lambda: fake.requests(), what="the fake got the ping")
    finally:
        sock.close(0)
        ctx.term()


def test_a_raising_handler(fake_factory):
    fake = fake_factory()

    def boom(req, f):
        raise RuntimeError("a bug in the handler")

    fake.on(PING, boom)
    ping(fake)
    eventually_sync(lambda: fake.handler_errors, what="the handler ran")


def test_a_fake_without_problems(fake):
    ping(fake)
'''


def test_a_handler_error_fails_the_test_once(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    # the helpers next to this file, and the lmkv_async this run imported
    package_root = str(Path(lmkv_async.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE), package_root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "fake_lmcache",
         "test_inner.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    summary = out.strip().splitlines()[-1]
    # failed in its call phase, reported once: no teardown error on top
    assert "1 failed, 1 passed" in summary and "error" not in summary, out
    assert "FAILED test_inner.py::test_a_raising_handler" in out, out
    assert "the fake's handlers raised" in out and "a bug in the handler" in out, out
