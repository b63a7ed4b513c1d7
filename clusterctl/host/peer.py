"""The peer's link to the coordinator: connect (non-blocking, with back-off), authenticate both ways, heartbeats.

`PeerLink` owns the connection, the handshake and the timers; it tells its handler (the supervisor) when
the coordinator welcomed this host, what it says afterwards, and when the connection was lost. Whether
having no coordinator fails the job is the rules' call (rules.on_coordinator_silence), from what the link
records: whether it ever connected, since when it is lost, and why. A refusal before the welcome (an
`error` line, a protocol version this agent does not speak, a coordinator that does not prove the token)
is one failed try: the link keeps trying, with back-off, for as long as the handler wants it to.
"""

import errno
import os
import selectors
import socket
import time

from .jobfile import format_endpoint
from .protocol import (AUTH_TIMEOUT, BACKOFF_MAX, BACKOFF_MIN, SEND_TIMEOUT, Conn, Msg, ProtocolError, _brief,
                       auth_proof, hello, parse_message, ping, proof_ok, version_mismatch)

__all__ = ["PeerLink", "CONNECT_TIMEOUT"]

CONNECT_TIMEOUT = 1.0  # one TCP connection attempt
# Until the first welcome the back-off stops at this (not BACKOFF_MAX): every host's supervisor starts at about
# the same time and the job starts only once all have joined (the start barrier), so a peer that came up
# before its coordinator listens must not sleep a second between tries.
JOIN_BACKOFF_MAX = 0.25


def _printable(text, limit=200):
    return "".join(c if c.isprintable() else "?" for c in str(text)[:limit])


