"""Wire format between trainers and pservers: one small JSON header frame, then one raw frame per tensor.

A request is a ZeroMQ multipart message ``[header, buf_0, buf_1, ...]``. The header is a UTF-8 JSON
object::

    {"v": 1, "op": "push_pull", "seq": 7, "tid": 0, "step": 12,
     "t": [["w.block0", "float32", 8192], ...],     # one entry per following frame
     ...op-specific fields...}

Each buffer frame is the tensor's raw little-endian bytes, sent with ``copy=False`` and received as a
``zmq.Frame`` that NumPy views without copying. Replies use the same layout with ``"ok": true`` or
``"ok": false, "code": ..., "error": ...``.

Authentication is not in these frames: it is the connection's (auth.py, door.py). Every connection
runs ZeroMQ's CURVE with keys derived from the job token, which encrypts and authenticates every frame
with a per-connection nonce sequence; a pserver sees no frame of a peer that has not proved the key.

Every number in a header is bounded before use: integers of at most 19 digits (|n| < 10**19, so a
5,000-digit ``seq`` is a ``bad_request``, not an internal error), no NaN or Infinity constants, and each
field's own range (``seq``, ``tid``, ``step``, ``part``, ``parts``, ``off``, ``c``, tensor sizes: >= 0).

Pipelined push_pull (async mode) uses the same layout: each request carries a piece of at most one
chunk of each listed block, with ``"part": i`` and ``"off": [element offset of each tensor in its
block, ...]``; the reply echoes both and carries the updated pieces (see docs/ps.md, "Protocol").
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import ProtocolError, PsConfigError

__all__ = [
    "PIPELINE_ENV",
    "env_flag",
    "quoted",
    "DTYPES",
    "MAX_HEADER_BYTES",
    "MAX_FRAME_BYTES",
    "MAX_TIMEOUT",
    "MAX_WIRE_FRAME_BYTES",
    "OPS",
    "PROTOCOL_VERSION",
    "Message",
    "decode",
    "encode",
    "error_frames",
    "finite_float",
]

PROTOCOL_VERSION = 1
#: Requests a pserver understands.
OPS = frozenset({"ping", "init", "pull", "push", "push_pull", "save", "load", "complete", "abort"})
#: Tensor dtypes allowed on the wire (anything else is rejected before touching the buffers).
DTYPES = frozenset({"float16", "float32", "float64"})
#: A header frame's limit: its tensor table names every block of a request (an `init` of a model with thousands
#: of parameter tensors: ~80 bytes each), so it is one chunk's default size, which frames may have anyway.
MAX_HEADER_BYTES = 4 << 20
#: The longest timeout (seconds, about 116 days) a trainer or pserver takes: "never" for a job, and far below
#: what a poll in milliseconds or a C long can hold (1e308 or 1e17 ended in OverflowError).
MAX_TIMEOUT = 1e7
CHUNK_ENV = "CLUSTERCTL_PS_CHUNK_BYTES"
DEFAULT_CHUNK_BYTES = 4 << 20
MAX_CHUNK_BYTES = 1 << 30


def chunk_bytes_ok(value: int) -> bool:
    """Whether `value` is a chunk size the job may set: a positive multiple of 8, at most MAX_CHUNK_BYTES."""
    return 8 <= value <= MAX_CHUNK_BYTES and value % 8 == 0


def _chunk_bytes(raw: str | None) -> int:
    """CHUNK_ENV's value, or the default where it is not a sane one: ps.env refuses such a value in one line, where
    a pserver or a trainer reads its environment (never a traceback at this import)."""
    try:
        value = int(raw or DEFAULT_CHUNK_BYTES)
    except ValueError:
        return DEFAULT_CHUNK_BYTES
    return value if chunk_bytes_ok(value) else DEFAULT_CHUNK_BYTES


#: Tensors larger than this go out as several frames: small enough that the receiver's allocator reuses
#: them (no fresh mmap + page faults per message), large enough that per-frame costs stay negligible.
#: Override with CLUSTERCTL_PS_CHUNK_BYTES (a positive multiple of 8) in every process of the job.
CHUNK_BYTES = _chunk_bytes(os.environ.get(CHUNK_ENV))

#: A switch's values, any case: those the collective's switches (CLUSTERCTL_COLLECTIVE_SHM, ...) take.
_FLAGS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
#: Trainers: sync and async push_pull go out pipelined, in pieces of one wire chunk (client.py); default on.
PIPELINE_ENV = "CLUSTERCTL_PS_PIPELINE"


def env_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """A switch: 1/true/yes/on or 0/false/no/off, any case (unset or blank: ``default``); PsConfigError otherwise."""
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    value = _FLAGS.get(raw.strip().lower())
    if value is None:  # "flase" or "2" must not leave the default on without a word
        raise PsConfigError(f"environment variable {name}={raw!r} is not a switch "
                            "(1, true, yes, on or 0, false, no, off)")
    return value


#: Largest single frame a pserver or client accepts: one chunk, or a header.
MAX_FRAME_BYTES = max(CHUNK_BYTES, MAX_HEADER_BYTES)
#: ZMQ_MAXMSGSIZE: a frame on the wire may carry CURVE's 33 bytes (command name, nonce, flags, MAC) more;
#: a bigger one drops the sender's connection before it is read.
MAX_WIRE_FRAME_BYTES = MAX_FRAME_BYTES + 64
#: Integers in a header: at most this many digits (json.loads would otherwise build 4,300-digit ints).
MAX_INT_DIGITS = 19
#: Header fields that must be non-negative integers when present.
_COUNTS = ("seq", "tid", "step", "part", "parts", "c")


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ProtocolError(f"header holds an integer of {len(text.lstrip('-'))} digits (limit {MAX_INT_DIGITS})")
    return int(text)


def _no_constant(name: str) -> Any:
    raise ProtocolError(f"header holds {name}, which is not a number a header may carry")


if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("clusterctl.ps assumes a little-endian host")


@dataclass(frozen=True)
class Tensor:
    """A received tensor: one or more pieces ``(element offset, 1-D view over a ZeroMQ frame)``."""

    dtype: np.dtype
    size: int
    pieces: tuple[tuple[int, np.ndarray], ...]

    @property
    def nbytes(self) -> int:
        """Payload size in bytes."""
        return self.size * self.dtype.itemsize

    def to_array(self, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor as one contiguous 1-D array: a copy into ``out`` (or a new array)."""
        if out is None:
            out = np.empty(self.size, self.dtype)
        for off, piece in self.pieces:
            out[off:off + piece.size] = piece
        return out


