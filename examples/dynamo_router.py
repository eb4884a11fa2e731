"""LMCache's CPU tier in NVIDIA Dynamo's KV router: a runnable local set-up.

Starts two lmcache 0.5.7rc2 servers (``lmkv_async.testing``), a :class:`~lmkv_async.Fleet`
over them, one vLLM-event publisher per server at Dynamo's block size, and Dynamo's
standalone KV indexer (``python -m dynamo.indexer``) subscribed to them. It stores
prompt A (3 chunks) on s1 and prompt B (1 chunk) plus A's first chunk on s2, then
prints, for each query, Dynamo's ``longest_matched`` per worker next to what each
LMCache server answers::

    python examples/dynamo_router.py --dynamo-python .nox/dynamo-indexer/bin/python \\
        --block-size 16

The indexer binds its HTTP port on 0.0.0.0, so here it runs in a private network
namespace (``unshare -n``; root, or ``unshare -rn``) via examples/dynamo_netns.py,
reading the publishers over ``ipc://``. In a deployment you run it as usual and
point ``--workers`` at the publishers' ``tcp://`` endpoints instead:
``python -m lmkv_async.vllm_events ... --router-block-size 16 --hash-mode dynamo``
prints the ``--workers`` value to use.

Needs the lmcache server environment (``LMKV_LMCACHE_PYTHON_057RC2``, ``nox -s
server-envs`` builds it) and an environment with ``ai-dynamo==1.6.1`` and
``ai-dynamo-runtime==1.6.1`` (``--no-deps``) plus ``pydantic``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import torch

import lmkv_async as lmkv
from lmkv_async.testing import LocalServer, ServerConfig, find_server_python
from lmkv_async.vllm_events import VllmEventPublisher, dynamo_workers_arg

HERE = Path(__file__).resolve().parent
C = 256
LAYOUT = lmkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                       block_size=16)


async def run(args: argparse.Namespace) -> int:
    python = find_server_python("0.5.7rc2")
    if python is None:
        print("set LMKV_LMCACHE_PYTHON_057RC2 to lmcache 0.5.7rc2's python", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="lmkv-dynamo-"))
    servers = {n: LocalServer(ServerConfig(version="0.5.7rc2", python=python, l1_size_gb=0.2),
                              log_path=tmp / f"{n}.log") for n in ("s1", "s2")}
    for srv in servers.values():
        srv.start()
    dyn = None
    try:
        async with lmkv.Fleet({n: (s.url, s.http_url) for n, s in servers.items()},
                              model_name=args.model, layout=LAYOUT) as fleet:
            # Worker ids: give each publisher the id Dynamo knows the engine by.
            pubs = [await VllmEventPublisher(
                fleet[n], endpoint=f"ipc://{tmp}/pub-{n}", replay_endpoint=f"ipc://{tmp}/rep-{n}",
                block_size=args.block_size, hash_mode="dynamo", encoding=args.encoding,
                worker_id=wid).start() for n, wid in (("s1", 1), ("s2", 2))]
            workers = dynamo_workers_arg(pubs)
            unshare = ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-rn"]
            uds = tmp / "dynamo.sock"
            dyn = subprocess.Popen(
                [*unshare, args.dynamo_python, str(HERE / "dynamo_netns.py"), str(uds), "--",
                 "--block-size", str(args.block_size), "--threads", "1",
                 "--model-name", args.model, "--workers", workers],
                stdout=subprocess.PIPE, stderr=open(tmp / "dynamo.log", "wb"))
            assert dyn.stdout is not None
            hello = json.loads(await asyncio.to_thread(dyn.stdout.readline) or b"{}")
            print(f"dynamo --workers {workers}  (namespace interfaces: {hello.get('interfaces')})")
            for pub in pubs:
                await pub.wait_subscribed(60)
            rng = random.Random(0)
            a = rng.choices(range(150_000), k=3 * C + 7)
            b = rng.choices(range(150_000), k=C + 3)
            kv = torch.zeros(2, 2, 3 * C, 128, dtype=torch.bfloat16)
            await fleet["s1"].store(kv, a[: 3 * C])
            await fleet["s2"].store(kv[:, :, : 2 * C], b[:C] + a[:C])
            await fleet["s2"].store(kv[:, :, :C], a[:C])
            await asyncio.sleep(1.0)  # events reach the indexer
            queries = {"A": a, "A[:C]": a[:C], "A[:C+100]": a[: C + 100], "B": b,
                       "B+A": b + a, "miss": rng.choices(range(150_000), k=2 * C)}
            client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(uds)),
                                       base_url="http://dynamo", trust_env=False)
            print(f"{'query':<10} {'lmcache s1':>10} {'dynamo 1':>9} {'lmcache s2':>10} "
                  f"{'dynamo 2':>9}  (block size {args.block_size}, {args.encoding})")
            async with client:
                for label, q in queries.items():
                    truth = (await fleet.lookup(q, source="lookup")).hits
                    r = await client.post("/query", json={"token_ids": q,
                                                          "model_name": args.model})
                    inst = r.json()["instances"]
                    got = {k: inst.get(str(w), {}).get("longest_matched", 0)
                           for k, w in (("s1", 1), ("s2", 2))}
                    print(f"{label:<10} {truth['s1']:>10} {got['s1']:>9} {truth['s2']:>10} "
                          f"{got['s2']:>9}")
            for pub in pubs:
                await pub.aclose()
    finally:
        if dyn is not None:
            dyn.terminate()
            dyn.wait(15)
        for srv in servers.values():
            srv.stop()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dynamo-python", default=os.environ.get("LMKV_DYNAMO_PYTHON", ""),
                   help="python of the ai-dynamo environment (default $LMKV_DYNAMO_PYTHON)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--encoding", choices=("map", "array"), default="map")
    p.add_argument("--model", default="lmkv-dynamo-demo")
    args = p.parse_args()
    if not args.dynamo_python:
        p.error("--dynamo-python (or LMKV_DYNAMO_PYTHON) is required")
    return asyncio.run(run(args))


if __name__ == "__main__":
    raise SystemExit(main())
