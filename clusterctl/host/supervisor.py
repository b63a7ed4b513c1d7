"""The per-host, per-job supervisor: a thin event loop between the rules and their effects.

What the supervisor decides lives in clusterctl/host/rules.py (pure functions over a `JobCore`, with the
job-state transition table); what it does lives in small objects it owns: `LocalProcesses` (spawn, reap;
clusterctl/host/processes.py), the `Stopper` (stopping.py), the `CoordinatorLink` (coordinator.py: the
listener and the peers) or the `PeerLink` (peer.py: the connection to the coordinator), `Membership`
(membership.py: the coordinator's view of the peer hosts) and the `EventLoop` (loop.py). This class wires
them: an event (a process exit, a message, a timer, a signal) goes to a rule, and the rule's answer (a
`Verdict`, a next attempt) becomes effects (signal the local processes, tell the peers, spawn again,
write state.json). One process plays one role: the coordinator (also a single-host job) or a peer.
"""

import json
import os
import signal
import time

from . import protocol, rules
from .common import log
from .control import ControlServer
from .coordinator import CoordinatorLink
from .jobdir import STATE_FILE, STOP_REQUEST, write_json_atomic
from .jobfile import AUTH_ENV, TOKEN_ENV
from .loop import EventLoop
from .membership import Membership
from .peer import PeerLink
from .policy import Policy, Timings
from .processes import LocalProcesses, TrainerGate
from .procfs import proc_stat
from .protocol import PROTOCOL_VERSION, LogLimiter, Msg
from .rules import ExitEvent, JobCore, Verdict
from .spawn import process_token
from .states import JobState, ProcState
from .stopping import Stopper

__all__ = ["Supervisor", "LAUNCH_REPORT_TIMEOUT"]

LAUNCH_REPORT_TIMEOUT = 60.0
TICK = 0.1  # seconds the loop waits for a socket before it looks at processes and timers again


