"""Every request builder against the exact frames of the protocol reference (appendix A,
compat.md §4 and §14.2), per dialect. Pure unit tests: no server."""

from __future__ import annotations

import struct

import msgpack
import pytest

from lmkv_async.wire import DIALECT_052, DIALECT_056, DIALECT_057, requests
from lmkv_async.wire.dialect import Dialect
from lmkv_async.wire.frames import encode_request
from lmkv_async.wire.keys import KeyEncoder, RegisterPayload

ALL = [DIALECT_052, DIALECT_056, DIALECT_057]
IDS = [d.name for d in ALL]

# Appendix A: IPCCacheServerKey(model_name="m", world_size=1, worker_id=0, token_ids=(1,2,3),
# start=0, end=256, request_id="r", cache_salt="", request_configs=None, num_kv_readers=1)
KEY_056 = bytes.fromhex(
    "8a"
    "aa6d6f64656c5f6e616d65" "a16d"
    "aa776f726c645f73697a65" "01"
    "a9776f726b65725f6964" "00"
    "a9746f6b656e5f696473" "93010203"
    "a57374617274" "00"
    "a3656e64" "cd0100"
    "aa726571756573745f6964" "a172"
    "aa63616368655f73616c74" "a0"
    "af726571756573745f636f6e66696773" "c0"
    "ae6e756d5f6b765f72656164657273" "01"
)
# 0.5.7 (compat.md §14.3): field 4 is token_bytes, bin of big-endian uint32.
KEY_057 = KEY_056.replace(
    bytes.fromhex("a9746f6b656e5f696473" "93010203"),
    bytes.fromhex("ab746f6b656e5f6279746573" "c40c" "000000010000000200000003"),
)


def key(d: Dialect, worker_id: int | None = 0) -> bytes:
    return KeyEncoder(d, "m", 1, [1, 2, 3]).encode(
        prefix_len=3, start=0, end=256, request_id="r", worker_id=worker_id)


@pytest.mark.parametrize("d", ALL, ids=IDS)
def test_key_frames_per_dialect(d: Dialect) -> None:
    expected = KEY_057 if d is DIALECT_057 else KEY_056
    assert key(d) == expected
    # nil worker_id for lookup / free_lookup_locks
    assert key(d, None) == expected.replace(bytes.fromhex("a9776f726b65725f6964" "00"),
                                            bytes.fromhex("a9776f726b65725f6964" "c0"))


def test_token_bytes_are_big_endian_uint32() -> None:
    toks = [0, 1, 255, 256, 65535, 2**32 - 1]
    k = KeyEncoder(DIALECT_057, "m", 1, toks).encode(prefix_len=6, start=0, end=6,
                                                     request_id="r", worker_id=None)
    m = msgpack.unpackb(k, raw=False)
    assert "token_ids" not in m
    assert m["token_bytes"] == struct.pack(">6I", *toks)


def test_noop_and_end_session_match_appendix_a() -> None:
    req = requests.noop(DIALECT_056)
    assert encode_request(1, req.op_id, req.payloads) == [b"\x01", b"\x18"]
    req = requests.end_session(DIALECT_056, "r")
    assert req.op == "end_session" and req.op_id == 13
    assert req.payloads == (bytes.fromhex("a172"),)


@pytest.mark.parametrize("d", ALL, ids=IDS)
def test_lookup_frames(d: Dialect) -> None:
    k = key(d, None)
    req = requests.lookup(d, k, 1)
    assert req.op_id == d.op_ids["lookup"]
    assert req.payloads == (k, b"\x01")
    assert encode_request(7, req.op_id, req.payloads)[1] == bytes([d.op_ids["lookup"]])


@pytest.mark.parametrize("d", ALL, ids=IDS)
def test_prepare_store_has_skipped_chunks_only_on_057(d: Dialect) -> None:
    k = key(d)
    req = requests.prepare_store(d, k, 5)
    if d is DIALECT_057:
        assert req.payloads == (k, b"\x05", b"\x90")  # skipped_chunks=[] is 90 (§14.2)
    else:
        assert req.payloads == (k, b"\x05")


