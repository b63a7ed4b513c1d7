"""The trainer side: shard parameters over pservers, push gradients (or geo deltas), pull parameters.

Every call talks to all pservers at once (one DEALER socket each: send to all, then collect replies),
so one step costs one round trip to the slowest pserver. Tensors are sent as views of the caller's
arrays (no copy) and received as frames that are copied once, into the assembled parameters.

In sync and async mode ``push_pull`` is pipelined: each pserver's share goes out as requests of at
most one wire chunk, and the updated pieces are collected while later ones are still being sent.

Why one module of ~640 lines: a trainer is one PSClient whose calls share its sockets, its request sequence,
its shard plan and its step, and every call checks each field of every reply where it reads it (a pserver may
be broken or compromised); split across modules the calls would reach into each other's private state. The
pieces that stand alone live beside it: the wire format and its switches (protocol.py), the shard plan
(sharding.py), optimizers (optim.py), keys (auth.py) and checkpoints (checkpoint.py).
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import zmq

from . import auth as auth_mod
from . import checkpoint as ckpt
from . import protocol
from .endpoints import zmq_address
from .errors import (BarrierTimeoutError, CheckpointError, ProtocolError, PsConfigError, PsError, PsTimeoutError,
                     RemoteOpError)
from .optim import SGD, OptimizerConfig
from .protocol import MAX_TIMEOUT, MAX_WIRE_FRAME_BYTES, PIPELINE_ENV, Message, decode, encode, env_flag, quoted
from .server import MODES
from .sharding import DEFAULT_MIN_BLOCK_SIZE, Block, ShardPlan, plan_shards

__all__ = ["PSClient", "pack_pieces"]

log = logging.getLogger(__name__)

#: Pipelined push_pull: requests in flight per pserver (far below ZeroMQ's default high-water mark
#: of 1000, so the pserver's replies are never dropped while this trainer is still sending).
WINDOW = 32
#: Seconds a trainer waits for the other pservers to take a failed sync round's ``abort`` (best effort).
ABORT_WAIT = 3.0


def pack_pieces(tensors: Mapping[str, np.ndarray], chunk: int) -> list[list[tuple[str, int, np.ndarray]]]:
    """Requests of a pipelined push: ``[(block key, element offset, 1-D view), ...]`` of <= ``chunk`` bytes each.

    Blocks larger than ``chunk`` are cut into chunk-sized pieces (the last one shorter); smaller
    pieces are packed greedily, in order, into one request while they fit.
    """
    msgs: list[list[tuple[str, int, np.ndarray]]] = []
    cur: list[tuple[str, int, np.ndarray]] = []
    used = 0
    for key, flat in tensors.items():
        step = max(1, chunk // flat.itemsize)
        for off in range(0, max(flat.size, 1), step):
            piece = flat[off:off + step]
            if cur and used + piece.nbytes > chunk:
                msgs.append(cur)
                cur, used = [], 0
            cur.append((key, off, piece))
            used += piece.nbytes
    if cur:
        msgs.append(cur)
    return msgs


#: The dtypes of parameters and gradients (the wire protocol's whitelist).
DTYPES = ("float16", "float32", "float64")


def _as_numpy(x: Any, name: str = "") -> np.ndarray:
    """A NumPy view of ``x`` (NumPy array, or a CPU torch tensor via ``detach()``) of a supported float dtype."""
    try:
        arr = np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x)
    except (TypeError, ValueError) as exc:  # e.g. a torch bfloat16 tensor, a ragged list
        raise PsConfigError(f"{name}: cannot be read as a float16/32/64 array: {exc}") from None
    if arr.dtype.name not in DTYPES:
        raise PsConfigError(f"{name}: dtype {arr.dtype} is not supported (float16/32/64)")
    return arr


#: A reply field the client cannot do without (no default).
_REQUIRED: Any = object()


def _is_count(value: Any) -> bool:
    """Whether ``value`` is a non-negative integer (a step, a trainer id): JSON's ``true`` is not one."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_text(value: Any) -> bool:
    return isinstance(value, str)


