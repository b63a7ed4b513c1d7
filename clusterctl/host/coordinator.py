"""The coordinator's link: the listener, the unauthenticated connections (bounded), the authenticated peers.

`CoordinatorLink` owns the sockets, the authentication and the per-connection timers; what an
authenticated peer says goes to its handler (the supervisor), which applies the rules. The listener
survives a flood (docs/agent.md, "Flood limits"): at most MAX_PENDING unauthenticated connections, at most
MAX_PENDING_PER_SOURCE from one address (a new one evicts the oldest: idle sockets never keep a peer out),
all of them within the descriptors left to the process (RLIMIT_NOFILE, less RESERVED_FDS),
AUTH_TIMEOUT to authenticate (a connection about to be evicted is read first: a hello that already
arrived is honoured), one line of garbage (blank, not an object, too long, too deep, not a hello)
drops the connection, and an accept error (EMFILE, ENFILE, ...) evicts the oldest unauthenticated
connection to make room, or, with none left, pauses accepting for ACCEPT_PAUSE: it never ends anything.
"""

import collections
import errno
import os
import resource
import socket
import time

from .jobfile import format_endpoint
from .protocol import (AUTH_TIMEOUT, SEND_TIMEOUT, Conn, Msg, ProtocolError, _brief, auth_proof, challenge,
                       error, parse_message, ping, proof_ok, version_mismatch, welcome)

__all__ = ["CoordinatorLink", "MAX_PENDING", "MAX_PENDING_PER_SOURCE", "ACCEPT_PAUSE", "ACCEPT_BATCH"]

MAX_PENDING = 64  # unauthenticated connections kept at once (a new one evicts the oldest)
MAX_PENDING_PER_SOURCE = 16  # of them from one address (a new one evicts that address's oldest)
ACCEPT_PAUSE = 0.5  # seconds without accepting after an accept error such as EMFILE
ACCEPT_BATCH = 64  # connections accepted per readiness event (the rest on the next one)
MIN_PENDING = 4  # however few descriptors are left, this many unauthenticated connections are kept
RESERVED_FDS = 64  # descriptors kept free for the supervisor's own work (peers, logs, /proc, state.json, spawning)
# accept errors that say "no resources now" (the listener is fine; try again later)
_ACCEPT_PAUSE_ERRNOS = frozenset(e for e in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM) if e)