@dataclass
class Message:
    """A decoded message: its JSON header and its tensors (read-only views over the received frames)."""

    header: dict[str, Any]
    tensors: dict[str, Tensor] = field(default_factory=dict)

    @property
    def op(self) -> str:
        """The request's operation name (``""`` for replies)."""
        return str(self.header.get("op", ""))

    @property
    def seq(self) -> int:
        """The request's sequence number, echoed in its reply."""
        seq = self.header.get("seq", 0)
        return seq if isinstance(seq, int) else 0


def encode(header: Mapping[str, Any], tensors: Mapping[str, np.ndarray] | None = None,
           *, chunk_bytes: int | None = None) -> list[Any]:
    """Frames for ``header`` plus ``tensors`` (zero-copy views of at most ``chunk_bytes`` bytes each)."""
    if chunk_bytes is None:
        chunk_bytes = CHUNK_BYTES
    if chunk_bytes <= 0 or chunk_bytes % 8:
        raise ProtocolError(f"chunk_bytes must be a positive multiple of 8, got {chunk_bytes}")
    head = dict(header)
    head.setdefault("v", PROTOCOL_VERSION)
    frames: list[Any] = []
    table = []
    for name, arr in (tensors or {}).items():
        a = np.ascontiguousarray(arr).reshape(-1)
        if a.dtype.name not in DTYPES:
            raise ProtocolError(f"tensor {name!r} has unsupported dtype {a.dtype.name}")
        table.append([name, a.dtype.name, int(a.size)])
        if a.nbytes <= chunk_bytes:
            frames.append(a)
        else:
            raw = memoryview(a).cast("B")
            frames.extend(raw[i:i + chunk_bytes] for i in range(0, a.nbytes, chunk_bytes))
    head["t"] = table
    head["c"] = chunk_bytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    if len(raw) > MAX_HEADER_BYTES:  # the receiver would refuse it unread, and could not even say to which request
        raise ProtocolError(f"a {head.get('op', 'reply')!r} header of {len(table)} tensor(s) is {len(raw)} bytes "
                            f"(limit {MAX_HEADER_BYTES}): send fewer tensors at once, or spread them over more pservers")
    return [raw, *frames]


