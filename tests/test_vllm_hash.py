"""The publisher's ``hash_mode="vllm"`` against vLLM 0.33.0's own hashing code.

vLLM runs from a test-only environment (``LMKV_VLLM_HASH_PYTHON``: nox builds
``.nox/vllm-hash`` from the vllm wheel, ``--no-deps``, plus what its hashing
imports); without it these tests FAIL. A subprocess there calls
``vllm.v1.core.kv_cache_utils.hash_block_tokens`` with ``sha256_cbor`` after
``init_none_hash`` (so ``PYTHONHASHSEED`` picks the seed as in vLLM) and
``maybe_convert_block_hash`` for the int form; nothing of vLLM is copied here.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

from lmkv_async._vllm_hash import (
    VLLM_DEFAULT_SEED,
    external_hash,
    vllm_block_hashes,
    vllm_none_hash,
)
from lmkv_async.vllm_events import VllmEventPublisher
from lmkv_async.wire.events import KVStored, VllmBlockStored
from lmkv_async.wire.hashing import chunk_hashes

VLLM_SCRIPT = r"""
import json, sys
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils as k
k.init_none_hash(sha256_cbor)
out = {"none": k.NONE_HASH.hex(), "cases": []}
for case in json.load(sys.stdin):
    B, toks, parent, hashes = case["block_size"], case["tokens"], None, []
    for i in range(len(toks) // B):
        parent = k.hash_block_tokens(sha256_cbor, parent, toks[i * B:(i + 1) * B])
        hashes.append(parent.hex())
    out["cases"].append({"hashes": hashes,
                         "ints": [k.maybe_convert_block_hash(bytes.fromhex(h)) for h in hashes]})
print(json.dumps(out))
"""


def vllm_python() -> str:
    py = os.environ.get("LMKV_VLLM_HASH_PYTHON", "")
    if not py or not Path(py).exists():
        pytest.fail("LMKV_VLLM_HASH_PYTHON is not set to the vllm-hash environment "
                    "(nox -s tests builds .nox/vllm-hash and exports it)")
    return py


def run_vllm(cases: list[dict[str, Any]], seed: str | None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    env.update(VLLM_LOGGING_LEVEL="ERROR", DO_NOT_TRACK="1", VLLM_NO_USAGE_STATS="1")
    out = subprocess.run([vllm_python(), "-c", VLLM_SCRIPT], input=json.dumps(cases),
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _cases() -> list[dict[str, Any]]:
    rng = random.Random(7)
    return [
        {"block_size": 16, "tokens": rng.choices(range(2**31), k=16 * 5 + 3)},
        # every CBOR integer width: <24, <2**8, <2**16, <2**32
        {"block_size": 4, "tokens": [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1] * 2},
        {"block_size": 256, "tokens": rng.choices(range(200_000), k=512)},
        {"block_size": 1, "tokens": [5]},
        {"block_size": 16, "tokens": [1] * 15},  # no full block
    ]


@pytest.mark.parametrize("seed", [None, "0", "4294967295"])  # PYTHONHASHSEED: an int
def test_vllm_mode_equals_vllms_own_block_hashes(seed: str | None) -> None:
    cases = _cases()
    got = run_vllm(cases, seed)
    mine = VLLM_DEFAULT_SEED if seed is None else seed
    assert got["none"] == vllm_none_hash(mine).hex()
    for case, theirs in zip(cases, got["cases"], strict=True):
        ours = vllm_block_hashes(case["tokens"], case["block_size"], seed=mine)
        assert [h.hex() for h in ours] == theirs["hashes"]
        assert [external_hash(h, "int") for h in ours] == theirs["ints"]
    assert any(c["hashes"] for c in got["cases"])  # something was compared


class _Fleet:
    chunk_size = 64
    model_name = "m"

    def __init__(self) -> None:
        self._own_store_listeners: list[Any] = []


class _Member:
    name = "s"

    def __init__(self) -> None:
        self.fleet = _Fleet()


def test_publisher_vllm_mode_announces_what_vllm_computes() -> None:
    """A 3-chunk store (records out of order) in ``vllm`` mode at B=16: the announced
    hashes are vLLM's hashes of the whole prompt, block by block, chained across chunks."""
    C, B = 64, 16
    toks = random.Random(3).choices(range(100_000), k=3 * C)
    hs = chunk_hashes(toks, C)
    recs = [KVStored(i, "m", (hs[i],), hs[i - 1] if i else None,
                     tuple(toks[i * C:(i + 1) * C]), "CPU") for i in range(3)]
    pub = VllmEventPublisher(_Member(), endpoint="inproc://x",  # type: ignore[arg-type]
                             block_size=B, hash_mode="vllm", hash_seed="42")
    evs = pub.translate([recs[2], recs[0], recs[1]])
    assert all(isinstance(e, VllmBlockStored) for e in evs)
    sent = [h for e in evs for h in e.block_hashes]  # type: ignore[union-attr]
    theirs = run_vllm([{"block_size": B, "tokens": toks}], "42")["cases"][0]["ints"]
    assert sent == theirs
    assert [e.parent_block_hash for e in evs] == [  # type: ignore[union-attr]
        None, theirs[C // B - 1], theirs[2 * C // B - 1]]
