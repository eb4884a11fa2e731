"""The output pool behind retrieve() without out=: reuse only memory nobody holds."""

from __future__ import annotations

import torch

from lmkv_async.memory import OutputPool

SHAPE = (2, 4, 1024, 256)  # 4 MiB of bf16


def test_reuses_a_freed_mapping_and_keeps_live_ones_apart() -> None:
    pool = OutputPool(max_bytes=64 << 20)
    a = pool.empty(SHAPE, torch.bfloat16)
    a.fill_(1.0)
    b = pool.empty(SHAPE, torch.bfloat16)  # a is alive: must not share memory
    assert b.data_ptr() != a.data_ptr()
    b.fill_(2.0)
    assert bool((a == 1.0).all())
    ptr = a.data_ptr()
    view = a[:, :, :8]
    del a
    c = pool.empty(SHAPE, torch.bfloat16)  # a view of a is still alive
    assert c.data_ptr() != ptr
    c.fill_(3.0)
    assert bool((view == 1.0).all())
    del view
    d = pool.empty(SHAPE, torch.bfloat16)  # now a's mapping is free again
    assert d.data_ptr() == ptr
    assert pool.hits == 1 and pool.misses == 3
    assert d.shape == SHAPE and d.dtype == torch.bfloat16


def test_respects_its_byte_limit_and_small_requests_bypass_it() -> None:
    pool = OutputPool(max_bytes=8 << 20)
    tensors = [pool.empty(SHAPE, torch.float32) for _ in range(3)]  # 8 MiB each
    assert pool.pooled_bytes <= 8 << 20
    assert len({t.data_ptr() for t in tensors}) == 3
    del tensors
    small = pool.empty((2, 2, 16, 16), torch.bfloat16)
    assert small.numel() == 2 * 2 * 16 * 16
    pool.clear()
    assert pool.pooled_bytes == 0
