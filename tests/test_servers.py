"""Smoke tests of the real-server infrastructure: launcher, fixtures, registration, SDK peer."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from servers import (
    VERSIONS,
    ServerPool,
    ServerSpec,
    assert_no_leaks,
    leak_report,
    server_python,
)
from timing import eventually_sync

from lmkv_async.testing import (
    EngineRegistration,
    LocalServer,
    ServerConfig,
    server_env,
    unlink_engine_segments,
)

REPO = Path(__file__).resolve().parent.parent
SDK_PEER = REPO / "benchmarks" / "sdk_peer.py"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); LocalServer reaps, so check the state.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _port_free(port: int) -> bool:
    """Nothing listens on ``port``. SO_REUSEADDR: connections the server closed linger
    in TIME_WAIT for a minute and would make a plain bind fail without any leak."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().split(")")[-1].split()[1])
            except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
                continue
            if ppid == pid:
                out.append(int(entry))
    return out


# --------------------------------------------------------------------------- no server needed


def test_server_config_validates() -> None:
    with pytest.raises(ValueError):
        ServerConfig(version="0.5.6", python="/x", transfer_mode="bogus")
    with pytest.raises(ValueError):
        ServerConfig(version="0.5.6", python="/x", chunk_size=0)
    assert ServerConfig(version="0.5.6", python="/x").uses_cli
    assert not ServerConfig(version="0.5.2", python="/x").uses_cli


def test_launch_commands_per_version() -> None:
    s056 = LocalServer(ServerConfig(version="0.5.6", python="py"), zmq_port=1, http_port=2)
    s052 = LocalServer(
        ServerConfig(version="0.5.2", python="py", shm=False), zmq_port=1, http_port=2
    )
    assert s056.command()[:4] == ["py", "-m", "lmcache.cli.main", "server"]
    assert s052.command()[:3] == ["py", "-m", "lmcache.v1.multiprocess.http_server"]
    for cmd in (s056.command(), s052.command()):
        assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
        assert cmd[cmd.index("--http-host") + 1] == "127.0.0.1"
    # SHM off is an explicit empty name (0.5.2 would otherwise auto-name a pool).
    cmd = s052.command()
    assert cmd[cmd.index("--shm-name") + 1] == ""


def test_missing_server_python_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMKV_LMCACHE_PYTHON_099", "/nonexistent/python")
    monkeypatch.delenv("LMKV_ALLOW_MISSING_SERVERS", raising=False)
    with pytest.raises(pytest.fail.Exception):
        server_python("0.9.9")
    monkeypatch.setenv("LMKV_ALLOW_MISSING_SERVERS", "1")
    with pytest.raises(pytest.skip.Exception):
        server_python("0.9.9")


def test_stale_engine_segments_of_one_pid_are_unlinked() -> None:
    """Segments left by a killed engine are removed for that pid, and only that pid's:
    a later engine reusing the pid would fail on them (lmcache creates them with O_EXCL)."""
    pid = 4_000_000 + os.getpid()  # past the usual pid_max (32768 here): no engine gets it
    mine = [f"/dev/shm/lmcache_kv_{pid}_{n}" for n in (0, 1)]
    other = f"/dev/shm/lmcache_kv_{pid}0_0"  # a pid with the same leading digits
    for path in [*mine, other]:
        Path(path).write_bytes(b"stale")
    try:
        unlink_engine_segments(pid)
        assert not [p for p in mine if os.path.exists(p)]
        assert os.path.exists(other)
    finally:
        for path in [*mine, other]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def test_leak_report_reads_status_fields() -> None:
    clean = {
        "active_sessions": 0,
        "storage_manager": {"l1_manager": {"read_locked_count": 0, "write_locked_count": 0}},
        "registered_non_cuda_instance_ids": [7],
    }
    assert leak_report(clean, allowed_instance_ids=[7]) == []
    dirty = {
        "active_sessions": 1,
        "storage_manager": {"l1_manager": {"read_locked_count": 2, "write_locked_count": 3}},
        "registered_non_cuda_instance_ids": [7, 8],
    }
    assert len(leak_report(dirty, allowed_instance_ids=[7])) == 4


# --------------------------------------------------------------------------- shared servers