class Supervisor:
    """Runs the job's local processes and takes part in the cross-host protocol (`run()` until the end)."""

    def __init__(self, job, jobdir, report_fd=None, clock=time.monotonic):
        self.job = job
        self.clock = clock  # monotonic seconds (tests pass their own)
        self.tick = TICK
        self.jobdir = jobdir
        self.report_fd = report_fd
        self.job_id = job["job"]
        self.host = job["host"]
        self.policy = Policy.from_job(job, "job %s" % self.job_id)
        self.coord = job.get("coordinator")
        self.is_coord = self.coord is None or self.coord["is_coordinator"]
        self.timings = Timings.from_job(self.coord or {}, "coordinator")
        # the processes' shared secret (pserver / PMI auth): in their environment only, or `auth: none` said so
        token = job.get("token") or (self.coord or {}).get("token")
        entries = []
        for p in job["processes"]:
            env = dict(p["env"])
            if job.get("auth") == "none":
                env[AUTH_ENV] = "none"
            elif token:
                env[TOKEN_ENV] = process_token(token)
            entries.append(dict(p, env=env))
        self.procs = LocalProcesses(self.job_id, jobdir, entries)
        trainers_total = (self.coord["trainers_total"] if self.coord is not None
                          else sum(1 for p in job["processes"] if p["role"] == "trainer"))
        self.core = JobCore(self.policy, trainers_total, started_at=time.time())
        self.loop = EventLoop()
        self.log_bad = LogLimiter()
        self.members = None
        self.link = None
        if self.coord is not None and self.is_coord:
            self.members = Membership(self.coord["hosts"] - 1)
            self.link = CoordinatorLink(self.loop, self.job_id, self.coord["address"], self.coord["port"],
                                        self.coord["token"], self.timings, self, self.log_bad, clock)
        elif self.coord is not None:
            self.link = PeerLink(self.loop, self.job_id, self.host, self.coord["address"], self.coord["port"],
                                 self.coord["token"], self.timings, self, self.log_bad, clock)
        self.t0 = self.attempt_t0 = clock()
        self.gate = None  # trainers held back until the pserver endpoints open (start_trainers_after)
        self.stopper = None
        self.stop_report = None
        self.stop_done_at = None
        self.restart_at = None  # coordinator: monotonic time of the next attempt, once every host stopped
        self.pending_restart = None  # peer: the attempt the coordinator asked for, started once the stop is done
        self.local_exits = []  # ExitEvents of this attempt on this host (a peer's hello repeats them)
        self.term_requested = self.term_handled = False
        self.my_ticks = self.started_at = None
        self.dirty = True
        self._counts_written = None

    @property
    def state(self):
        """The job state on this host (a JobState)."""
        return self.core.state

    # -- state.json and the launch report ---------------------------------------------------------------------

    def snapshot(self):
        """state.json: what this supervisor knows (docs/agent.md 3.2 is the reply built from it)."""
        core, v = self.core, self.core.verdict
        state = {
            "version": PROTOCOL_VERSION, "job": self.job_id, "host": self.host, "jobdir": self.jobdir,
            "state": core.state, "outcome": v.outcome if v else None, "reason": v.reason if v else None,
            "failure": v.failure if v else None, "failures": core.failures,
            "on_failure": self.policy.on_failure, "grace": self.policy.grace,
            "restarts": self.policy.restarts, "restart_backoff": self.policy.restart_backoff,
            "supervisor": {"pid": os.getpid(), "start_ticks": self.my_ticks, "started_at": self.started_at},
            "is_coordinator": self.is_coord, "processes": self.procs.to_json(), "updated_at": time.time(),
            "stop": self.stop_report,
            "attempt": core.attempt, "attempts": [a.to_json() for a in core.history.kept],
            "attempts_total": core.history.total, "attempt_started_at": core.started_at,
            "restart_pending": core.restart_pending,
            "restart_at": (time.time() + max(0.0, self.restart_at - self.clock())
                           if self.restart_at is not None else None),
            "lingering": core.final and core.stop_done,  # the verdict is in; waiting for peers only
        }
        if self.coord is not None:
            state["coordinator"] = {"address": self.coord["address"], "port": self.coord["port"],
                                    "hosts": self.coord["hosts"]}
            if self.members is not None:
                state["coordinator"]["trainers_total"] = core.trainers_total
                state["coordinator"].update(self.link.stats())
                state["hosts"] = self.members.to_json()
            else:
                state["coordinator"]["connected"] = self.link.connected
        return state

    def write_state(self):
        """Write state.json (atomically); a failure (a full disk, no descriptor left) is logged and retried on
        the next round, never the end of the supervisor."""
        try:
            write_json_atomic(os.path.join(self.jobdir, STATE_FILE), self.snapshot())
        except OSError as e:
            self.log_bad("state", "cannot write %s: %s; retrying" % (STATE_FILE, e.strerror or e))
            return
        self.dirty = False

    def report(self, obj):
        """The launch report (`agent launch` relays it): once, then the pipe is closed."""
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

    def _report_launch(self, error):
        self.report({"ok": error is None, "error": error, "jobdir": self.jobdir, "supervisor_pid": os.getpid(),
                     "pids": self.procs.pids()})

    # -- main ----------------------------------------------------------------------------------------------------

    def run(self):
        """Run the job on this host until its verdict is final and its processes are stopped; 0, or 1 when the
        coordinator could not even listen."""
        self.my_ticks = (proc_stat(os.getpid()) or (None, None, None))[2]
        self.started_at = time.time()
        # the handlers are this run's: put back as they were when it returns (a supervisor run in-process, by
        # `agent run` in a pod's main process or by a test, leaves its process as it found it)
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_term)
        # a handler, not SIG_IGN: ignored signals would be inherited by the children
        signal.signal(signal.SIGHUP, lambda s, f: None)
        log("supervisor %d for job %s on %s (%s), %d local processes" % (
            os.getpid(), self.job_id, self.host, "coordinator" if self.is_coord else "peer", len(self.procs.rows)))
        try:
            return self._run()
        finally:
            for sig, handler in previous.items():
                if handler is not None:
                    signal.signal(sig, handler)

    def _run(self):
        self.control = ControlServer.start(self)  # status, top, stop, logs without a Python start (control.py)
        try:
            if self.members is not None and not self._listen():
                return 1
            self._start_attempt()
            self._loop()
        finally:
            self.control.close()
            if self.link is not None:
                self.link.close()
            self.loop.close()
        if self.gate is not None:  # ended before the trainers were released
            self._report_launch("job %s: %s before the trainers started" % (self.core.state, self._reason()))
        log("supervisor exiting, job state %s (%s)" % (self.core.state, self._reason()))
        return 0

    def _reason(self):
        return self.core.verdict.reason if self.core.verdict else None

    def _listen(self):
        msg = self.link.listen()
        if msg is None:
            log("coordinator listening on %s, expecting %d peer(s), %d trainer(s) in total"
                % (self.link.endpoint, self.members.expected, self.core.trainers_total))
            return True
        log(msg)
        self.core.verdict = Verdict(JobState.FAILED, msg)
        self.core.move(JobState.FAILED)
        self.core.stop_done = True
        self.procs.not_started("not started: " + msg)
        self.write_state()
        self.report({"ok": False, "error": msg, "pids": {}, "jobdir": self.jobdir, "supervisor_pid": os.getpid()})
        return False

    def _on_term(self, signum, frame):
        self.term_requested = True

    def _loop(self):
        while not self.step():
            pass

    def step(self):
        """One round of the loop: sockets, exits, timers, rules, state.json. True when the work is over."""
        self.loop.poll(self.tick)
        now = self.clock()
        self._reap()
        if self.gate is not None:
            self._gate_tick(now)
        if self.term_requested and not self.term_handled:
            self.term_handled = True
            self._stop_requested()
        if self.members is not None:
            self._coordinator_tick(now)
        elif self.link is not None:
            self._peer_tick(now)
        if self.stopper is not None and not self.core.stop_done and self.stopper.step(now):
            self._stop_finished()
        if self.is_coord:
            self._restart_tick(now)
        if self.dirty:
            self.write_state()
        return self._finished(now)

    def _finished(self, now):
        m = self.members
        return rules.may_exit(self.core, now, m is not None, self.stop_done_at, m.waiting() if m else (),
                              m.unjoined() if m else 0, self.attempt_t0 + self.timings.connect_timeout,
                              self.term_requested)

    # -- local processes -----------------------------------------------------------------------------------------

    def _start_attempt(self):
        """Spawn this attempt's local processes: pservers first, trainers at once or once the pservers listen."""
        attempt = self.core.attempt
        if attempt:
            log("attempt %d of job %s (restart %d of %d)" % (attempt, self.job_id, attempt, self.policy.restarts))
        after = self.job.get("start_trainers_after")
        if after and after["endpoints"] and self.procs.has("trainer"):
            # pservers first; trainers once every pserver endpoint accepts connections (_gate_tick)
            error = self.procs.spawn(attempt, roles=("pserver",))
            if error is None:
                self.gate = TrainerGate(after["endpoints"], after["timeout"], self.clock())
        else:
            error = self.procs.spawn(attempt)
        rules.mark_running(self.core)
        self.write_state()
        if self.gate is None:
            self._report_launch(error)
        for r in self.procs.failed():
            self._local_exit(r)

    def _gate_tick(self, now):
        """Start the local trainers once every pserver endpoint accepts TCP connections (bounded)."""
        gate = self.gate
        if self.core.verdict is not None:  # the job was stopped or failed while waiting
            self.gate = None
            self.procs.not_started("not started: the job ended first")
            self.dirty = True
            self._report_launch("job %s: %s before the trainers started" % (self.core.verdict.outcome,
                                                                           self.core.verdict.reason))
            return
        result = gate.poll(now)
        if result == TrainerGate.OPEN:
            self.gate = None
            log("pserver endpoints open: starting trainers")
            error = self.procs.spawn(self.core.attempt, roles=("trainer",))
            self.dirty = True
            self._report_launch(error)
            for r in self.procs.failed(roles=("trainer",)):
                self._local_exit(r)
        elif result == TrainerGate.TIMEOUT:
            self.gate = None
            msg = gate.timeout_message()
            log(msg)
            rows = self.procs.not_started("not started: " + msg, state=ProcState.FAILED)
            self.dirty = True
            self._report_launch(msg)
            if rows:
                self._local_exit(rows[0])

    def _reap(self):
        for r in self.procs.reap():
            self.dirty = True
            self._local_exit(r)

    def _local_exit(self, r):
        ev = ExitEvent(r.role, r.id, r.exit_code, r.error, self.host, self.core.attempt)
        self.local_exits.append(ev)
        self.dirty = True
        if self.is_coord:
            self._on_exit(ev)
        else:  # not connected: the next hello carries it (`exits`)
            self.link.send(protocol.exit_event(**ev.to_json()))

    def _on_exit(self, ev):
        before = len(self.core.failures)
        verdict = rules.on_exit(self.core, ev)
        self.dirty = True
        if verdict is not None:
            self.decide(verdict)
        elif len(self.core.failures) > before:
            log("%s.%s on %s exited with code %s; on_failure=continue" % (ev.role, ev.id, ev.host, ev.code))

    # -- verdicts, stops, restarts ---------------------------------------------------------------------------

    def decide(self, verdict):
        """Apply a verdict (rules.apply_verdict): stop the local processes and tell the peers, or make a
        pending restart final."""
        effect = rules.apply_verdict(self.core, verdict)
        if effect is None:
            return
        self.dirty = True
        if effect == rules.BEGIN_STOP:
            log("job %s -> %s: %s%s" % (self.job_id, verdict.outcome, verdict.reason,
                                        "; restart %d of %d follows" % (self.core.attempt + 1, self.policy.restarts)
                                        if verdict.restart else ""))
            self._tell_peers()
            self._begin_stop(self.policy.grace if verdict.grace is None else verdict.grace)
        else:
            log("job %s -> %s: %s (no restart)" % (self.job_id, verdict.outcome, verdict.reason))
            self.restart_at = self.pending_restart = None
            self._tell_peers()
            if self.core.stop_done:
                self.stop_done_at = self.clock()

    def _stop_message(self):
        v = self.core.verdict
        return protocol.stop(v.outcome, v.reason, v.failure, self.core.attempt, v.restart)

    def _tell_peers(self):
        if self.members is not None:
            self.link.broadcast(self._stop_message())

    def _begin_stop(self, grace):
        groups = [r.group() for r in self.procs.to_stop()]
        self.stopper = Stopper(self.job_id, self.jobdir, groups, grace)
        self.stopper.start(self.clock())

    def _stop_finished(self):
        self._reap()
        self.stop_done_at = self.clock()
        v = self.core.verdict
        self.stop_report = {"killed": self.stopper.killed, "leftover": self.stopper.leftover,
                            "finished_at": time.time(), "attempt": self.core.attempt,
                            # a stop request's kills are reported once, by the `agent stop` on this host
                            "requested": v.outcome == JobState.STOPPED, "reported": False}
        rules.stop_finished(self.core, time.time())
        self.dirty = True
        log("local processes stopped; killed %s" % self.stopper.killed)
        if self.members is None and self.link is not None:  # else the hello says `idle`
            self.link.send(protocol.done(self.host, self.core.attempt))
        if self.core.restart_pending and self.pending_restart is not None:
            self._next_attempt(self.pending_restart)

    def _stop_requested(self):
        grace = self.policy.grace
        try:
            with open(os.path.join(self.jobdir, STOP_REQUEST), "rb") as f:
                req = json.loads(f.read().decode("utf-8"))
            if isinstance(req, dict) and isinstance(req.get("grace"), (int, float)) and req["grace"] >= 0:
                grace = float(req["grace"])
        except (OSError, ValueError, UnicodeDecodeError):
            pass
        reason = "stop requested on %s" % self.host
        log(reason)
        verdict = rules.on_stop_request(self.core, reason, grace)
        if verdict is None:
            return
        if self.members is None and self.link is not None:  # not connected: the hello says `stopping`
            self.link.send(protocol.stopping(reason))
        self.decide(verdict)

    def _restart_tick(self, now):
        """Coordinator: once every host stopped the failed attempt, wait the back-off, then start the next."""
        if self.restart_at is None:
            waiting = self.members.waiting() if self.members is not None else ()
            if not rules.restart_ready(self.core, now, self.stop_done_at, waiting, self.policy.grace):
                return
            delay = self.policy.restart_delay(self.core.attempt + 1)
            self.restart_at = self.clock() + delay  # not `now`: the stop that just ended took time
            self.dirty = True
            log("restart %d of %d in %.1fs" % (self.core.attempt + 1, self.policy.restarts, delay))
        if self.clock() >= self.restart_at:
            self._next_attempt(self.core.attempt + 1)

    def _next_attempt(self, attempt):
        """Start attempt number `attempt` on this host, on the same plan (the coordinator tells the peers)."""
        rules.begin_attempt(self.core, attempt, time.time())
        self.attempt_t0 = self.clock()
        self.restart_at = self.pending_restart = None
        self.stopper = self.stop_report = None
        self.local_exits = []
        self.gate = None
        self.procs.reset()
        if self.members is not None:
            self.members.new_attempt(time.time())
            self.link.broadcast(protocol.restart(attempt))  # a broken connection is noticed by the tick
        self.dirty = True
        self._start_attempt()

    # -- the coordinator's side (CoordinatorLink's handler) ----------------------------------------------------

    def _coordinator_tick(self, now):
        self.link.tick(now)
        stats = self.link.stats()
        if stats != self._counts_written:
            self._counts_written = stats
            self.dirty = True
        verdict = rules.on_peers_missing(self.core, self.link.connected(), self.members.expected,
                                         now - self.attempt_t0, self.timings)
        if verdict is not None:
            self.decide(verdict)

    def peer_joined(self, host, addr, hello):
        """A peer authenticated (or came back): bring it to the job's attempt and state."""
        log("host %s connected from %s" % (host, addr))
        core = self.core
        self.members.join(host, addr, time.time(), done=hello["idle"] and core.verdict is not None)
        self.dirty = True
        if hello["stopping"]:
            verdict = rules.on_stop_request(core, hello["stopping"])
            if verdict is not None:
                self.decide(verdict)
        if core.verdict is not None:  # decided already (also: a peer joining late learns it at once)
            self.link.send(host, self._stop_message())
            if core.final and core.stop_done:  # wait for this one's "done" as for the others' (PEER_DONE_LINGER)
                self.stop_done_at = self.clock()
            return
        if hello["attempt"] != core.attempt:  # it stopped an earlier attempt on its own: it joins this one
            log("host %s rejoined at attempt %d; sending it attempt %d" % (host, hello["attempt"], core.attempt))
            self.link.send(host, protocol.restart(core.attempt))
            return
        for e in hello["exits"]:
            self._on_exit(ExitEvent(e["role"], e["id"], e["code"], e["error"], host, e["attempt"]))
        if hello["failed"]:  # it stopped this attempt by itself (it had lost us for a while)
            verdict = rules.on_host_failed(core, host, hello["failed"])
            if verdict is not None:
                self.decide(verdict)

    def peer_message(self, host, msg):
        """A message from an authenticated peer."""
        kind = msg["type"]
        if kind == Msg.EXIT:
            self._on_exit(ExitEvent(msg["role"], msg["id"], msg["code"], msg["error"], host, msg["attempt"]))
        elif kind == Msg.STOPPING:
            verdict = rules.on_stop_request(self.core, msg["reason"] or "stop requested on %s" % host)
            if verdict is not None:
                self.decide(verdict)
        elif kind == Msg.DONE:
            if msg["attempt"] == self.core.attempt:  # not a late "done" of an earlier attempt
                self.members.mark_done(host, time.time())
                self.dirty = True
        else:
            log("ignoring message type %r from %s" % (str(kind), host))

    def peer_left(self, host, why):
        """A peer's connection is gone: a lost host, unless it had finished its stop."""
        self.dirty = True
        if self.members.leave(host, why, time.time(), deciding=self.core.verdict is None):
            self.decide(rules.on_host_lost(self.core, host, why))

    # -- the peer's side (PeerLink's handler) ------------------------------------------------------------------

    def _peer_tick(self, now):
        link = self.link
        link.tick(now, keep_trying=not self.core.final)
        if link.connected:
            return
        verdict = rules.on_coordinator_silence(self.core, self.timings, now, self.t0, link.ever_connected,
                                               link.lost_since, link.why(), link.endpoint)
        if verdict is not None:
            self.decide(verdict)

    def hello_fields(self):
        """What the hello repeats: this attempt's exits here, a stop request, the attempt, whether idle, failed."""
        v = self.core.verdict
        return {"exits": [e.to_json() for e in self.local_exits],
                "stopping": "stop requested on %s" % self.host if self.term_requested else None,
                "attempt": self.core.attempt, "idle": self.core.stop_done,
                "failed": v.reason if v is not None and v.outcome == JobState.FAILED else None}

    def coordinator_welcomed(self):
        """The coordinator proved the token."""
        log("connected to coordinator %s" % self.link.endpoint)
        self.dirty = True

    def coordinator_lost(self, why):
        """The connection to the coordinator is gone (the rules decide when that fails the job)."""
        self.dirty = True
        if self.core.verdict is None:
            log("lost coordinator connection (%s); retrying for %.1fs" % (why, self.timings.reconnect_timeout))

    def coordinator_message(self, msg):
        """A message from the coordinator (after its welcome)."""
        kind = msg["type"]
        if kind == Msg.STOP:
            verdict = rules.on_verdict_received(self.core, msg["state"], msg["reason"], msg["failure"],
                                                msg["attempt"], msg["restart"])
            if verdict is not None:
                self.decide(verdict)
        elif kind == Msg.RESTART:
            follow, verdict = rules.on_restart_order(self.core, msg["attempt"])
            if not follow:
                return
            if verdict is not None:
                self.decide(verdict)
            if self.core.stop_done:
                self._next_attempt(msg["attempt"])
            else:
                self.pending_restart = msg["attempt"]
        else:
            log("ignoring message type %r from the coordinator" % str(kind))
