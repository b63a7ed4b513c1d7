"""The peer role of a supervisor: connects to the coordinator, proves the token, reports exits, obeys stops.

A mixin of clusterctl/host/supervisor.py's `Supervisor`. A peer reconnects with back-off when it loses
the coordinator; its hello carries what the coordinator may have missed (exits, a stop, being idle).
"""

import os
import selectors
import socket
import time

from .common import log
from .jobfile import format_endpoint
from .protocol import (AUTH_TIMEOUT, BACKOFF_MAX, BACKOFF_MIN, NONCE_BYTES, PROTOCOL_VERSION, Conn, _brief,
                       auth_proof, proof_ok, version_mismatch)
from .states import TERMINAL_JOB_STATES, JobState


class PeerRole:
    """The peer's side of the protocol (mixed into Supervisor)."""

    def _init_peer(self):
        self.conn = None
        self.ever_connected = False
        self.welcomed = False
        self.lost_since = None
        self.lost_why = None
        self.rejected = False
        self.next_attempt = 0.0
        self.backoff = BACKOFF_MIN
        self.last_error = None

    def _peer_tick(self, now):
        if self.conn is not None and not self.welcomed:
            if now > self.conn.deadline:
                self._peer_lost("coordinator did not authenticate within %.0fs" % AUTH_TIMEOUT)
            elif (self.lost_since is not None
                  and now - (self.conn.deadline - AUTH_TIMEOUT) > self.timing["reconnect_timeout"]):
                # reconnected, but nobody answers (a frozen or cut-off coordinator host still completes TCP handshakes)
                self._peer_lost("no answer from the coordinator within %.1fs" % self.timing["reconnect_timeout"])
            else:
                return
        if self.conn is not None:
            if now - self.conn.last_tx >= self.timing["heartbeat"]:
                if not self.conn.send({"type": "ping"}):
                    self._peer_lost("send failed")
                    return
            if now - self.conn.last_rx > self.timing["peer_timeout"]:
                self._peer_lost("no heartbeat for %.1fs" % (now - self.conn.last_rx))
            return
        if self.rejected or (self.outcome is not None and self.final):
            return
        ep = format_endpoint(self.coord["address"], self.coord["port"])
        if not self.ever_connected and now - self.t0 > self.timing["connect_timeout"]:
            why = "could not connect to coordinator %s within %.0fs: %s" % (
                ep, self.timing["connect_timeout"], self.last_error)
            if self.outcome is None:
                self.decide(JobState.FAILED, why, restart=False)
            else:
                self._finalize(self.outcome, self.reason, self.failure)
            return
        if self.ever_connected:
            away = now - self.lost_since
            if self.outcome is None and away > self.timing["reconnect_timeout"]:
                # stop our processes; with restarts left, keep trying to rejoin the coordinator
                self.decide(JobState.FAILED, "lost connection to coordinator %s: %s" % (ep, self.lost_why),
                            restart=self.attempt < self.restarts)
                return
            if (self.outcome is not None and not self.final
                    and away > self.timing["reconnect_timeout"] + self.timing["connect_timeout"]):
                self._finalize(JobState.FAILED, "lost connection to coordinator %s and could not rejoin within %.0fs: %s"
                               % (ep, self.timing["connect_timeout"], self.lost_why), self.failure)
                return
        if now < self.next_attempt:
            return
        self._next_backoff()
        try:
            sock = socket.create_connection((self.coord["address"], self.coord["port"]), timeout=1.0)
        except OSError as e:
            self.last_error = e.strerror or str(e)
            return
        sock.settimeout(2.0)
        # the hello goes out only in answer to the coordinator's challenge (_peer_message)
        self.conn = Conn(sock, ep, time.monotonic())
        self.sel.register(sock, selectors.EVENT_READ, self._on_readable)

    def _next_backoff(self):
        """Peer: schedule the next connection attempt (exponential back-off with jitter)."""
        delay = self.backoff * (0.5 + 0.5 * int.from_bytes(os.urandom(2), "big") / 65535.0)
        self.next_attempt = time.monotonic() + delay
        self.backoff = min(self.backoff * 2, BACKOFF_MAX)

    def _peer_challenge(self, msg):
        """Peer: answer the coordinator's challenge with our proof of the token and our own nonce."""
        ep = format_endpoint(self.coord["address"], self.coord["port"])
        conn = self.conn
        mismatch = version_mismatch(msg, "this host's agent", "coordinator %s" % ep)
        if mismatch is not None:  # the coordinator's version: in its challenge, which the welcome's proof covers
            why = mismatch + " (upload the same agent to every host)"
            self.rejected = True
            self._peer_lost(why)
            self.decide(JobState.FAILED, why)
            return
        nonce = msg.get("nonce")
        if conn.their_nonce is not None or not isinstance(nonce, str) or len(nonce) != 2 * NONCE_BYTES:
            self._peer_lost("malformed challenge from %s" % ep)
            return
        conn.their_nonce = nonce
        hello = {"type": "hello", "job": self.job_id, "host": self.host, "version": PROTOCOL_VERSION,
                 "nonce": conn.nonce,
                 "proof": auth_proof(self.coord["token"], "peer", self.job_id, self.host, nonce, conn.nonce),
                 "exits": self.local_exits, "stopping": self.reason if self.term_requested else None,
                 "attempt": self.attempt, "idle": self.stop_done,
                 "failed": self.reason if self.outcome == JobState.FAILED and self.decided_at is not None else None}
        if not conn.send(hello):
            self._peer_lost("send failed")

    def _rejected(self, msg):
        """The coordinator refused this host: the job fails here. Its text is the other end's: cut short."""
        self.rejected = True
        why = "coordinator rejected this host: %s" % "".join(
            c if c.isprintable() else "?" for c in str(msg.get("error"))[:200])
        log(why)
        self._peer_lost(why)
        self.decide(JobState.FAILED, why)

    def _peer_lost(self, why):
        if self.conn is None:
            return
        try:
            self.sel.unregister(self.conn.sock)
        except (KeyError, ValueError):
            pass
        self.conn.close()
        self.conn = None
        was_welcomed, self.welcomed = self.welcomed, False
        self.dirty = True
        if not was_welcomed:  # an attempt that never authenticated: the loss (if any) dates from earlier
            self.last_error = why
            if self.outcome is None:
                self.log_bad("connect", "connection to coordinator failed (%s); retrying" % why)
            return
        if self.lost_since is None:  # since the last welcome, across failed reconnections
            self.lost_since = time.monotonic()
        self.lost_why = why
        if self.outcome is None:
            log("lost coordinator connection (%s); retrying for %.1fs" % (why, self.timing["reconnect_timeout"]))

    def _peer_message(self, msg):
        kind = msg["type"]
        conn = self.conn
        if not self.welcomed:
            # nothing the other end says counts until it has proved the token over our nonce
            if kind == "challenge":
                self._peer_challenge(msg)
            elif kind == "welcome" and conn.their_nonce is not None and proof_ok(
                    auth_proof(self.coord["token"], "coordinator", self.job_id, self.host, conn.their_nonce,
                               conn.nonce), msg.get("proof")):
                self.welcomed = True
                self.backoff = BACKOFF_MIN
                self.dirty = True
                log("connected to coordinator %s" % conn.addr)
                self.ever_connected = True
                self.lost_since = None
            elif kind == "error" and conn.their_nonce is not None:
                # unauthenticated, but only the coordinator (or whoever holds its port) sends it
                self._rejected(msg)
            else:
                self.log_bad("impostor", "coordinator %s did not prove the job token (sent %s); closing"
                             % (conn.addr, _brief(kind, 40)))
                self._peer_lost("coordinator did not prove the job token")
            return
        if kind == "welcome":
            pass
        elif kind == "error":
            self._rejected(msg)
        elif kind == "stop":
            state = msg.get("state") if msg.get("state") in TERMINAL_JOB_STATES else JobState.FAILED
            failure = msg.get("failure") if isinstance(msg.get("failure"), dict) else None
            attempt = msg.get("attempt", self.attempt)
            if isinstance(attempt, int) and attempt < self.attempt:
                return  # about an attempt this host already left
            restart = bool(msg.get("restart")) and state == JobState.FAILED
            if self.outcome is None:
                self.decide(state, str(msg.get("reason")), failure, restart=restart)
            elif not self.final and not restart:
                self._finalize(state, str(msg.get("reason")), failure)
        elif kind == "restart":
            attempt = msg.get("attempt")
            if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt <= self.attempt or self.final:
                return
            if self.outcome is None:  # still running an earlier attempt: stop it first
                self.decide(JobState.FAILED, "the coordinator started attempt %d" % attempt, restart=True)
            if self.stop_done:
                self._next_attempt(attempt)
            else:
                self.pending_restart = attempt
        elif kind != "ping":
            log("ignoring unknown message type %r from coordinator" % kind)
