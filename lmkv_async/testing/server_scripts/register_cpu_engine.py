"""Register CPU paged KV caches with an lmcache MP server, the way vLLM's adapter does.

This script runs INSIDE a server environment (it imports ``lmcache``; the
``lmkv_async`` library never does). It allocates, per layer, a CPU paged KV
cache in HND physical order ``[NB, 2, NH, BS, HS]`` and registers it through
lmcache's own vLLM worker adapter (``LMCacheMPWorkerAdapter``) in
*lmcache-driven* mode: the adapter migrates the tensors into POSIX SHM
(``/dev/shm/lmcache_kv_<pid>_<n>``) and sends ``REGISTER_KV_CACHE`` with
``CpuShmTensorWrapper`` handles. On a server started with
``--supported-transfer-mode auto`` this makes ``/status`` show a
``cache_context_meta`` entry, which is what lmcache's official SDK needs to
discover the layout.

CPU workers default to the engine-driven path in lmcache, so the mode is
forced with ``extra_config={"lmcache.mp.mp_transfer_mode": "lmcache_driven"}``.

Version notes (feature-detected, not keyed on the version string):

* 0.5.6: ``register_kv_caches(kv, engine_group_infos, layout_hints=...)``; the
  script passes ``{"kv_layout": "HND"}``.
* 0.5.2: ``register_kv_caches`` takes no hints (the adapter asks vLLM, which is
  absent, and gets ``{}``); the 0.5.2 detector forces HND for CPU tensors.

Protocol with the parent: after registering, print exactly one line
``READY <json>`` on stdout, then stay alive (the adapter's heartbeat thread
pings the server, as in vLLM) until stdin reaches EOF or SIGTERM/SIGINT
arrives; then unregister (``adapter.shutdown()``) and exit 0. Logs go to
stderr.

Usage::

    <server-python> register_cpu_engine.py --url tcp://127.0.0.1:P --model NAME \
        --num-layers L --num-kv-heads NH --head-dim HS --block-size BS \
        --num-blocks NB --dtype bfloat16 [--world-size 1]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import signal
import sys
import threading
import traceback
from typing import Any

os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="server ZMQ url, tcp://127.0.0.1:P")
    p.add_argument("--model", required=True)
    p.add_argument("--num-layers", type=int, required=True)
    p.add_argument("--num-kv-heads", type=int, required=True)
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--num-blocks", type=int, required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--timeout", type=float, default=30.0, help="RPC timeout, seconds")
    p.add_argument(
        "--unregister-timeout",
        type=float,
        default=5.0,
        help="seconds to wait for the unregister reply at exit",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=5.0,
        help="seconds between pings (must stay below the server's reap timeout)",
    )
    p.add_argument(
        "--fill",
        choices=["zeros", "arange"],
        default="zeros",
        help="initial KV contents (arange: a deterministic per-element pattern)",
    )
    return p.parse_args(argv)


def _make_adapter(adapter_mod: Any, zmq_ctx: Any, args: argparse.Namespace, rank: int) -> Any:
    """Build one worker adapter with the legacy positional signature (both versions)."""
    extra_config = {
        "lmcache.mp.mp_transfer_mode": "lmcache_driven",
        "lmcache.mp.mq_timeout": args.timeout,
        "lmcache.mp.heartbeat_interval": args.heartbeat_interval,
    }
    # Legacy form (kv_world_size, kv_worker_id, block_size): accepted by 0.5.2
    # and 0.5.6, and on 0.5.6 it also disables the adapter's server auto-start.
    return adapter_mod.LMCacheMPWorkerAdapter(
        args.url,
        zmq_ctx,
        args.model,
        args.world_size,
        rank,
        args.block_size,
        extra_config=extra_config,
    )


def _register(adapter: Any, kv_caches: dict[str, Any], args: argparse.Namespace) -> None:
    """Call ``register_kv_caches`` with what this lmcache version accepts."""
    kwargs: dict[str, Any] = {}
    params = inspect.signature(adapter.register_kv_caches).parameters
    if "engine_group_infos" in params:
        try:
            from lmcache.v1.multiprocess.group_view import EngineGroupInfo
        except ImportError:  # pragma: no cover - older layouts
            pass
        else:
            kwargs["engine_group_infos"] = [
                EngineGroupInfo(
                    engine_group_id=0,
                    layer_indices=tuple(range(args.num_layers)),
                    tokens_per_block=args.block_size,
                )
            ]
    if "layout_hints" in params:
        kwargs["layout_hints"] = {"kv_layout": "HND"}
    adapter.register_kv_caches(kv_caches, **kwargs)


def main(argv: list[str] | None = None) -> None:
    """Register, print READY, wait for EOF/SIGTERM, unregister; exits the process."""
    args = _parse_args(argv)

    import lmcache
    import torch
    import zmq
    from lmcache.integration.vllm import vllm_multi_process_adapter as adapter_mod

    dtype = getattr(torch, args.dtype)
    shape = (args.num_blocks, 2, args.num_kv_heads, args.block_size, args.head_dim)

    stop = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)

    zmq_ctx = zmq.Context()
    rc = 0
    kv_caches: dict[str, Any] = {}
    adapters: list[Any] = []
    # Keep the tensors alive: the SHM segments are unlinked when they are freed.
    all_caches: list[dict[str, Any]] = []
    try:
        for rank in range(args.world_size):
            kv_caches = {}
            for layer in range(args.num_layers):
                if args.fill == "arange":
                    n = 1
                    for d in shape:
                        n *= d
                    t = (torch.arange(n, dtype=torch.float32) % 251).to(dtype).reshape(shape)
                else:
                    t = torch.zeros(shape, dtype=dtype)
                kv_caches[f"model.layers.{layer}.self_attn.attn"] = t
            adapter = _make_adapter(adapter_mod, zmq_ctx, args, rank)
            adapters.append(adapter)
            _register(adapter, kv_caches, args)
            all_caches.append(kv_caches)
            # Ping like vLLM does, so the server's reaper sees a live worker
            # (0.5.6's heartbeat also re-registers after a server restart).
            start_hb = getattr(adapter, "_ensure_heartbeat_started", None)
            if callable(start_hb):
                start_hb()

        info = {
            "lmcache_version": getattr(lmcache, "__version__", "unknown"),
            "pid": os.getpid(),
            "model": args.model,
            "world_size": args.world_size,
            "instance_ids": [int(a.instance_id) for a in adapters],
            "shape": list(shape),
            "dtype": str(dtype),
            "num_layers": args.num_layers,
            # migrate_to_shm_and_wrap names them /lmcache_kv_<pid>_<n>.
            "shm_segments": sorted(
                n for n in os.listdir("/dev/shm") if n.startswith(f"lmcache_kv_{os.getpid()}_")
            ),
        }
        print("READY " + json.dumps(info), flush=True)

        def _watch_stdin() -> None:
            try:
                while sys.stdin.buffer.read(65536):
                    pass
            except (OSError, ValueError):
                pass
            stop.set()

        threading.Thread(target=_watch_stdin, name="stdin-watch", daemon=True).start()
        while not stop.wait(0.5):
            pass
    except BaseException:
        traceback.print_exc()
        rc = 1
    finally:
        for adapter in adapters:
            # Do not wait the full RPC timeout if the server is already gone.
            if hasattr(adapter, "_mq_timeout"):
                adapter._mq_timeout = min(float(adapter._mq_timeout), args.unregister_timeout)
            try:
                adapter.shutdown()
            except Exception as exc:  # report and keep unregistering the rest
                print(f"unregister failed: {exc!r}", file=sys.stderr, flush=True)
        # Freeing the tensors runs lmcache's finalizers, which unlink the
        # /dev/shm/lmcache_kv_<pid>_<n> segments; sweep whatever is left.
        adapters.clear()
        all_caches.clear()
        kv_caches = {}
        gc.collect()
        prefix = f"lmcache_kv_{os.getpid()}_"
        for name in os.listdir("/dev/shm"):
            if name.startswith(prefix):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join("/dev/shm", name))
        sys.stdout.flush()
        sys.stderr.flush()
        # lmcache's shared ZMQ polling loop keeps sockets open, so a clean
        # interpreter exit (zmq Context.term) can block forever: leave now.
        os._exit(rc)


if __name__ == "__main__":
    main()
