"""The pserver: holds parameter blocks, applies trainers' updates in sync / async / geo mode.

One ZeroMQ ROUTER socket bound to the planned endpoint, one thread, one event loop. Requests are
answered in arrival order except sync-mode pushes, whose replies are held until every active trainer
has pushed for the round (the barrier); the round then sums the gradients in trainer-id order, divides
by the number of contributors, applies one optimizer step, and replies to all of them.

Sync and async mode also take *pipelined* push_pull requests (``"part"`` in the header): one request
per piece of at most one wire chunk. Async applies and answers each piece as soon as it arrives
(:meth:`_push_part`); sync reduces, applies and answers each range of a block as soon as every active
trainer's pieces reached it (:meth:`_advance_round`). Either way the trainers' sending of later pieces
overlaps with the update and the reply of earlier ones.

Why one module of ~870 lines: the pserver is one event loop over one socket, and its handlers share that
loop's state (blocks, optimizer states, the open sync round, deferred requests) without locks; split
across modules they would reach into each other's private state. The pieces that stand alone live
beside it: the wire format (protocol.py), checkpoints (checkpoint.py), optimizers (optim.py), and
who may connect (auth.py: CURVE keys from the job token; door.py: the ZAP handler and the cap on
connections waiting to authenticate, in a thread of their own).
"""

from __future__ import annotations

import logging
import os
import resource
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from . import auth as auth_mod
from . import checkpoint as ckpt
from .door import Door
from .endpoints import split_endpoint, zmq_address
from .errors import BarrierTimeoutError, ProtocolError, PsConfigError, PsError
from .optim import OptimizerConfig, apply_piece, apply_update, begin_update, init_state, state_dtype
from .protocol import MAX_TIMEOUT, MAX_WIRE_FRAME_BYTES, PROTOCOL_VERSION, Message, Tensor, decode, encode, error_frames

__all__ = ["MODES", "ParameterServer"]

log = logging.getLogger(__name__)

MODES = ("sync", "async", "geo")


@dataclass
class _Waiting:
    """A sync-mode push whose reply is held until the round completes."""

    envelope: list[Any]
    msg: Message
    pull: list[str]


@dataclass
class _SyncPush:
    """One trainer's gradients in the open sync round: ``(offset, 1-D piece)`` per block, in order.

    A one-message push (``whole``) arrives complete; a pipelined one (``parts`` requests) fills its
    blocks from offset 0 upwards, one part request at a time.
    """

    whole: _Waiting | None = None
    parts: int = 0  # pipelined: part requests announced
    got: set[int] = field(default_factory=set)  # pipelined: part indices received
    pieces: dict[str, list[tuple[int, np.ndarray]]] = field(default_factory=dict)
    upto: dict[str, int] = field(default_factory=dict)  # block -> elements received from 0
    unanswered: list[tuple[list[Any], Message, list[tuple[str, int, int]]]] = field(default_factory=list)

    def covers(self, key: str, size: int) -> int | None:
        """Elements of block ``key`` received so far (from 0); None: this push has no gradient for it."""
        if self.whole is not None:
            return size if key in self.pieces else None
        if key not in self.upto and self.finished():
            return None  # every part arrived and none had this block: like a one-message push without it
        return self.upto.get(key, 0)

    def finished(self) -> bool:
        """Every request of this push arrived."""
        return self.whole is not None or len(self.got) == self.parts


@dataclass
class _Build:
    """Async pipelined pushes: the next value of one block, written piece by piece before it is published."""

    owner: int  # the trainer whose update this is; other trainers' pieces of the block wait for it
    new: np.ndarray
    done: list[tuple[int, int]]  # element ranges of ``new`` already holding their updated value

    def covered(self) -> int:
        return sum(b - a for a, b in self.done)

    def overlaps(self, start: int, stop: int) -> bool:
        return any(a < stop and start < b for a, b in self.done)


class _RejectError(Exception):
    """Internal: answer the current request with an error reply of this code."""

    def __init__(self, code: str, message: str, **extra: Any):
        super().__init__(message)
        self.code = code
        self.extra = extra


def _param_diff(saved: dict[str, tuple[tuple[int, ...], str]], given: dict[str, tuple[tuple[int, ...], str]]) -> str:
    """Up to five same-named parameters whose shape or dtype differ between ``saved`` (the checkpoint's) and ``given``."""
    bad = [f"{name}: checkpoint {saved[name][0]} {saved[name][1]}, trainer {given[name][0]} {given[name][1]}"
           for name in sorted(saved.keys() & given.keys()) if saved[name] != given[name]]
    return "; ".join(bad[:5]) + (f"; ... ({len(bad)} in all)" if len(bad) > 5 else "")


def _nbytes(frame: Any) -> int:
    return frame.nbytes if hasattr(frame, "nbytes") else len(frame)


