"""vllm-router 0.1.17 (``--policy kv_aware``) as a second real consumer of the publisher.

The router runs from its own environment (``LMKV_VLLM_ROUTER_PYTHON``: nox builds
``.nox/vllm-router``; without it this test FAILS). It binds 127.0.0.1. Its two
workers are stubs that only say who they are (no engine, no model); the router gets
token-id prompts, so it needs no tokenizer. Each worker's KV events come from a
publisher of one real LMCache server, where prompt X (server 1) and prompt Y
(server 2) were stored through the fleet. A prompt must go to the worker whose
server holds it, in both hash modes (measured: vllm-router matches the events'
``token_ids``, so the ``dynamo`` chain routes as well as vLLM's own hashes).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from timing import SLACK, eventually

import lmkv_async as lmkv
from lmkv_async.testing import free_port
from lmkv_async.vllm_events import VllmEventPublisher

LAYOUT = lmkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                       block_size=16)
C = 256


def router_python() -> str:
    py = os.environ.get("LMKV_VLLM_ROUTER_PYTHON", "")
    if not py or not Path(py).exists():
        pytest.fail("LMKV_VLLM_ROUTER_PYTHON is not set to the vllm-router environment "
                    "(nox -s tests builds .nox/vllm-router and exports it)")
    return py


def stub_worker(name: str, hits: list[str]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, obj: object) -> None:
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # /health, /v1/models
            self._send({"object": "list", "data": [{"id": "m", "object": "model"}]})

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            hits.append(name)
            self._send({"id": "x", "object": "text_completion", "model": "m",
                        "choices": [{"index": 0, "text": name, "finish_reason": "stop"}]})

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.mark.anyio
@pytest.mark.parametrize("hash_mode", ["vllm", "dynamo"])
async def test_vllm_router_routes_to_the_server_holding_the_prompt(
        server_factory: Any, tmp_path: Path, hash_mode: str) -> None:
    s1 = server_factory("0.5.7rc2", l1_size_gb=0.2)
    s2 = server_factory("0.5.7rc2", l1_size_gb=0.25)
    model = f"vr-{hash_mode}-{time.monotonic_ns()}"
    hits: list[str] = []
    workers = {n: stub_worker(n, hits) for n in ("s1", "s2")}
    urls = {n: f"http://127.0.0.1:{w.server_address[1]}" for n, w in workers.items()}
    port = free_port()
    log = open(tmp_path / "vllm-router.log", "wb")
    proc: subprocess.Popen[bytes] | None = None
    try:
        async with lmkv.Fleet({"s1": (s1.url, s1.http_url), "s2": (s2.url, s2.http_url)},
                              model_name=model, layout=LAYOUT) as fleet:
            pubs = {n: await VllmEventPublisher(
                fleet[n], endpoint=f"tcp://127.0.0.1:{free_port()}", block_size=16,
                hash_mode=hash_mode).start() for n in ("s1", "s2")}  # type: ignore[arg-type]
            try:
                sources = [a for n in ("s1", "s2")
                           for a in ("--kv-event-source", f"{urls[n]}={pubs[n].endpoint}")]
                proc = subprocess.Popen(
                    [router_python(), "-m", "vllm_router.launch_router", "--host", "127.0.0.1",
                     "--port", str(port), "--policy", "kv_aware",
                     "--worker-urls", urls["s1"], urls["s2"], *sources,
                     "--kv-event-block-size", "16", "--kv-event-model", model],
                    stdout=log, stderr=subprocess.STDOUT)
                for p in pubs.values():
                    await p.wait_subscribed(30 * SLACK)
                rng = random.Random(11)
                X = rng.choices(range(1, 100_000), k=3 * C)
                Y = rng.choices(range(1, 100_000), k=3 * C)
                kv = torch.zeros(2, 2, 3 * C, 128, dtype=torch.bfloat16)
                await fleet["s1"].store(kv, X)
                await fleet["s2"].store(kv, Y)
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10,
                                             trust_env=False) as client:
                    async def ready() -> bool:
                        try:
                            return (await client.get("/health")).status_code == 200
                        except httpx.HTTPError:
                            return False

                    await eventually(ready, 30 * SLACK, interval=0.2, what="router up")
                    cases = [(X, "s1"), (Y, "s2"), ([*X, 7, 8], "s1"), (Y[:C + 50], "s2"),
                             (X[: 2 * C], "s1")]

                    async def routed() -> list[tuple[str, list[str]]]:
                        out = []
                        for q, want in cases:
                            hits.clear()
                            for _ in range(3):
                                r = await client.post("/v1/completions", json={
                                    "model": model, "prompt": q, "max_tokens": 1})
                                assert r.status_code == 200, r.text
                            out.append((want, list(hits)))
                        return out

                    last: list[tuple[str, list[str]]] = []

                    async def agree() -> bool:
                        last[:] = await routed()
                        return all(got == [want] * 3 for want, got in last)

                    try:
                        await eventually(agree, 10 * SLACK, interval=0.2, what="kv routing")
                    except AssertionError as exc:
                        raise AssertionError(f"{exc}: {last}") from None
            finally:
                for p in pubs.values():
                    await p.aclose()
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(15)
        log.close()
        for w in workers.values():
            w.shutdown()
            w.server_close()
