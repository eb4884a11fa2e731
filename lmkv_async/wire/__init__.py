"""Sans-IO core of the LMCache MP protocol: bytes in, bytes out, no sockets.

* :mod:`.dialect`  - op-id tables per server release and version detection
* :mod:`.frames`   - request/reply frame encoding and decoding
* :mod:`.keys`     - ``IPCCacheServerKey`` and registration payload encoding
* :mod:`.messages` - typed, validated views of replies (slots, prepare results)
"""

from .dialect import DIALECT_052, DIALECT_056, Dialect
from .frames import NO_RESULT, Reply, decode_reply, encode_request, pack
from .keys import KeyEncoder, RegisterPayload, encode_register
from .messages import (
    PrepareRetrieve,
    PrepareStore,
    RegisterReply,
    Slot,
    SlotSpec,
    parse_prepare_retrieve,
    parse_prepare_store,
    parse_register,
)

__all__ = [
    "DIALECT_052",
    "DIALECT_056",
    "NO_RESULT",
    "Dialect",
    "KeyEncoder",
    "PrepareRetrieve",
    "PrepareStore",
    "RegisterPayload",
    "RegisterReply",
    "Reply",
    "Slot",
    "SlotSpec",
    "decode_reply",
    "encode_register",
    "encode_request",
    "pack",
    "parse_prepare_retrieve",
    "parse_prepare_store",
    "parse_register",
]
