"""examples/router.py against two real servers, through httpx's ASGI transport."""

from __future__ import annotations

import importlib.util
import random
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import torch

import lmkv_async as lmkv

pytest.importorskip("starlette")

LAYOUT = lmkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                       block_size=16)
C = 256


def _router() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "examples" / "router.py"
    spec = importlib.util.spec_from_file_location("lmkv_example_router", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.anyio
async def test_router_answers_with_the_longest_prefix(server_factory: Any) -> None:
    a = server_factory("0.5.7rc2", l1_size_gb=0.2)
    b = server_factory("0.5.6", l1_size_gb=0.2)
    model = f"router-{time.monotonic_ns()}"
    seq = random.Random(9).choices(range(2**31), k=3 * C + 7)
    fleet = lmkv.Fleet({"gpu-0": (a.url, a.http_url), "gpu-1": (b.url, b.http_url)},
                       model_name=model, layout=LAYOUT, timeout=2.0)
    router = _router()
    app = router.create_app(fleet, {"gpu-0": "http://engine-0", "gpu-1": "http://engine-1"})
    async with fleet:
        await fleet["gpu-1"].store(torch.zeros(2, 2, 2 * C, 128, dtype=torch.bfloat16),
                                   seq[: 2 * C])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://router") as client:
            r = await client.post("/v1/completions", json={"model": model, "prompt": seq,
                                                           "max_tokens": 8})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["backend"] == "gpu-1" and body["url"] == "http://engine-1"
            assert body["cached_tokens"] == 2 * C
            assert body["hits"] == {"gpu-0": 0, "gpu-1": 2 * C}
            assert r.headers["x-lmkv-backend"] == "gpu-1"
            r = await client.post("/v1/chat/completions",
                                  json={"prompt_token_ids": [seq], "cache_salt": "other"})
            assert r.status_code == 200 and r.json()["cached_tokens"] == 0
            for bad in ({"prompt": "hello"}, {"prompt": []}, {"prompt": [1.5]},
                        {"prompt": [-3] * C}, {"prompt": [1] * C, "cache_salt": "a/b"}, [1, 2]):
                r = await client.post("/v1/completions", json=bad)
                assert r.status_code == 400, (bad, r.text)
            r = await client.post("/v1/completions", content=b"{not json")
            assert r.status_code == 400
            r = await client.get("/health")
            assert r.status_code == 200 and r.json() == {
                "members": {"gpu-0": "up", "gpu-1": "up"}}
            # A frozen backend: the router still answers, from the other one.
            a.freeze()
            try:
                t0 = time.monotonic()
                r = await client.post("/v1/completions", json={"prompt": seq})
                assert r.status_code == 200 and r.json()["backend"] == "gpu-1"
                assert time.monotonic() - t0 < 2.0 + 0.5
            finally:
                a.resume()