def test_server_version_status_and_config(server: LocalServer) -> None:
    cfg = server.config
    assert server.version().startswith(cfg.version + "-")
    # op 21 is noop ("OK") on 0.5.2 and get_chunk_size (256) on 0.5.6.
    assert server.probe() == ("OK" if cfg.version == "0.5.2" else 256)
    status = server.status()
    assert status["is_healthy"] is True
    assert status["chunk_size"] == 256
    assert "read_locked_count" in status["storage_manager"]["l1_manager"]
    mp = server.config_json()["mp"]
    assert mp["supported_transfer_mode"] == "auto"
    assert mp["host"] == "127.0.0.1"
    assert server.config_json()["http"]["http_host"] == "127.0.0.1"
    if cfg.shm:
        assert server.shm_segment is not None
        assert mp["shm_name"] == server.shm_segment.removeprefix("lmcache_l1_pool_")
        assert Path("/dev/shm", server.shm_segment).exists()
    else:
        assert server.shm_segment is None
        assert mp["shm_name"] in ("", None)
    assert_no_leaks(server)


def test_registration_shows_cache_context_meta(
    server: LocalServer, register_engine: Callable[..., EngineRegistration]
) -> None:
    L, NB, NH, BS, HS = 3, 40, 4, 16, 64
    model = f"reg-{server.config.version}-{server.zmq_port}"
    reg: EngineRegistration = register_engine(
        server,
        model=model,
        num_layers=L,
        num_kv_heads=NH,
        head_dim=HS,
        block_size=BS,
        num_blocks=NB,
        dtype="bfloat16",
    )
    assert reg.info["lmcache_version"] == server.config.version
    status = server.status()
    metas = status["cache_context_meta"]
    (iid,) = reg.instance_ids
    meta = metas[str(iid)]
    assert meta["model_name"] == model
    assert meta["world_size"] == 1
    layout = meta["kv_cache_layout"]
    assert layout["num_layers"] == L
    group = layout["kernel_groups"][0]
    assert group["engine_kv_concrete_shape"] == f"{L} x [{NB}, 2, {NH}, {BS}, {HS}]"
    assert group["engine_kv_format"] == "NL_X_NB_TWO_NH_BS_HS"
    assert group["dtype"] == "torch.bfloat16"
    assert group["tokens_per_block"] == BS
    assert iid in status["registered_gpu_ids"]
    assert reg.info["shm_segments"], "CPU caches should live in /dev/shm segments"

    # Closing stdin unregisters; the client-side SHM segments go away too.
    assert reg.proc.stdin is not None
    reg.proc.stdin.close()
    assert reg.proc.wait(timeout=60) == 0
    status = server.status()
    assert str(iid) not in status["cache_context_meta"]
    assert iid not in status["registered_gpu_ids"]
    for name in reg.info["shm_segments"]:
        assert not Path("/dev/shm", name).exists()
    assert_no_leaks(server)


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "pickle"])
def test_sdk_peer_smoke(
    shm: bool,
    server_factory: Callable[..., LocalServer],
    register_engine: Callable[..., EngineRegistration],
) -> None:
    """The official-SDK baseline runs against 0.5.6 and returns the stored bytes.

    (Only 0.5.6: the 0.5.6 SDK speaks the 0.5.3+ op table, which a 0.5.2 server cannot decode.)
    """
    server = server_factory("0.5.6", shm=shm)
    model = f"peer-{server.zmq_port}"
    geometry = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "dtype": "bfloat16"}
    reg: EngineRegistration = register_engine(
        server, model=model, num_layers=2, num_kv_heads=2, head_dim=64, block_size=16
    )
    job = {
        "url": server.url,
        "http_url": server.http_url,
        "model": model,
        "geometry": geometry,
        "seed": 3,
        "timeout": 30,
        "workloads": [
            {"op": "store", "T": 512, "reps": 2},
            {"op": "retrieve", "T": 512, "reps": 2},
            {"op": "retrieve_seq", "n_prefixes": 2, "T": 256},
            {"op": "lookup", "n": 4, "T": 256, "threads": 2},
            {"op": "mixed_soak", "ops": 12, "T": 256, "threads": 2},
        ],
    }
    proc = subprocess.run(
        [server.config.python, str(SDK_PEER), json.dumps(job)],
        capture_output=True,
        timeout=300,
        env=server_env(),
    )
    lines = proc.stdout.decode().splitlines()
    assert len(lines) == 1, proc.stdout.decode() + proc.stderr.decode()[-3000:]
    result = json.loads(lines[0])
    assert result["ok"], result.get("error")
    assert proc.returncode == 0
    assert result["sanity"]["retrieve_bit_exact"] is True
    ops = [r["op"] for r in result["results"]]
    assert ops == ["store", "retrieve", "retrieve_seq", "lookup", "mixed_soak"]
    assert len(result["results"][0]["samples"]) == 2
    assert all(s > 0 for s in result["results"][1]["samples"])
    assert sum(len(v) for v in result["results"][4]["samples"].values()) == 12
    assert_no_leaks(server, allowed_instance_ids=reg.instance_ids)