def _is_seconds(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value >= 0)


def _is_steps(value: Any) -> bool:
    return isinstance(value, list) and all(map(_is_count, value))


def _is_dir(value: Any) -> bool:
    return isinstance(value, str) and "\0" not in value  # a NUL is a ValueError in every path function


def _poll_ms(left: float) -> int:
    """A poll's wait for ``left`` seconds, at most an hour (the callers poll again until their deadline)."""
    return int(min(max(left, 0.0), 3600.0) * 1000) + 1


def _one_line(text: str, limit: int) -> str:
    """A pserver's ``text`` as one line of at most ``limit`` characters (control characters escaped)."""
    if not text.isprintable():
        text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _step(step: Any) -> int:
    """A trainer step given by the caller: a non-negative integer (the pservers refuse anything else)."""
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)) or step < 0:
        raise PsConfigError(f"step must be a non-negative integer, got {step!r}")
    return int(step)


class PSClient:
    """A trainer's connection to every pserver of the job."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        trainer_id: int,
        num_trainers: int,
        mode: str = "sync",
        k_steps: int = 1,
        optimizer: OptimizerConfig | None = None,
        min_block_size: int = DEFAULT_MIN_BLOCK_SIZE,
        timeout: float = 360.0,
        job: str = "",
        context: zmq.Context | None = None,
        token: str | None = None,
        auth: str | None = None,
        pipeline: bool | None = None,
    ):
        if mode not in MODES:
            raise PsConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        for name, value in (("trainer_id", trainer_id), ("num_trainers", num_trainers), ("k_steps", k_steps)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise PsConfigError(f"{name} must be an integer, got {value!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not math.isfinite(timeout):
            raise PsConfigError(f"timeout must be a finite number of seconds, got {timeout!r}")
        if isinstance(endpoints, str):
            raise PsConfigError(f"endpoints must be a list of 'ip:port' strings, got the string {endpoints!r}")
        if pipeline is not None and not isinstance(pipeline, bool):
            raise PsConfigError(f"pipeline must be True, False or None (from {PIPELINE_ENV}), got {pipeline!r}")
        if not 0 <= trainer_id < num_trainers:
            raise PsConfigError(f"trainer_id {trainer_id} is outside 0..{num_trainers - 1}")
        if k_steps < 1:
            raise PsConfigError(f"k_steps must be >= 1, got {k_steps}")
        if not 0 < timeout <= MAX_TIMEOUT:
            raise PsConfigError(f"timeout must be > 0 and at most {MAX_TIMEOUT:,.0f} seconds, got {timeout}")
        self.endpoints = tuple(endpoints)
        if not self.endpoints:
            raise PsConfigError("the pserver endpoint list is empty")
        self.trainer_id = int(trainer_id)
        self.num_trainers = int(num_trainers)
        self.mode = mode
        self.k_steps = int(k_steps)
        self.optimizer = optimizer or SGD()
        self.min_block_size = min_block_size
        self.timeout = float(timeout)
        self.job = job
        # sync/async push_pull in pieces of one wire chunk (None: CLUSTERCTL_PS_PIPELINE, default on); False: one
        # message per pserver
        self.pipeline = env_flag(os.environ, PIPELINE_ENV, True) if pipeline is None else pipeline
        # CURVE keys from the job token (token/auth None: CLUSTERCTL_JOB_TOKEN/CLUSTERCTL_AUTH); neither: refuse
        creds = auth_mod.resolve(token, auth, f"trainer {trainer_id}")
        self.plan: ShardPlan | None = None
        self.start_step = 0
        self.step = 0
        self._dtypes: dict[str, np.dtype] = {}
        self._geo_base: dict[str, np.ndarray] = {}
        self._geo_pending = 0
        self._seq = 0
        self._done = ""  # why this client may send no more requests (close() or complete() was called)
        self._own_ctx = context is None
        self._ctx = context or zmq.Context(io_threads=auth_mod.io_threads(len(self.endpoints)))
        self._socks: list[zmq.Socket] = []
        for ep in self.endpoints:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)  # every request waits for its reply; nothing to flush
            s.setsockopt(zmq.MAXMSGSIZE, MAX_WIRE_FRAME_BYTES)
            auth_mod.secure_client(s, creds)
            self._socks.append(s)
        self._watch = auth_mod.HandshakeWatch(self._socks, self.endpoints)
        for s, ep in zip(self._socks, self.endpoints, strict=True):
            s.connect(zmq_address(ep))

    # ------------------------------------------------------------------ plumbing

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the sockets (and the context if this client created it)."""
        self._done = "close() was called"
        self._watch.close()
        for s in self._socks:
            s.close()
        self._socks = []
        if self._own_ctx and not self._ctx.closed:
            self._ctx.term()

    def _poller(self, servers: Iterable[int]) -> zmq.Poller:
        """A poller over the sockets of ``servers`` and their handshake monitors."""
        poller = zmq.Poller()
        for i in servers:
            poller.register(self._socks[i], zmq.POLLIN)
            poller.register(self._watch.monitors[i], zmq.POLLIN)
        return poller

    def _timeout(self, missing: Sequence[int], op: str, wait: float) -> PsTimeoutError:
        """The timeout error for the pservers ``missing``, naming failed handshakes with them."""
        hint = "".join(self._watch.hint(i) for i in missing)
        if protocol.CHUNK_BYTES != protocol.DEFAULT_CHUNK_BYTES:  # a frame over the peer's limit is dropped silently
            hint += (f" ({protocol.CHUNK_ENV}={protocol.CHUNK_BYTES} here, not the default "
                     f"{protocol.DEFAULT_CHUNK_BYTES}: every pserver must have the same value, or each side drops "
                     "the other's larger frames without a reply)")
        return PsTimeoutError([self.endpoints[i] for i in missing], op, wait, hint)

    def _read(self, i: int, op: str, header: Mapping[str, Any], name: str, want: str,
              valid: Callable[[Any], bool], default: Any = _REQUIRED) -> Any:
        """Field ``name`` of pserver ``i``'s reply to ``op`` (``default`` when absent), or ProtocolError naming both:
        a reply that decoded may still carry a list where a step belongs (a broken or compromised pserver)."""
        value = header.get(name, default)
        if value is _REQUIRED or not valid(value):
            got = "nothing" if value is _REQUIRED else quoted(value)
            raise ProtocolError(f"pserver {self.endpoints[i]}: malformed {op!r} reply: {name} must be {want}, "
                                f"got {got}")
        return value

    def _status(self, i: int, op: str, header: Mapping[str, Any]) -> tuple[bool, str, str]:
        """``(ok, code, error)`` of pserver ``i``'s reply to ``op``; code and error one line each."""
        if self._read(i, op, header, "ok", "true or false", lambda v: isinstance(v, bool)):
            return True, "", ""
        code = self._read(i, op, header, "code", "a string", _is_text, "error")
        error = self._read(i, op, header, "error", "a string", _is_text, "")
        return False, _one_line(code, 80), _one_line(error, 2000)

    def _replies(self, poller: zmq.Poller, left: float, seq: int) -> Iterator[tuple[int, Message]]:
        """The replies to request `seq` that arrive within `left` seconds, as (pserver index, message);
        a late reply to an earlier request is dropped. A pserver that refuses this trainer's key raises AuthError."""
        for sock, _ in poller.poll(_poll_ms(left)):
            w = self._watch.index(sock)
            if w is not None:
                self._watch.check(w)
                continue
            i = self._socks.index(sock)
            frames = sock.recv_multipart(copy=False)
            try:
                msg = decode(frames, request=False)
            except ProtocolError as exc:
                log.warning("dropping a malformed reply from %s: %s", self.endpoints[i], exc)
                continue
            if msg.seq != seq:
                log.warning("dropping a stale reply (seq %d, want %d) from %s", msg.seq, seq, self.endpoints[i])
                continue
            yield i, msg

    def _send(self, i: int, frames: list[Any], deadline: float, op: str, wait: float) -> None:
        """Queue a request to pserver ``i`` without ever blocking past ``deadline``.

        A DEALER's send blocks while it has no pipe to a peer, and libzmq may drop a connection's pipe for good when
        its handshake fails with a protocol error (one side CURVE, the other not; 4.3.5 did about one time in two),
        without reconnecting: had that happened before the first request (a loaded machine), a blocking send would
        wait for ever. Here a send that cannot go waits for the socket to become writable or for a handshake event,
        which raises the refusal it reports (AuthError), until the deadline (PsTimeoutError)."""
        sock = self._socks[i]
        while True:
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                pass
            self._watch.check(i)
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timeout([i], op, wait)
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLOUT)
            if self._watch.monitors and not self._watch.succeeded[i]:
                poller.register(self._watch.monitors[i], zmq.POLLIN)
            poller.poll(_poll_ms(left))

    def _request(self, op: str, per_server: Mapping[int, tuple[dict[str, Any], Mapping[str, np.ndarray]]],
                 timeout: float | None = None) -> dict[int, Message]:
        """Send one request to each listed pserver, wait for every reply; raise on errors or timeout."""
        self._check_open()
        self._seq += 1
        seq = self._seq
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        for i, (fields, tensors) in per_server.items():
            head = {"op": op, "seq": seq, "tid": self.trainer_id, **fields}
            self._send(i, encode(head, tensors), deadline, op, wait)
        replies: dict[int, Message] = {}
        poller = self._poller(per_server)
        while len(replies) < len(per_server):
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timeout([i for i in per_server if i not in replies], op, wait)
            for i, msg in self._replies(poller, left, seq):
                replies[i] = msg
                poller.unregister(self._socks[i])
        status = {i: self._status(i, op, replies[i].header) for i in sorted(replies)}
        timed_out = [i for i, (ok, code, _) in status.items() if not ok and code == "barrier_timeout"]
        if timed_out:
            raise self._barrier_failed(op, timed_out[0], replies[timed_out[0]].header, self.step, timed_out)
        for i, (ok, code, error) in status.items():
            if not ok:
                raise RemoteOpError(self.endpoints[i], code, error)
        return replies

    def _barrier_failed(self, op: str, i: int, header: Mapping[str, Any], step: int,
                        reported: Sequence[int]) -> BarrierTimeoutError:
        """The error of a sync round that pserver(s) ``reported`` timed out (``header``: pserver ``i``'s reply to
        ``op``), after telling the other pservers.

        Another pserver may have completed the round (the lost trainer's push reached it and no other): nobody
        would push to it again, and it would wait for ever. The ``abort`` makes it fail the same way; best
        effort, for at most ABORT_WAIT seconds (a pserver that timed out on its own has exited and does not answer).
        """
        n = self.num_trainers
        missing = self._read(i, op, header, "missing", f"a list of distinct trainer ids 0..{n - 1}",
                             lambda v: isinstance(v, list) and len(v) <= n and all(_is_count(t) and t < n for t in v)
                             and len(set(v)) == len(v), [])
        timeout = self._read(i, op, header, "timeout", "a finite number of seconds >= 0", _is_seconds, 0.0)
        err = BarrierTimeoutError(missing, timeout, self._read(i, op, header, "step", "a step", _is_count, step))
        others = [j for j in range(len(self.endpoints)) if j not in reported]
        if others:
            fields = {"missing": list(err.missing), "timeout": err.timeout, "step": err.step}
            try:
                self._request("abort", {j: (fields, {}) for j in others}, timeout=min(self.timeout, ABORT_WAIT))
            except PsError as exc:
                log.debug("trainer %d: telling the other pservers about the failed round: %s", self.trainer_id, exc)
        return err

    def _check_open(self) -> None:
        """Refuse a request after close() or complete() (the pservers would never answer it)."""
        if self._done:
            raise PsConfigError(f"trainer {self.trainer_id}: {self._done} on this client; no more requests")

    def _need_plan(self) -> ShardPlan:
        if self.plan is None:
            raise PsConfigError("call init(params) before talking to the pservers")
        return self.plan

    def _split(self, arrays: Mapping[str, Any]) -> dict[int, dict[str, np.ndarray]]:
        """Per-server ``{block key: flat view}`` of ``arrays`` (a name -> tensor mapping)."""
        plan = self._need_plan()
        out: dict[int, dict[str, np.ndarray]] = {i: {} for i in range(len(self.endpoints))}
        known = dict(plan.shapes)
        for name, value in arrays.items():
            if name not in known:
                raise PsConfigError(f"{name!r} is not a registered parameter ({', '.join(map(repr, known))})")
            shape = known[name]
            arr = _as_numpy(value, name)
            if arr.shape != shape:
                raise PsConfigError(f"{name}: shape {arr.shape} differs from the registered {shape}")
            flat = np.ascontiguousarray(arr, dtype=self._dtypes[name]).reshape(-1)
            for b in plan.for_param(name):
                out[b.server][b.key] = flat[b.start:b.stop]
        return out

    def _targets(self, out: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        """Arrays to assemble the parameters into: ``out``'s (checked) or new ones."""
        result: dict[str, np.ndarray] = {}
        for name, shape in self._need_plan().shapes:
            target = out.get(name) if out is not None else None
            if target is None:
                target = np.empty(shape, self._dtypes[name])
            elif (not isinstance(target, np.ndarray) or target.shape != shape or not target.flags.c_contiguous
                  or target.dtype != self._dtypes[name]):
                raise PsConfigError(f"out[{name!r}] must be a C-contiguous {self._dtypes[name]} array of shape {shape}")
            result[name] = target
        return result

    def _assemble(self, replies: Mapping[int, Message], out: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        plan = self._need_plan()
        result = self._targets(out)
        for name, target in result.items():
            flat = target.reshape(-1)
            for b in plan.for_param(name):
                t = replies[b.server].tensors.get(b.key)
                if t is None or t.size != b.size or t.dtype != target.dtype:
                    raise RemoteOpError(self.endpoints[b.server], "bad_reply", f"reply lacks block {b.key!r}")
                t.to_array(out=flat[b.start:b.stop])
        return result

    def _all(self, fields: dict[str, Any]) -> dict[int, tuple[dict[str, Any], Mapping[str, np.ndarray]]]:
        return {i: (fields, {}) for i in range(len(self.endpoints))}

    # ------------------------------------------------------------------ API

    def ping(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """Every pserver's status header (mode, step, request counters)."""
        replies = self._request("ping", self._all({}), timeout)
        return [replies[i].header for i in sorted(replies)]

    def init(self, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Register ``params`` (name -> initial array), first init wins; return the pservers' values."""
        self._check_open()
        if not params:
            raise PsConfigError("init needs at least one parameter")
        bad = [n for n in params if not isinstance(n, str) or not n]
        if bad:
            raise PsConfigError(f"parameter names must be non-empty strings, got {bad[0]!r}")
        arrays = {n: _as_numpy(v, n) for n, v in params.items()}
        registered = self.plan, self._dtypes
        self.plan = plan_shards(((n, a.shape) for n, a in arrays.items()), self.endpoints,
                                min_block_size=self.min_block_size)
        self._dtypes = {n: a.dtype for n, a in arrays.items()}
        try:
            parts = self._split(arrays)
            fields = {"mode": self.mode, "optimizer": self.optimizer.to_dict(), "k_steps": self.k_steps,
                      "plan": self.plan.fingerprint}
            # each pserver gets the full shape of the parameters it holds blocks of, to check against a checkpoint
            params: dict[int, dict[str, tuple[tuple[int, ...], str]]] = {i: {} for i in parts}
            shapes = dict(self.plan.shapes)
            for b in self.plan.blocks:
                params[b.server][b.param] = (shapes[b.param], self._dtypes[b.param].name)
            # "server": the index the pserver must have (its blocks, not another's, are in this request)
            replies = self._request("init", {i: ({**fields, "server": i, "params": ckpt.param_table(params[i])}, parts[i])
                                             for i in parts})
        except PsError:  # refused (e.g. another trainer registered other shapes): keep what was registered
            self.plan, self._dtypes = registered
            raise
        loaded = {self._read(i, "init", replies[i].header, "loaded_step", "a step", _is_count, 0) for i in replies}
        if len(loaded) != 1:
            # pservers that save on their own (checkpoint_every) and were stopped between two saves: settle on
            # the newest step every one of them still holds (each keeps its previous checkpoint)
            common = set.intersection(*(set(self._read(i, "init", replies[i].header, "saved_steps", "a list of steps",
                                                       _is_steps, [])) for i in replies))
            if not common:
                raise CheckpointError(f"pservers resumed from different checkpoint steps: {sorted(loaded)}")
            step = max(common)
            log.info("trainer %d: pservers resumed at steps %s; settling on step %d", self.trainer_id,
                     sorted(loaded), step)
            replies = self._request("load", self._all({"step": step}))
            loaded = {self._read(i, "load", r.header, "loaded_step", "a step", _is_count) for i, r in replies.items()}
            if loaded != {step}:
                raise CheckpointError(f"pservers could not settle on checkpoint step {step}: {sorted(map(str, loaded))}")
        self.start_step = self.step = int(loaded.pop())
        if self.start_step:
            log.info("trainer %d resumes at step %d", self.trainer_id, self.start_step)
        values = self.pull()
        if self.mode == "geo":
            self._geo_base = {n: v.copy() for n, v in values.items()}
        return values

    def pull(self, out: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Current parameters from every pserver (written into ``out``'s arrays when given)."""
        plan = self._need_plan()
        per = {i: ({"keys": [b.key for b in plan.for_server(i)]}, {}) for i in range(len(self.endpoints))}
        return self._assemble(self._request("pull", per), out)

    def push(self, grads: Mapping[str, Any], *, step: int | None = None) -> None:
        """Push gradients (sync: returns once the round's update is applied)."""
        self._push("push", grads, step, pull=False)

    def push_pull(self, grads: Mapping[str, Any], *, step: int | None = None,
                  out: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Push gradients and get the updated parameters back in the same round trip."""
        return self._push("push_pull", grads, step, pull=True, out=out)

    def _push(self, op: str, tensors: Mapping[str, Any], step: int | None, *, pull: bool,
              out: Mapping[str, np.ndarray] | None = None) -> Any:
        if self.mode == "geo":
            raise PsConfigError("geo mode pushes parameter deltas: call geo_step(params) instead")
        s = self.step if step is None else _step(step)
        plan = self._need_plan()
        if self.pipeline and pull and set(tensors) == {name for name, _ in plan.shapes}:
            result = self._push_pull_pipelined(tensors, s, out)
            self.step = s + 1
            return result
        parts = self._split(tensors)
        replies = self._request("push_pull" if pull else "push",
                                {i: ({"step": s, "pull": pull}, parts[i]) for i in parts})
        self.step = s + 1
        return self._assemble(replies, out) if pull else None

    def _push_pull_pipelined(self, grads: Mapping[str, Any], step: int,
                             out: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        """push_pull as pieces of at most one wire chunk, sent while earlier pieces' replies come back.

        Each request carries ``"part": i``, ``"parts"`` (their number for that pserver) and ``"off"``
        (element offset of each tensor in its block); big blocks are cut into chunk-sized pieces, small
        ones packed together. Async: the pserver applies and answers every piece on arrival. Sync: it
        answers a piece once every active trainer's gradient for its range arrived and the averaged
        update of that range was applied. Replies are copied into the output arrays as they come.
        """
        self._check_open()
        plan = self._need_plan()
        result = self._targets(out)
        flats = {name: arr.reshape(-1) for name, arr in result.items()}
        chunk = protocol.CHUNK_BYTES
        self._seq += 1
        seq = self._seq
        base = {"op": "push_pull", "seq": seq, "tid": self.trainer_id, "step": step, "pull": True}
        todo: dict[int, list[tuple[dict[str, Any], dict[str, np.ndarray]]]] = {}
        expect: dict[int, dict[int, list[tuple[Block, int, int]]]] = {}
        for i, tensors in self._split(grads).items():
            blocks = {b.key: b for b in plan.for_server(i)}
            todo[i], expect[i] = [], {}
            packed = pack_pieces(tensors, chunk)
            for n, pieces in enumerate(packed):
                todo[i].append(({**base, "part": n, "parts": len(packed), "off": [off for _, off, _ in pieces]},
                                {key: piece for key, _, piece in pieces}))
                expect[i][n] = [(blocks[key], off, piece.size) for key, off, piece in pieces]
        sent = {i: 0 for i in todo}
        got = {i: 0 for i in todo}
        deadline = time.monotonic() + self.timeout
        error: RemoteOpError | None = None
        poller = self._poller(todo)
        while any(got[i] < len(todo[i]) for i in todo):
            for i, msgs in todo.items():  # keep up to WINDOW requests in flight to each pserver
                while sent[i] < len(msgs) and sent[i] - got[i] < WINDOW:
                    head, tensors = msgs[sent[i]]
                    self._send(i, encode(head, tensors, chunk_bytes=chunk), deadline, "push_pull", self.timeout)
                    sent[i] += 1
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timeout([i for i in todo if got[i] < len(todo[i])], "push_pull", self.timeout)
            for i, msg in self._replies(poller, left, seq):
                got[i] += 1
                h = msg.header
                ok, code, text = self._status(i, "push_pull", h)
                if not ok:
                    if code == "barrier_timeout":  # sync: the round will not complete
                        raise self._barrier_failed("push_pull", i, h, step, [i])
                    error = error or RemoteOpError(self.endpoints[i], code, text)
                    continue
                spans = expect[i].pop(msg.header.get("part"), None) if isinstance(msg.header.get("part"), int) else None
                offs = msg.header.get("off")
                if spans is None or offs != [o for _, o, _ in spans] or len(msg.tensors) != len(spans):
                    raise RemoteOpError(self.endpoints[i], "bad_reply", f"unexpected reply part {msg.header.get('part')!r}")
                for (b, off, size), (key, t) in zip(spans, msg.tensors.items(), strict=True):
                    flat = flats[b.param]
                    if key != b.key or t.size != size or t.dtype != flat.dtype:
                        raise RemoteOpError(self.endpoints[i], "bad_reply", f"reply piece {key!r} does not match the request")
                    t.to_array(out=flat[b.start + off:b.start + off + size])
        if error is not None:
            raise error
        return result

    def geo_step(self, params: Mapping[str, np.ndarray], *, step: int | None = None) -> Mapping[str, np.ndarray]:
        """Geo mode, once per local step: every ``k_steps`` push ``params - last_synced`` and pull, in place."""
        if self.mode != "geo":
            raise PsConfigError(f"geo_step() is for geo mode; this client runs {self.mode!r}")
        self._geo_params(params, convert=False)  # each local step: names and shapes only (a GPU tensor stays put)
        self.step = (self.step if step is None else _step(step)) + 1
        self._geo_pending += 1
        if self._geo_pending >= self.k_steps:
            self.geo_flush(params)
        return params

    def geo_flush(self, params: Mapping[str, np.ndarray]) -> None:
        """Geo mode: send the pending local deltas now and refresh ``params`` (and the base) in place."""
        if not self._geo_pending:
            return
        arrays = self._geo_params(params)
        deltas = {n: arr - self._geo_base[n] for n, arr in arrays.items()}
        parts = self._split(deltas)
        replies = self._request("push_pull", {i: ({"step": self.step - 1, "pull": True}, parts[i]) for i in parts})
        self._assemble(replies, self._geo_base)  # the merged values become the new base, in place
        for name, base in self._geo_base.items():
            if hasattr(params[name], "detach"):  # torch: .cpu().numpy() of a CUDA tensor is a host copy
                import torch

                params[name].detach().copy_(torch.from_numpy(base))
            else:
                np.copyto(arrays[name], base)
        self._geo_pending = 0

    def _geo_params(self, params: Mapping[str, Any], *, convert: bool = True) -> dict[str, Any]:
        """``params`` as arrays geo mode can update in place: every registered parameter, of its shape.

        Checked before anything is sent: a missing parameter could not be refreshed, and a wrong shape would
        broadcast against the base into a wrong delta. Without ``convert``, only what needs no copy is checked
        (the names, and the shape of whatever has one) and ``params`` is returned as it is."""
        plan = self._need_plan()
        known = dict(plan.shapes)
        if set(params) != set(known):
            raise PsConfigError(f"geo mode needs every registered parameter ({', '.join(map(repr, known))}), "
                                f"got {', '.join(map(repr, params))}")
        arrays = {n: _as_numpy(params[n], n) for n in known} if convert else params
        for name, arr in arrays.items():
            shape = getattr(arr, "shape", None)
            if shape is not None and tuple(shape) != known[name]:
                raise PsConfigError(f"{name}: shape {tuple(shape)} differs from the registered {known[name]}")
        return dict(arrays)

    def save(self, root: str, step: int | None = None) -> int:
        """Ask every pserver to save its shards under ``root`` at ``step``; write the commit record beside them.

        A relative ``root`` is one inside the pservers' checkpoint root (they resolve it there), not the
        trainer's working directory: the record goes to the directory the pservers report they saved in.
        """
        if not isinstance(root, (str, os.PathLike)):
            raise PsConfigError(f"save needs a directory path, got {root!r}")
        s = self.step if step is None else _step(step)
        replies = self._request("save", self._all({"dir": os.fspath(root), "step": s}))
        steps = {self._read(i, "save", r.header, "step", "a step", _is_count) for i, r in replies.items()}
        if steps != {s}:
            raise CheckpointError(f"pservers saved inconsistent steps {sorted(map(str, steps))}, want {s}")
        if not os.path.isabs(root):  # resolved by the pservers in their checkpoint root
            dirs = {os.path.dirname(self._read(i, "save", r.header, "path", "a path", _is_dir))
                    for i, r in replies.items()}
            if len(dirs) != 1 or not os.path.isabs(next(iter(dirs))):
                raise CheckpointError(f"pservers saved {os.fspath(root)!r} in different directories {sorted(dirs)}; "
                                      "no commit record written (give save an absolute path)")
            root = dirs.pop()
        try:
            ckpt.write_commit(root, s, list(self.endpoints), job=self.job)
        except OSError as exc:
            raise CheckpointError(f"cannot write the commit record under {root}: {exc}") from None
        return s

    def load(self, root: str) -> int:
        """Ask every pserver to load its shards from ``root``; return the (common) step to resume at."""
        if not isinstance(root, (str, os.PathLike)):
            raise PsConfigError(f"load needs a directory path, got {root!r}")
        replies = self._request("load", self._all({"dir": os.fspath(root)}))
        steps = {self._read(i, "load", r.header, "loaded_step", "a step", _is_count) for i, r in replies.items()}
        if len(steps) != 1:
            raise CheckpointError(f"pservers loaded different steps {sorted(map(str, steps))} from {root}")
        self.start_step = self.step = int(steps.pop())
        return self.start_step

    def complete(self, params: Mapping[str, np.ndarray] | None = None) -> None:
        """Tell every pserver this trainer is done (geo: flushes pending deltas of ``params`` first)."""
        if self.mode == "geo" and params is not None:
            self.geo_flush(params)
        self._request("complete", self._all({}))
        self._done = "complete() was called"
