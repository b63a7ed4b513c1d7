"""The per-host, per-job supervisor: runs the local processes and applies the job's rules.

`Supervisor` is what both roles share (spawning, reaping, the decision and the local stop, restarts, the
event loop); the coordinator role (clusterctl/host/coordinator.py) and the peer role (peer.py) are mixed in
and hold their own side of the protocol. One process plays one role: `is_coord` picks it.
"""

import json
import os
import selectors
import signal
import socket
import subprocess
import time

from .common import log
from .coordinator import PEER_DONE_LINGER, CoordinatorRole
from .jobdir import STATE_FILE, STOP_REQUEST, write_json_atomic
from .jobfile import AUTH_ENV, DEFAULT_TIMINGS, RESTART_ENV, ROLES, TOKEN_ENV, parse_endpoint
from .peer import PeerRole
from .procfs import proc_stat
from .protocol import PROTOCOL_VERSION, LogLimiter, PeerProtocolError, _brief
from .spawn import _pdeathsig_setup, _private_opener, attempt_log, base_env, process_token
from .states import HostState, JobState, ProcState
from .stopping import Stopper

LAUNCH_REPORT_TIMEOUT = 60.0


class Supervisor(CoordinatorRole, PeerRole):
    """Runs the job's local processes and takes part in the cross-host protocol."""

    def __init__(self, job, jobdir, report_fd=None):
        self.job = job
        self.jobdir = jobdir
        self.report_fd = report_fd
        self.job_id = job["job"]
        self.host = job["host"]
        self.grace = job["grace"]
        self.coord = job["coordinator"]
        self.is_coord = self.coord is None or self.coord["is_coordinator"]
        # the processes' shared secret (pserver / PMI auth): in their environment only, or `auth: none` said so
        token = job.get("token") or (self.coord or {}).get("token")
        for p in job["processes"]:
            if job.get("auth") == "none":
                p["env"][AUTH_ENV] = "none"
            elif token:
                p["env"][TOKEN_ENV] = process_token(token)
        self.timing = dict(DEFAULT_TIMINGS)
        if self.coord is not None:
            self.timing.update({k: self.coord[k] for k in DEFAULT_TIMINGS})
        self.trainers_total = (self.coord["trainers_total"] if self.coord is not None
                               else sum(1 for p in job["processes"] if p["role"] == "trainer"))
        self.t0 = time.monotonic()
        self.state = JobState.STARTING
        # restarts: the attempt being run (0 = the first), the finished ones, and whether the decision is final
        self.restarts = job.get("restarts", 0)
        self.restart_backoff = job.get("restart_backoff", 1.0)
        self.attempt = 0
        self.attempt_t0 = self.t0
        self.attempt_started_at = time.time()
        self.attempts = []  # finished attempts: {attempt, outcome, reason, failure, started_at, ended_at}
        self.final = False  # the current decision ends the job (no restart follows)
        self.restart_at = None  # coordinator: monotonic time of the next attempt, once every host has stopped
        self.pending_restart = None  # peer: attempt the coordinator asked for, started once the local stop is done
        self.term_handled = False
        self.outcome = None  # terminal state decided, while stopping
        self.reason = None
        self.failure = None
        self.failures = []
        self.decided_at = None
        self.stop_done_at = None
        self.stopper = None
        self.stop_done = False
        self.stop_report = None
        self.term_requested = False
        self.waiting = None  # trainers held back until the pserver endpoints open (start_trainers_after)
        self.dirty = True
        self.sel = selectors.DefaultSelector()
        self.procs = []
        self.popens = {}
        for p in job["processes"]:
            rec = {"role": p["role"], "id": p["id"], "argv": p["argv"], "cwd": p["cwd"], "log": p["log"],
                   "ports": p["ports"], "pid": None, "start_ticks": None, "state": ProcState.PENDING,
                   "exit_code": None, "started_at": None, "ended_at": None, "error": None, "signalled": False,
                   "logs": []}
            self.procs.append(rec)
        self.local_exits = []
        self.log_bad = LogLimiter()
        # both roles' attributes exist in every supervisor (the loop and the state file read them)
        self._init_coordinator()
        self._init_peer()

    # -- bookkeeping ---------------------------------------------------

    def snapshot(self):
        procs = []
        for r in self.procs:
            procs.append({k: v for k, v in r.items() if k != "signalled"})
        state = {
            "version": PROTOCOL_VERSION, "job": self.job_id, "host": self.host, "jobdir": self.jobdir,
            "state": self.state, "outcome": self.outcome, "reason": self.reason, "failure": self.failure,
            "failures": self.failures, "on_failure": self.job["on_failure"], "grace": self.grace,
            "supervisor": {"pid": os.getpid(), "start_ticks": self.my_ticks, "started_at": self.started_at},
            "is_coordinator": self.is_coord, "processes": procs, "updated_at": time.time(),
            "stop": self.stop_report,
            "attempt": self.attempt, "restarts": self.restarts, "attempts": self.attempts,
            "attempt_started_at": self.attempt_started_at,
            "restart_pending": self.outcome is not None and not self.final,
            "restart_at": (time.time() + max(0.0, self.restart_at - time.monotonic())
                           if self.restart_at is not None else None),
        }
        if self.coord is not None:
            state["coordinator"] = {"address": self.coord["address"], "port": self.coord["port"],
                                    "hosts": self.coord["hosts"]}
            if self.is_coord:
                state["coordinator"]["trainers_total"] = self.trainers_total
                state["coordinator"]["rejected_connections"] = self.bad_conns
                state["hosts"] = self.hosts
            else:
                state["coordinator"]["connected"] = self.conn is not None and self.welcomed
        return state

    def write_state(self):
        write_json_atomic(os.path.join(self.jobdir, STATE_FILE), self.snapshot())
        self.dirty = False

    def report(self, obj):
        if self.report_fd is None:
            return
        try:
            os.write(self.report_fd, (json.dumps(obj, sort_keys=True) + "\n").encode())
        except OSError as e:
            log("cannot report to launcher: %s" % e)
        try:
            os.close(self.report_fd)
        except OSError:
            pass
        self.report_fd = None

    # -- main ------------------------------------------------------------

    def run(self):
        self.my_ticks = (proc_stat(os.getpid()) or (None, None, None))[2]
        self.started_at = time.time()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_term)
        # a handler, not SIG_IGN: ignored signals would be inherited by the children
        signal.signal(signal.SIGHUP, lambda s, f: None)
        log("supervisor %d for job %s on %s (%s), %d local processes"
            % (os.getpid(), self.job_id, self.host, "coordinator" if self.is_coord else "peer", len(self.procs)))
        if self.coord is not None and self.is_coord:
            msg = self._listen()
            if msg is not None:
                log(msg)
                self.state, self.reason = JobState.FAILED, msg
                for r in self.procs:
                    r["state"], r["error"] = ProcState.STOPPED, "not started: " + msg
                self.write_state()
                self.report({"ok": False, "error": msg, "pids": {}, "jobdir": self.jobdir,
                             "supervisor_pid": os.getpid()})
                return 1
        self._start_attempt()
        self._loop()
        if self.waiting is not None:  # ended before the trainers were released
            self._report_launch("job %s: %s before the trainers started" % (self.state, self.reason))
        log("supervisor exiting, job state %s (%s)" % (self.state, self.reason))
        return 0

    def _start_attempt(self):
        """Spawn this attempt's local processes: pservers first, trainers at once or once the pservers listen."""
        if self.attempt:
            log("attempt %d of job %s (restart %d of %d)" % (self.attempt, self.job_id, self.attempt, self.restarts))
        after = self.job.get("start_trainers_after")
        if after and after["endpoints"] and any(r["role"] == "trainer" for r in self.procs):
            # pservers first; trainers once every pserver endpoint accepts connections (see _release_trainers)
            spawn_error = self._spawn_all(roles=("pserver",))
            if spawn_error is None:
                self.waiting = {"eps": list(after["endpoints"]), "open": set(), "next": 0.0,
                                "deadline": time.monotonic() + after["timeout"], "timeout": after["timeout"]}
        else:
            spawn_error = self._spawn_all()
        if self.state == JobState.STARTING:
            self.state = JobState.RUNNING
        self.write_state()
        if self.waiting is None:
            self._report_launch(spawn_error)
        for r in self.procs:
            if r["state"] == ProcState.FAILED:
                self._local_exit(r)

    def _report_launch(self, error):
        self.report({"ok": error is None, "error": error, "jobdir": self.jobdir,
                     "supervisor_pid": os.getpid(),
                     "pids": {"%s.%d" % (r["role"], r["id"]): r["pid"] for r in self.procs if r["pid"]}})

    def _release_trainers(self, now):
        """Start the local trainers once every pserver endpoint accepts TCP connections (bounded)."""
        w = self.waiting
        if self.outcome is not None:  # the job was stopped or failed while waiting
            self.waiting = None
            for r in self.procs:
                if r["state"] == ProcState.PENDING:
                    r["state"], r["error"] = ProcState.STOPPED, "not started: the job ended first"
            self.dirty = True
            self._report_launch("job %s: %s before the trainers started" % (self.outcome, self.reason))
            return
        if now < w["next"]:
            return
        w["next"] = now + 0.2
        for ep in w["eps"]:
            if ep in w["open"]:
                continue
            try:
                socket.create_connection(parse_endpoint(ep), timeout=0.2).close()
                w["open"].add(ep)
            except OSError:
                pass
        if len(w["open"]) == len(w["eps"]):
            self.waiting = None
            log("pserver endpoints open: starting trainers")
            error = self._spawn_all(roles=("trainer",))
            self.dirty = True
            self._report_launch(error)
            for r in self.procs:
                if r["state"] == ProcState.FAILED and r["role"] == "trainer":
                    self._local_exit(r)
            return
        if now >= w["deadline"]:
            self.waiting = None
            closed = [ep for ep in w["eps"] if ep not in w["open"]]
            msg = "pserver endpoint(s) %s did not accept connections within %gs" % (", ".join(closed), w["timeout"])
            log(msg)
            first = None
            for r in self.procs:
                if r["state"] == ProcState.PENDING:
                    r["state"], r["error"], r["ended_at"] = ProcState.FAILED, "not started: " + msg, time.time()
                    first = first or r
            self.dirty = True
            self._report_launch(msg)
            if first is not None:
                self._local_exit(first)

    def _spawn_all(self, roles=ROLES):
        preexec = _pdeathsig_setup(os.getpid())
        for r in self.procs:
            if r["role"] not in roles or r["state"] != ProcState.PENDING:
                continue
            spec = next(p for p in self.job["processes"] if p["role"] == r["role"] and p["id"] == r["id"])
            env = base_env(self.job_id, self.jobdir, spec["env"])
            for name in RESTART_ENV:
                env[name] = str(self.attempt)
            r["log"] = attempt_log(spec["log"], self.attempt)
            if not any(entry["attempt"] == self.attempt for entry in r["logs"]):
                r["logs"].append({"attempt": self.attempt, "path": r["log"]})
            try:
                os.makedirs(os.path.dirname(r["log"]), mode=0o700, exist_ok=True)
                if os.path.exists(r["log"]):  # keep the previous run's log, start this one fresh
                    os.replace(r["log"], r["log"] + ".1")
                with open(r["log"], "ab", opener=_private_opener) as logf:  # 0600: logs may hold secrets
                    popen = subprocess.Popen(
                        r["argv"], cwd=r["cwd"], env=env, stdin=subprocess.DEVNULL, stdout=logf,
                        stderr=subprocess.STDOUT, start_new_session=True, close_fds=True, preexec_fn=preexec)
            except (OSError, subprocess.SubprocessError) as e:
                err = "cannot start %s.%d (%s in %s): %s" % (
                    r["role"], r["id"], r["argv"][0], r["cwd"], getattr(e, "strerror", None) or e)
                log(err)
                r["state"], r["error"], r["ended_at"] = ProcState.FAILED, err, time.time()
                for rest in self.procs:
                    if rest["state"] == ProcState.PENDING and rest["role"] in roles:
                        rest["state"], rest["error"] = ProcState.STOPPED, "not started: an earlier process failed to start"
                return err
            st = proc_stat(popen.pid)
            r.update(pid=popen.pid, start_ticks=st[2] if st else None, state=ProcState.RUNNING,
                     started_at=time.time())
            self.popens[(r["role"], r["id"])] = popen
            log("started %s.%d pid %d: %s" % (r["role"], r["id"], popen.pid, r["argv"]))
        return None

    def _on_term(self, signum, frame):
        self.term_requested = True

    def _loop(self):
        while True:
            for key, _ in self.sel.select(timeout=0.1):
                key.data(key.fileobj)
            now = time.monotonic()
            self._reap()
            if self.waiting is not None:
                self._release_trainers(now)
            if self.term_requested and not self.term_handled:
                self.term_handled = True
                self._stop_requested()
            if self.coord is not None:
                if self.is_coord:
                    self._coordinator_tick(now)
                else:
                    self._peer_tick(now)
            if self.stopper is not None and not self.stop_done and self.stopper.step(now):
                self._stop_finished()
            if self.is_coord:
                self._restart_tick(now)
            if self.dirty:
                self.write_state()
            if self._finished(now):
                break
        for conn in list(self.peers.values()) + list(self.pending.values()):
            conn.close()
        if self.conn is not None:
            self.conn.close()
        if self.listener is not None:
            self.listener.close()

    def _finished(self, now):
        if not self.stop_done or not self.final:
            return False
        if not self.is_coord or self.coord is None:
            return True
        # the stop message is already sent; wait briefly for peers' "done" so state.json can show it
        waiting = [h for h, c in self.peers.items() if not c.done]
        return not waiting or now > self.stop_done_at + PEER_DONE_LINGER

    def _reap(self):
        for r in self.procs:
            popen = self.popens.get((r["role"], r["id"]))
            if popen is None or r["state"] != ProcState.RUNNING:
                continue
            rc = popen.poll()
            if rc is None:
                continue
            r["exit_code"], r["ended_at"] = rc, time.time()
            if r["signalled"]:
                r["state"] = ProcState.STOPPED
            else:
                r["state"] = ProcState.EXITED if rc == 0 else ProcState.FAILED
            self.dirty = True
            log("%s.%d pid %d ended with %s -> %s" % (r["role"], r["id"], r["pid"], rc, r["state"]))
            if not r["signalled"]:
                self._local_exit(r)

    def _local_exit(self, r):
        ev = {"role": r["role"], "id": r["id"], "code": r["exit_code"], "host": self.host, "error": r["error"],
              "attempt": self.attempt}
        self.local_exits.append(ev)
        if self.is_coord:
            self._handle_exit(ev)
        elif self.conn is not None and self.welcomed:  # else the next hello carries it (`exits`)
            msg = dict(ev)
            msg["type"] = "exit"
            if not self.conn.send(msg):
                self._peer_lost("send failed")

    def _stop_requested(self):
        grace = self.grace
        try:
            with open(os.path.join(self.jobdir, STOP_REQUEST), "rb") as f:
                req = json.loads(f.read().decode("utf-8"))
            if isinstance(req, dict) and isinstance(req.get("grace"), (int, float)) and req["grace"] >= 0:
                grace = float(req["grace"])
        except (OSError, ValueError, UnicodeDecodeError):
            pass
        reason = "stop requested on %s" % self.host
        log(reason)
        if self.outcome is not None and self.final:
            return
        if not self.is_coord and self.conn is not None and self.welcomed:  # else the hello says `stopping`
            self.conn.send({"type": "stopping", "reason": reason})
        self._user_stop(reason, grace)

    def _user_stop(self, reason, grace=None):
        """A user's stop (on any host): final, it never leads to a restart, also while one is pending."""
        if self.outcome is None:
            self.decide(JobState.STOPPED, reason, grace=grace, restart=False)
        elif not self.final:
            self._finalize(JobState.STOPPED, reason, None)

    # -- decisions -------------------------------------------------------

    def decide(self, outcome, reason, failure=None, grace=None, restart=None):
        """Fix the attempt's outcome; the coordinator broadcasts it; stop local processes.

        The decision is final unless `restart` (default: the coordinator's rule: a failure, not a failure
        to start, with restarts left), in which case the whole job starts again once every host stopped.
        """
        if self.outcome is not None:
            return
        if restart is None:
            restart = (self.is_coord and outcome == JobState.FAILED and self.attempt < self.restarts
                       and not (failure or {}).get("error"))
        self.final = not restart
        self.outcome, self.reason, self.failure = outcome, reason, failure
        self.decided_at = time.monotonic()
        log("job %s -> %s: %s%s" % (self.job_id, outcome, reason,
                                    "; restart %d of %d follows" % (self.attempt + 1, self.restarts) if restart else ""))
        if self.is_coord:
            for host, conn in list(self.peers.items()):
                self._send_stop(conn)
        self._begin_stop(self.grace if grace is None else grace)

    def _finalize(self, outcome, reason, failure):
        """Make a decision that awaited a restart final (a user's stop, the coordinator gone): the job ends."""
        self.final = True
        self.outcome, self.reason, self.failure = outcome, reason, failure
        self.restart_at = self.pending_restart = None
        log("job %s -> %s: %s (no restart)" % (self.job_id, outcome, reason))
        if self.is_coord:
            for host, conn in list(self.peers.items()):
                self._send_stop(conn)
        if self.stop_done:
            self.state = outcome
            self.stop_done_at = time.monotonic()
        self.dirty = True

    def _begin_stop(self, grace):
        self.state = JobState.STOPPING
        groups = []
        for r in self.procs:
            if r["state"] == ProcState.RUNNING:
                r["signalled"] = True
                groups.append(r)
            elif r["state"] == ProcState.PENDING:
                r["state"] = ProcState.STOPPED
        self.stopper = Stopper(self.job_id, self.jobdir, groups, grace)
        self.stopper.start(time.monotonic())
        self.dirty = True

    def _stop_finished(self):
        self._reap()
        self.stop_done = True
        self.stop_done_at = time.monotonic()
        self.stop_report = {"killed": self.stopper.killed, "leftover": self.stopper.leftover,
                            "finished_at": time.time()}
        self.dirty = True
        log("local processes stopped; killed %s" % self.stopper.killed)
        if self.final:
            self.state = self.outcome
        else:
            self.state = JobState.RESTARTING
            self.attempts.append({"attempt": self.attempt, "outcome": self.outcome, "reason": self.reason,
                                  "failure": self.failure, "started_at": self.attempt_started_at,
                                  "ended_at": time.time()})
        if not self.is_coord and self.conn is not None and self.welcomed:  # else the hello says `idle`
            self.conn.send({"type": "done", "host": self.host, "attempt": self.attempt})
        if not self.final and self.pending_restart is not None:
            self._next_attempt(self.pending_restart)

    # -- restarts ------------------------------------------------------------

    def _next_attempt(self, attempt):
        """Start attempt number `attempt` on this host, on the same plan (the coordinator tells the peers)."""
        self.attempt = attempt
        self.attempt_t0 = time.monotonic()
        self.attempt_started_at = time.time()
        self.outcome = self.reason = self.failure = None
        self.final = False
        self.failures = []
        self.decided_at = self.restart_at = self.pending_restart = None
        self.stopper, self.stop_done, self.stop_report = None, False, None
        self.exits, self.local_exits = {}, []
        self.waiting = None
        self.popens = {}
        for r in self.procs:
            r.update(pid=None, start_ticks=None, state=ProcState.PENDING, exit_code=None, started_at=None, ended_at=None,
                     error=None, signalled=False)
        self.state = JobState.STARTING
        if self.is_coord:
            for host, conn in list(self.peers.items()):
                conn.done = False
                self.hosts[host] = {"state": HostState.CONNECTED, "since": time.time(), "addr": conn.addr}
                conn.send({"type": "restart", "attempt": attempt})  # a broken connection is noticed by the tick
        self.dirty = True
        self._start_attempt()

    def _conn_for(self, sock):
        if sock in self.pending:
            return self.pending[sock]
        for c in self.peers.values():
            if c.sock is sock:
                return c
        if self.conn is not None and self.conn.sock is sock:
            return self.conn
        return None

    def _on_readable(self, sock):
        conn = self._conn_for(sock)
        if conn is None:
            try:
                self.sel.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
            return
        try:
            msgs = conn.receive()
        except PeerProtocolError as e:
            self.log_bad("garbage", "garbage from %s (%s): %s; closing" % (conn.addr, conn.host or "unauthenticated", e))
            if conn is self.conn:
                self._peer_lost("protocol error: %s" % e)
            else:
                self._drop(conn, "protocol error: %s" % e)
            return
        if msgs is None:
            if conn is self.conn:
                self._peer_lost("connection closed by coordinator")
            else:
                self._drop(conn, "connection closed")
            return
        for msg in msgs:
            try:
                if conn is self.conn:
                    self._peer_message(msg)
                    if conn is not self.conn:  # dropped while handling it
                        return
                elif not conn.authed:
                    self._hello(conn, msg)
                    if not conn.authed:
                        return
                else:
                    self._coordinator_message(conn, msg)
            except Exception as e:  # noqa: BLE001 - contained per connection: log it, drop the sender
                self.log_bad("bad-message", "bad message %s from %s: %s: %s"
                             % (_brief(msg), conn.addr, type(e).__name__, e))
                if conn is self.conn:
                    self._peer_lost("bad message from coordinator")
                else:
                    self._drop(conn, "bad message")
                return

