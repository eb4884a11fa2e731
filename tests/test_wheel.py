"""Packaging: ``python -m build`` makes an sdist and a wheel; the wheel works on its own.

One test, about 1-2 minutes (most of it installing torch into a fresh venv):

1. ``python -m build`` builds the sdist, then the wheel *from the sdist* (build's
   default), so a file the sdist lacks (``_copy.c``, ``setup.py``) fails here.
2. The sdist carries the kernel source, the tests, docs, LICENSE and CHANGELOG;
   the wheel carries the compiled kernel, the license and the ``lmkv`` script.
3. A fresh venv (no system site-packages) gets ``torch==2.13.0`` (the local CPU
   wheel; never a bare ``torch``), then the wheel and its dependencies.
4. In that venv, from a directory outside the checkout: ``lmkv_async`` and its
   ``_copy`` extension come from the venv, the C kernel serves ``backend="auto"``,
   and a store/lookup/retrieve round trip against a real 0.5.6 server is bit-exact.
5. The ``lmkv`` console script exists and, without the ``cli`` extra, prints the
   one line naming it (exit 5).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from lmkv_async.testing import LocalServer

# the test extra has it; a stray build/ directory would import as a namespace package
if not hasattr(pytest.importorskip("build"), "ProjectBuilder"):
    pytest.skip("the 'build' package is not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"

CHECK = r"""
import json, sys, asyncio
import torch
import lmkv_async as lmkv
import lmkv_async.kernel as kernel

url, http_url, venv = sys.argv[1:4]
info = {"file": lmkv.__file__, "ext": getattr(kernel._ext, "__file__", None),
        "available": kernel.kernel_available(), "auto_is_c": kernel._use_c("auto")}
# The C kernel really runs: stream_copy goes through the extension when it is loaded.
src = torch.arange(1 << 16, dtype=torch.int16)
dst = torch.empty_like(src)
kernel.stream_copy(dst, src)
info["stream_copy_ok"] = bool(torch.equal(src, dst))

LAYOUT = lmkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                       block_size=16)

async def main():
    async with lmkv.connect(url, http_url, "wheel-test", layout=LAYOUT) as ctx:
        tokens = list(range(7, 7 + 2 * ctx.chunk_size))
        kv = torch.randn(2, 2, len(tokens), 128).to(torch.bfloat16)
        res = await ctx.store(kv, tokens)
        hit = await ctx.lookup(tokens)
        out = await ctx.retrieve(tokens)
        info.update(transport=ctx.transport, version=ctx.server_version,
                    written=res.written_chunks, hit=hit,
                    exact=out is not None and bool(torch.equal(out, kv)))

asyncio.run(main())
print("RESULT " + json.dumps(info))
"""


def run(*argv: str | Path, cwd: Path, timeout: float = 240,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, f"{argv}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_build_install_wheel_in_a_fresh_venv_and_use_it(
        tmp_path: Path, server_factory: Callable[..., LocalServer]) -> None:
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "build", "--outdir", dist, ROOT, cwd=tmp_path, timeout=300)
    (sdist,) = dist.glob("lmkv_async-*.tar.gz")
    (wheel,) = dist.glob("lmkv_async-*.whl")

    with tarfile.open(sdist) as tf:
        top = tf.getnames()[0].split("/")[0]
        members = {n.removeprefix(top + "/") for n in tf.getnames()}
    for needed in ("lmkv_async/_copy.c", "setup.py", "pyproject.toml", "LICENSE",
                   "CHANGELOG.md", "MANIFEST.in", "README.md", "tests/test_wheel.py",
                   "tests/conftest.py", "tests/server_scripts/lmcache_store.py",
                   "lmkv_async/testing/server_scripts/register_cpu_engine.py",
                   "docs/index.md", "examples/demo.py", "constraints/ci.txt", "mkdocs.yml",
                   "tools/griffe_sphinx_roles.py"):
        assert needed in members, f"the sdist lacks {needed}"
    assert not [m for m in members if m.endswith(".so")], "a compiled object in the sdist"

    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry_points = next(zf.read(n).decode() for n in names
                            if n.endswith(".dist-info/entry_points.txt"))
        metadata = next(zf.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    assert [n for n in names if n.startswith("lmkv_async/_copy.") and n.endswith(".so")]
    assert "lmkv_async/py.typed" in names
    assert "lmkv_async/cli/__init__.py" in names and "lmkv_async/cli/_app.py" in names
    assert "lmkv_async/testing/server_scripts/register_cpu_engine.py" in names  # run by path
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "lmkv = lmkv_async.__main__:main" in entry_points
    assert "License-Expression: Apache-2.0" in metadata
    assert "Requires-Python: >=3.10" in metadata
    assert 'Requires-Dist: typer>=0.12; extra == "cli"' in metadata

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=tmp_path)  # no --system-site-packages
    py = venv / "bin" / "python"
    pip = [py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    constraints = ROOT / "constraints" / "ci.txt"
    run(*pip, "-c", constraints, TORCH, cwd=tmp_path, timeout=400)  # the local CPU wheel
    run(*pip, "-c", constraints, wheel, cwd=tmp_path, timeout=300)

    srv = server_factory("0.5.6")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    out = run(py, "-P", "-c", CHECK, srv.url, srv.http_url, venv, cwd=tmp_path, env=env)
    info = json.loads(out.stdout.split("RESULT ", 1)[1])
    site = str(venv.resolve())
    assert info["file"].startswith(site), info
    assert info["ext"] and info["ext"].startswith(site) and info["ext"].endswith(".so"), info
    assert info["available"] and info["auto_is_c"] and info["stream_copy_ok"], info
    assert info["version"].startswith("0.5.6") and info["transport"] == "shm", info
    assert info["written"] == 2 and info["hit"] == 512 and info["exact"], info

    script = subprocess.run([venv / "bin" / "lmkv", "--version"], capture_output=True,
                            text=True, timeout=60, env=env, cwd=tmp_path)
    assert script.returncode == 5, script
    # the last line: torch itself may warn first on import (no numpy in this venv)
    assert script.stderr.strip().splitlines()[-1] == (
        "lmkv: error: the lmkv command line needs the 'cli' extra: "
        "pip install 'lmkv_async[cli]'")
    assert "Traceback" not in script.stderr
