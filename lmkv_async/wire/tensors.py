"""Inline tensor data (servers without SHM): pickle (<= 0.5.6) and the tensor envelope (0.5.7).

* **pickle**: servers send and receive ``pickle.dumps(list[torch.Tensor])``.
  Unpickling bytes from the network can run arbitrary code, so only the
  globals torch needs to rebuild plain CPU tensors are admitted, and the inner
  storage bytes (which torch would hand to ``torch.load(weights_only=False)``)
  are loaded with ``weights_only=True``.
* **envelope** (compat.md §14.3): msgpack ``{version: 1, tensors: [{dtype,
  shape, data}]}`` with ``dtype`` a torch name such as ``"bfloat16"`` and
  ``data`` the raw C-order bytes. The server rejects unknown fields, and so do we.

Anything malformed raises :class:`ProtocolError`. :func:`encode_inline` and
:func:`decode_inline` pick the codec from the dialect.
"""

from __future__ import annotations

import collections
import ctypes
import io
import pickle
import warnings
from collections.abc import Sequence
from typing import Any

import msgpack
import torch
import torch._utils

from ..errors import ProtocolError
from .dialect import Dialect

__all__ = [
    "decode_envelope",
    "decode_inline",
    "dumps_tensors",
    "encode_envelope",
    "encode_inline",
    "loads_tensors",
]


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


#: dtypes the envelope may carry (the server's own list is a superset).
_ENVELOPE_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16",
                 "int32", "int64", "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, name)
}
_TENSOR_FIELDS = frozenset({"dtype", "shape", "data"})


def encode_envelope(tensors: Sequence[torch.Tensor]) -> bytes:
    """Encode contiguous CPU tensors as a version-1 tensor envelope."""
    frames = []
    keep: list[torch.Tensor] = []  # alive until packed: the memoryviews point into them
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError("a tensor envelope carries CPU tensors only")
        name = str(t.dtype).removeprefix("torch.")
        if name not in _ENVELOPE_DTYPES:
            raise ValueError(f"dtype {t.dtype} cannot travel in a tensor envelope")
        c = t.contiguous()
        keep.append(c)
        nbytes = c.numel() * c.element_size()
        # A view of the tensor's memory (no numpy, no copy): msgpack copies it once.
        raw = memoryview((ctypes.c_char * nbytes).from_address(c.data_ptr())) if nbytes else b""
        frames.append({"dtype": name, "shape": list(c.shape), "data": raw})
    data: bytes = msgpack.packb({"version": 1, "tensors": frames}, use_bin_type=True)
    del keep
    return data


def decode_envelope(data: bytes) -> list[torch.Tensor]:
    """Decode a version-1 tensor envelope into CPU tensors (views of ``data``)."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"malformed tensor envelope: {exc!s}") from None
    if not isinstance(obj, dict) or set(obj) != {"version", "tensors"} or obj["version"] != 1:
        raise ProtocolError("tensor envelope must be {version: 1, tensors: [...]}")
    items = obj["tensors"]
    if not isinstance(items, list):
        raise ProtocolError("tensor envelope 'tensors' must be a list")
    out: list[torch.Tensor] = []
    for item in items:
        if not isinstance(item, dict) or set(item) != _TENSOR_FIELDS:
            raise ProtocolError("envelope tensor must be a map of exactly dtype, shape, data")
        dtype = _ENVELOPE_DTYPES.get(item["dtype"]) if isinstance(item["dtype"], str) else None
        shape, raw = item["shape"], item["data"]
        if dtype is None:
            raise ProtocolError(f"envelope tensor has an unknown dtype {item['dtype']!r}")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ProtocolError(f"envelope tensor shape must be a list of sizes: {shape!r}")
        if not isinstance(raw, (bytes, bytearray)):
            raise ProtocolError("envelope tensor data must be bytes")
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for d in shape:
            numel *= d
        if numel * itemsize != len(raw):
            raise ProtocolError(
                f"envelope tensor holds {len(raw)} bytes for shape {shape} of {item['dtype']}")
        if raw:
            with warnings.catch_warnings():
                # read-only bytes: the tensors are only ever copied from
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(raw, dtype=torch.uint8)
        else:
            flat = torch.empty(0, dtype=torch.uint8)
        out.append(flat.view(dtype).view(shape))
    return out


def encode_inline(d: Dialect, tensors: Sequence[torch.Tensor]) -> bytes:
    """The ``commit_store`` data for ``tensors`` in this release's inline codec."""
    if d.inline_codec == "envelope":
        return encode_envelope(tensors)
    return dumps_tensors(tensors)


def decode_inline(d: Dialect, data: bytes) -> list[torch.Tensor]:
    """Decode ``prepare_retrieve`` inline data in this release's codec."""
    if d.inline_codec == "envelope":
        return decode_envelope(data)
    return loads_tensors(data)
