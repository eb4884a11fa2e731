"""Client-side input checks, run before any server traffic.

The server answers bad input with silence (a timeout), or worse, with bogus
objects on 0.5.2, so everything that can be checked here is (compat.md §12.7).
"""

from __future__ import annotations

import math
import operator
from array import array
from collections.abc import Sequence

import torch

from .errors import InvalidInputError, LayoutMismatchError
from .layout import KVLayout
from .wire.keys import MAX_SALT_LEN, SALT_FORBIDDEN

__all__ = ["check_kv", "check_salt", "check_timeout", "check_tokens"]

TOKEN_LIMIT = 2**32
_PLAIN_INT = {int}
# array("I") is 4 bytes (0 <= x < 2**32) on every Linux ABI we run on
assert array("I").itemsize == 4
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)

Tokens = Sequence[int] | torch.Tensor


def check_tokens(tokens: Tokens) -> list[int]:
    """Return the tokens as a list of ints in ``[0, 2**32)``; raise on anything else."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.dtype not in _INT_DTYPES:
            raise InvalidInputError(
                f"tokens tensor must be 1-D of an integer dtype, got {tuple(tokens.shape)} "
                f"{tokens.dtype}"
            )
        if tokens.numel() == 0:
            raise InvalidInputError("tokens must not be empty")
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= TOKEN_LIMIT:
            raise InvalidInputError(f"token ids must be in [0, 2**32); got range [{lo}, {hi}]")
        out: list[int] = tokens.tolist()
        return out
    if _is_array_like(tokens):
        # NumPy and friends, duck-typed so numpy is never imported: a 1-D array of
        # an integer kind ("i" signed, "u" unsigned); tolist() gives Python ints.
        kind = getattr(getattr(tokens, "dtype", None), "kind", None)
        if getattr(tokens, "ndim", None) != 1 or kind not in ("i", "u"):
            raise InvalidInputError(
                f"tokens array must be 1-D of an integer dtype, got shape "
                f"{getattr(tokens, 'shape', '?')} dtype {getattr(tokens, 'dtype', '?')}")
        tokens = tokens.tolist()  # type: ignore[attr-defined]
    if isinstance(tokens, (str, bytes, bytearray, memoryview)) or not isinstance(tokens, Sequence):
        raise InvalidInputError(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
    if len(tokens) == 0:
        raise InvalidInputError("tokens must not be empty")
    values = list(tokens)
    # Fast path (C loops only; this runs on every operation, ~20 us per 1024 tokens instead
    # of ~45): all plain ints, in range. array("I") raises for anything else.
    plain = set(map(type, values)) == _PLAIN_INT
    if plain:
        try:
            array("I", values)
        except OverflowError:
            pass  # out of range: the slow path below words the error
        else:
            return values
    if not plain:
        try:
            values = [_as_int(t) for t in values]
        except TypeError as exc:
            raise InvalidInputError(f"tokens must be ints: {exc}") from None
    if min(values) < 0 or max(values) >= TOKEN_LIMIT:
        raise InvalidInputError(
            f"token ids must be in [0, 2**32); got range [{min(values)}, {max(values)}]"
        )
    return values


def _is_array_like(obj: object) -> bool:
    return (hasattr(obj, "__array_interface__") and hasattr(obj, "tolist")
            and hasattr(obj, "dtype") and not isinstance(obj, torch.Tensor))


def _as_int(value: object) -> int:
    if isinstance(value, bool):
        raise TypeError("bool is not a token id")
    return operator.index(value)  # type: ignore[arg-type]


def check_salt(cache_salt: str) -> str:
    """``cache_salt``: a str of at most 128 chars without ``@ / \\ NUL``."""
    if not isinstance(cache_salt, str):
        raise InvalidInputError(f"cache_salt must be a str, got {type(cache_salt).__name__}")
    if len(cache_salt) > MAX_SALT_LEN:
        raise InvalidInputError(f"cache_salt is {len(cache_salt)} chars; at most {MAX_SALT_LEN}")
    bad = sorted(set(cache_salt) & SALT_FORBIDDEN)
    if bad:
        raise InvalidInputError(f"cache_salt contains forbidden characters {bad!r}")
    return cache_salt


def check_timeout(timeout: float | None, default: float) -> float:
    """``None`` means the context default; otherwise a positive finite number."""
    if timeout is None:
        return default
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise InvalidInputError(f"timeout must be a number of seconds, got {timeout!r}")
    if not math.isfinite(timeout) or timeout <= 0:
        raise InvalidInputError(f"timeout must be positive and finite, got {timeout!r}")
    return float(timeout)


def check_kv(kv: object, layout: KVLayout, num_tokens: int, *, what: str = "kv") -> torch.Tensor:
    """``[P, L, T, D]`` CPU or CUDA tensor of the layout's dtype with ``T == num_tokens``.

    The last dimension must be contiguous; other strides are free (views are fine).
    """
    if not isinstance(kv, torch.Tensor):
        raise InvalidInputError(f"{what} must be a torch.Tensor, got {type(kv).__name__}")
    expected = (layout.planes, layout.num_layers, num_tokens, layout.hidden_dim)
    if kv.device.type not in ("cpu", "cuda"):
        raise LayoutMismatchError(f"{what} must be a CPU or CUDA tensor, got device {kv.device}")
    if kv.dtype != layout.dtype:
        raise LayoutMismatchError(f"{what} dtype {kv.dtype} != layout dtype {layout.dtype}")
    if tuple(kv.shape) != expected:
        raise LayoutMismatchError(
            f"{what} shape {tuple(kv.shape)} != expected [P, L, T, D] = {expected}"
        )
    if kv.stride(3) != 1:
        raise LayoutMismatchError(f"{what} must have a contiguous last dimension")
    return kv


def check_out(out: object, layout: KVLayout, num_tokens: int) -> torch.Tensor:
    """A caller buffer ``[P, L, >=T, D]`` for ``retrieve(out=...)``."""
    if not isinstance(out, torch.Tensor):
        raise InvalidInputError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dim() != 4:
        raise LayoutMismatchError(f"out must be 4-D [P, L, T, D], got {tuple(out.shape)}")
    if out.shape[2] < num_tokens:
        raise LayoutMismatchError(
            f"out has room for {out.shape[2]} tokens; the full-chunk prefix has {num_tokens}"
        )
    return check_kv(out[:, :, :num_tokens], layout, num_tokens, what="out")


def check_paged(
    caches: object, block_ids: object, layout: KVLayout, num_tokens: int
) -> list[int]:
    """Per-layer HND caches ``[NB, P, NH, BS, HS]`` (``[NB, BS, D]`` for MLA) and a block table.

    Returns the block ids as a list; at least ``ceil(num_tokens / BS)`` are
    needed and each must be in ``[0, NB)``.
    """
    if isinstance(caches, torch.Tensor) or not isinstance(caches, Sequence):
        raise InvalidInputError("kv_caches must be a sequence of per-layer tensors")
    if len(caches) != layout.num_layers:
        raise LayoutMismatchError(
            f"kv_caches has {len(caches)} layers; the layout has {layout.num_layers}"
        )
    num_blocks: int | None = None
    device = caches[0].device if caches and isinstance(caches[0], torch.Tensor) else None
    for i, cache in enumerate(caches):
        if not isinstance(cache, torch.Tensor):
            raise InvalidInputError(f"kv_caches[{i}] is not a tensor")
        if layout.use_mla:
            tail: tuple[int, ...] = (layout.block_size, layout.hidden_dim)
        else:
            tail = (2, layout.num_kv_heads, layout.block_size, layout.head_dim)
        if cache.dim() != len(tail) + 1 or tuple(cache.shape[1:]) != tail:
            raise LayoutMismatchError(
                f"kv_caches[{i}] shape {tuple(cache.shape)} != [NB, *{list(tail)}]"
            )
        if (cache.dtype != layout.dtype or cache.device.type not in ("cpu", "cuda")
                or cache.device != device):
            raise LayoutMismatchError(
                f"kv_caches[{i}] must be a CPU (or CUDA, all layers on one device) "
                f"{layout.dtype} tensor, got {cache.device} {cache.dtype}"
            )
        if cache.stride(-1) != 1:
            raise LayoutMismatchError(f"kv_caches[{i}] must have a contiguous last dimension")
        if num_blocks is None:
            num_blocks = cache.shape[0]
        elif cache.shape[0] != num_blocks:
            raise LayoutMismatchError("all kv_caches layers must have the same number of blocks")
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1 or block_ids.dtype not in _INT_DTYPES:
            raise InvalidInputError("block_ids must be a 1-D integer tensor or a list of ints")
        ids: list[int] = block_ids.tolist()
    elif isinstance(block_ids, Sequence) and not isinstance(block_ids, (str, bytes)):
        try:
            ids = [_as_int(b) for b in block_ids]
        except TypeError as exc:
            raise InvalidInputError(f"block_ids must be ints: {exc}") from None
    else:
        raise InvalidInputError("block_ids must be a 1-D integer tensor or a list of ints")
    need = -(-num_tokens // layout.block_size)
    if len(ids) < need:
        raise InvalidInputError(f"{len(ids)} block ids for {num_tokens} tokens; need {need}")
    assert num_blocks is not None
    bad = [b for b in ids[:need] if not 0 <= b < num_blocks]
    if bad:
        raise InvalidInputError(f"block ids {bad[:5]} out of range [0, {num_blocks})")
    return ids