def fd_budget():
    """How many more descriptors this process may open, less RESERVED_FDS (a large number where unknown)."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        used = len(os.listdir("/proc/self/fd"))
    except (OSError, ValueError):
        return MAX_PENDING
    if soft == resource.RLIM_INFINITY:
        return MAX_PENDING
    return soft - used - RESERVED_FDS


class CoordinatorLink:
    """Listens on the job's control endpoint; authenticates peers; hands their messages to `handler`.

    `handler` has peer_joined(host, addr, hello), peer_message(host, msg) and peer_left(host, why), and may
    have refuse(host, hello): a reason to refuse a hello whose proof is good (sent as the `error`), or None;
    `hello` and `msg` are parsed messages (protocol.parse_message)."""

    def __init__(self, loop, job_id, address, port, token, timings, handler, log_bad, clock=time.monotonic,
                 max_pending=MAX_PENDING, max_per_source=MAX_PENDING_PER_SOURCE, auth_timeout=AUTH_TIMEOUT):
        self.loop = loop
        self.job_id = job_id
        self.address, self.port = address, port
        self.token = token
        self.timings = timings
        self.handler = handler
        self.log_bad = log_bad
        self.clock = clock
        self.max_pending, self.max_per_source, self.auth_timeout = max_pending, max_per_source, auth_timeout
        self.listener = None
        self.pending = collections.OrderedDict()  # sock -> Conn, oldest first
        self.by_source = collections.Counter()  # source address -> unauthenticated connections from it
        self.peers = {}  # host label -> Conn
        self.by_sock = {}  # sock -> Conn of an authenticated peer
        self.accept_paused_until = None
        self.counts = collections.Counter()  # rejected (all dropped unauthenticated), evicted, garbage, accept_errors

    @property
    def endpoint(self):
        """address:port ([v6]:port)."""
        return format_endpoint(self.address, self.port)

    def listen(self):
        """Open the listening socket; None, or why it cannot."""
        try:
            fam = socket.AF_INET6 if ":" in self.address else socket.AF_INET
            self.listener = socket.create_server((self.address, self.port), family=fam, backlog=1024)
        except OSError as e:
            return "cannot listen on %s: %s" % (self.endpoint, os.strerror(e.errno) if e.errno else e)
        self.listener.setblocking(False)
        self.loop.register(self.listener, self._on_accept)
        self.max_pending = min(self.max_pending, max(MIN_PENDING, fd_budget()))
        self.max_per_source = min(self.max_per_source, self.max_pending)
        return None

    # -- unauthenticated connections ------------------------------------------------------------------------

    def _on_accept(self, listener):
        made_room = False
        for _ in range(ACCEPT_BATCH):
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self.counts["accept_errors"] += 1
                if e.errno not in _ACCEPT_PAUSE_ERRNOS:
                    continue  # ECONNABORTED and the like: that one connection is gone
                if self.pending and not made_room:  # out of descriptors: the oldest unauthenticated one makes room
                    self._evict(next(iter(self.pending.values())), "cannot accept (%s)" % os.strerror(e.errno))
                    made_room = True
                    continue
                self.log_bad("accept", "cannot accept connections (%s); pausing %.1fs"
                             % (os.strerror(e.errno), ACCEPT_PAUSE))
                self.loop.unregister(self.listener)
                self.accept_paused_until = self.clock() + ACCEPT_PAUSE
                return
            made_room = False
            self._admit(sock, addr)

    def _admit(self, sock, addr):
        source = addr[0] if isinstance(addr, tuple) else str(addr)
        while self.by_source[source] >= self.max_per_source:
            oldest = next(c for c in self.pending.values() if c.source == source)
            self._make_room(oldest, "more than %d unauthenticated connections from %s" % (self.max_per_source, source))
        while len(self.pending) >= self.max_pending:
            self._make_room(next(iter(self.pending.values())),
                            "more than %d unauthenticated connections" % self.max_pending)
        sock.settimeout(SEND_TIMEOUT)
        conn = Conn(sock, addr, self.clock(), self.auth_timeout, self.clock)
        self.pending[sock] = conn
        self.by_source[source] += 1
        self.loop.register(sock, self._on_readable)
        # mutual authentication: the peer proves the token over this nonce and its own, and so do we
        if not conn.send(challenge(conn.nonce)):
            self._drop_pending(conn, "send failed")

    def _make_room(self, conn, why):
        """Take `conn` out of the pending ones: first read what it already sent (a peer whose hello waits
        unread gets in, garbage is dropped as garbage), else evict it."""
        self._on_readable(conn.sock)
        if conn.sock in self.pending:
            self._evict(conn, why)

    def _evict(self, conn, why):
        self.counts["evicted"] += 1
        self.log_bad("overload", "%s; dropping the oldest, from %s" % (why, conn.addr))
        self._drop_pending(conn, why)

    def _drop_pending(self, conn, why):
        """Close an unauthenticated connection (counted: state.json coordinator.rejected_connections)."""
        self.loop.unregister(conn.sock)
        if self.pending.pop(conn.sock, None) is not None:
            self.counts["rejected"] += 1
            self.counts["unauthenticated_bytes"] += conn.received
            self.by_source[conn.source] -= 1
            if self.by_source[conn.source] <= 0:
                del self.by_source[conn.source]
        conn.close()

    def _reject(self, conn, why, text):
        self.log_bad("rejected", "rejected connection from %s: %s" % (conn.addr, why))
        conn.send(error(text))
        self._drop_pending(conn, why)

    def _on_readable(self, sock):
        conn = self.pending.get(sock) or self.by_sock.get(sock)
        if conn is None:  # not ours any more
            self.loop.unregister(sock)
            sock.close()
            return
        try:
            objs = conn.receive()
        except ProtocolError as e:
            self.counts["garbage"] += 1
            self.log_bad("garbage", "garbage from %s (%s): %s; closing" % (conn.addr, conn.host or "unauthenticated", e))
            if conn.authed:
                self.drop_peer(conn.host, "protocol error: %s" % e)
            else:
                self._drop_pending(conn, "garbage")
            return
        if objs is None:
            if conn.authed:
                self.drop_peer(conn.host, "connection closed")
            else:
                self._drop_pending(conn, "connection closed")
            return
        for obj in objs:
            if not conn.authed:
                self._hello(conn, obj)
                if not conn.authed:
                    return
                continue
            if self.peers.get(conn.host) is not conn:
                return  # dropped while handling an earlier line
            try:
                msg = parse_message(obj)
            except ProtocolError as e:
                self.log_bad("bad-message", "ignoring message %s from %s: %s" % (_brief(obj), conn.host, e))
                continue
            if msg["type"] == Msg.PING:
                continue
            self.handler.peer_message(conn.host, msg)

    def _hello(self, conn, obj):
        if obj.get("type") != Msg.HELLO:
            return self._reject(conn, "first message is not a hello", "expected hello")
        mismatch = version_mismatch(obj, "coordinator", "peer")
        if mismatch is not None:  # one line naming both versions, sent to the peer
            return self._reject(conn, "protocol version %s" % _brief(obj.get("version"), 20), mismatch)
        try:
            msg = parse_message(obj)
        except ProtocolError as e:
            return self._reject(conn, str(e), "malformed hello")
        host = msg["host"]
        want = auth_proof(self.token, "peer", msg["job"], host, conn.nonce, msg["nonce"])
        if not proof_ok(want, msg["proof"]):
            return self._reject(conn, "bad token", "bad token")
        if msg["job"] != self.job_id:
            return self._reject(conn, "wrong job %s" % _brief(msg["job"]), "wrong job")
        refuse = getattr(self.handler, "refuse", None)  # the handler's own check (an elastic host's index)
        refusal = refuse(host, msg) if refuse is not None else None
        if refusal is not None:
            return self._reject(conn, refusal, refusal)
        del self.pending[conn.sock]
        self.by_source[conn.source] -= 1
        if self.by_source[conn.source] <= 0:
            del self.by_source[conn.source]
        old = self.peers.get(host)
        if old is not None:  # it reconnected before we noticed the old connection die
            self.loop.unregister(old.sock)
            self.by_sock.pop(old.sock, None)
            old.close()
        conn.authed, conn.host = True, host
        self.peers[host] = conn
        self.by_sock[conn.sock] = conn
        proof = auth_proof(self.token, "coordinator", self.job_id, host, conn.nonce, msg["nonce"])
        if not conn.send(welcome(self.job_id, proof)):
            return self.drop_peer(host, "send failed")
        self.handler.peer_joined(host, conn.addr, msg)

    # -- authenticated peers --------------------------------------------------------------------------------

    def send(self, host, msg):
        """Send to one peer; a broken connection drops it (the handler hears peer_left). True if sent."""
        conn = self.peers.get(host)
        if conn is None:
            return False
        if conn.send(msg):
            return True
        self.drop_peer(host, "send failed")
        return False

    def broadcast(self, msg):
        """Send to every authenticated peer."""
        for host in list(self.peers):
            self.send(host, msg)

    def drop_peer(self, host, why):
        """Close a peer's connection; the handler hears peer_left(host, why)."""
        conn = self.peers.pop(host, None)
        if conn is None:
            return
        self.loop.unregister(conn.sock)
        self.by_sock.pop(conn.sock, None)
        conn.close()
        self.handler.peer_left(host, why)

    def connected(self):
        """The labels of the authenticated peers."""
        return set(self.peers)

    def tick(self, now):
        """Auth deadlines, heartbeats, silent peers, and accepting again after a pause."""
        if self.accept_paused_until is not None and now >= self.accept_paused_until and self.listener is not None:
            self.accept_paused_until = None
            self.loop.register(self.listener, self._on_accept)
        while self.pending:  # oldest first: they expire in order
            conn = next(iter(self.pending.values()))
            if now <= conn.deadline:
                break
            self.log_bad("rejected", "rejected connection from %s: no hello within %.0fs" % (conn.addr, self.auth_timeout))
            self._drop_pending(conn, "no hello")
        for host, conn in list(self.peers.items()):
            if now - conn.last_tx >= self.timings.heartbeat and not self.send(host, ping()):
                continue
            if now - conn.last_rx > self.timings.peer_timeout:
                self.drop_peer(host, "no heartbeat for %.1fs" % (now - conn.last_rx))

    def close(self):
        """Close every connection and the listener."""
        for conn in list(self.pending.values()) + list(self.peers.values()):
            self.loop.unregister(conn.sock)
            conn.close()
        self.pending.clear()
        self.peers.clear()
        self.by_sock.clear()
        if self.listener is not None:
            self.loop.unregister(self.listener)
            self.listener.close()
            self.listener = None

    def stats(self):
        """Counters for state.json's coordinator section."""
        return {"rejected_connections": self.counts["rejected"], "evicted_connections": self.counts["evicted"],
                "garbage_connections": self.counts["garbage"], "accept_errors": self.counts["accept_errors"],
                "pending_connections": len(self.pending),
                "unauthenticated_bytes": self.counts["unauthenticated_bytes"]}