# --------------------------------------------------------------------------- one-off servers


def test_lmcache_driven_server_from_factory(server_factory: Callable[..., LocalServer]) -> None:
    srv: LocalServer = server_factory(
        "0.5.6", shm=False, transfer_mode="lmcache_driven", extra_args=("--max-gpu-workers", "2")
    )
    mp = srv.config_json()["mp"]
    assert mp["supported_transfer_mode"] == "lmcache_driven"
    assert mp["max_gpu_workers"] == 2
    assert srv.probe() == 256


@pytest.mark.parametrize("version", VERSIONS)
def test_private_server_kill_restart_freeze_stop(
    version: str, server_factory: Callable[..., LocalServer]
) -> None:
    srv: LocalServer = server_factory(version, shm=True, private=True)
    ok_reply = "OK" if version == "0.5.2" else 256
    ports = (srv.zmq_port, srv.http_port)
    segment = srv.shm_segment
    assert segment is not None and Path("/dev/shm", segment).exists()

    first_pid = srv.pid
    assert first_pid is not None
    srv.kill()
    assert not srv.is_running()
    assert not _pid_alive(first_pid)
    assert srv.probe(timeout=0.5) is None

    srv.restart()
    assert (srv.zmq_port, srv.http_port) == ports
    assert srv.pid != first_pid
    assert srv.probe() == ok_reply

    srv.freeze()
    assert srv.probe(timeout=0.5) is None
    srv.resume()
    assert srv.probe() == ok_reply

    pid = srv.pid
    assert pid is not None
    children = _children(pid)
    srv.freeze()  # stop() must also handle a frozen server
    srv.stop()
    assert srv.pid is None
    assert not _pid_alive(pid)
    for child in children:
        # a resource-tracker child exits once its parent's pipe closes: allow it a moment
        eventually_sync(lambda c=child: not _pid_alive(c), 15,
                        what=f"child {child} of the server survived stop()")
    assert not Path("/dev/shm", segment).exists()
    assert _port_free(ports[0]) and _port_free(ports[1])


def test_pool_evicts_least_recently_used(tmp_path: Path) -> None:
    """The pool never runs more than max_shared unpinned servers (2-core budget)."""
    pool = ServerPool(log_dir=tmp_path, max_shared=1)
    try:
        a = pool.get(ServerSpec("0.5.6", shm=False))
        b = pool.get(ServerSpec("0.5.2", shm=False))
        assert b.is_running()
        assert not a.is_running(), "the least recently used server should have been stopped"
        assert len(pool.running()) == 1
    finally:
        pool.stop_all()
    assert pool.running() == []


def test_sdk_peer_comparison_is_bit_exact() -> None:
    """The SDK peer's sanity check compares bits, dtype and shape, never a cast value."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("sdk_peer", SDK_PEER)
    assert spec is not None and spec.loader is not None
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    a = torch.tensor([1.0, float("nan"), 0.0], dtype=torch.bfloat16)
    assert peer.bit_equal(torch, a, a.clone()) == (True, "")
    other_nan = a.clone()
    other_nan.view(torch.int16)[1] += 1  # another NaN payload: torch.equal cannot see it
    assert not peer.bit_equal(torch, other_nan, a)[0]
    neg_zero = a.clone()
    neg_zero[2] = -0.0  # equal as a number, different bits
    assert not peer.bit_equal(torch, neg_zero, a)[0]
    # a float32 copy holds the same values, but is not what was stored
    assert peer.bit_equal(torch, a.float(), a) == (False, "dtype torch.float32 != torch.bfloat16")
    assert "shape" in peer.bit_equal(torch, a[:2], a)[1]
