"""Interop with lmcache's own engine-side code, per release (0.5.6 and 0.5.7rc2):

* the layout is discovered from an lmcache-driven registration made by lmcache's own code
  (``server_scripts/register_cpu_engine.py``, run with the server's interpreter);
* data stored by this library reads back bit-exact through the official SDK, and the reverse
  (``server_scripts/sdk_interop.py``), over SHM and without it.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from servers import assert_no_leaks
from test_context import random_kv, same_bits, tokens_for

import lmkv_async as lmkv
from lmkv_async.testing import EngineRegistration, LocalServer, server_env

pytestmark = pytest.mark.anyio

SDK_INTEROP = Path(__file__).resolve().parent / "server_scripts" / "sdk_interop.py"


def run_sdk(server: LocalServer, model: str, ops: list[dict[str, str]]) -> list[dict[str, object]]:
    job = {"url": server.url, "http_url": server.http_url, "model": model, "timeout": 60,
           "ops": ops}
    proc = subprocess.run([server.config.python, str(SDK_INTEROP), json.dumps(job)],
                          capture_output=True, timeout=300, env=server_env())
    lines = proc.stdout.decode().splitlines()
    assert lines, proc.stderr.decode()[-3000:]
    result = json.loads(lines[-1])
    assert result["ok"], result.get("error")
    out: list[dict[str, object]] = result["results"]
    return out


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "pickle"])
@pytest.mark.parametrize("version", ["0.5.6", "0.5.7rc2"])
async def test_library_and_official_sdk_read_each_others_data(
    version: str,
    shm: bool,
    tmp_path: Path,
    server_factory: Callable[..., LocalServer],
    register_engine: Callable[..., EngineRegistration],
) -> None:
    server = server_factory(version, shm=shm)
    model = f"interop-{server.zmq_port}"
    reg = register_engine(server, model=model, num_layers=2, num_kv_heads=2, head_dim=64,
                          block_size=16)
    async with lmkv.connect(server.url, server.http_url, model) as ctx:  # discovered layout
        layout = ctx.layout
        assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (2, 2, 64)
        assert ctx.transport == ("shm" if shm else "pickle")
        C = ctx.chunk_size
        ours, theirs = tokens_for(2 * C), tokens_for(3 * C)
        kv_ours, kv_theirs = random_kv(layout, 2 * C, seed=71), random_kv(layout, 3 * C, seed=72)
        assert (await ctx.store(kv_ours, ours)).written_chunks == 2

        torch.save(torch.tensor(ours), tmp_path / "ours.pt")
        torch.save(torch.tensor(theirs), tmp_path / "theirs.pt")
        torch.save(kv_theirs, tmp_path / "kv_theirs.pt")
        results = run_sdk(server, model, [
            {"op": "retrieve", "tokens": str(tmp_path / "ours.pt"),
             "out": str(tmp_path / "sdk_out.pt")},
            {"op": "store", "tokens": str(tmp_path / "theirs.pt"),
             "kv": str(tmp_path / "kv_theirs.pt")},
        ])
        assert results[0] == {"op": "retrieve", "tokens": 2 * C}
        assert results[1] == {"op": "store", "stored": True}
        sdk_out = torch.load(tmp_path / "sdk_out.pt")
        assert sdk_out.dtype == kv_ours.dtype and same_bits(sdk_out, kv_ours)

        assert await ctx.lookup(theirs) == 3 * C
        out = await ctx.retrieve(theirs)
        assert out is not None and out.dtype == kv_theirs.dtype and same_bits(out, kv_theirs)
    assert_no_leaks(server, allowed_instance_ids=reg.instance_ids)
