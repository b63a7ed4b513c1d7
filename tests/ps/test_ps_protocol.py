"""The wire format: round trips and every kind of malformed message rejected with a reason."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clusterctl.ps.protocol import MAX_HEADER_BYTES, ProtocolError, decode, encode

pytestmark = pytest.mark.timeout(10)


def _hdr(**kw) -> bytes:
    return json.dumps({"v": 1, "op": "push", "seq": 1, "t": [], **kw}).encode()


def test_round_trip_is_zero_copy_on_send():
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    frames = encode({"op": "push", "seq": 3, "tid": 1}, {"w.block0": w, "b.block0": np.ones(2)})
    assert np.shares_memory(frames[1], w)  # the frame is a view of the caller's array
    msg = decode([bytes(memoryview(f)) if not isinstance(f, bytes) else f for f in frames])
    assert msg.op == "push" and msg.seq == 3 and msg.header["tid"] == 1
    assert msg.header["t"] == [["w.block0", "float32", 12], ["b.block0", "float64", 2]]
    np.testing.assert_array_equal(msg.tensors["w.block0"].to_array(), w.reshape(-1))
    np.testing.assert_array_equal(msg.tensors["b.block0"].to_array(), np.ones(2))


def _wire(frames):
    return [f if isinstance(f, bytes) else bytes(memoryview(f)) for f in frames]


def test_large_tensors_are_chunked_without_copies():
    w = np.arange(10, dtype=np.float32)  # 40 bytes -> chunks of 16, 16, 8
    frames = encode({"op": "push"}, {"w": w, "s": np.ones(2, np.float32)}, chunk_bytes=16)
    assert [memoryview(f).nbytes for f in frames[1:]] == [16, 16, 8, 8]
    assert np.shares_memory(np.frombuffer(frames[2], np.float32), w)
    msg = decode(_wire(frames))
    t = msg.tensors["w"]
    assert (t.size, t.nbytes, [off for off, _ in t.pieces]) == (10, 40, [0, 4, 8])
    np.testing.assert_array_equal(t.to_array(), w)
    np.testing.assert_array_equal(msg.tensors["s"].to_array(), np.ones(2))


def test_chunk_size_must_be_a_multiple_of_8():
    with pytest.raises(ProtocolError, match="chunk_bytes must be a positive multiple of 8, got 12"):
        encode({"op": "push"}, {"w": np.ones(4, np.float32)}, chunk_bytes=12)


def test_encode_rejects_int_tensors():
    with pytest.raises(ProtocolError, match="tensor 'i' has unsupported dtype int64"):
        encode({"op": "push"}, {"i": np.arange(3)})


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([], "empty message"),
        ([b"\xff\xfe garbage"], "header is not UTF-8 JSON"),
        ([b"not json"], "header is not UTF-8 JSON"),
        ([b"[1, 2]"], "header is not a JSON object"),
        ([json.dumps({"op": "push"}).encode()], "unsupported protocol version None (want 1)"),
        ([_hdr(op="rm -rf")], "unknown op 'rm -rf'"),
        ([_hdr(seq="x")], "seq must be a non-negative integer, got 'x'"),
        ([_hdr(seq=-1)], "seq must be a non-negative integer, got -1"),
        ([_hdr(tid=True)], "tid must be a non-negative integer, got True"),
        ([_hdr(step=1.5)], "step must be a non-negative integer, got 1.5"),
        ([_hdr(part="0")], "part must be a non-negative integer, got '0'"),
        ([_hdr(parts=[1])], "parts must be a non-negative integer, got [1]"),
        ([_hdr().replace(b'"seq": 1', b'"seq": ' + b"7" * 5000)],
         "header holds an integer of 5000 digits (limit 19)"),
        ([_hdr().replace(b'"seq": 1', b'"seq": -' + b"7" * 20)], "header holds an integer of 20 digits (limit 19)"),
        ([_hdr(t=[["w", "float32", 10 ** 30]])], "header holds an integer of 31 digits (limit 19)"),
        ([_hdr().replace(b'"seq": 1', b'"seq": NaN')], "header holds NaN, which is not a number a header may carry"),
        ([_hdr().replace(b'"seq": 1', b'"seq": -Infinity')],
         "header holds -Infinity, which is not a number a header may carry"),
        ([_hdr(seq="x" * 500)], "seq must be a non-negative integer, got 'xxxxxxxx"),
        ([_hdr(), b"\0" * 8], "tensor table accounts for 0 buffer frames but 1 followed"),
        ([_hdr(t=[["w", "float32", 2]])], "tensor table needs more than the 0 buffer frames that followed"),
        ([_hdr(t={"w": 1})], "tensor table 't' must be a list"),
        ([_hdr(c=12)], "chunk size must be a non-negative multiple of 8, got 12"),
        ([_hdr(c=8, t=[["w", "float32", 3]]), b"\0" * 8], "tensor table needs more than the 1 buffer frames"),
        ([_hdr(c=8, t=[["w", "float32", 3]]), b"\0" * 4, b"\0" * 8], "tensor 'w': frame has 4 bytes, header says 8"),
        ([_hdr(c=8, t=[["w", "float32", 3]]), b"\0" * 8, b"\0" * 8], "tensor 'w': frame has 8 bytes, header says 4"),
        ([_hdr(t=[["w", "float32", True]]), b"\0" * 4], "bad tensor table entry ['w', 'float32', True]"),
        ([_hdr(t=[["w", "int8", 8]]), b"\0" * 8], "bad tensor table entry ['w', 'int8', 8]"),
        ([_hdr(t=[["w", "float32", -1]]), b""], "bad tensor table entry ['w', 'float32', -1]"),
        ([_hdr(t=[["w", "float32", 3]]), b"\0" * 8], "tensor 'w': frame has 8 bytes, header says 12"),
        ([_hdr(t=[["w", "float32", 1], ["w", "float32", 1]]), b"\0" * 4, b"\0" * 4], "tensor 'w' appears twice"),
        ([b" " * (MAX_HEADER_BYTES + 1)], f"header frame is {MAX_HEADER_BYTES + 1} bytes (limit {MAX_HEADER_BYTES})"),
    ],
)
def test_malformed_messages_are_rejected(frames, message):
    with pytest.raises(ProtocolError) as err:
        decode(frames)
    assert str(err.value).startswith(message)


def test_replies_need_no_op():
    msg = decode([json.dumps({"v": 1, "ok": True, "seq": 9, "t": []}).encode()], request=False)
    assert msg.seq == 9 and msg.header["ok"] is True
