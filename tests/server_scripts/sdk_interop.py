"""Store and retrieve through lmcache's OFFICIAL SDK, for interop tests (runs in a server env).

Input: one JSON job as argv[1]::

    {"url": ..., "http_url": ..., "model": ..., "timeout": 60,
     "ops": [{"op": "store", "tokens": "<file.pt>", "kv": "<file.pt>"},
             {"op": "retrieve", "tokens": "<file.pt>", "out": "<file.pt>"}]}

Tensors travel as torch.save files. Output: exactly one JSON line,
``{"ok": true, "results": [{"op": "store", "stored": true}, {"op": "retrieve",
"tokens": 512}, ...]}``. The SDK's close() leaves its engine-driven registration
behind, so this script unregisters it explicitly.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any

os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")


def main() -> int:
    job: dict[str, Any] = json.loads(sys.argv[1])
    import torch
    from lmcache.sdk import kvcache

    results: list[dict[str, Any]] = []
    ctx = kvcache.connect(job["url"], job["http_url"], job["model"],
                          timeout=float(job.get("timeout", 60)))
    try:
        for op in job["ops"]:
            tokens = torch.load(op["tokens"]).tolist()
            if op["op"] == "store":
                kv = torch.load(op["kv"])
                results.append({"op": "store", "stored": bool(ctx.store(kv, tokens))})
            elif op["op"] == "retrieve":
                out = ctx.retrieve(tokens)
                if out is not None:
                    torch.save(out.contiguous().clone(), op["out"])
                results.append({"op": "retrieve",
                                "tokens": None if out is None else int(out.shape[2])})
            else:
                raise ValueError(f"unknown op {op['op']!r}")
    except Exception as exc:  # reported, not raised: the test prints it
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
        return 1
    finally:
        with contextlib.suppress(Exception):
            ctx._req_client.unregister_kv_cache_engine_driven_context(ctx.instance_id).result(
                timeout=10)
        with contextlib.suppress(Exception):
            ctx.close()
    print(json.dumps({"ok": True, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
