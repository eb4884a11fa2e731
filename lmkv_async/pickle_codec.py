"""The pickle transfer format, decoded with a restricted unpickler.

Servers without SHM send and receive ``pickle.dumps(list[torch.Tensor])``.
Unpickling bytes from the network can run arbitrary code, so only the globals
torch needs to rebuild plain CPU tensors are admitted, and the inner storage
bytes (which torch would hand to ``torch.load(weights_only=False)``) are loaded
with ``weights_only=True``. Anything else raises :class:`ProtocolError`.
"""

from __future__ import annotations

import collections
import io
import pickle
from collections.abc import Sequence
from typing import Any

import torch
import torch._utils

from .errors import ProtocolError

__all__ = ["dumps_tensors", "loads_tensors"]


def _load_storage(data: bytes) -> Any:
    # Same job as torch.storage._load_from_bytes, minus weights_only=False.
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch.storage", "_load_from_bytes"): _load_storage,
    ("collections", "OrderedDict"): collections.OrderedDict,
}


class _TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise ProtocolError(
                f"refusing to unpickle {module}.{name}: only CPU tensors are accepted"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise ProtocolError("refusing a pickle with persistent ids")


def loads_tensors(data: bytes) -> list[torch.Tensor]:
    """Decode a server pickle into a list of CPU tensors, safely."""
    try:
        obj = _TensorUnpickler(io.BytesIO(data)).load()
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"malformed tensor pickle: {exc!s}") from None
    if not isinstance(obj, list) or not all(isinstance(t, torch.Tensor) for t in obj):
        raise ProtocolError(f"tensor pickle holds {type(obj).__name__}, not a list of tensors")
    for t in obj:
        if t.device.type != "cpu":
            raise ProtocolError("tensor pickle holds a non-CPU tensor")
    return obj


def dumps_tensors(tensors: Sequence[torch.Tensor]) -> bytes:
    """Encode chunk tensors for ``commit_store`` (each must be contiguous)."""
    return pickle.dumps(list(tensors))
