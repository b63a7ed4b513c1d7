"""The coordinator role of a supervisor: accepts and authenticates peers, applies the job rules, restarts.

A mixin of clusterctl/host/supervisor.py's `Supervisor` (which holds the state it reads and writes):
the coordinator listens on the job's control endpoint, challenges every connection, decides the job's
outcome from every host's process exits, broadcasts stops and restarts, and starts the next attempt once
every host stopped the failed one.
"""

import os
import selectors
import socket
import time

from .common import log
from .jobfile import ROLES, format_endpoint
from .protocol import (AUTH_TIMEOUT, MAX_PENDING, NONCE_BYTES, PROTOCOL_VERSION, Conn, _brief,
                       auth_proof, proof_ok, version_mismatch)
from .spawn import restart_delay
from .states import HostState, JobState

PEER_DONE_LINGER = 5.0  # coordinator: after its own stop, how long it waits for peers' "done"


class CoordinatorRole:
    """The coordinator's side of the protocol and the job-wide rules (mixed into Supervisor)."""

    def _init_coordinator(self):
        self.listener = None
        self.pending = {}
        self.peers = {}  # host label -> Conn
        self.hosts = {}  # host label -> {"state": ..., "since": ...}
        self.exits = {}  # (role, id) -> event
        self.bad_conns = 0  # unauthenticated / malformed connections dropped (coordinator)

    def _listen(self):
        """Open the coordinator's listening socket; None, or why it cannot."""
        ep = format_endpoint(self.coord["address"], self.coord["port"])
        try:
            fam = socket.AF_INET6 if ":" in self.coord["address"] else socket.AF_INET
            self.listener = socket.create_server((self.coord["address"], self.coord["port"]), family=fam)
        except OSError as e:
            return "cannot listen on %s: %s" % (ep, os.strerror(e.errno) if e.errno else e)
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, self._on_accept)
        log("coordinator listening on %s, expecting %d peer(s), %d trainer(s) in total"
            % (ep, self.coord["hosts"] - 1, self.trainers_total))
        return None

    # -- decisions -------------------------------------------------------

    def _handle_exit(self, ev):
        """Coordinator: apply the job rules to one process exit anywhere in the job."""
        role, pid_, code, err = ev.get("role"), ev.get("id"), ev.get("code"), ev.get("error")
        if (role not in ROLES or isinstance(pid_, bool) or not isinstance(pid_, int)
                or not (code is None or (isinstance(code, int) and not isinstance(code, bool)))
                or not (err is None or isinstance(err, str)) or (code is None and err is None)):
            log("ignoring malformed exit event from %s: %r" % (ev.get("host"), ev))
            return
        key = (role, pid_)
        if self.outcome is not None or key in self.exits or ev.get("attempt", self.attempt) != self.attempt:
            return  # decided already, a repeat, or an exit of an earlier attempt
        self.exits[key] = ev
        failure = {"role": key[0], "id": key[1], "host": ev.get("host"), "exit_code": code}
        what = "%s.%s on %s" % (key[0], key[1], ev.get("host"))
        trainers = [e for k, e in self.exits.items() if k[0] == "trainer"]
        trainers_running = len(trainers) < self.trainers_total
        if err:
            failure["error"] = err
            self.failures.append(failure)
            self.decide(JobState.FAILED, "%s failed to start: %s" % (what, err), failure)
            return
        if code != 0 and (key[0] == "trainer" or trainers_running):
            self.failures.append(failure)
            self.dirty = True
            if self.job["on_failure"] == "stop":
                self.decide(JobState.FAILED, "%s exited with code %s" % (what, code), failure)
                return
            log("%s exited with code %s; on_failure=continue" % (what, code))
        if self.trainers_total and len(trainers) >= self.trainers_total:
            bad = [e for e in trainers if e.get("code") != 0]
            if not bad and not self.failures:
                self.decide(JobState.SUCCEEDED, "all %d trainers exited 0" % self.trainers_total)
            else:
                first = self.failures[0] if self.failures else None
                self.decide(JobState.FAILED, "all trainers ended; %d failure(s), first: %s.%s on %s code %s" % (
                    len(self.failures), first["role"], first["id"], first["host"], first["exit_code"]), first)


    def _send_stop(self, conn):
        conn.send({"type": "stop", "state": self.outcome, "reason": self.reason, "failure": self.failure,
                   "attempt": self.attempt, "restart": not self.final})


    def _restart_tick(self, now):
        """Coordinator: once every host stopped the failed attempt, wait the back-off, then start the next."""
        if not self.stop_done or self.final:
            return
        if self.restart_at is None:
            waiting = [h for h, c in self.peers.items() if not c.done]
            if waiting and now < self.stop_done_at + self.grace + PEER_DONE_LINGER:
                return
            delay = restart_delay(self.restart_backoff, self.attempt + 1)
            self.restart_at = time.monotonic() + delay  # not `now`: the stop that just ended took time
            self.dirty = True
            log("restart %d of %d in %.1fs" % (self.attempt + 1, self.restarts, delay))
        if time.monotonic() >= self.restart_at:
            self._next_attempt(self.attempt + 1)


    def _on_accept(self, listener):
        try:
            sock, addr = listener.accept()
        except OSError:
            return
        if len(self.pending) >= MAX_PENDING:
            self.bad_conns += 1
            self.dirty = True
            self.log_bad("overload", "too many unauthenticated connections; dropping %s" % (addr,))
            sock.close()
            return
        sock.settimeout(2.0)
        conn = Conn(sock, addr, time.monotonic())
        self.pending[sock] = conn
        self.sel.register(sock, selectors.EVENT_READ, self._on_readable)
        # mutual authentication: the peer proves the token over this nonce and its own, and so do we
        if not conn.send({"type": "challenge", "version": PROTOCOL_VERSION, "nonce": conn.nonce}):
            self._drop(conn, "send failed")

    def _drop(self, conn, why):
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        if self.pending.pop(conn.sock, None) is not None:
            self.bad_conns += 1  # an unauthenticated connection dropped: counted in state.json
            self.dirty = True
        if conn.host is not None and self.peers.get(conn.host) is conn:
            del self.peers[conn.host]
            if not conn.done:
                self.hosts[conn.host] = {"state": HostState.LOST if self.outcome is None else HostState.DISCONNECTED,
                                         "since": time.time(), "why": why}
                self.dirty = True
                if self.outcome is None:
                    self.decide(JobState.FAILED, "lost host %s: %s" % (conn.host, why),
                                {"host": conn.host, "role": None, "id": None, "exit_code": None})
        conn.close()


    def _reject(self, conn, why, error):
        self.log_bad("rejected", "rejected connection from %s: %s" % (conn.addr, why))
        conn.send({"type": "error", "error": error, "version": PROTOCOL_VERSION})
        self._drop(conn, why)

    def _hello(self, conn, msg):
        if msg.get("type") != "hello":
            return self._reject(conn, "first message is not a hello", "expected hello")
        mismatch = version_mismatch(msg, "coordinator", "peer")
        if mismatch is not None:  # one line naming both versions, sent to the peer (which logs and fails on it)
            return self._reject(conn, "protocol version %s" % _brief(msg.get("version"), 20), mismatch)
        host, nonce = msg.get("host"), msg.get("nonce")
        if (not isinstance(host, str) or not host or len(host) > 255 or not isinstance(nonce, str)
                or len(nonce) != 2 * NONCE_BYTES or not isinstance(msg.get("job"), str)):
            return self._reject(conn, "malformed hello", "malformed hello")
        want = auth_proof(self.coord["token"], "peer", msg["job"], host, conn.nonce, nonce)
        if not proof_ok(want, msg.get("proof")):
            return self._reject(conn, "bad token", "bad token")
        if msg["job"] != self.job_id:
            return self._reject(conn, "wrong job %s" % _brief(msg["job"]), "wrong job")
        del self.pending[conn.sock]
        old = self.peers.get(host)
        if old is not None:
            log("host %s reconnected; replacing its old connection" % host)
            try:
                self.sel.unregister(old.sock)
            except (KeyError, ValueError):
                pass
            old.close()
        conn.authed, conn.host = True, host
        self.peers[host] = conn
        self.hosts[host] = {"state": HostState.CONNECTED, "since": time.time(), "addr": conn.addr}
        self.dirty = True
        log("host %s connected from %s" % (host, conn.addr))
        conn.send({"type": "welcome", "job": self.job_id,
                   "proof": auth_proof(self.coord["token"], "coordinator", self.job_id, host, conn.nonce, nonce)})
        self._rejoin(conn, msg)

    def _rejoin(self, conn, msg):
        """Coordinator: bring a peer that (re)connected to the job's attempt and state."""
        host = conn.host
        attempt = msg.get("attempt", 0)
        attempt = attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else 0
        conn.done = bool(msg.get("idle")) and self.outcome is not None
        if msg.get("stopping"):
            self._user_stop(str(msg["stopping"]))
        if self.outcome is not None:
            self._send_stop(conn)
            return
        if attempt != self.attempt:  # it stopped an earlier attempt on its own: it joins this one
            log("host %s rejoined at attempt %d; sending it attempt %d" % (host, attempt, self.attempt))
            conn.send({"type": "restart", "attempt": self.attempt})
            return
        exits = msg.get("exits")
        for ev in exits if isinstance(exits, list) else []:
            if isinstance(ev, dict):
                ev = dict(ev, host=host)
                self._handle_exit(ev)
        if msg.get("failed") and self.outcome is None:  # it stopped this attempt by itself (lost us for a while)
            self.decide(JobState.FAILED, "host %s: %s" % (host, msg["failed"]),
                        {"host": host, "role": None, "id": None, "exit_code": None})

    def _coordinator_message(self, conn, msg):
        kind = msg["type"]
        if kind == "ping":
            return
        if kind == "exit":
            self._handle_exit({"role": msg.get("role"), "id": msg.get("id"), "code": msg.get("code"),
                               "error": msg.get("error"), "host": conn.host})
        elif kind == "stopping":
            self._user_stop(str(msg.get("reason") or "stop requested on %s" % conn.host))
        elif kind == "done":
            if msg.get("attempt", self.attempt) != self.attempt:
                return  # a late "done" of an earlier attempt
            conn.done = True
            self.hosts[conn.host] = {"state": HostState.DONE, "since": time.time()}
            self.dirty = True
        else:
            log("ignoring unknown message type %r from %s" % (kind, conn.host))

    def _coordinator_tick(self, now):
        for conn in list(self.pending.values()):
            if now > conn.deadline:
                self.log_bad("rejected", "rejected connection from %s: no hello within %.0fs" % (conn.addr, AUTH_TIMEOUT))
                self._drop(conn, "no hello")
        for host, conn in list(self.peers.items()):
            if now - conn.last_tx >= self.timing["heartbeat"]:
                if not conn.send({"type": "ping"}):
                    self._drop(conn, "send failed")
                    continue
            if not conn.done and now - conn.last_rx > self.timing["peer_timeout"]:
                self._drop(conn, "no heartbeat for %.1fs" % (now - conn.last_rx))
        expected = self.coord["hosts"] - 1
        if (self.outcome is None and len(self.peers) < expected
                and now - self.attempt_t0 > self.timing["connect_timeout"]):
            self.decide(JobState.FAILED, "only %d of %d peer host(s) connected within %.0fs (connected: %s)" % (
                len(self.peers), expected, self.timing["connect_timeout"], sorted(self.peers) or "none"))

