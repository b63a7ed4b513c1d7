"""Wire format between trainers and pservers: one small JSON header frame, then one raw frame per tensor.

A request is a ZeroMQ multipart message ``[header, buf_0, buf_1, ...]``. The header is a UTF-8 JSON
object::

    {"v": 1, "op": "push_pull", "seq": 7, "tid": 0, "step": 12,
     "t": [["w.block0", "float32", 8192], ...],     # one entry per following frame
     ...op-specific fields...}

Each buffer frame is the tensor's raw little-endian bytes, sent with ``copy=False`` and received as a
``zmq.Frame`` that NumPy views without copying. Replies use the same layout with ``"ok": true`` or
``"ok": false, "code": ..., "error": ...``.

Authentication: when the job has a token (``CLUSTERCTL_JOB_TOKEN``, set by the host agent), the header
frame is ``MAC + JSON`` where MAC is 64 hex characters of HMAC-SHA256 keyed by :func:`job_key` over
``b"req\0"`` (requests) or ``b"rep\0"`` (replies) followed by the JSON bytes. The JSON carries the tensor
table (names, dtypes, sizes), so the frames that follow are bound to it. The MAC is checked before the
JSON is parsed; a pserver answers a request without a valid MAC with ``"code": "unauthenticated"`` and
does nothing else (docs/security.md).

Pipelined push_pull (async mode) uses the same layout: each request carries a piece of at most one
chunk of each listed block, with ``"part": i`` and ``"off": [element offset of each tensor in its
block, ...]``; the reply echoes both and carries the updated pieces (see docs/ps.md, "Protocol").
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import AuthError, ProtocolError

__all__ = [
    "DTYPES",
    "MAX_HEADER_BYTES",
    "MAX_FRAME_BYTES",
    "TOKEN_ENV",
    "job_key",
    "sign",
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
OPS = frozenset({"ping", "init", "pull", "push", "push_pull", "save", "load", "complete"})
#: Tensor dtypes allowed on the wire (anything else is rejected before touching the buffers).
DTYPES = frozenset({"float16", "float32", "float64"})
MAX_HEADER_BYTES = 64 * 1024
#: Tensors larger than this go out as several frames: small enough that the receiver's allocator reuses
#: them (no fresh mmap + page faults per message), large enough that per-frame costs stay negligible.
#: Override with CLUSTERCTL_PS_CHUNK_BYTES (a positive multiple of 8) in every process of the job.
CHUNK_BYTES = int(os.environ.get("CLUSTERCTL_PS_CHUNK_BYTES") or 4 << 20)
MAC_LEN = 64  # hex characters of HMAC-SHA256 in front of an authenticated header
#: Largest single frame a pserver or client accepts (ZMQ_MAXMSGSIZE): one chunk, or a header.
MAX_FRAME_BYTES = max(CHUNK_BYTES, MAX_HEADER_BYTES + MAC_LEN)
#: The job's secret for the processes of a job; the host agent sets it (never in argv or logs).
TOKEN_ENV = "CLUSTERCTL_JOB_TOKEN"
_HEX = frozenset(b"0123456789abcdef")


def job_key(token: str | None) -> bytes | None:
    """The pserver MAC key derived from the job token (None: no authentication)."""
    if not token:
        return None
    return hmac.new(token.encode(), b"clusterctl-ps/1", hashlib.sha256).digest()


def sign(frames: list[Any], key: bytes | None, *, request: bool) -> list[Any]:
    """``frames`` with the MAC put in front of the header frame (unchanged when ``key`` is None)."""
    if key is None or not frames:
        return frames
    head = bytes(_buffer(frames[0]))
    return [_mac(key, b"req" if request else b"rep", head) + head, *frames[1:]]


def _mac(key: bytes, kind: bytes, data: bytes) -> bytes:
    return hmac.digest(key, kind + b"\0" + data, "sha256").hex().encode()  # one-shot: the fast C path

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
           *, chunk_bytes: int | None = None, key: bytes | None = None, request: bool = True) -> list[Any]:
    """Frames for ``header`` plus ``tensors`` (zero-copy views of at most ``chunk_bytes``), MACed with ``key``."""
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
    if key is not None:
        raw = _mac(key, b"req" if request else b"rep", raw) + raw
    return [raw, *frames]


def _buffer(frame: Any) -> memoryview:
    """A memoryview over a received frame (``zmq.Frame`` or bytes-like)."""
    buf = getattr(frame, "buffer", None)
    return buf if buf is not None else memoryview(frame)


def decode(frames: Sequence[Any], *, request: bool = True, key: bytes | None = None) -> Message:
    """Check the MAC (with ``key``), then parse and validate ``[header, buffers...]``.

    Raises AuthError when ``key`` is set and the header frame does not carry its valid MAC, and
    ProtocolError on anything malformed.
    """
    if not frames:
        raise ProtocolError("empty message")
    raw = _buffer(frames[0])
    if raw.nbytes > MAX_HEADER_BYTES + (MAC_LEN if key is not None else 0):
        raise ProtocolError(f"header frame is {raw.nbytes} bytes (limit {MAX_HEADER_BYTES})")
    data = raw.tobytes()
    if key is not None:
        want = _mac(key, b"req" if request else b"rep", data[MAC_LEN:])
        if len(data) < MAC_LEN or not hmac.compare_digest(want, data[:MAC_LEN]):
            raise AuthError("the message does not carry a valid MAC of the job token")
        data = data[MAC_LEN:]
    elif len(data) > MAC_LEN and data[MAC_LEN:MAC_LEN + 1] == b"{" and set(data[:MAC_LEN]) <= _HEX:
        raise ProtocolError("the message is signed with a job token but this end has none "
                            f"(set {TOKEN_ENV} in every process of the job, or in none)")
    try:
        header = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"header is not UTF-8 JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError("header JSON is nested too deeply") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a JSON object")
    if header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {header.get('v')!r} (want {PROTOCOL_VERSION})")
    if request and header.get("op") not in OPS:
        raise ProtocolError(f"unknown op {header.get('op')!r}")
    if not isinstance(header.get("seq", 0), int):
        raise ProtocolError("seq must be an integer")
    chunk = header.get("c", 0)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0 or chunk % 8:
        raise ProtocolError(f"chunk size must be a non-negative multiple of 8, got {chunk!r}")
    table = header.get("t", [])
    if not isinstance(table, list):
        raise ProtocolError("tensor table 't' must be a list")
    tensors: dict[str, Tensor] = {}
    body = frames[1:]
    pos = 0
    for entry in table:
        if (not isinstance(entry, list) or len(entry) != 3 or not isinstance(entry[0], str)
                or entry[1] not in DTYPES or isinstance(entry[2], bool) or not isinstance(entry[2], int)
                or entry[2] < 0):
            raise ProtocolError(f"bad tensor table entry {entry!r}")
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


def error_frames(seq: int, code: str, message: str, *, key: bytes | None = None) -> list[bytes]:
    """Frames of an error reply (MACed with ``key``)."""
    head = {"v": PROTOCOL_VERSION, "ok": False, "seq": seq, "code": code, "error": message[:2000], "t": []}
    raw = json.dumps(head, separators=(",", ":")).encode()
    return [raw if key is None else _mac(key, b"rep", raw) + raw]


def finite_float(value: Any, name: str) -> float:
    """``value`` as a finite float, or ProtocolError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProtocolError(f"{name} must be a finite number, got {value!r}")
    return float(value)
