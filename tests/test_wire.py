"""Sans-IO tests of the wire layer against the frames of the protocol reference (appendix A)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmkv_async.errors import ProtocolError
from lmkv_async.wire import (
    DIALECT_052,
    DIALECT_056,
    NO_RESULT,
    KeyEncoder,
    RegisterPayload,
    SlotSpec,
    decode_reply,
    encode_register,
    encode_request,
    pack,
    parse_prepare_retrieve,
    parse_prepare_store,
    parse_register,
)
from lmkv_async.wire.dialect import (
    dialect_for_version,
    dialect_from_config,
    dialect_from_probe,
    parse_version,
)


def test_noop_frames_appendix_a() -> None:
    assert encode_request(1, DIALECT_056.op_id("noop"), []) == [b"\x01", b"\x18"]
    reply = decode_reply([b"\x01", b"\x18", bytes.fromhex("a24f4b")], expected_op=b"\x18")
    assert reply.result() == "OK"


def test_end_session_two_frame_reply() -> None:
    frames = encode_request(7, DIALECT_056.op_id("end_session"), [pack("r")])
    assert frames[1:] == [b"\x0d", bytes.fromhex("a172")]
    reply = decode_reply([frames[0], b"\x0d"], expected_op=b"\x0d")
    assert reply.result() is NO_RESULT


def test_key_encoding_matches_appendix_a_byte_for_byte() -> None:
    expected = bytes.fromhex(
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
    enc = KeyEncoder(DIALECT_056, "m", 1, [1, 2, 3])
    assert enc.encode(prefix_len=3, start=0, end=256, request_id="r", worker_id=0) == expected


def test_lookup_key_has_nil_worker_and_decodes_as_map() -> None:
    enc = KeyEncoder(DIALECT_056, "model", 1, list(range(600)), "tenant")
    frame = enc.encode(prefix_len=512, start=0, end=512, request_id="x", worker_id=None)
    decoded = msgpack.unpackb(frame)
    assert decoded["worker_id"] is None
    assert decoded["token_ids"] == list(range(512))
    assert decoded["cache_salt"] == "tenant"
    assert decoded["num_kv_readers"] == 1
    assert list(decoded) == [
        "model_name", "world_size", "worker_id", "token_ids", "start", "end",
        "request_id", "cache_salt", "request_configs", "num_kv_readers",
    ]


def test_op_tables_match_compat_section_12() -> None:
    order = ["lookup", "query_prefetch_status", "wait_prefetch_status", "free_lookup_locks",
             "end_session", "register_kv_cache_engine_driven_context",
             "unregister_kv_cache_engine_driven_context", "prepare_store", "commit_store",
             "prepare_retrieve", "commit_retrieve", "clear", "get_chunk_size", "ping", "noop"]
    assert [DIALECT_052.op_id(o) for o in order] == [5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 16, 17,
                                                     18, 19, 21]
    assert [DIALECT_056.op_id(o) for o in order] == [8, 9, 10, 12, 13, 14, 15, 16, 17, 18, 19, 20,
                                                     21, 22, 24]


def test_string_ops_only_from_dialects_that_name_them() -> None:
    # A string op kills a <= 0.5.5 request loop: only 0.5.6+ dialects hand one out.
    with pytest.raises(TypeError):
        encode_request(1, True, [])
    with pytest.raises(KeyError):
        DIALECT_052.op_id("subscribe_kv_events")
    assert DIALECT_056.op_id("subscribe_kv_events") == "subscribe_kv_events"
    assert all(isinstance(DIALECT_052.op_id(op), int) for op in DIALECT_052.op_ids)


@pytest.mark.parametrize(
    ("text", "dialect"),
    [("0.5.2-gcd2c0d6a", DIALECT_052), ('"0.5.6-g3e11e108"', DIALECT_056), ("0.5.1", DIALECT_052)],
)
def test_version_detection(text: str, dialect: object) -> None:
    version = parse_version(text)
    assert version is not None
    assert dialect_for_version(version) is dialect


def test_version_detection_fallbacks() -> None:
    assert parse_version("NA-gdeadbeef") is None
    assert dialect_for_version((0, 4, 7)) is None
    assert dialect_from_config({"mp": {"chunk_size": 256}}) is DIALECT_052
    assert dialect_from_config({"mp": {"session_ttl_seconds": 600, "enable": True}}) is DIALECT_056
    assert dialect_from_probe("OK") is DIALECT_052
    probe = dialect_from_probe(256)
    assert probe is not None and probe.op_ids == DIALECT_056.op_ids
    assert dialect_from_probe(None) is None


def test_reply_checks() -> None:
    with pytest.raises(ProtocolError, match="frame"):
        decode_reply([b"\x01"])
    with pytest.raises(ProtocolError, match="frames"):
        decode_reply([b"\x01", b"\x18", b"\xc0", b"\xc0"])
    with pytest.raises(ProtocolError, match="op"):
        decode_reply([b"\x01", b"\x19"], expected_op=b"\x18")
    with pytest.raises(ProtocolError, match="msgpack"):
        decode_reply([b"\x01", b"\x18", b"\xc1"]).result()


SPEC = SlotSpec(shape=(2, 2, 256, 128), dtype="bfloat16", itemsize=2, pool_size=1 << 30)


def _slot(offset: int, **kw: object) -> dict[str, object]:
    slot: dict[str, object] = {"offset": offset, "length": 262144, "shape": [2, 2, 256, 128],
                               "dtype": "bfloat16"}
    slot.update(kw)
    return slot


def test_prepare_store_reply_appendix_a() -> None:
    raw = {"context": {"slots": [_slot(1048576), _slot(1310720)], "chunk_indices": [0, 1]}}
    prep = parse_prepare_store(raw, SPEC, 2)
    assert prep.shm and [s.offset for s in prep.slots] == [1048576, 1310720]
    assert prep.chunk_indices == (0, 1)
    assert parse_prepare_store({"context": {"slots": [], "chunk_indices": []}}, SPEC, 2).slots == ()
    assert not parse_prepare_store({"context": {}}, None, 2).shm


@pytest.mark.parametrize(
    "bad",
    [
        _slot(-1),
        _slot((1 << 30) - 100),
        _slot(0, length=100),
        _slot(0, shape=[2, 2, 128, 128]),
        _slot(0, dtype="float32"),
        {**_slot(0), "offset": "0"},
        {"offset": 0},
        [1, 2, 3],
    ],
)
def test_bad_slot_descriptors_raise(bad: object) -> None:
    with pytest.raises(ProtocolError):
        parse_prepare_store({"context": {"slots": [bad], "chunk_indices": [0]}}, SPEC, 2)


def test_overlapping_and_out_of_range_chunks_raise() -> None:
    with pytest.raises(ProtocolError, match="overlap"):
        parse_prepare_store(
            {"context": {"slots": [_slot(0), _slot(1000)], "chunk_indices": [0, 1]}}, SPEC, 2)
    with pytest.raises(ProtocolError, match="range"):
        parse_prepare_store({"context": {"slots": [_slot(0)], "chunk_indices": [5]}}, SPEC, 2)
    with pytest.raises(ProtocolError, match="no SHM pool"):
        parse_prepare_store({"context": {"slots": [_slot(0)], "chunk_indices": [0]}}, None, 2)


def test_prepare_retrieve_replies() -> None:
    ok = parse_prepare_retrieve(
        {"success": True, "data": b"", "context": {"slots": [_slot(0), _slot(262144)]}}, SPEC, 2)
    assert ok.success and ok.shm and len(ok.slots) == 2
    with pytest.raises(ProtocolError, match="slots for"):
        parse_prepare_retrieve({"success": True, "data": b"", "context": {"slots": [_slot(0)]}},
                               SPEC, 2)
    pick = parse_prepare_retrieve({"success": True, "data": b"xx", "context": {}}, None, 2)
    assert not pick.shm and pick.data == b"xx"
    failed = parse_prepare_retrieve({"success": False, "data": b"", "context": {}}, None, 2)
    assert not failed.success


def test_register_reply_and_payload() -> None:
    assert parse_register({"shm_name": "lmcache_l1_pool_testpool", "pool_size": 1 << 30}).has_shm
    assert not parse_register({"shm_name": "", "pool_size": 0}).has_shm
    with pytest.raises(ProtocolError):
        parse_register({"shm_name": "../etc/passwd", "pool_size": 10})
    payload = msgpack.unpackb(encode_register(RegisterPayload(
        instance_id=5, model_name="m", world_size=1, block_size=16, num_layers=2,
        hidden_dim_size=128, dtype_str="bfloat16", use_mla=False, num_physical_slots=256)))
    assert payload["hidden_dim_size"] == 128 and payload["num_physical_slots"] == 256


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=5))
def test_reply_decoder_never_crashes_on_garbage(frames: list[bytes]) -> None:
    try:
        reply = decode_reply(frames, expected_op=frames[1] if len(frames) > 1 else None)
        reply.result()
    except ProtocolError:
        pass


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(["offset", "length", "shape", "dtype", "slots", "context",
                                       "chunk_indices", "success", "data"]) | st.text(max_size=4),
                      children, max_size=5),
    max_leaves=20,
)


@settings(max_examples=500, deadline=None)
@given(_json, st.integers(0, 4))
def test_reply_parsers_only_raise_protocol_error(raw: object, n: int) -> None:
    for parse in (parse_prepare_store, parse_prepare_retrieve):
        try:
            result = parse(raw, SPEC, n)
        except ProtocolError:
            continue
        for slot in result.slots:
            assert 0 <= slot.offset and slot.offset + slot.length <= SPEC.pool_size