def _raise_fd_limit() -> None:
    """Raise the soft limit on open files to the hard one: libzmq spins on accept() when it runs out."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY:
            hard = 1 << 20
        if soft != resource.RLIM_INFINITY and soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):  # not allowed here: keep the limit there is
        pass


class ParameterServer:
    """A pserver bound to exactly ``endpoint`` (``ip:port``) serving ``num_trainers`` trainers."""

    #: Seconds another trainer's pipelined requests wait for a block whose update stopped arriving.
    DEFER_TIMEOUT = 5.0

    def __init__(
        self,
        endpoint: str,
        *,
        server_id: int = 0,
        num_servers: int = 1,
        num_trainers: int = 1,
        mode: str = "sync",
        k_steps: int = 1,
        barrier_timeout: float = 300.0,
        checkpoint_dir: str | None = None,
        checkpoint_every: int = 0,
        job: str = "",
        token: str | None = None,
        auth: str | None = None,
        checkpoint_root: str | None = None,
    ):
        if mode not in MODES:
            raise PsConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if num_trainers < 1:
            raise PsConfigError(f"num_trainers must be >= 1, got {num_trainers}")
        if not 0 <= server_id < num_servers:
            raise PsConfigError(f"server_id {server_id} is outside 0..{num_servers - 1}")
        if k_steps < 1:
            raise PsConfigError(f"k_steps must be >= 1, got {k_steps}")
        if not 0 < barrier_timeout <= MAX_TIMEOUT:  # nan too
            raise PsConfigError(f"barrier_timeout must be > 0 and at most {MAX_TIMEOUT:,.0f} seconds, "
                                f"got {barrier_timeout}")
        self.endpoint = endpoint
        self.address = zmq_address(endpoint)
        self.server_id = server_id
        self.num_servers = num_servers
        self.num_trainers = num_trainers
        self.mode = mode
        self.k_steps = k_steps
        self.barrier_timeout = float(barrier_timeout)
        self.job = job
        # token/auth None: CLUSTERCTL_JOB_TOKEN/CLUSTERCTL_AUTH (set by the host supervisor); neither: refuse
        self._creds = auth_mod.resolve(token, auth, f"pserver {server_id}")
        # save/load requests may only name this directory or one inside it (default: checkpoint_dir)
        root = checkpoint_root or checkpoint_dir
        self.checkpoint_root = os.path.realpath(root) if root else None
        self._log_window = [0.0, 0, 0]  # rejected-request log lines: window start, lines, suppressed
        self.step = 0  # sync: rounds applied; async/geo: highest trainer step seen + 1
        self.loaded_step = 0  # step of the checkpoint this server started from (0: fresh)
        self.resumed = False  # blocks come from a checkpoint: every init must name exactly those blocks
        self.blocks: dict[str, np.ndarray] = {}
        self.states: dict[str, dict[str, np.ndarray]] = {}
        # parameter -> (shape, dtype) of the blocks held: blocks are flat, their sizes cannot tell (3, 4) from (4, 3)
        self.params: dict[str, tuple[tuple[int, ...], str]] = {}
        self.optimizer: OptimizerConfig | None = None
        self.plan_id: str | None = None  # placement fingerprint of the first trainer's init
        self.completed: set[int] = set()
        self.stats = {"requests": 0, "rejected": 0, "updates": 0, "bytes_in": 0, "bytes_out": 0,
                      "buffers_allocated": 0}
        self._round: dict[int, _SyncPush] = {}  # sync: the open round's pushes, by trainer id
        self._acc: dict[str, np.ndarray] = {}
        self._sync_new: dict[str, np.ndarray] = {}  # sync: next value of a block, filled range by range
        self._sync_done: dict[str, int] = {}  # sync: elements of a block applied in the open round
        self._sync_t: dict[str, float] = {}  # sync: Adam step of the block's update in the open round
        self._builds: dict[str, _Build] = {}
        self._part_t: dict[tuple[int, str], float] = {}  # (trainer, block) -> Adam step of its pipelined update
        # trainer -> its pipelined requests waiting for another trainer's update of the same block
        self._deferred: dict[int, deque[tuple[list[Any], Message, float]]] = {}
        self._pool: dict[str, list[np.ndarray]] = {}
        self._inflight: list[tuple[list[zmq.MessageTracker], list[np.ndarray]]] = []
        self._round_started = 0.0
        self._failed: BarrierTimeoutError | None = None  # sync: a trainer reported another pserver's timeout
        self._stop = threading.Event()
        self._ctx: zmq.Context | None = None  # the pserver's own: ZAP handlers are per context
        self._sock: zmq.Socket | None = None
        self._door: Door | None = None
        if checkpoint_every < 0:
            raise PsConfigError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
        if checkpoint_every and not checkpoint_dir:
            raise PsConfigError("checkpoint_every needs a checkpoint directory")
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_every = checkpoint_every  # save to checkpoint_dir every this many steps (0: only on request)
        self._next_save = 0
        if checkpoint_dir:
            ckpt.recover_server(checkpoint_dir, server_id)  # a save a crash interrupted: finished, not forgotten
        if checkpoint_dir and ckpt.has_server_checkpoint(checkpoint_dir, server_id):
            # saving on its own, this pserver may be one save ahead of another; trainers settle on a common step
            self._load(checkpoint_dir, siblings=not checkpoint_every)
        elif checkpoint_dir:
            log.info("no checkpoint for pserver %d under %s; starting fresh", server_id, checkpoint_dir)

    # ------------------------------------------------------------------ lifecycle

    #: Connections that may wait to authenticate at once, in all and from one IP address (door.py).
    MAX_PENDING = 32
    MAX_PENDING_PER_SOURCE = 8

    def bind(self) -> str:
        """Bind the ROUTER socket to the planned address; return the bound ``tcp://`` address."""
        if self._sock is not None:
            return self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        _raise_fd_limit()
        ctx = self._ctx = zmq.Context(io_threads=auth_mod.io_threads(4))
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 5000)  # let the final replies flush on close
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_WIRE_FRAME_BYTES)  # a bigger frame drops the sender's connection
        sock.setsockopt(zmq.RCVHWM, 256)  # messages queued per peer before libzmq stops reading from it
        sock.setsockopt(zmq.BACKLOG, 1024)  # a flood of connects must not leave a trainer's SYN unanswered
        auth_mod.secure_server(sock, self._creds, b"clusterctl-ps")
        if self.address.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        door = Door(ctx, sock, self._creds, f"pserver {self.server_id}", max_pending=self.MAX_PENDING,
                    max_pending_per_source=self.MAX_PENDING_PER_SOURCE)
        try:
            sock.bind(self.address)
        except zmq.ZMQError as exc:
            door.close()
            sock.close(0)
            ctx.term()
            self._ctx = None
            raise PsConfigError(f"pserver {self.server_id} cannot bind {self.address}: {exc}") from None
        door.start()
        self._sock, self._door = sock, door
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        host, _ = split_endpoint(self.endpoint)
        self.endpoint = f"{host}:{bound.rsplit(':', 1)[1]}"  # the real port when the plan said 0
        log.info("pserver %d of %d listening on %s (mode=%s, trainers=%d, %s)",
                 self.server_id, self.num_servers, bound, self.mode, self.num_trainers,
                 "CURVE with the job token's keys" if self._creds else "UNAUTHENTICATED")
        return bound

    def stop(self) -> None:
        """Ask :meth:`serve` to return at its next poll (thread-safe)."""
        self._stop.set()

    def serve(self) -> None:
        """Serve until every trainer sent ``complete`` or :meth:`stop`; raise BarrierTimeoutError on a stuck barrier."""
        self.bind()
        sock = self._sock
        assert sock is not None  # bound just above
        try:
            while not self._stop.is_set():
                if sock.poll(self._poll_ms(), zmq.POLLIN):
                    frames = sock.recv_multipart(copy=False)
                    self._dispatch(frames)
                    if self._failed is not None:
                        raise self._failed
                    self._maybe_save()
                    if self._deferred:
                        self._replay()
                    if len(self.completed) >= self.num_trainers:
                        log.info("all %d trainer(s) completed; pserver %d exiting", self.num_trainers, self.server_id)
                        return
                self._check_barrier()
                self._check_deferred()
        finally:
            self.close()

    def close(self) -> None:
        """Close the socket (flushing pending replies), its door and the pserver's ZeroMQ context."""
        if self._door is not None:
            self._door.close()
            self._door = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # ------------------------------------------------------------------ barrier

    def _poll_ms(self) -> int:
        if not self._round:
            return 200
        left = self._round_started + self.barrier_timeout - time.monotonic()
        return max(1, min(200, int(min(left, 1.0) * 1000) + 1))

    def _active(self) -> set[int]:
        return set(range(self.num_trainers)) - self.completed

    def _check_barrier(self) -> None:
        if not self._round or time.monotonic() - self._round_started < self.barrier_timeout:
            return
        missing = sorted(self._active() - {t for t, p in self._round.items() if p.finished()})
        err = BarrierTimeoutError(missing, self.barrier_timeout, self.step)
        log.error("pserver %d: %s", self.server_id, err)
        self._fail_round(err)
        raise err

    def _fail_round(self, err: BarrierTimeoutError) -> None:
        """Answer every push held in the open round with ``err`` and close the round."""
        for push in self._round.values():
            held = [(w.envelope, w.msg) for w in [push.whole] if w is not None]
            held += [(env, msg) for env, msg, _ in push.unanswered]
            for envelope, msg in held:
                self._send(envelope, encode({"ok": False, "seq": msg.seq, "code": "barrier_timeout",
                                             "error": str(err), "missing": list(err.missing),
                                             "timeout": err.timeout, "step": err.step}))
        self._clear_round()

    def _clear_round(self) -> None:
        self._round.clear()
        self._sync_new.clear()
        self._sync_done.clear()
        self._sync_t.clear()

    def _advance_round(self) -> None:
        """Sync: reduce and apply every range that all active trainers have pushed; finish the round.

        A range of a block is final once every active trainer's gradient for it arrived (a trainer
        that pushed no gradient for the block does not count): it is summed in trainer-id order,
        divided by the number of contributors and applied right away, into the block's next buffer,
        and the pipelined requests whose pieces are all applied are answered. So the reduction and
        the replies of early pieces overlap with the arrival of later ones. Every element goes
        through the same operations, in the same order, as when whole gradients are summed at once:
        the result is the same bit for bit.
        """
        active = self._active()
        if not self._round or not active.issubset(self._round):
            return  # an active trainer has not pushed anything yet: no range is complete
        tids = sorted(self._round)
        pushes = [self._round[t] for t in tids]
        open_keys = []
        for key, block in self.blocks.items():
            have = [(p, c) for p in pushes if (c := p.covers(key, block.size)) is not None]
            if not have:
                continue
            done = self._sync_done.get(key, 0)
            frontier = min(c for _, c in have)
            if frontier > done:
                self._reduce_range(key, [p for p, _ in have], done, frontier)
            if self._sync_done.get(key, 0) < block.size:
                open_keys.append(key)
        done = not open_keys and all(p.finished() for p in pushes)
        if done:
            self.step += 1  # before any reply goes out: a trainer that got its last reply sees the new step
        for push in pushes:
            if push.unanswered:
                self._answer_parts(push, self.step if done else self.step + 1)
        if not done:
            return
        for push in pushes:
            if push.whole is not None:
                w = push.whole
                self._reply(w.envelope, w.msg, {"step": self.step}, w.pull)
        self._clear_round()

    def _reduce_range(self, key: str, pushes: list[_SyncPush], lo: int, hi: int) -> None:
        """Sum the pushes' gradients of ``key[lo:hi]`` in trainer-id order, average, apply the optimizer."""
        block = self.blocks[key]
        acc = self._acc.get(key)
        if acc is None or acc.shape != block.shape or acc.dtype != state_dtype(block.dtype):
            # private: never sent, reused every round; float16 gradients summed in float32 (as the optimizer's
            # arithmetic is): ten trainers' 10,000 each overflow float16's 65,504 to inf
            acc = self._acc[key] = np.empty(block.shape, state_dtype(block.dtype))
        for i, push in enumerate(pushes):  # fixed trainer-id order: the sum is reproducible bit for bit
            for off, piece in push.pieces[key]:
                a, b = max(lo, off), min(hi, off + piece.size)
                if a >= b:
                    continue
                if i == 0:
                    acc[a:b] = piece[a - off:b - off]
                else:
                    acc[a:b] += piece[a - off:b - off]
        g = acc[lo:hi]
        g /= acc.dtype.type(len(pushes))
        if self.optimizer is None:
            raise _RejectError("not_initialised", "no trainer has sent init (optimizer unknown)")
        new = self._sync_new.get(key)
        if new is None:
            new = self._sync_new[key] = self._spare(key)
            self._sync_t[key] = begin_update(self.optimizer, self.states[key])
        apply_piece(self.optimizer, block, g, self.states[key], lo, new, self._sync_t[key])
        self._sync_done[key] = hi
        if hi == block.size:  # the block's update is complete: it becomes the block's value
            self.blocks[key] = new
            self._retire(key, block)
            del self._sync_new[key]
            self.stats["updates"] += 1

    def _answer_parts(self, push: _SyncPush, step: int) -> None:
        """Reply to a pipelined push's requests whose pieces all hold this round's new values."""
        left = []
        for envelope, msg, spans in push.unanswered:
            if any(self._sync_done.get(key, 0) < off + size for key, off, size in spans):
                left.append((envelope, msg, spans))
                continue
            out: dict[str, np.ndarray] = {}
            owners = []
            for key, off, size in spans:
                arr = self._sync_new.get(key)
                arr = self.blocks[key] if arr is None else arr
                out[key] = arr[off:off + size]
                owners.append(arr)
            head = {"v": PROTOCOL_VERSION, "ok": True, "seq": msg.seq, "op": msg.op,
                    "part": msg.header["part"], "step": step, "off": msg.header["off"]}
            one_frame = max(8, -(-max(a.nbytes for a in out.values()) // 8) * 8) if out else 8
            frames = encode(head, out, chunk_bytes=one_frame)  # one frame per piece
            if self._sock is not None:
                self._send_tracked(envelope, frames, owners)
        push.unanswered = left

    # ------------------------------------------------------------------ dispatch

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        self.stats["requests"] += 1
        envelope: list[Any] = [frames[0]]
        body = frames[1:]
        if body and len(body[0]) == 0:  # REQ-style envelope: identity, empty delimiter, body
            envelope.append(b"")
            body = body[1:]
        self._guarded(envelope, body=body)

    def _guarded(self, envelope: list[Any], *, body: list[Any] | None = None, deferred: Message | None = None) -> None:
        """Decode and handle ``body`` (or replay a ``deferred`` pipelined request); reject on any error."""
        ident = envelope[0]  # the peer's identity frame (carries its address for the log)
        seq = deferred.seq if deferred is not None else 0
        try:
            if deferred is not None:
                self._push_part(envelope, deferred, replay=True)
                return
            msg = decode(body or [])  # the peer proved the job's key in the CURVE handshake (door.py)
            seq = msg.seq
            self.stats["bytes_in"] += sum(t.nbytes for t in msg.tensors.values())
            handler = getattr(self, f"_op_{msg.op}")
            handler(envelope, msg)
        except ProtocolError as exc:
            self._reject(envelope, getattr(exc, "seq", seq), "bad_request", str(exc), ident)
        except _RejectError as exc:
            self._reject(envelope, seq, exc.code, str(exc), ident, **exc.extra)
        except (PsError, OSError) as exc:
            self._reject(envelope, seq, type(exc).__name__, str(exc), ident)
        except Exception as exc:  # a bug must not take the pserver (and the whole job) down
            log.exception("pserver %d: internal error handling a request", self.server_id)
            self._reject(envelope, seq, "internal", f"{type(exc).__name__}: {exc}", ident)

    def _reject(self, envelope: list[Any], seq: int, code: str, message: str, ident: Any, **extra: Any) -> None:
        self.stats["rejected"] += 1
        peer = "?"
        try:
            peer = ident.get("Peer-Address")
        except (zmq.ZMQError, AttributeError):
            pass
        self._log_rejected("pserver %d rejected a request from %s (%s): %s", self.server_id, peer, code, message)
        frames = error_frames(seq, code, message)
        if extra:
            frames = encode({"ok": False, "seq": seq, "code": code, "error": message, **extra})
        self._send(envelope, frames)

    def _log_rejected(self, fmt: str, *args: Any) -> None:
        """Log a rejected request: at most 10 lines per 10 s, then one line counting the rest."""
        w = self._log_window
        now = time.monotonic()
        if now - w[0] >= 10.0:
            if w[2]:
                log.warning("pserver %d: %d more rejected request(s) not logged", self.server_id, w[2])
            w[:] = [now, 0, 0]
        if w[1] < 10:
            w[1] += 1
            log.warning(fmt, *args)
        else:
            w[2] += 1

    def _send(self, envelope: list[Any], frames: list[Any]) -> None:
        if self._sock is not None:
            self._sock.send_multipart(envelope + frames, copy=False)

    def _reply(self, envelope: list[Any], msg: Message, fields: dict[str, Any], pull: Sequence[str] = ()) -> None:
        tensors = {k: self.blocks[k] for k in pull}
        head = {"v": PROTOCOL_VERSION, "ok": True, "seq": msg.seq, "op": msg.op, **fields}
        frames = encode(head, tensors)
        if not tensors or self._sock is None:
            self._send(envelope, frames)
            return
        self._send_tracked(envelope, frames, list(tensors.values()))

    def _send_tracked(self, envelope: list[Any], frames: list[Any], owners: list[np.ndarray]) -> None:
        """Send ``frames`` whose tensor frames view ``owners``; keep those until ZeroMQ releases them."""
        assert self._sock is not None  # callers check
        self.stats["bytes_out"] += sum(_nbytes(f) for f in frames[1:])
        # Zero-copy send of live buffers; remember them until ZeroMQ releases them, so _spare()
        # never recycles a buffer that is still being written to a socket.
        for part in envelope + frames[:1]:
            self._sock.send(part, zmq.SNDMORE, copy=False)
        body = frames[1:]
        trackers = [self._sock.send(f, zmq.SNDMORE if i < len(body) - 1 else 0, copy=False, track=True)
                    for i, f in enumerate(body)]
        self._reap()
        self._inflight.append((trackers, owners))

    def _reap(self) -> None:
        """Forget replies whose every frame ZeroMQ has released."""
        self._inflight = [(trs, arrs) for trs, arrs in self._inflight if not all(tr.done for tr in trs)]

    # ------------------------------------------------------------------ helpers

    def _tid(self, msg: Message) -> int:
        tid = msg.header.get("tid")
        if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < self.num_trainers:
            raise ProtocolError(f"tid must be a trainer id in 0..{self.num_trainers - 1}, got {tid!r}")
        return tid

    def _pull_keys(self, msg: Message, field: str = "pull") -> list[str]:
        want = msg.header.get(field, False)
        if want is True:
            return list(self.blocks)
        if want is False or want is None:
            return []
        if not isinstance(want, list) or not all(isinstance(k, str) for k in want):
            raise ProtocolError(f"{field} must be true, false or a list of block keys")
        unknown = [k for k in want if k not in self.blocks]
        if unknown:
            raise _RejectError("unknown_key", f"unknown block(s): {', '.join(unknown[:5])}")
        return list(want)

    def _check_pushed(self, msg: Message) -> None:
        for key, t in msg.tensors.items():
            block = self.blocks.get(key)
            if block is None:
                raise _RejectError("unknown_key", f"block {key!r} was never initialised on pserver {self.server_id}")
            if t.dtype != block.dtype or t.size != block.size:
                raise _RejectError("shape_mismatch", f"block {key!r}: got {t.dtype.name}[{t.size}], "
                              f"holds {block.dtype.name}[{block.size}]")

    def _apply(self, key: str, grad: Tensor | np.ndarray) -> None:
        if self.optimizer is None:
            raise _RejectError("not_initialised", "no trainer has sent init (optimizer unknown)")
        self._publish(key)
        old = self.blocks[key]
        self.blocks[key] = apply_update(self.optimizer, old, grad, self.states[key], out=self._spare(key))
        self._retire(key, old)
        self.stats["updates"] += 1

    def _spare(self, key: str) -> np.ndarray:
        """A buffer for the next value of block ``key``: a recycled one ZeroMQ is done sending, or new."""
        pool = self._pool.get(key, [])
        if pool:
            self._reap()
            busy = {id(a) for _, arrs in self._inflight for a in arrs}
            for i, arr in enumerate(pool):
                if id(arr) not in busy:
                    return pool.pop(i)
        self.stats["buffers_allocated"] += 1
        return np.empty_like(self.blocks[key])

    def _retire(self, key: str, old: np.ndarray) -> None:
        pool = self._pool.setdefault(key, [])
        if len(pool) < 4:
            pool.append(old)

    def _publish(self, key: str) -> None:
        """Make block ``key``'s pipelined update in progress (if any) the block's value now.

        Ranges no piece has reached yet are copied from the current value, so every update applied so
        far is kept and none is applied twice; the pieces still to come land in the next build.
        """
        build = self._builds.pop(key, None)
        if build is None:
            return
        old = self.blocks[key]
        pos = 0
        for a, b in sorted(build.done):
            if pos < a:
                build.new[pos:a] = old[pos:a]
            pos = b
        if pos < old.size:
            build.new[pos:] = old[pos:]
        self.blocks[key] = build.new
        self._retire(key, old)

    def _blocked(self, tid: int, msg: Message) -> bool:
        """Whether a pipelined request of ``tid`` touches a block another trainer's update is being built in."""
        for key in msg.tensors:
            build = self._builds.get(key)
            if build is not None and build.owner != tid:
                return True
        return False

    def _replay(self) -> None:
        """Handle deferred pipelined requests whose blocks are free now, in each trainer's order."""
        progress = True
        while progress:
            progress = False
            for tid in list(self._deferred):
                queue = self._deferred[tid]
                while queue and not self._blocked(tid, queue[0][1]):
                    envelope, msg, _ = queue.popleft()
                    self._guarded(envelope, deferred=msg)
                    progress = True
                if not queue:
                    del self._deferred[tid]

    def _check_deferred(self) -> None:
        """Publish a build that has kept another trainer's requests waiting for DEFER_TIMEOUT (its owner stalled)."""
        now = time.monotonic()
        stalled = False
        for tid, queue in self._deferred.items():
            if queue and now - queue[0][2] > self.DEFER_TIMEOUT:
                for key in queue[0][1].tensors:
                    build = self._builds.get(key)
                    if build is not None and build.owner != tid:
                        log.warning("pserver %d: trainer %d's update of %s stalled for %.0fs; publishing it "
                                    "partially", self.server_id, build.owner, key, self.DEFER_TIMEOUT)
                        self._publish(key)
                        stalled = True
        if stalled:
            self._replay()

    def _publish_all(self) -> None:
        for key in list(self._builds):
            self._publish(key)

    def _note_step(self, msg: Message) -> None:
        step = msg.header.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            self.step = max(self.step, step + 1)

    # ------------------------------------------------------------------ ops

    def _op_ping(self, envelope: list[Any], msg: Message) -> None:
        door = {**self._door.stats, "pending": self._door.pending} if self._door is not None else {}
        self._reply(envelope, msg, {"server_id": self.server_id, "mode": self.mode, "step": self.step,
                                    "stats": dict(self.stats), "door": door})

    def _op_init(self, envelope: list[Any], msg: Message) -> None:
        self._tid(msg)
        mode = msg.header.get("mode")
        if mode != self.mode:
            raise _RejectError("mode_mismatch",
                               f"trainer runs mode {mode!r}, pserver {self.server_id} runs {self.mode!r}")
        try:
            opt = OptimizerConfig.from_dict(msg.header.get("optimizer") or {})
        except PsConfigError as exc:
            raise ProtocolError(str(exc)) from None
        if self.optimizer is not None and opt != self.optimizer:
            raise _RejectError("optimizer_mismatch", f"trainer optimizer {opt.to_dict()} differs from the "
                          f"pserver's {self.optimizer.to_dict()}")
        plan = msg.header.get("plan")
        if not isinstance(plan, str):
            raise ProtocolError("init needs the trainer's placement fingerprint 'plan'")
        if self.plan_id is not None and plan != self.plan_id:
            raise _RejectError("plan_mismatch", f"trainer {msg.header['tid']} placed the parameters differently "
                               f"(plan {plan}, pserver has {self.plan_id}): same names, shapes and order "
                               "on every trainer?")
        server = msg.header.get("server")
        if isinstance(server, bool) or not isinstance(server, int):
            raise ProtocolError("init needs 'server', this pserver's index in the trainer's endpoint list")
        if server != self.server_id:  # the trainer's list is not ours: its blocks for another pserver would land here
            raise _RejectError("wrong_pserver", f"trainer {msg.header['tid']} takes pserver {self.server_id} for pserver "
                               f"{server}: the same PADDLE_PSERVERS_IP_PORT_LIST, in the same order, on every trainer "
                               "and pserver?")
        params = ckpt.parse_params(msg.header.get("params", {}))  # absent: a trainer that sends no shapes
        if params is None:
            raise ProtocolError("init's 'params' must map each parameter to its 'shape' and 'dtype'")
        diff = _param_diff(self.params, params) if self.resumed else ""
        if diff:
            raise _RejectError("checkpoint_mismatch", f"trainer {msg.header['tid']}'s parameters differ from the "
                               f"checkpoint (step {self.loaded_step}) pserver {self.server_id} resumed from: {diff}")
        if self.resumed and msg.tensors.keys() != self.blocks.keys():
            diff = [f"{what} {len(keys)} block(s): {', '.join(keys[:5])}{', ...' if len(keys) > 5 else ''}"
                    for what, keys in (("lacks", sorted(self.blocks.keys() - msg.tensors.keys())),
                                       ("adds", sorted(msg.tensors.keys() - self.blocks.keys()))) if keys]
            raise _RejectError("checkpoint_mismatch", f"trainer {msg.header['tid']}'s parameters differ from the "
                               f"checkpoint (step {self.loaded_step}) pserver {self.server_id} resumed from: it "
                               + "; it ".join(diff))
        fresh = {}
        for key, t in msg.tensors.items():
            have = self.blocks.get(key)
            if have is None:
                fresh[key] = t.to_array()
            elif have.dtype != t.dtype or have.size != t.size:
                raise _RejectError("shape_mismatch", f"block {key!r}: trainer has {t.dtype.name}[{t.size}], "
                              f"pserver holds {have.dtype.name}[{have.size}]")
        self.optimizer = opt
        self.plan_id = plan
        for name, shape in params.items():  # first init wins; also fills in what an older checkpoint lacked
            self.params.setdefault(name, shape)
        for key, arr in fresh.items():
            self.blocks[key] = arr
            self.states[key] = init_state(opt, arr)
        log.info("pserver %d: trainer %d init, %d new block(s), %d total", self.server_id,
                 msg.header["tid"], len(fresh), len(self.blocks))
        self._reply(envelope, msg, {"step": self.step, "loaded_step": self.loaded_step,
                                    "saved_steps": ckpt.saved_steps(self.checkpoint_dir, self.server_id)
                                    if self.checkpoint_dir else []})

    def _op_pull(self, envelope: list[Any], msg: Message) -> None:
        self._reply(envelope, msg, {"step": self.step}, self._pull_keys(msg, "keys"))

    def _op_push(self, envelope: list[Any], msg: Message) -> None:
        self._push(envelope, msg, [])

    def _op_push_pull(self, envelope: list[Any], msg: Message) -> None:
        if "part" in msg.header:
            self._push_part(envelope, msg)
            return
        self._push(envelope, msg, self._pull_keys(msg))

    def _push_part(self, envelope: list[Any], msg: Message, *, replay: bool = False) -> None:
        """Async pipelined push_pull: apply one piece of each listed block now, reply with the new values.

        Header: ``"part": i`` (index of this request among the ``parts`` of one push_pull, echoed),
        ``"off": [o, ...]`` (element offset of each tensor in its block). The new values of a block go
        to a separate buffer (:class:`_Build`) that replaces the block when an update's last piece was
        applied (ranges not reached yet are copied from the current value), so pulls see whole
        versions. One update of a block is built at a time: another trainer's requests touching the
        block wait (in order, per trainer) until it is published, then are replayed (:meth:`_replay`).
        """
        if self.mode not in ("async", "sync"):
            raise ProtocolError(f"pipelined push_pull (\"part\") needs sync or async mode; pserver runs {self.mode}")
        tid = self._tid(msg)
        if tid in self.completed:
            raise _RejectError("completed", f"trainer {tid} already sent complete")
        if self.optimizer is None:
            raise _RejectError("not_initialised", "no trainer has sent init (optimizer unknown)")
        part, offs = msg.header.get("part"), msg.header.get("off")
        if isinstance(part, bool) or not isinstance(part, int) or part < 0:
            raise ProtocolError(f"part must be a non-negative integer, got {part!r}")
        if (not isinstance(offs, list) or len(offs) != len(msg.tensors)
                or any(isinstance(o, bool) or not isinstance(o, int) for o in offs)):
            raise ProtocolError("off must list one integer element offset per tensor")
        pieces = []
        for (key, t), off in zip(msg.tensors.items(), offs, strict=True):
            block = self.blocks.get(key)
            if block is None:
                raise _RejectError("unknown_key", f"block {key!r} was never initialised on pserver {self.server_id}")
            if t.dtype != block.dtype or off < 0 or off + t.size > block.size or len(t.pieces) != 1:
                raise _RejectError("shape_mismatch", f"block {key!r}: got {t.dtype.name}[{off}:{off + t.size}], "
                                   f"holds {block.dtype.name}[{block.size}]")
            pieces.append((key, off, t.pieces[0][1]))
        if self.mode == "sync":
            self._push_part_sync(envelope, msg, tid, part, pieces)
            return
        if (not replay and self._deferred.get(tid)) or self._blocked(tid, msg):
            self._deferred.setdefault(tid, deque()).append((envelope, msg, time.monotonic()))
            return
        out: dict[str, np.ndarray] = {}
        owners = []
        for key, off, g in pieces:  # everything validated: now touch state
            stop = off + g.size
            build = self._builds.get(key)
            if build is not None and build.overlaps(off, stop):  # the same range twice: a new update
                self._publish(key)
                build = None
            if build is None:
                build = self._builds[key] = _Build(tid, self._spare(key), [])
            state = self.states[key]
            if off == 0 or (tid, key) not in self._part_t:  # a trainer's pieces of a block arrive in order
                self._part_t[tid, key] = begin_update(self.optimizer, state)
            apply_piece(self.optimizer, self.blocks[key], g, state, off, build.new, self._part_t[tid, key])
            build.done.append((off, stop))
            out[key] = build.new[off:stop]
            owners.append(build.new)
            if stop == build.new.size:  # a trainer's update of this block is complete: make it visible
                self.stats["updates"] += 1  # (counted once per update of a block, at its last piece)
                self._publish(key)
            elif build.covered() == build.new.size:
                self._publish(key)
        self._note_step(msg)
        head = {"v": PROTOCOL_VERSION, "ok": True, "seq": msg.seq, "op": msg.op, "part": part, "step": self.step,
                "off": offs}
        one_frame = max(8, -(-max(a.nbytes for a in out.values()) // 8) * 8) if out else 8
        frames = encode(head, out, chunk_bytes=one_frame)  # one frame per piece
        if self._sock is not None:
            self._send_tracked(envelope, frames, owners)

    def _push_part_sync(self, envelope: list[Any], msg: Message, tid: int, part: int,
                        pieces: list[tuple[str, int, np.ndarray]]) -> None:
        """Sync pipelined push_pull: keep this part's pieces for the round; reduce what is complete.

        Header ``"parts": N`` (the push_pull's number of requests to this pserver, the same in all of
        them). A trainer's pieces of a block must arrive in order (each starts where the previous one
        ended): the round reduces a range once every active trainer's pieces reach past it, and
        answers each request as soon as all its pieces are applied (:meth:`_advance_round`).
        """
        parts = msg.header.get("parts")
        if isinstance(parts, bool) or not isinstance(parts, int) or not part < parts:
            raise ProtocolError(f"parts must be an integer above part ({part}), got {parts!r}")
        push = self._round.get(tid)
        if push is not None and (push.whole is not None or push.parts != parts or part in push.got):
            raise _RejectError("duplicate", f"trainer {tid} pushed part {part} of {parts} twice (or mixed "
                               f"push kinds) in round {self.step}")
        upto = push.upto if push is not None else {}
        seen: dict[str, int] = {}
        for key, off, g in pieces:
            if off != seen.get(key, upto.get(key, 0)):
                raise _RejectError("shape_mismatch", f"block {key!r}: piece at {off} does not continue the "
                                   f"trainer's previous piece (ends at {seen.get(key, upto.get(key, 0))})")
            seen[key] = off + g.size
        if push is None:  # everything validated: now touch state
            if not self._round:
                self._round_started = time.monotonic()
            push = self._round[tid] = _SyncPush(parts=parts)
        push.got.add(part)
        for key, off, g in pieces:
            push.pieces.setdefault(key, []).append((off, g))
            push.upto[key] = off + g.size
        push.unanswered.append((envelope, msg, [(key, off, g.size) for key, off, g in pieces]))
        self._advance_round()

    def _push(self, envelope: list[Any], msg: Message, pull: list[str]) -> None:
        tid = self._tid(msg)
        if tid in self.completed:
            raise _RejectError("completed", f"trainer {tid} already sent complete")
        self._check_pushed(msg)
        if self.mode == "sync":
            if tid in self._round:
                raise _RejectError("duplicate", f"trainer {tid} pushed twice in round {self.step}")
            if not self._round:
                self._round_started = time.monotonic()
            self._round[tid] = _SyncPush(whole=_Waiting(envelope, msg, pull),
                                         pieces={k: list(t.pieces) for k, t in msg.tensors.items()})
            self._advance_round()
            return
        if self.mode == "async":
            for key, grad in msg.tensors.items():
                self._apply(key, grad)
        else:  # geo: the pushed tensors are parameter deltas, averaged over trainers as Paddle's GeoSGD
            for key, delta in msg.tensors.items():
                block = self.blocks[key]
                new = self._spare(key)
                for off, piece in delta.pieces:
                    np.divide(piece, block.dtype.type(self.num_trainers), out=new[off:off + piece.size])
                new += block
                self.blocks[key] = new
                self._retire(key, block)
                self.stats["updates"] += 1
        self._note_step(msg)
        self._reply(envelope, msg, {"step": self.step}, pull)

    def _confined(self, op: str, root: Any) -> str:
        """The real path of a save/load directory, refused unless inside the configured checkpoint root."""
        if not isinstance(root, str) or not root or "\0" in root:
            raise ProtocolError(f"{op} needs a non-empty 'dir'")
        if self.checkpoint_root is None:
            raise _RejectError("checkpoint_refused", f"pserver {self.server_id} has no checkpoint directory "
                               "configured (CLUSTERCTL_PS_CHECKPOINT); save/load refused")
        real = os.path.realpath(os.path.join(self.checkpoint_root, root))
        if os.path.commonpath([real, self.checkpoint_root]) != self.checkpoint_root:
            raise _RejectError("checkpoint_refused", f"{op}: {root!r} is outside the checkpoint directory "
                               f"{self.checkpoint_root} of pserver {self.server_id}")
        return real

    def _op_save(self, envelope: list[Any], msg: Message) -> None:
        root = self._confined("save", msg.header.get("dir"))
        step = msg.header.get("step", self.step)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ProtocolError(f"save step must be a non-negative integer, got {step!r}")
        self._publish_all()  # parameters and optimizer state of the same updates
        path = ckpt.save_server(root, ckpt.ServerCheckpoint(
            self.server_id, self.num_servers, step, self.mode,
            self.optimizer.to_dict() if self.optimizer else None, dict(self.blocks), self.states, self.params,
        ), job=self.job)
        self._reply(envelope, msg, {"step": step, "path": str(path)})

    def _maybe_save(self) -> None:
        """checkpoint_every: save when a step boundary is crossed and no sync round is open."""
        if not self.checkpoint_every or self._round or not self.blocks or self.step < self._next_save:
            return
        if self.step > self.loaded_step or self._next_save:
            self._publish_all()
            ckpt.save_server(self.checkpoint_dir, ckpt.ServerCheckpoint(
                self.server_id, self.num_servers, self.step, self.mode,
                self.optimizer.to_dict() if self.optimizer else None, dict(self.blocks), self.states, self.params,
            ), job=self.job)
        self._next_save = (self.step // self.checkpoint_every + 1) * self.checkpoint_every

    def _op_load(self, envelope: list[Any], msg: Message) -> None:
        root = self._confined("load", msg.header.get("dir") or self.checkpoint_dir)
        step = msg.header.get("step")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ProtocolError(f"load step must be a non-negative integer, got {step!r}")
        if step is not None and step == self.loaded_step and self.step == step:
            # another trainer settled this pserver on that step already
            self._reply(envelope, msg, {"step": self.step, "loaded_step": self.loaded_step})
            return
        if self._round:
            raise _RejectError("busy", "cannot load while a sync round is open")
        self._load(root, step=step, siblings=step is None)
        self._reply(envelope, msg, {"step": self.step, "loaded_step": self.loaded_step})

    def _load(self, root: str, *, step: int | None = None, siblings: bool = True) -> None:
        ckpt.recover_server(root, self.server_id)
        loaded = ckpt.load_server(root, self.server_id, self.num_servers, step=step, siblings=siblings)
        diff = _param_diff(loaded.params, self.params)  # a load after init: no init follows to check it
        if diff:
            raise _RejectError("checkpoint_mismatch", f"the checkpoint (step {loaded.step}) in {root} differs from "
                               f"the parameters registered with pserver {self.server_id}: {diff}")
        if loaded.mode and loaded.mode != self.mode:
            log.warning("checkpoint %s was saved in mode %s, pserver runs %s", root, loaded.mode, self.mode)
        opt = OptimizerConfig.from_dict(loaded.optimizer) if loaded.optimizer else None  # states checked there
        self.blocks = loaded.blocks
        self.states = loaded.states
        self.params = loaded.params
        self._pool.clear()  # recycled buffers may have other sizes than the loaded blocks
        self._builds.clear()  # deferred requests are replayed (and validated again) after this one
        self._part_t.clear()
        self._acc.clear()
        self._clear_round()
        self.optimizer = opt
        self.step = self.loaded_step = loaded.step
        self.resumed = True

    def _op_abort(self, envelope: list[Any], msg: Message) -> None:
        """Sync: a trainer reports that another pserver's barrier timed out; this pserver fails the same way.

        Without it, a pserver whose round had completed (the lost trainer's push reached it, not the other
        pservers) would wait for ever for a next round that nobody will push: the trainers failed on the
        other pserver's timeout. A trainer holding the job token could end the job by other means as well.
        """
        tid = self._tid(msg)
        if self.mode != "sync":
            raise ProtocolError(f"abort is for sync mode; pserver {self.server_id} runs {self.mode}")
        h = msg.header
        missing, timeout, step = h.get("missing"), h.get("timeout"), h.get("step")
        if (not isinstance(missing, list) or len(missing) > self.num_trainers
                or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.num_trainers for t in missing)
                or len(set(missing)) != len(missing)
                or isinstance(timeout, bool) or not isinstance(timeout, int | float)
                or isinstance(step, bool) or not isinstance(step, int)):
            raise ProtocolError("abort needs the barrier's 'missing' trainer ids, its 'timeout' and its 'step'")
        err = BarrierTimeoutError(missing, timeout, step)
        log.error("pserver %d: trainer %d reports another pserver's %s", self.server_id, tid, err)
        self._reply(envelope, msg, {"step": self.step})
        self._fail_round(err)
        self._failed = err

    def _op_complete(self, envelope: list[Any], msg: Message) -> None:
        tid = self._tid(msg)
        if tid in self._round:
            raise _RejectError("busy", f"trainer {tid} has a push pending in this round")
        self.completed.add(tid)
        log.info("pserver %d: trainer %d complete (%d/%d)", self.server_id, tid, len(self.completed),
                 self.num_trainers)
        self._reply(envelope, msg, {"step": self.step, "completed": len(self.completed)})
        self._advance_round()