class PeerLink:
    """A peer supervisor's connection to the coordinator.

    `handler` has hello_fields() (the hello's exits, stopping, attempt, idle, failed), coordinator_welcomed(),
    coordinator_message(msg) (a parsed message) and coordinator_lost(why)."""

    def __init__(self, loop, job_id, host, address, port, token, timings, handler, log_bad, clock=time.monotonic):
        self.loop = loop
        self.job_id, self.host = job_id, host
        self.address, self.port = address, port
        self.token = token
        self.timings = timings
        self.handler = handler
        self.log_bad = log_bad
        self.clock = clock
        self.conn = None  # connected (maybe not yet welcomed)
        self.connecting = None  # a socket whose connect is in progress
        self.connect_deadline = 0.0
        self.welcomed = False
        self.ever_connected = False  # welcomed at least once
        self.lost_since = None  # since the last welcome, across failed reconnections
        self.lost_why = None
        self.last_error = None  # why the last try failed (before any welcome)
        self.rejection = None  # the coordinator's last refusal, kept until a welcome
        self.backoff = BACKOFF_MIN
        self.next_try = 0.0
        self.tries = 0

    @property
    def endpoint(self):
        """address:port ([v6]:port)."""
        return format_endpoint(self.address, self.port)

    @property
    def connected(self):
        """Connected and welcomed (the coordinator proved the token)."""
        return self.conn is not None and self.welcomed

    def why(self):
        """Why there is no coordinator: the loss after a welcome, else the last refusal or failed try."""
        if self.ever_connected:
            return self.lost_why
        return self.rejection or self.last_error

    def send(self, msg):
        """Send to the coordinator once welcomed; False otherwise (a broken connection is lost)."""
        if not self.connected:
            return False
        if self.conn.send(msg):
            return True
        self.lose("send failed")
        return False

    def tick(self, now, keep_trying=True):
        """Timers: the connect and authentication deadlines, heartbeats, silence; a new try when due."""
        if self.connecting is not None:
            if now > self.connect_deadline:
                self._try_failed("timed out")
            return
        conn = self.conn
        if conn is not None and not self.welcomed:
            if now > conn.deadline:
                self.lose("coordinator did not authenticate within %.0fs" % AUTH_TIMEOUT)
            elif self.lost_since is not None and now - conn.opened > self.timings.reconnect_timeout:
                # reconnected, but nobody answers (a frozen or cut-off coordinator host still completes TCP handshakes)
                self.lose("no answer from the coordinator within %.1fs" % self.timings.reconnect_timeout)
            return
        if conn is not None:
            if now - conn.last_tx >= self.timings.heartbeat and not self.send(ping()):
                return
            if now - conn.last_rx > self.timings.peer_timeout:
                self.lose("no heartbeat for %.1fs" % (now - conn.last_rx))
            return
        if keep_trying and now >= self.next_try:
            self._connect(now)

    def _connect(self, now):
        """Start a non-blocking connection attempt (and schedule the next one: back-off with jitter)."""
        self.tries += 1
        delay = self.backoff * (0.5 + 0.5 * int.from_bytes(os.urandom(2), "big") / 65535.0)
        self.next_try = now + delay
        self.backoff = min(self.backoff * 2, BACKOFF_MAX if self.ever_connected else JOIN_BACKOFF_MAX)
        try:
            family, kind, proto, _, sockaddr = socket.getaddrinfo(self.address, self.port, type=socket.SOCK_STREAM)[0]
            sock = socket.socket(family, kind, proto)
        except OSError as e:
            self.last_error = getattr(e, "strerror", None) or str(e)
            return
        sock.setblocking(False)
        err = sock.connect_ex(sockaddr)
        if err not in (0, errno.EINPROGRESS, errno.EAGAIN, errno.EWOULDBLOCK):
            sock.close()
            self.last_error = os.strerror(err)
            return
        self.connecting = sock
        self.connect_deadline = now + CONNECT_TIMEOUT
        self.loop.register(sock, self._on_connected, selectors.EVENT_WRITE)

    def _try_failed(self, why):
        sock, self.connecting = self.connecting, None
        self.loop.unregister(sock)
        sock.close()
        self.last_error = why

    def _on_connected(self, sock):
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            return self._try_failed(os.strerror(err))
        self.loop.unregister(sock)
        self.connecting = None
        sock.settimeout(SEND_TIMEOUT)
        # the hello goes out only in answer to the coordinator's challenge (_handshake)
        self.conn = Conn(sock, self.endpoint, self.clock(), clock=self.clock)
        self.loop.register(sock, self._on_readable)

    def lose(self, why):
        """Close the connection; after a welcome the coordinator is lost (the handler hears it)."""
        conn = self.conn
        if conn is None:
            return
        self.loop.unregister(conn.sock)
        conn.close()
        self.conn = None
        was_welcomed, self.welcomed = self.welcomed, False
        if not was_welcomed:  # a try that never authenticated: the loss (if any) dates from earlier
            self.last_error = why
            self.log_bad("connect", "connection to coordinator failed (%s); retrying" % why)
            return
        if self.lost_since is None:
            self.lost_since = self.clock()
        self.lost_why = why
        self.handler.coordinator_lost(why)

    def _on_readable(self, sock):
        conn = self.conn
        if conn is None or conn.sock is not sock:
            self.loop.unregister(sock)
            sock.close()
            return
        try:
            objs = conn.receive()
        except ProtocolError as e:
            self.log_bad("garbage", "garbage from coordinator %s: %s; closing" % (conn.addr, e))
            return self.lose("protocol error: %s" % e)
        if objs is None:
            return self.lose("connection closed by coordinator")
        for obj in objs:
            if not self.welcomed:
                self._handshake(conn, obj)
            else:
                try:
                    msg = parse_message(obj)
                except ProtocolError as e:
                    self.log_bad("bad-message", "bad message %s from coordinator: %s" % (_brief(obj), e))
                    return self.lose("bad message from coordinator: %s" % e)
                if msg["type"] == Msg.ERROR:
                    return self.lose("coordinator sent an error: %s" % _printable(msg["error"]))
                if msg["type"] not in (Msg.PING, Msg.WELCOME):
                    self.handler.coordinator_message(msg)
            if self.conn is not conn:
                return

    def _handshake(self, conn, obj):
        """Nothing the other end says counts until it has proved the token over our nonce."""
        kind = obj.get("type")
        if kind == Msg.CHALLENGE and conn.their_nonce is None:
            # the coordinator's version: in its challenge, which the welcome's proof covers
            mismatch = version_mismatch(obj, "this host's agent", "coordinator %s" % self.endpoint)
            if mismatch is not None:
                self.rejection = mismatch + " (upload the same agent to every host)"
                self.log_bad("rejected", self.rejection + "; retrying")
                return self.lose(self.rejection)
            try:
                nonce = parse_message(obj)["nonce"]
            except ProtocolError:
                return self.lose("malformed challenge from %s" % self.endpoint)
            conn.their_nonce = nonce
            proof = auth_proof(self.token, "peer", self.job_id, self.host, nonce, conn.nonce)
            if not conn.send(hello(self.job_id, self.host, conn.nonce, proof, **self.handler.hello_fields())):
                self.lose("send failed")
        elif kind == Msg.WELCOME and conn.their_nonce is not None and proof_ok(
                auth_proof(self.token, "coordinator", self.job_id, self.host, conn.their_nonce, conn.nonce),
                obj.get("proof")):
            self.welcomed = self.ever_connected = True
            self.backoff = BACKOFF_MIN
            self.lost_since = self.lost_why = self.rejection = None
            self.handler.coordinator_welcomed()
        elif kind == Msg.ERROR and conn.their_nonce is not None:
            # unauthenticated (anyone on the coordinator's port may send it): one failed try, not a verdict
            self.rejection = "coordinator rejected this host: %s" % _printable(obj.get("error"))
            self.log_bad("rejected", self.rejection + "; retrying")
            self.lose(self.rejection)
        else:
            self.log_bad("impostor", "coordinator %s did not prove the job token (sent %s); closing"
                         % (conn.addr, _brief(kind, 40)))
            self.lose("coordinator did not prove the job token")

    def close(self):
        """Close the connection (and a connection attempt)."""
        if self.connecting is not None:
            self.loop.unregister(self.connecting)
            self.connecting.close()
            self.connecting = None
        if self.conn is not None:
            self.loop.unregister(self.conn.sock)
            self.conn.close()
            self.conn = None
