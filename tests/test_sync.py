"""lmkv_async.sync: the official SDK's usage pattern, blocking, against real 0.5.6 servers.

Covers the functional API (connect/store/retrieve/lookup/close), the context
manager form, four threads at once, calls from inside ``asyncio.run(...)``,
typed errors instead of None/False, and the lazily started, shared loop thread
(nothing at import time, contexts closed at interpreter exit).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import lmkv_async
from lmkv_async import sync as kvcache
from lmkv_async.testing import LocalServer, free_port

LAYOUT = lmkv_async.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64,
                             dtype=torch.bfloat16, block_size=16)
C = 256  # the servers' chunk size


def make_kv(tokens: list[int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, LAYOUT.num_layers, len(tokens), LAYOUT.hidden_dim,
                       generator=g).to(LAYOUT.dtype)


def registered(server: LocalServer) -> list[int]:
    return [int(i) for i in server.status().get("registered_non_cuda_instance_ids", [])]


def wait_unregistered(server: LocalServer, instance_id: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while instance_id in registered(server):
        assert time.monotonic() < deadline, f"instance {instance_id} still registered"
        time.sleep(0.1)


def loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "lmkv-loop"]


@pytest.fixture
def srv(server_factory: Callable[..., LocalServer]) -> LocalServer:
    return server_factory("0.5.6")


def test_import_starts_nothing() -> None:
    code = ("import threading, lmkv_async.sync, lmkv_async._loop_thread as s; "
            "print(threading.active_count(), s._portal is None, s._hooks_installed)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.split() == ["1", "True", "False"]


def test_sdk_functional_pattern(srv: LocalServer) -> None:
    tokens = list(range(1000, 1000 + 3 * C + 17))
    kv = make_kv(tokens, 1)
    ctx = kvcache.connect(srv.url, srv.http_url, "sync-functional", layout=LAYOUT)
    try:
        assert isinstance(ctx, kvcache.SyncKVContext)
        assert ctx.chunk_size == C and ctx.server_version.startswith("0.5.6")
        assert ctx.instance_id in registered(srv)
        res = kvcache.store(ctx, kv, tokens)
        assert isinstance(res, lmkv_async.StoreResult)
        assert (res.total_chunks, res.written_chunks, res.ignored_tokens) == (3, 3, 17)
        assert kvcache.lookup(ctx, tokens) == 3 * C
        out = kvcache.retrieve(ctx, tokens)
        assert out is not None and out.shape == (2, 2, 3 * C, 128)
        assert torch.equal(out, kv[:, :, : 3 * C])
        # a salt is a different namespace: a miss is None, as in the SDK
        assert kvcache.retrieve(ctx, tokens, "other-tenant") is None
        assert kvcache.lookup(ctx, tokens, cache_salt="other-tenant") == 0
        # again: nothing new to write
        assert kvcache.store(ctx, kv, tokens).written_chunks == 0
    finally:
        kvcache.close(ctx)
    kvcache.close(ctx)  # idempotent
    assert ctx.closed
    wait_unregistered(srv, ctx.instance_id)
    with pytest.raises(lmkv_async.ClosedError):
        kvcache.lookup(ctx, tokens)


def test_context_manager_and_methods(srv: LocalServer) -> None:
    tokens = list(range(50_000, 50_000 + 2 * C))
    kv = make_kv(tokens, 2)
    with kvcache.connect(srv.url, srv.http_url, "sync-cm", layout=LAYOUT, timeout=30.0) as ctx:
        assert ctx.store(kv, tokens).stored_tokens == 2 * C
        buf = torch.zeros(2, 2, 3 * C, 128, dtype=LAYOUT.dtype)
        view = ctx.retrieve(tokens, out=buf)
        assert view is not None and view.data_ptr() == buf.data_ptr()
        assert torch.equal(buf[:, :, : 2 * C], kv)
        assert torch.count_nonzero(buf[:, :, 2 * C:]) == 0
        many = ctx.lookup_many([tokens, list(range(7, 7 + C))])
        assert [r.value for r in many] == [2 * C, 0]
        assert isinstance(ctx.status(), dict)
        instance = ctx.instance_id
    assert ctx.closed
    wait_unregistered(srv, instance)


def test_typed_errors_instead_of_none(srv: LocalServer) -> None:
    with kvcache.connect(srv.url, srv.http_url, "sync-errors", layout=LAYOUT) as ctx:
        tokens = list(range(C))
        with pytest.raises(lmkv_async.LayoutMismatchError):  # SDK: its own RuntimeError
            ctx.store(torch.zeros(2, 2, C, 128, dtype=torch.float32), tokens)
        with pytest.raises(lmkv_async.InvalidInputError):
            ctx.lookup([-1] * C)
        assert ctx.lookup(tokens) == 0
    port = free_port()
    with pytest.raises(lmkv_async.ServerUnavailableError):
        kvcache.connect(f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{port}", "m",
                        timeout=2.0, layout=LAYOUT)


def test_four_threads_at_once_share_one_loop_thread(srv: LocalServer) -> None:
    shared = kvcache.connect(srv.url, srv.http_url, "sync-threads", layout=LAYOUT)
    errors: list[BaseException] = []
    results: dict[int, tuple[int, bool, int]] = {}
    barrier = threading.Barrier(4)

    def worker(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            for j in range(3):
                tokens = list(range(i * 100_000 + j * 5_000, i * 100_000 + j * 5_000 + 2 * C))
                kv = make_kv(tokens, 100 * i + j)
                # threads 0-1 use the shared context, threads 2-3 their own
                if i < 2:
                    written = kvcache.store(shared, kv, tokens).written_chunks
                    out = kvcache.retrieve(shared, tokens)
                    hit = kvcache.lookup(shared, tokens)
                else:
                    with kvcache.connect(srv.url, srv.http_url, "sync-threads",
                                         layout=LAYOUT) as own:
                        written = own.store(kv, tokens).written_chunks
                        out = own.retrieve(tokens)
                        hit = own.lookup(tokens)
                results[i * 10 + j] = (written, out is not None and torch.equal(out, kv), hit)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
        assert not any(t.is_alive() for t in threads), "a thread did not finish"
        assert not errors, errors
        assert len(results) == 12
        assert all(r == (2, True, 2 * C) for r in results.values()), results
        assert len(loop_threads()) == 1
    finally:
        kvcache.close(shared)
    wait_unregistered(srv, shared.instance_id)


def test_inside_a_running_event_loop(srv: LocalServer) -> None:
    """Blocking calls from a thread that runs a loop (Jupyter, asyncio.run) must not deadlock."""
    tokens = list(range(70_000, 70_000 + C))
    kv = make_kv(tokens, 3)
    outcome: dict[str, Any] = {}

    async def main() -> None:
        assert asyncio.get_running_loop().is_running()
        ctx = kvcache.connect(srv.url, srv.http_url, "sync-in-loop", layout=LAYOUT)
        try:
            outcome["written"] = kvcache.store(ctx, kv, tokens).written_chunks
            out = kvcache.retrieve(ctx, tokens)
            outcome["equal"] = out is not None and torch.equal(out, kv)
            # the caller's own loop still runs afterwards
            await asyncio.sleep(0.01)
            outcome["lookup"] = await asyncio.to_thread(kvcache.lookup, ctx, tokens)
        finally:
            kvcache.close(ctx)
        outcome["instance"] = ctx.instance_id

    runner = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    runner.start()
    runner.join(timeout=120)
    assert not runner.is_alive(), "deadlock: blocking call inside a running loop never returned"
    assert outcome.get("written") == 1 and outcome["equal"] and outcome["lookup"] == C
    wait_unregistered(srv, outcome["instance"])


def test_calling_from_the_loop_thread_raises_instead_of_deadlocking(srv: LocalServer) -> None:
    with kvcache.connect(srv.url, srv.http_url, "sync-reentrant", layout=LAYOUT) as ctx:
        async def reenter() -> int:
            return kvcache.lookup(ctx, list(range(C)))

        with pytest.raises(RuntimeError, match="own event loop thread"):
            kvcache._run(reenter)


def test_shutdown_closes_open_contexts_and_a_new_connect_starts_again(srv: LocalServer) -> None:
    ctx = kvcache.connect(srv.url, srv.http_url, "sync-shutdown", layout=LAYOUT)
    instance = ctx.instance_id
    kvcache.shutdown()
    assert not loop_threads()
    assert ctx.closed
    wait_unregistered(srv, instance)
    with pytest.raises(lmkv_async.ClosedError):
        ctx.lookup(list(range(C)))
    with kvcache.connect(srv.url, srv.http_url, "sync-shutdown", layout=LAYOUT) as again:
        assert again.lookup(list(range(C))) == 0
        assert len(loop_threads()) == 1


def test_interpreter_exit_closes_contexts_left_open(srv: LocalServer) -> None:
    """A script that never calls close() must not hang at exit or leave its registration."""
    script = textwrap.dedent(f"""
        import json, torch
        import lmkv_async
        from lmkv_async import sync as kvcache
        layout = lmkv_async.KVLayout(2, 2, 64, torch.bfloat16, 16)
        ctx = kvcache.connect({srv.url!r}, {srv.http_url!r}, "sync-exit", layout=layout)
        tokens = list(range(90_000, 90_000 + {C}))
        kvcache.store(ctx, torch.ones(2, 2, {C}, 128, dtype=torch.bfloat16), tokens)
        print(json.dumps({{"instance": ctx.instance_id}}), flush=True)
        # no close(): interpreter exit must close it
    """)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert time.monotonic() - t0 < 60
    instance = json.loads(out.stdout.strip().splitlines()[-1])["instance"]
    # unregistered by the exit hook (not by the server's reaper, which takes 120 s)
    wait_unregistered(srv, instance, timeout=5.0)


def test_forked_child_uses_the_facade_without_hanging(srv: LocalServer) -> None:
    """A process that used the facade forks a worker (multiprocessing's fork, gunicorn's
    preload): the child must not hang on the parent's loop thread, which it does not
    have, and can connect on a loop thread of its own; the parent goes on working."""
    script = textwrap.dedent(f"""
        import gc, os, sys, torch
        import lmkv_async
        from lmkv_async import sync as kvcache
        layout = lmkv_async.KVLayout(2, 2, 64, torch.bfloat16, 16)
        tokens = list(range(70_000, 70_000 + {C}))
        kv = torch.ones(2, 2, {C}, 128, dtype=torch.bfloat16)
        ctx = kvcache.connect({srv.url!r}, {srv.http_url!r}, "sync-fork", layout=layout)
        kvcache.store(ctx, kv, tokens)
        print(ctx.instance_id, flush=True)
        pid = os.fork()
        if pid == 0:
            try:
                gc.collect()  # finalizes what the child dropped of the parent's loop
                with kvcache.connect({srv.url!r}, {srv.http_url!r}, "sync-fork",
                                     layout=layout) as child:
                    ok = child.lookup(tokens) == {C}
                    print(child.instance_id, flush=True)
                os._exit(0 if ok else 1)
            except BaseException:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        assert kvcache.lookup(ctx, tokens) == {C}
        kvcache.close(ctx)
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    instances = [int(line) for line in out.stdout.split()]
    assert len(set(instances)) == 2, out.stdout  # the parent's and the child's
    for instance in instances:  # both closed: neither left its registration
        wait_unregistered(srv, instance, timeout=5.0)