@pytest.mark.parametrize("d", ALL, ids=IDS)
def test_free_lookup_locks_third_frame(d: Dialect) -> None:
    k = key(d, None)
    req = requests.free_lookup_locks(d, k, 1)
    if d is DIALECT_057:
        assert req.payloads == (k, b"\x01", b"\x90")
        ranged = requests.free_lookup_locks(d, k, 1, [(0, 512)])
        assert ranged.payloads[2] == bytes.fromhex("9192 00 cd0200".replace(" ", ""))
    else:
        assert req.payloads == (k, b"\x01")
        with pytest.raises(ValueError):
            requests.free_lookup_locks(d, k, 1, [(0, 512)])


@pytest.mark.parametrize("d", ALL, ids=IDS)
def test_commit_and_retrieve_frames(d: Dialect) -> None:
    k = key(d)
    assert requests.commit_store(d, k, 5).payloads == (k, b"\x05", b"\xc4\x00")
    assert requests.commit_store(d, k, 5, b"xy").payloads == (k, b"\x05", b"\xc4\x02xy")
    assert requests.prepare_retrieve(d, k, 5).payloads == (k, b"\x05")
    assert requests.commit_retrieve(d, k, 5).payloads == (k, b"\x05")
    for op in ("commit_store", "prepare_retrieve", "commit_retrieve"):
        assert isinstance(d.op_id(op), int)


@pytest.mark.parametrize("d", ALL, ids=IDS)
def test_clear_force_frame(d: Dialect) -> None:
    req = requests.clear(d, force=True)
    assert req.payloads == ((b"\xc3",) if d.clear_takes_force else ())


@pytest.mark.parametrize("d", ALL, ids=IDS)
def test_prefetch_ping_register_frames(d: Dialect) -> None:
    assert requests.query_prefetch_status(d, "r").payloads == (b"\xa1r",)
    wait = requests.wait_prefetch_status(d, "r", 1)
    assert wait.payloads == (b"\xa1r", msgpack.packb(1.0))
    assert requests.ping(d, 9).payloads == (b"\x09",)
    assert requests.unregister(d, 9).payloads == (b"\x09",)
    payload = RegisterPayload(9, "m", 1, 16, 2, 256, "bfloat16", False, 256)
    reg = requests.register(d, payload)
    assert msgpack.unpackb(reg.payloads[0], raw=False) == {
        "instance_id": 9, "model_name": "m", "world_size": 1, "block_size": 16,
        "num_layers": 2, "hidden_dim_size": 256, "dtype_str": "bfloat16", "use_mla": False,
        "num_physical_slots": 256,
    }


def test_op_ids_per_table() -> None:
    assert DIALECT_052.op_ids["lookup"] == 5 and DIALECT_052.op_ids["noop"] == 21
    assert DIALECT_056.op_ids["lookup"] == 8 and DIALECT_056.op_ids["noop"] == 24
    assert DIALECT_057.op_ids == DIALECT_056.op_ids  # 0.5.7 keeps the frozen legacy ids
    assert requests.probe().op_id == 21 and requests.probe().payloads == ()


def test_subscribe_kv_events_is_named_and_checked() -> None:
    req = requests.subscribe_kv_events(DIALECT_057, 9, "m", 0, 16)
    assert req.op_id == "subscribe_kv_events"
    assert req.payloads == (b"\x09", b"\xa1m", b"\x00", b"\x10")
    with pytest.raises(KeyError):
        requests.subscribe_kv_events(DIALECT_052, 9, "m", 0, 16)
    for bad in ((0, 0), (0, 1025), (-1, 16)):
        with pytest.raises(ValueError):
            requests.subscribe_kv_events(DIALECT_056, 9, "m", *bad)


def test_every_request_has_at_least_uid_and_op() -> None:
    # A one-frame request kills a 0.5.7 request loop for good (compat.md §14.6).
    assert len(encode_request(1, requests.get_chunk_size(DIALECT_057).op_id, ())) == 2
