"""Sans-IO core of the LMCache MP protocol: bytes in, bytes out, no sockets.

* :mod:`.dialect`  - per-release wire facts, capabilities, the version policy
* :mod:`.frames`   - request/reply frame encoding and decoding
* :mod:`.keys`     - ``IPCCacheServerKey`` and registration payload encoding
* :mod:`.requests` - one builder per operation: the exact frames it sends
* :mod:`.replies`  - typed, validated views of replies (slots, prepare results)
* :mod:`.tensors`  - inline tensor data: pickle (<= 0.5.6) and the 0.5.7 envelope

Only this package imports msgpack or assembles payload frames.
"""

from . import requests
from .dialect import DIALECT_052, DIALECT_056, DIALECT_057, Dialect
from .frames import NO_RESULT, Reply, decode_reply, encode_request, pack
from .keys import KeyEncoder, RegisterPayload, encode_register
from .replies import (
    PrepareRetrieve,
    PrepareStore,
    RegisterReply,
    Slot,
    SlotSpec,
    parse_prepare_retrieve,
    parse_prepare_store,
    parse_register,
)
from .requests import Request

__all__ = [
    "DIALECT_052",
    "DIALECT_056",
    "DIALECT_057",
    "NO_RESULT",
    "Dialect",
    "KeyEncoder",
    "PrepareRetrieve",
    "PrepareStore",
    "RegisterPayload",
    "RegisterReply",
    "Reply",
    "Request",
    "Slot",
    "SlotSpec",
    "decode_reply",
    "encode_register",
    "encode_request",
    "pack",
    "parse_prepare_retrieve",
    "parse_prepare_store",
    "parse_register",
    "requests",
]
