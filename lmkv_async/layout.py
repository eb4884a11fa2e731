"""KV geometry: :class:`KVLayout`, and its discovery from the server's ``/status``."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .errors import InvalidInputError, LayoutNotFoundError

__all__ = ["SUPPORTED_DTYPES", "KVLayout", "LayoutNotFoundError", "discover_layout"]

SUPPORTED_DTYPES: Mapping[torch.dtype, str] = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
}
_BY_NAME = {name: dtype for dtype, name in SUPPORTED_DTYPES.items()}


@dataclass(frozen=True)
class KVLayout:
    """The geometry of the KV cache a context moves.

    Tensors handed to ``store``/``retrieve`` are ``[P, L, T, D]`` with ``P = 2``
    (K and V; ``P = 1`` when ``use_mla``), ``L = num_layers`` and
    ``D = num_kv_heads * head_dim`` (index ``head * head_dim + d``). Paged
    engine caches are per-layer ``[NB, P, NH, BS, HS]`` (HND).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    block_size: int = 16
    use_mla: bool = False
    world_size: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInputError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise InvalidInputError(
                f"KVLayout.dtype must be one of {[str(d) for d in SUPPORTED_DTYPES]}, "
                f"got {self.dtype!r}"
            )

    @property
    def planes(self) -> int:
        """2 (K and V), or 1 for MLA."""
        return 1 if self.use_mla else 2

    @property
    def hidden_dim(self) -> int:
        """``D = num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    @property
    def dtype_name(self) -> str:
        """The dtype as the server names it (``"bfloat16"``)."""
        return SUPPORTED_DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        # dtype.itemsize (torch >= 2.1), not a throwaway tensor: this is on every op's path
        return int(self.dtype.itemsize)

    def chunk_shape(self, chunk_size: int) -> tuple[int, ...]:
        """Shape of one server object: ``[2, L, C, D]`` (``[L, C, D]`` for MLA)."""
        if self.use_mla:
            return (self.num_layers, chunk_size, self.hidden_dim)
        return (2, self.num_layers, chunk_size, self.hidden_dim)

    def token_bytes(self) -> int:
        """Bytes of KV per token across all layers."""
        return self.planes * self.num_layers * self.hidden_dim * self.itemsize


_SHAPE_RE = re.compile(r"^\s*(\d+)\s*x\s*\[([\d,\s]+)\]\s*$")


def _parse_group(entry: Mapping[str, Any]) -> KVLayout:
    layout = entry.get("kv_cache_layout") or {}
    groups = layout.get("kernel_groups") or []
    if len(groups) != 1:
        raise LayoutNotFoundError(
            f"registered layout has {len(groups)} kernel groups; exactly one is supported"
        )
    group = groups[0]
    match = _SHAPE_RE.match(str(group.get("engine_kv_concrete_shape", "")))
    fmt = str(group.get("engine_kv_format", ""))
    if match is None or not fmt.startswith("NL_X_"):
        raise LayoutNotFoundError(f"cannot parse registered layout {dict(group)!r}")
    num_layers = int(match.group(1))
    dims = [int(x) for x in match.group(2).split(",") if x.strip()]
    names = fmt[len("NL_X_") :].split("_")
    if len(names) != len(dims):
        raise LayoutNotFoundError(f"format {fmt} does not match shape {dims}")
    by_name = dict(zip(names, dims, strict=True))
    dtype_text = str(group.get("dtype", "")).removeprefix("torch.")
    if dtype_text not in _BY_NAME:
        raise LayoutNotFoundError(f"unsupported dtype {group.get('dtype')!r} in registered layout")
    is_mla = bool(group.get("is_mla", False)) or "TWO" not in by_name
    block = by_name.get("BS", group.get("tokens_per_block"))
    if "HS" not in by_name or block is None:
        raise LayoutNotFoundError(f"format {fmt} has no head size or block size")
    return KVLayout(
        num_layers=num_layers,
        num_kv_heads=by_name.get("NH", 1),
        head_dim=by_name["HS"],
        dtype=_BY_NAME[dtype_text],
        block_size=int(block),
        use_mla=is_mla,
        world_size=int(entry.get("world_size", 1)),
    )


def discover_layout(status: Mapping[str, Any], model_name: str) -> KVLayout:
    """Find the layout an engine registered for ``model_name`` in ``/status``.

    Reads ``cache_context_meta`` (lmcache-driven registrations, which carry the
    full geometry). Engine-driven registrations (``non_cuda_context_meta``) carry
    no geometry and cannot be used.
    """
    meta = status.get("cache_context_meta") or {}
    entries = [
        e for e in meta.values() if isinstance(e, Mapping) and e.get("model_name") == model_name
    ]
    if not entries:
        names = sorted({str(e.get("model_name")) for e in meta.values() if isinstance(e, Mapping)})
        raise LayoutNotFoundError(
            f"no engine has registered a layout for model {model_name!r} "
            f"(registered: {names or 'none'}); pass layout=KVLayout(...) explicitly"
        )
    layouts = {_parse_group(e) for e in entries}
    if len(layouts) > 1:
        raise LayoutNotFoundError(
            f"model {model_name!r} has {len(layouts)} different registered layouts; "
            "pass layout=KVLayout(...) explicitly"
        )
    return layouts.pop()
