"""The wire format: round trips and every kind of malformed message rejected with a reason."""

from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest

from clusterctl.ps.protocol import DTYPES, MAX_HEADER_BYTES, OPS, Message, ProtocolError, decode, encode

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


@pytest.mark.parametrize(
    ("frames", "request_", "message"),
    [
        ([b'{"v":1,"op":[1],"seq":1}'], True, "unknown op [1]"),  # a list is not hashable: was a TypeError
        ([b'{"v":1,"op":{"a":1},"seq":1}'], True, "unknown op {'a': 1}"),
        ([b'{"v":1,"ok":true,"seq":1,"t":[["a",[1],4]]}', b"\0" * 16], False, "bad tensor table entry ['a', [1], 4]"),
        ([b'{"v":1,"op":"push","seq":1,"t":[["a",{},4]]}', b"\0" * 16], True, "bad tensor table entry ['a', {}, 4]"),
        ([b'{"v":[1],"seq":1}'], False, "unsupported protocol version [1] (want 1)"),
        ([b'{"v":1,"op":"push","seq":1,"t":[["a","float32",1]]}', "\0\0\0\0"], True, "a frame is a str, not bytes"),
    ],
    ids=["request-op-list", "request-op-object", "reply-dtype-list", "request-dtype-object", "reply-version-list",
         "request-frame-str"],
)
def test_unhashable_or_mistyped_fields_are_protocol_errors(frames, request_, message):
    """A list where a name belongs made ``in OPS``/``in DTYPES`` raise TypeError, which a trainer does not catch."""
    with pytest.raises(ProtocolError) as err:
        decode(frames, request=request_)
    assert str(err.value) == message
    assert err.value.seq == 1  # the refusal still names the request it refuses


#: JSON values a mutation puts in place of any part of a valid header (the tensor table's entries included).
_ODD = [None, True, False, 0, -1, 7, 2 ** 63, 1.5, "", "x", "float32", "push", [], [1], ["a"], [[1]], {}, {"a": 1},
        ["w", [1], 4], [["w", "float32", 2]]]


def _valid_frames(rng: random.Random, request: bool) -> list[bytes]:
    """A valid request or reply of up to 3 tensors (chunked into several frames or not)."""
    tensors = {f"w{i}": np.arange(rng.randint(0, 9), dtype=rng.choice(sorted(DTYPES)))
               for i in range(rng.randint(0, 3))}
    if request:
        head = {"op": rng.choice(sorted(OPS)), "seq": rng.randint(0, 9), "tid": 0, "step": 1}
    else:
        head = {"ok": True, "seq": rng.randint(0, 9)}
    if rng.random() < 0.3:
        head.update(part=0, parts=1, off=[0] * len(tensors))
    return [bytes(memoryview(f).cast("B")) for f in encode(head, tensors, chunk_bytes=rng.choice([8, 16, 1024]))]


def _paths(node, path=()):
    """Every place in a JSON document, as a path of keys and indexes."""
    yield path
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        yield from _paths(child, path + (key,))


def _mutated(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    """``frames`` with one to three random changes to the header's JSON, its bytes or the buffer frames."""
    frames = list(frames)
    kind = rng.random()
    if kind < 0.5:  # a value anywhere in the header replaced, or a field added
        head = json.loads(frames[0])
        for _ in range(rng.randint(1, 3)):
            path = rng.choice(list(_paths(head)))
            value = json.loads(json.dumps(rng.choice(_ODD)))
            if not path:
                head[rng.choice(["v", "op", "seq", "t", "c", "part", "off", "ok"])] = value
                continue
            parent = head
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]] = value
        frames[0] = json.dumps(head).encode()
    elif kind < 0.75:  # bytes of the header changed, added or removed
        raw = bytearray(frames[0])
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(raw))
            edit = rng.random()
            if edit < 0.4:
                raw[i] = rng.randrange(256)
            elif edit < 0.7:
                raw[i:i] = bytes([rng.choice(b'{}[]",:0123456789-e.tfn\\ ')])
            else:
                del raw[i]
        frames[0] = bytes(raw)
    else:  # a buffer frame dropped, added or cut short
        i = rng.randint(1, len(frames))
        edit = rng.random()
        if edit < 0.3 and i < len(frames):
            del frames[i]
        elif edit < 0.6 or i == len(frames):
            frames.insert(i, bytes(rng.randint(0, 24)))
        else:
            frames[i] = frames[i][:rng.randrange(len(frames[i]) + 1)]
    return frames


def _check_valid(msg: Message, request: bool) -> None:
    """What decode promises about a message it returns."""
    assert isinstance(msg, Message) and isinstance(msg.header, dict) and msg.header["v"] == 1
    if request:
        assert msg.op in OPS
    assert isinstance(msg.seq, int) and msg.seq >= 0
    assert list(msg.tensors) == [entry[0] for entry in msg.header.get("t", [])]
    for t in msg.tensors.values():
        assert t.dtype.name in DTYPES and t.to_array().size == t.size


def test_mutated_valid_messages_decode_or_raise_protocol_error():
    """3,000 mutations of valid requests and replies, each decoded both ways: a valid Message or ProtocolError,
    never another exception (a TypeError escaped a trainer's reply loop as a traceback)."""
    rng = random.Random(20240611)
    outcomes = {"decoded": 0, "refused": 0}
    t0 = time.monotonic()
    for _ in range(3000):
        valid = _valid_frames(rng, request=rng.random() < 0.5)
        frames = _mutated(rng, valid)
        for request in (True, False):
            try:
                msg = decode(frames, request=request)
            except ProtocolError as exc:
                assert str(exc) and "\n" not in str(exc), frames[0]  # one line, saying something
                outcomes["refused"] += 1
                continue
            _check_valid(msg, request)
            outcomes["decoded"] += 1
    assert outcomes["decoded"] > 100 and outcomes["refused"] > 1000, outcomes  # both paths really exercised
    assert time.monotonic() - t0 < 8  # linear in the input: well inside the module's 10 s timeout
