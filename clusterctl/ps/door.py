"""The pserver's door: who gets in (the ZAP handler) and how many may wait at it (the connection guard).

ZeroMQ hands a multipart message to the application only once all of its frames arrived, so a pserver
cannot authenticate requests by reading them: a stranger's 1 GiB message would be in memory first. The
check therefore happens in the connection handshake, before libzmq accepts any message frame: the
ROUTER runs CURVE (auth.py) and libzmq asks this ZAP handler about each client's long-term key, which
the client has just proved it holds; only the job's client key gets ``200``.

What is left to a stranger is the handshake itself: connections that say nothing, or garbage, or a
handshake command as large as ``ZMQ_MAXMSGSIZE``. libzmq drops a connection that has not finished its
handshake within ``HANDSHAKE_TIMEOUT_MS`` and one that sends anything but the protocol; the guard bounds
how many may be pending at once. It follows the socket's monitor events (``ACCEPTED`` carries the
connection's file descriptor) and keeps the pending connections oldest first; beyond ``max_pending`` in
all, or ``max_pending_per_source`` from one IP address, it shuts the oldest down (``shutdown(2)`` on
libzmq's descriptor, after checking that it still names the same peer; libzmq then closes it). A
connection is pending until the pserver's side of its handshake is written out: libzmq's monitor does
not say which connection a ``HANDSHAKE_SUCCEEDED`` belongs to, so the guard reads the bytes the kernel
took from the pserver on that connection (``TCP_INFO`` bytes acked + ``SIOCOUTQ``): the greeting,
``WELCOME`` and ``READY`` add up to more than a connection that was refused or is still in its
handshake can have been sent. Authenticated connections (the job's trainers) are never evicted.

Everything runs in one daemon thread; an error while handling one event is logged (rate-limited),
counted and contained. Counters: :attr:`Door.stats` (also in the pserver's ``ping`` reply).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import termios
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from .auth import HANDSHAKE_TIMEOUT_MS, Credentials

__all__ = ["Door", "ZAP_ENDPOINT"]

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27; one handler per ZeroMQ context

# Bytes a pserver has written on a connection once its handshake succeeded: the ZMTP 3 greeting (64),
# then CURVE's WELCOME (170 on the wire) and READY (>= 60), or NULL's READY (>= 30). A connection the
# ZAP handler refused gets an ERROR (12) instead of READY and is closed.
_DONE_BYTES = {True: 64 + 170 + 50, False: 64 + 28}

# Not HANDSHAKE_FAILED_PROTOCOL: libzmq 4.3 emits it between a frame that fails its MAC or nonce check and
# the errno test that decides to drop the connection, and the monitor send leaves errno at EAGAIN: with
# that event monitored, a replayed or altered frame stalls the connection instead of closing it.
_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_ACCEPT_FAILED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
           | zmq.EVENT_HANDSHAKE_SUCCEEDED)


@dataclass
class _Pending:
    since: float
    peer: tuple[str, int]


class _Throttle:
    """At most ``per`` log lines per ``window`` seconds per kind, then one line counting the rest."""

    def __init__(self, per: int = 10, window: float = 10.0):
        self.per, self.window = per, window
        self.kinds: dict[str, list[float]] = {}

    def __call__(self, kind: str, fmt: str, *args: Any) -> None:
        now = time.monotonic()
        w = self.kinds.setdefault(kind, [now, 0, 0])
        if now - w[0] >= self.window:
            if w[2]:
                log.warning("%d more %s line(s) not logged", w[2], kind)
            w[:] = [now, 0, 0]
        if w[1] < self.per:
            w[1] += 1
            log.warning(fmt, *args)
        else:
            w[2] += 1


def _peer(fd: int) -> tuple[socket.socket, tuple[str, int]] | None:
    """A duplicate of descriptor ``fd`` and its peer address, or None when it is no connected socket now."""
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        return dup, dup.getpeername()[:2]
    except OSError:
        dup.close()
        return None


def _bytes_written(sock: socket.socket) -> int | None:
    """Bytes this end wrote on a TCP connection: acknowledged by the peer plus still queued (None: not Linux)."""
    if not hasattr(socket, "TCP_INFO"):  # pragma: no cover - Linux only
        return None
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
    if len(info) < 128:  # pragma: no cover - kernels before 4.1 lack tcpi_bytes_acked
        return None
    acked = struct.unpack_from("Q", info, 120)[0]
    queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    return acked + queued


class Door:
    """The ZAP handler and connection guard of one pserver's ROUTER socket (a daemon thread)."""

    def __init__(self, ctx: zmq.Context, router: zmq.Socket, creds: Credentials | None, name: str, *,
                 max_pending: int = 32, max_pending_per_source: int = 8,
                 deadline: float = HANDSHAKE_TIMEOUT_MS / 1000):
        self.name = name
        self.creds = creds
        self.max_pending = max_pending
        self.max_pending_per_source = max_pending_per_source
        self.deadline = deadline
        # accepted - authenticated: connections that never finished the handshake (refused, evicted, pending)
        self.stats: dict[str, int] = Counter({"accepted": 0, "authenticated": 0, "closed": 0, "refused_keys": 0,
                                              "evicted": 0, "accept_failures": 0, "door_errors": 0})
        self._pending: dict[int, _Pending] = {}  # fd -> pending connection, oldest first
        self._sources: Counter[str] = Counter()
        self._throttle = _Throttle()
        self._stop = threading.Event()
        self._zap: zmq.Socket | None = None
        if creds is not None:  # bound before the ROUTER binds, so no handshake ever finds no handler
            self._zap = ctx.socket(zmq.REP)
            self._zap.setsockopt(zmq.LINGER, 0)
            self._zap.bind(ZAP_ENDPOINT)
        self._monitor = router.get_monitor_socket(_EVENTS)
        self._monitor.setsockopt(zmq.LINGER, 0)
        self._router = router
        self._thread = threading.Thread(target=self._run, name=f"{name} door", daemon=True)

    def start(self) -> None:
        """Start answering ZAP requests and watching connections."""
        self._thread.start()

    def close(self) -> None:
        """Stop the thread and close its sockets (before the ROUTER closes and the context ends)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        else:
            self._close_sockets()

    @property
    def pending(self) -> int:
        """Connections accepted whose handshake has not finished (as far as the guard knows)."""
        return len(self._pending)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._monitor, zmq.POLLIN)
        if self._zap is not None:
            poller.register(self._zap, zmq.POLLIN)
        next_sweep = time.monotonic() + 1.0
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(100))
                if self._zap in ready:  # first: a handshake waiting for its answer must not look pending long
                    self._guarded(self._answer_zap)
                if self._monitor in ready:
                    self._guarded(self._read_events)
                if time.monotonic() >= next_sweep:
                    self._guarded(self._sweep)
                    next_sweep = time.monotonic() + 1.0
        finally:
            self._close_sockets()

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # one bad event must not stop the door (nobody could connect any more)
            self.stats["door_errors"] += 1
            self._throttle("door error", "%s: error at the door (contained): %s: %s", self.name,
                           type(exc).__name__, exc)

    def _close_sockets(self) -> None:
        try:
            self._router.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(0)
        if self._zap is not None:
            self._zap.close(0)

    # ------------------------------------------------------------------ ZAP (RFC 27)

    def _answer_zap(self) -> None:
        assert self._zap is not None and self.creds is not None
        while self._zap.poll(0):
            frames = self._zap.recv_multipart()
            if len(frames) < 6:  # libzmq always sends >= 6 frames; answer anything else with a refusal
                self._zap.send_multipart([b"1.0", b"", b"500", b"malformed ZAP request", b"", b""])
                continue
            version, request_id, _domain, address, _identity, mechanism = frames[:6]
            credentials = frames[6:]
            ok = (mechanism == b"CURVE" and len(credentials) == 1
                  and credentials[0] == self.creds.client_public_raw)
            if not ok:
                self.stats["refused_keys"] += 1
                self._throttle("refused key", "%s: refused a connection from %s: its %s key is not this job's "
                               "(another CLUSTERCTL_JOB_TOKEN?)", self.name, address.decode(errors="replace"),
                               mechanism.decode(errors="replace"))
            self._zap.send_multipart([version, request_id, b"200" if ok else b"400",
                                      b"OK" if ok else b"not this job's key", b"trainer" if ok else b"", b""])

    # ------------------------------------------------------------------ connections

    def _read_events(self) -> None:
        while self._monitor.poll(0):
            ev = parse_monitor_message(self._monitor.recv_multipart())
            event, value = ev["event"], ev["value"]
            if event == zmq.EVENT_ACCEPTED:
                self.stats["accepted"] += 1
                self._accepted(value)
            elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                self.stats["closed"] += 1
                self._forget(value)
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.stats["authenticated"] += 1
                self._settle()
            elif event == zmq.EVENT_ACCEPT_FAILED:
                self.stats["accept_failures"] += 1
                self._throttle("accept failure", "%s: accept() failed: %s", self.name, os.strerror(value))

    def _accepted(self, fd: int) -> None:
        self._forget(fd)  # a descriptor number libzmq reused
        found = _peer(fd)
        if found is None:  # gone already
            return
        dup, peer = found
        dup.close()
        self._pending[fd] = _Pending(time.monotonic(), peer)
        self._sources[peer[0]] += 1
        if self._sources[peer[0]] > self.max_pending_per_source:
            self._evict_oldest(peer[0])
        while len(self._pending) > self.max_pending:
            self._evict_oldest(None)

    def _forget(self, fd: int) -> _Pending | None:
        conn = self._pending.pop(fd, None)
        if conn is not None:
            self._sources[conn.peer[0]] -= 1
            if not self._sources[conn.peer[0]]:
                del self._sources[conn.peer[0]]
        return conn

    def _evict_oldest(self, source: str | None) -> None:
        """Shut down the oldest pending connection (from ``source``, or from anywhere) that is still pending."""
        for fd, conn in list(self._pending.items()):
            if source is not None and conn.peer[0] != source:
                continue
            state = self._state(fd, conn)
            self._forget(fd)
            if state == "pending":
                self.stats["evicted"] += 1
                self._throttle("eviction", "%s: too many connections waiting to authenticate%s; dropped the "
                               "oldest, from %s:%d", self.name, f" from {source}" if source else "", *conn.peer)
                return

    def _state(self, fd: int, conn: _Pending, *, shut: bool = True) -> str:
        """``gone``, ``done`` (handshake written out) or ``pending`` (shut down when ``shut``)."""
        found = _peer(fd)
        if found is None:
            return "gone"
        dup, peer = found
        try:
            if peer != conn.peer:
                return "gone"  # the descriptor names another connection now
            written = _bytes_written(dup)
            if written is None or written >= _DONE_BYTES[self.creds is not None]:
                return "done"  # (cannot tell: never evicted; libzmq's handshake deadline still applies)
            if shut:
                dup.shutdown(socket.SHUT_RDWR)  # libzmq sees the end of the stream and closes its descriptor
            return "pending"
        finally:
            dup.close()

    def _settle(self) -> None:
        """A handshake succeeded somewhere: stop counting the connections whose handshake is written out."""
        for fd, conn in list(self._pending.items()):
            if self._state(fd, conn, shut=False) != "pending":
                self._forget(fd)

    def _sweep(self) -> None:
        """Connections pending past the deadline: libzmq drops those; forget the ones that finished."""
        limit = time.monotonic() - self.deadline - 1.0
        for fd, conn in list(self._pending.items()):
            if conn.since > limit:
                break
            if self._state(fd, conn) == "pending":
                self.stats["evicted"] += 1
            self._forget(fd)
