"""lmkv_async: an async-first client for the LMCache multiprocess KV-cache server.

Quick start::

    import torch, lmkv_async as lmkv
    layout = lmkv.KVLayout(num_layers=32, num_kv_heads=8, head_dim=128,
                           dtype=torch.bfloat16, block_size=16)
    async with lmkv.connect("tcp://127.0.0.1:5555", "http://127.0.0.1:8080",
                            model_name="m", layout=layout) as ctx:
        res = await ctx.store(kv, tokens)      # kv: [2, L, T, D]
        n = await ctx.lookup(tokens)           # cached prefix length, in tokens
        out = await ctx.retrieve(tokens)       # [2, L, n, D], or None on a miss
"""

from . import _logctx, wire
from .api import close, lookup, retrieve, store
from .context import AsyncKVContext, StoreResult, TransportMode, connect
from .errors import (
    AuthenticationError,
    ClosedError,
    CopyBoundsError,
    InvalidInputError,
    KVCacheError,
    LayoutMismatchError,
    LayoutNotFoundError,
    ProtocolError,
    ServerError,
    ServerTimeoutError,
    ServerUnavailableError,
    TransportUnavailableError,
    UnsupportedOperationError,
    UnsupportedServerError,
    ViewClosedError,
)
from .events import KVEventStream
from .fanout import ItemResult
from .fleet import Fleet, FleetLookup, FleetMember
from .layout import KVLayout
from .view import RetrieveView, ViewTensor
from .wire.events import KVRemoved, KVResync, KVStored

__version__ = "0.1.0"

_logctx.install()  # op / server / request_id on every log record of the package

__all__ = [
    "AsyncKVContext",
    "AuthenticationError",
    "ClosedError",
    "CopyBoundsError",
    "Fleet",
    "FleetLookup",
    "FleetMember",
    "InvalidInputError",
    "ItemResult",
    "KVCacheError",
    "KVEventStream",
    "KVLayout",
    "KVRemoved",
    "KVResync",
    "KVStored",
    "LayoutMismatchError",
    "LayoutNotFoundError",
    "ProtocolError",
    "RetrieveView",
    "ServerError",
    "ServerTimeoutError",
    "ServerUnavailableError",
    "StoreResult",
    "TransportMode",
    "TransportUnavailableError",
    "UnsupportedOperationError",
    "UnsupportedServerError",
    "ViewClosedError",
    "ViewTensor",
    "__version__",
    "close",
    "connect",
    "lookup",
    "retrieve",
    "store",
    "wire",
]
