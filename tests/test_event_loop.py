"""Outside both asyncio and trio (a bare coroutine driver) the entry points fail clearly.

On asyncio and trio the library runs natively (tests/test_trio.py). Here the coroutines
are driven by hand, as a loop that is neither would drive them: the first step must
raise a typed error that names what to do, before any traffic (and not
``RuntimeError: no running event loop`` from deep inside).
"""

from __future__ import annotations

import pytest
import torch

import lmkv_async as lmkv
from lmkv_async.errors import KVCacheError

LAYOUT = lmkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                       block_size=16)
# Nothing listens here: a connect attempt would time out instead of failing at once.
URL, HTTP = "tcp://127.0.0.1:9", "http://127.0.0.1:9"


def test_connect_outside_asyncio_is_a_typed_error() -> None:
    step = lmkv.connect(URL, HTTP, "m", layout=LAYOUT).__await__()
    with pytest.raises(KVCacheError, match=r"asyncio or trio event loop") as info:
        step.send(None)
    assert not isinstance(info.value, RuntimeError)


def test_fleet_outside_asyncio_is_a_typed_error() -> None:
    fleet = lmkv.Fleet({"a": (URL, HTTP)}, model_name="m", layout=LAYOUT)
    coro = fleet.open()
    with pytest.raises(KVCacheError, match=r"asyncio or trio event loop"):
        coro.send(None)
