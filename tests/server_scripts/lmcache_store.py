"""Store token prefixes the way vLLM does (lmcache-driven), on command, for event tests.

Runs INSIDE a server environment (it imports ``lmcache``; ``lmkv_async`` never
does). It registers CPU paged caches exactly like ``register_cpu_engine.py``
(whose helpers it reuses: that script ships in ``lmkv_async/testing/server_scripts/``,
which the parent, ``tests/storer.py``, puts on ``PYTHONPATH``) and then serves one JSON
command per stdin line:

* ``{"op": "store", "id": "r1", "tokens": [...], "salt": "", "chunk_size": 256}``: store
  every complete chunk of ``tokens`` through ``LMCacheMPWorkerAdapter.submit_store_request`` (the
  path vLLM's connector takes, which is what makes the server log ``stored``
  events) and wait until the adapter reports it finished;
* ``{"op": "quit"}``: unregister and exit.

Each command is answered by one stdout line ``OK <json>`` or ``ERR <text>``. The
first line is ``READY <json>`` once registered. Logs go to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

from register_cpu_engine import _make_adapter, _parse_args, _register

os.environ.setdefault("DO_NOT_TRACK", "1")


def _op(adapter_mod: Any, tokens: list[int], block_ids: list[int]) -> Any:
    """A ``LoadStoreOp`` in whichever shape this lmcache has (token_ids or token_bytes)."""
    fields = adapter_mod.LoadStoreOp.__dataclass_fields__
    if "token_bytes" in fields:
        packed = b"".join(int(t).to_bytes(4, "big") for t in tokens)
        return adapter_mod.LoadStoreOp(token_bytes=packed, block_ids=[block_ids], start=0,
                                       end=len(tokens))
    return adapter_mod.LoadStoreOp(token_ids=list(tokens), block_ids=[block_ids], start=0,
                                   end=len(tokens))


def main() -> None:
    """Register, print READY, serve commands; exits the process."""
    args = _parse_args()
    import torch
    import zmq
    from lmcache.integration.vllm import vllm_multi_process_adapter as adapter_mod

    dtype = getattr(torch, args.dtype)
    shape = (args.num_blocks, 2, args.num_kv_heads, args.block_size, args.head_dim)
    kv_caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(shape, dtype=dtype)
                 for i in range(args.num_layers)}
    adapter = _make_adapter(adapter_mod, zmq.Context(), args, 0)
    rc = 0
    try:
        _register(adapter, kv_caches, args)
        start_hb = getattr(adapter, "_ensure_heartbeat_started", None)
        if callable(start_hb):
            start_hb()
        print("READY " + json.dumps({"instance_id": int(adapter.instance_id),
                                     "pid": os.getpid()}), flush=True)
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                cmd = json.loads(line)
                if cmd["op"] == "quit":
                    break
                chunk = int(cmd.get("chunk_size", 256))
                tokens = [int(t) for t in cmd["tokens"]]
                # vLLM stores whole chunks only (the server asserts end % chunk == 0).
                tokens = tokens[: len(tokens) // chunk * chunk]
                need = -(-len(tokens) // args.block_size)
                if need > args.num_blocks:
                    raise ValueError(f"{len(tokens)} tokens need {need} blocks")
                rid = str(cmd["id"])
                event = adapter.create_recorded_event()
                adapter.submit_store_request(rid, _op(adapter_mod, tokens, list(range(need))),
                                             event, cache_salt=str(cmd.get("salt", "")))
                # Wait on the store's own future (vLLM's get_finished bookkeeping
                # needs the scheduler's view, which there is none of here).
                future = adapter.store_futures.pop(rid)
                adapter.store_events.pop(rid, None)
                ok = future.result(timeout=30)
                # vLLM ends a request's server session when the request finishes;
                # do the same, or the session stays until its TTL.
                adapter.req_client.end_session(rid).result(timeout=10)
                print("OK " + json.dumps({"id": rid, "result": bool(ok)}), flush=True)
            except Exception as exc:  # report and keep serving
                traceback.print_exc()
                print(f"ERR {type(exc).__name__}: {exc}", flush=True)
    except BaseException:
        traceback.print_exc()
        rc = 1
    finally:
        try:
            adapter.shutdown()
        except Exception as exc:
            print(f"unregister failed: {exc!r}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)  # lmcache's polling loop can block a clean interpreter exit


if __name__ == "__main__":
    main()
