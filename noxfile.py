"""nox sessions for lmkv_async.

    nox -s tests          # the test suite (not soak) against the INSTALLED package + real servers
    nox -s soak           # pytest -m soak
    nox -s lint           # ruff check + mypy --strict lmkv_async
    nox -s demo           # examples/demo.py against a real server it starts
    nox -s bench          # benchmarks/bench_*.py with the server envs exported
    nox -s docs           # the docs site (mkdocs --strict) into site/
    nox -s server-envs    # only build/verify the lmcache server + router-consumer envs

Real lmcache servers run from three dedicated environments, built on first use
and reused across sessions and runs:

    .nox/lmcache-server-056      torch==2.13.0 + lmcache==0.5.6
    .nox/lmcache-server-052      torch==2.13.0 + lmcache==0.5.2
    .nox/lmcache-server-057rc2   torch==2.13.0 + lmcache==0.5.7rc2 (grpc, OpenTelemetry, ...)

(``.installed`` marks a finished build; about 1.5-2 min each from PyPI).

Two router-consumer environments are built the same way for the tests of
``lmkv_async.vllm_events`` (tests/test_dynamo.py, tests/test_vllm_hash.py):

    .nox/dynamo-indexer   ai-dynamo + ai-dynamo-runtime 1.6.1 (--no-deps) + pydantic
    .nox/vllm-hash        the vllm 0.33.0 wheel (--no-deps) + what its hashing imports
    .nox/vllm-router      vllm-router 0.1.17

exported as ``LMKV_DYNAMO_PYTHON`` / ``LMKV_VLLM_HASH_PYTHON`` / ``LMKV_VLLM_ROUTER_PYTHON``.
lmcache is never installed into a library session. Their interpreters are
exported as ``LMKV_LMCACHE_PYTHON_056`` / ``_052`` / ``_057RC2``, which
``lmkv_async.testing.find_server_python`` reads (nothing else finds them).

torch is always installed as ``torch==2.13.0`` first (the local CPU wheel);
a bare ``torch`` requirement would pull a multi-GB CUDA build.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"  # not uv: it ignores the local torch wheel
nox.options.sessions = ["lint", "tests"]

ROOT = Path(__file__).resolve().parent
CONSTRAINTS = str(ROOT / "constraints" / "ci.txt")
TORCH = "torch==2.13.0"
SERVER_VERSIONS = ("0.5.6", "0.5.2", "0.5.7rc2")
SERVER_ENV_ROOT = ROOT / ".nox"


# --------------------------------------------------------------------------- server envs


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Serialise builders across concurrent nox runs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def server_env_python(session: nox.Session, version: str) -> str:
    """Build ``.nox/lmcache-server-<tag>`` if needed; return its interpreter.

    The env is a plain venv made with the interpreter running nox (it must be
    CPython 3.11 for the local torch wheel). ``.installed`` holds the spec it
    was built with; a missing or different marker means rebuild from scratch.
    """
    tag = version.replace(".", "")
    env_dir = SERVER_ENV_ROOT / f"lmcache-server-{tag}"
    python = env_dir / "bin" / "python"
    marker = env_dir / ".installed"
    spec = f"lmcache=={version} {TORCH}"
    with _file_lock(SERVER_ENV_ROOT / f"lmcache-server-{tag}.lock"):
        if marker.exists() and python.exists() and marker.read_text().strip() in ("", spec):
            session.log(f"lmcache {version} server env: reusing {env_dir}")
            return str(python)
        session.log(f"building lmcache {version} server env in {env_dir}")
        t0 = time.monotonic()
        if env_dir.exists():
            shutil.rmtree(env_dir)
        session.run(sys.executable, "-m", "venv", str(env_dir), external=True)
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        session.run(*pip, TORCH, external=True)
        session.run(*pip, f"lmcache=={version}", TORCH, external=True)
        session.run(str(python), "-c", "import lmcache, torch", external=True, silent=True)
        marker.write_text(spec + "\n")
        session.log(f"lmcache {version} server env built in {time.monotonic() - t0:.0f}s")
        return str(python)


def server_envs(session: nox.Session) -> dict[str, str]:
    """Build both server envs; return the env vars that point the library at them."""
    env: dict[str, str] = {}
    for version in SERVER_VERSIONS:
        var = f"LMKV_LMCACHE_PYTHON_{version.replace('.', '').upper()}"
        env[var] = server_env_python(session, version)
    return env


# --------------------------------------------------------------------------- consumer envs
# Real third-party consumers of lmkv_async.vllm_events, each in its own venv built
# like the server envs (never a library session): Dynamo's standalone KV indexer
# and vLLM's own block-hash code. Their interpreters are exported to the tests as
# LMKV_DYNAMO_PYTHON / LMKV_VLLM_HASH_PYTHON; a test that needs one FAILS without it.

DYNAMO_VERSION = "1.6.1"
VLLM_VERSION = "0.33.0"

# What `python -m dynamo.indexer` imports at start-up (measured: only pydantic, in the
# range ai-dynamo-runtime pins; msgspec and pyzmq are what its Python side lists).
DYNAMO_STEPS: tuple[tuple[str, ...], ...] = (
    ("--no-deps", f"ai-dynamo=={DYNAMO_VERSION}", f"ai-dynamo-runtime=={DYNAMO_VERSION}"),
    ("pydantic>=2.10.6,<=2.13.5", "msgspec>=0.19", "pyzmq>=26"),
)
# vllm.v1.core.kv_cache_utils (hash_block_tokens, init_none_hash) imports vllm.config
# and friends: these are the packages that import chain needs (measured one by one),
# with the wheel itself --no-deps (its pins want a CUDA torch).
VLLM_HASH_STEPS: tuple[tuple[str, ...], ...] = (
    (TORCH,),
    ("--no-deps", f"vllm=={VLLM_VERSION}"),
    (TORCH, "cbor2", "packaging", "pydantic", "regex", "numpy", "psutil", "pyzmq", "urllib3",
     "transformers", "aiohttp", "requests", "openai-harmony", "openai", "pillow", "pybase64",
     "cachetools", "msgspec", "cloudpickle", "uvloop", "py-cpuinfo", "prometheus-client",
     "xgrammar", "fastapi", "partial-json-parser", "llguidance"),
)

# vllm-router (the vLLM project's Rust router): its kv_aware policy subscribes to
# vLLM KV-event streams; the wheel's own dependencies are small (fastapi, aiohttp, ...).
VLLM_ROUTER_STEPS: tuple[tuple[str, ...], ...] = (("vllm-router==0.1.17",),)


def tool_env_python(session: nox.Session, name: str, steps: tuple[tuple[str, ...], ...],
                    check: str) -> str:
    """Build ``.nox/<name>`` (pip install each step in order) if needed; return its python.

    Same contract as :func:`server_env_python`: ``.installed`` holds the spec it was
    built with, a lock serialises concurrent builders, ``check`` must import.
    """
    env_dir = SERVER_ENV_ROOT / name
    python = env_dir / "bin" / "python"
    marker = env_dir / ".installed"
    spec = " | ".join(" ".join(step) for step in steps)
    with _file_lock(SERVER_ENV_ROOT / f"{name}.lock"):
        if marker.exists() and python.exists() and marker.read_text().strip() == spec:
            session.log(f"{name} env: reusing {env_dir}")
            return str(python)
        session.log(f"building the {name} env in {env_dir}")
        t0 = time.monotonic()
        if env_dir.exists():
            shutil.rmtree(env_dir)
        session.run(sys.executable, "-m", "venv", str(env_dir), external=True)
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        for step in steps:
            session.run(*pip, *step, external=True)
        session.run(str(python), "-c", check, external=True, silent=True)
        marker.write_text(spec + "\n")
        session.log(f"{name} env built in {time.monotonic() - t0:.0f}s")
        return str(python)


def consumer_envs(session: nox.Session) -> dict[str, str]:
    """Build the router-consumer envs; return the env vars that point the tests at them."""
    return {
        "LMKV_DYNAMO_PYTHON": tool_env_python(
            session, "dynamo-indexer", DYNAMO_STEPS, "import dynamo.llm, dynamo.indexer"),
        "LMKV_VLLM_HASH_PYTHON": tool_env_python(
            session, "vllm-hash", VLLM_HASH_STEPS,
            "from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash; "
            "from vllm.utils.hashing import sha256_cbor"),
        "LMKV_VLLM_ROUTER_PYTHON": tool_env_python(
            session, "vllm-router", VLLM_ROUTER_STEPS, "import vllm_router.launch_router"),
    }


# --------------------------------------------------------------------------- helpers


def install_package(session: nox.Session, extra: str = "") -> None:
    """torch (local CPU wheel) first, then the package itself, built from this tree.

    ``--force-reinstall --no-deps`` rebuilds the C extension on a reused venv
    even when the version number did not change.
    """
    session.install("-c", CONSTRAINTS, TORCH)
    session.install("-c", CONSTRAINTS, f".{extra}")
    session.install("--no-deps", "--force-reinstall", ".")


#: pytest-xdist workers for ``nox -s tests`` (``$LMKV_TEST_WORKERS``; 0 runs in one
#: process). The suite mostly waits on servers (start-up, reap timeouts, deadlines), so two
#: workers on CI's 2 cores about halve its wall time; ``-n`` after ``--`` overrides this.
TEST_WORKERS = os.environ.get("LMKV_TEST_WORKERS", "2")


def _pytest_args(session: nox.Session, marker: str, workers: str = "0") -> list[str]:
    """pytest argv: paths made absolute (we run from a temp dir), default marker first."""
    args: list[str] = []
    has_path = False
    for arg in session.posargs:
        candidate = ROOT / arg.split("::", 1)[0]
        if not arg.startswith("-") and candidate.exists():
            args.append(str(ROOT / arg))
            has_path = True
        else:
            args.append(arg)
    return [
        "--import-mode=importlib",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(ROOT),
        "-c",
        str(ROOT / "pyproject.toml"),
        "-m",
        marker,  # a later -m in posargs overrides this one
        # worksteal: an idle worker takes queued tests from a busy one (the long
        # fault and fleet tests would otherwise end the run on one worker)
        *(["-n", workers, "--dist", "worksteal"] if workers != "0" else ["-p", "no:xdist"]),
        *args,  # a later -n in posargs overrides the one above
        *([] if has_path else [str(ROOT / "tests")]),
    ]


def run_pytest(session: nox.Session, marker: str, workers: str = "0") -> None:
    """Run pytest against the installed package, from a directory outside the source tree.

    Exit code 5 ("no tests collected") fails the session like any non-zero code.
    """
    install_package(session, "[test]")
    env = server_envs(session)
    env.update(consumer_envs(session))
    tmp = Path(session.create_tmp())
    logs = tmp / "server-logs"
    shutil.rmtree(logs, ignore_errors=True)
    env.update(
        {
            "LMKV_REQUIRE_INSTALLED": "1",
            "LMKV_SERVER_LOG_DIR": str(logs),
            "PYTHONDONTWRITEBYTECODE": "1",
        }
    )
    session.chdir(tmp)
    # -P: never put the current directory on sys.path (belt and braces; we are in tmp).
    session.run("python", "-P", "-m", "pytest", *_pytest_args(session, marker, workers),
                env=env)


# --------------------------------------------------------------------------- sessions


@nox.session(reuse_venv=True)
def tests(session: nox.Session) -> None:
    """The test suite minus soak tests, on TEST_WORKERS processes (pytest args after --)."""
    run_pytest(session, "not soak", TEST_WORKERS)


@nox.session(reuse_venv=True)
def soak(session: nox.Session) -> None:
    """Long-running load tests (pytest -m soak)."""
    run_pytest(session, "soak")


@nox.session(reuse_venv=True)
def lint(session: nox.Session) -> None:
    """ruff check on the repo, mypy --strict on lmkv_async."""
    install_package(session, "[lint]")
    session.run("ruff", "check", ".")
    session.run("mypy", "--strict", "lmkv_async")


@nox.session(reuse_venv=True)
def demo(session: nox.Session) -> None:
    """examples/demo.py (it starts its own local server; ``-- --version 0.5.7rc2``)."""
    install_package(session)
    env = server_envs(session)
    session.chdir(session.create_tmp())
    session.run("python", "-P", str(ROOT / "examples" / "demo.py"), *session.posargs, env=env)


@nox.session(reuse_venv=True)
def bench(session: nox.Session) -> None:
    """Every benchmarks/bench_*.py runner (args after -- go to each runner)."""
    install_package(session, "[bench]")  # matplotlib, for report.py's charts
    env = server_envs(session)
    runners = sorted((ROOT / "benchmarks").glob("bench_*.py"))
    if not runners:
        session.error("no benchmarks/bench_*.py runner found")
    for runner in runners:
        session.run("python", str(runner), *session.posargs, env=env)
    # docs/benchmarks.md and its charts (docs/benchmarks*.png) from the result files
    session.run("python", str(ROOT / "benchmarks" / "report.py"), env=env)


@nox.session(reuse_venv=True)
def docs(session: nox.Session) -> None:
    """The docs site: mkdocs + material, API reference by mkdocstrings, built --strict.

    Writes ``site/`` (args after -- go to ``mkdocs build``, e.g. ``--site-dir DIR``).
    The package is installed like everywhere else so that griffe sees the same
    modules a user gets; it reads the sources statically and needs no server.
    """
    install_package(session, "[docs]")
    session.run("mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session(name="server-envs", python=False)
def server_envs_session(session: nox.Session) -> None:
    """Only build (or verify) the lmcache server and router-consumer environments."""
    for key, value in consumer_envs(session).items():
        session.log(f"{key}={value}")
    for key, value in server_envs(session).items():
        out = subprocess.run(
            [value, "-c", "import lmcache; print(lmcache.__version__)"],
            capture_output=True,
            text=True,
            env={**os.environ, "DO_NOT_TRACK": "1", "LMCACHE_TRACK_USAGE": "false"},
        )
        session.log(f"{key}={value} (lmcache {out.stdout.strip() or '?'})")


@nox.session(reuse_venv=True, venv_params=["--system-site-packages"])
def gpu(session: nox.Session) -> None:
    """GPU tests (pytest -m gpu, tests/test_gpu.py) on a CUDA machine; not part of CI.

    The venv sees the machine's own CUDA build of torch (system site packages)
    instead of the CPU pin, so torch is never installed here. Fails when CUDA is
    not available rather than reporting skipped tests as a pass.
    """
    session.install("-c", CONSTRAINTS, "pytest", "hypothesis", "pyzmq", "httpx", "anyio",
                    "msgpack")
    session.install("--no-deps", "--force-reinstall", ".")
    session.run("python", "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() "
                "else 'nox -s gpu needs a CUDA device')")
    tmp = Path(session.create_tmp())
    session.chdir(tmp)
    # Only tests/test_gpu.py unless paths are given (the other modules need the test
    # extras); 0 tests selected (exit 5, e.g. no CUDA) fails the session.
    args = _pytest_args(session, "gpu")
    if args[-1] == str(ROOT / "tests"):
        args[-1] = str(ROOT / "tests" / "test_gpu.py")
    session.run("python", "-P", "-m", "pytest", *args,
                env={"LMKV_REQUIRE_INSTALLED": "1", "PYTHONDONTWRITEBYTECODE": "1"})