def _buffer(frame: Any) -> memoryview:
    """A memoryview over a received frame (``zmq.Frame`` or bytes-like); ProtocolError for anything else."""
    buf = getattr(frame, "buffer", None)
    if buf is not None:
        return buf
    try:
        return memoryview(frame)
    except TypeError:
        raise ProtocolError(f"a frame is a {type(frame).__name__}, not bytes") from None


def decode(frames: Sequence[Any], *, request: bool = True) -> Message:
    """Parse and validate ``[header, buffers...]``; ProtocolError (one line) on anything malformed."""
    if not frames:
        raise ProtocolError("empty message")
    raw = _buffer(frames[0])
    if raw.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header frame is {raw.nbytes} bytes (limit {MAX_HEADER_BYTES})")
    try:
        header = json.loads(raw.tobytes().decode("utf-8"), parse_int=_int, parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"header is not UTF-8 JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError("header JSON is nested too deeply") from None
    except ValueError as exc:  # anything else json or int() refuses
        raise ProtocolError(f"header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a JSON object")
    try:
        return _message(header, frames, request)
    except ProtocolError as exc:  # the refusal names the request it refuses, when the header says which
        seq = header.get("seq")
        exc.seq = seq if isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0 else 0
        raise


def _message(header: dict, frames: Sequence[Any], request: bool) -> Message:
    """The rest of decode(): the header's fields and the buffer frames its tensor table describes."""
    if header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {quoted(header.get('v'))} (want {PROTOCOL_VERSION})")
    op = header.get("op")
    if request and (not isinstance(op, str) or op not in OPS):  # type first: a list is not hashable (TypeError)
        raise ProtocolError(f"unknown op {quoted(op)}")
    for name in _COUNTS:
        value = header.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ProtocolError(f"{name} must be a non-negative integer, got {quoted(value)}")
    chunk = header.get("c", 0)
    if chunk % 8:
        raise ProtocolError(f"chunk size must be a non-negative multiple of 8, got {chunk!r}")
    table = header.get("t", [])
    if not isinstance(table, list):
        raise ProtocolError("tensor table 't' must be a list")
    tensors: dict[str, Tensor] = {}
    body = frames[1:]
    pos = 0
    for entry in table:
        if (not isinstance(entry, list) or len(entry) != 3 or not isinstance(entry[0], str)
                or not isinstance(entry[1], str) or entry[1] not in DTYPES  # type first, as for op
                or isinstance(entry[2], bool) or not isinstance(entry[2], int) or entry[2] < 0):
            raise ProtocolError(f"bad tensor table entry {quoted(entry)}")
        key, dtype_name, size = entry
        if key in tensors:
            raise ProtocolError(f"tensor {key!r} appears twice")
        dtype = np.dtype(dtype_name)
        nbytes = size * dtype.itemsize
        count = -(-nbytes // chunk) if chunk and nbytes > chunk else 1
        if pos + count > len(body):
            raise ProtocolError(f"tensor table needs more than the {len(body)} buffer frames that followed")
        pieces = []
        off = 0
        for i in range(count):
            buf = _buffer(body[pos + i])
            want = min(chunk, nbytes - off) if count > 1 else nbytes
            if buf.nbytes != want:
                raise ProtocolError(f"tensor {key!r}: frame has {buf.nbytes} bytes, header says {want}")
            pieces.append((off // dtype.itemsize, np.frombuffer(buf, dtype=dtype)))
            off += want
        pos += count
        tensors[key] = Tensor(dtype, size, tuple(pieces))
    if pos != len(body):
        raise ProtocolError(f"tensor table accounts for {pos} buffer frames but {len(body)} followed")
    return Message(header, tensors)


def error_frames(seq: int, code: str, message: str) -> list[bytes]:
    """Frames of an error reply."""
    head = {"v": PROTOCOL_VERSION, "ok": False, "seq": seq, "code": code, "error": message[:2000], "t": []}
    return [json.dumps(head, separators=(",", ":")).encode()]


def quoted(value: Any) -> str:
    """``repr(value)``, cut to 80 characters (error messages quote what a peer sent)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def finite_float(value: Any, name: str) -> float:
    """``value`` as a finite float, or ProtocolError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProtocolError(f"{name} must be a finite number, got {value!r}")
    return float(value)
