"""One side of bench_backends.py: one workload through ``anyio.run`` on a backend.

    python _backends_child.py URL HTTP_URL MODEL asyncio|trio

Imports ``lmkv_async`` from ``$PYTHONPATH`` (the tree under test) and prints one
JSON line of medians in seconds.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import anyio
import torch

import lmkv_async as lmkv

L, NH, HS = 16, 8, 128
LAYOUT = lmkv.KVLayout(num_layers=L, num_kv_heads=NH, head_dim=HS, dtype=torch.bfloat16,
                       block_size=16)
REPS = 7


async def main(url: str, http_url: str, model: str) -> dict[str, dict[str, float]]:
    res: dict[str, dict[str, float]] = {}
    async with lmkv.connect(url, http_url, model, layout=LAYOUT, timeout=60) as ctx:
        # lookups at T=1024 on a stored prefix: one at a time, then 64 in flight
        T = 1024
        kv = torch.randint(-2**14, 2**14, (2, L, T, NH * HS), dtype=torch.int16)
        toks = torch.randint(0, 2**31, (T,)).tolist()
        await ctx.store(kv.view(torch.bfloat16), toks)
        for _ in range(20):  # warm up
            assert await ctx.lookup(toks) == T
        one = []
        for _ in range(300):
            t0 = time.perf_counter()
            n = await ctx.lookup(toks)
            one.append(time.perf_counter() - t0)
            assert n == T
        many = []
        for _ in range(15):
            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for _ in range(64):
                    tg.start_soon(ctx.lookup, toks)
            many.append((time.perf_counter() - t0) / 64)
        res["lookup"] = {"one": statistics.median(one), "64 in flight": statistics.median(many)}
        for T in (256, 1024, 4096):
            kv = torch.randint(-2**14, 2**14, (2, L, T, NH * HS), dtype=torch.int16)
            out = torch.zeros_like(kv)
            st, rt = [], []
            for _ in range(REPS):
                toks = torch.randint(0, 2**31, (T,)).tolist()
                t0 = time.perf_counter()
                w = await ctx.store(kv.view(torch.bfloat16), toks)
                st.append(time.perf_counter() - t0)
                assert w.stored_tokens == T
                t0 = time.perf_counter()
                v = await ctx.retrieve(toks, out=out.view(torch.bfloat16))
                rt.append(time.perf_counter() - t0)
                assert v is not None and torch.equal(out, kv)
            res[str(T)] = {"store": statistics.median(st), "retrieve_out": statistics.median(rt)}
    return res


if __name__ == "__main__":
    url, http_url, model, backend = sys.argv[1:5]
    print(json.dumps(anyio.run(main, url, http_url, model, backend=backend)))
