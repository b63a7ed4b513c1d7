"""The per-host, per-job supervisor: a thin event loop between the rules and their effects.

What the supervisor decides lives in clusterctl/host/rules.py (pure functions over a `JobCore`, with the
job-state transition table); what it does lives in small objects it owns: `LocalProcesses` (spawn, reap;
clusterctl/host/processes.py), the `Stopper` (stopping.py), the `CoordinatorLink` (coordinator.py: the
listener and the peers) or the `PeerLink` (peer.py: the connection to the coordinator), `Membership`
(membership.py: the coordinator's view of the peer hosts) and the `EventLoop` (loop.py). This class wires
them: an event (a process exit, a message, a timer, a signal) goes to a rule, and the rule's answer (a
`Verdict`, a next attempt) becomes effects (signal the local processes, tell the peers, spawn again,
write state.json). One process plays one role: the coordinator (also a single-host job) or a peer.

Why one module: this is the wiring, one handler per event, each a few lines from a rule's answer to its
effects (the start barrier, restarts, elastic views, the control socket's requests); the handlers share the
supervisor's few fields (the core, the links, the loop), and split across modules they would pass all of them
back and forth. Every decision they carry out is in rules.py, membership.py, policy.py and elastic.py.
"""

import json
import os
import signal
import time

from . import protocol, rules
from .common import log
from .control import ControlServer
from .coordinator import CoordinatorLink
from .elastic import CannotContinue
from .elastichost import ElasticHost
from .jobdir import STATE_FILE, STOP_REQUEST, abort_note, write_json_atomic
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
SETTLE_S = 2.0  # after a stop: how long a stopped process may take to be reapable (Processes.settle)
TICK = 0.1  # seconds the loop waits for a socket before it looks at processes and timers again


class Supervisor:
    """Runs the job's local processes and takes part in the cross-host protocol (`run()` until the end)."""

    def __init__(self, job, jobdir, report_fd=None, clock=time.monotonic, start_problems=()):
        self.job = job
        # the problems a preflight before this supervisor found (Slurm's node: host/slurm.py); the first attempt
        # fails with them where it would spawn, as a spawn failure (never restarted): every host hears of it at once
        self.start_problems = list(start_problems)
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
        self.token = job.get("token") or (self.coord or {}).get("token")
        self.procs = LocalProcesses(self.job_id, jobdir, self._entries(job["processes"]))
        self.retired = []  # an elastic job's rows of earlier attempts that this host no longer runs (their logs)
        self.after = job.get("start_trainers_after")
        trainers_total = (self.coord["trainers_total"] if self.coord is not None
                          else sum(1 for p in job["processes"] if p["role"] == "trainer"))
        self.core = JobCore(self.policy, trainers_total, started_at=time.time())
        self.loop = EventLoop()
        self.log_bad = LogLimiter()
        # an elastic job (hosts[].spare, job.min_hosts): the view of the attempt, this host's part in it
        self.elastic = None
        if job.get("elastic") is not None and self.coord is not None:
            self.elastic = ElasticHost(job["elastic"], os.path.expanduser("~"),
                                       (self.after or {}).get("timeout", 120.0))
        self.members = None
        self.link = None
        if self.coord is not None and self.is_coord:
            self.members = self._membership()
            self.link = CoordinatorLink(self.loop, self.job_id, self.coord["address"], self.coord["port"],
                                        self.coord["token"], self.timings, self, self.log_bad, clock)
        elif self.coord is not None:
            self.link = self._peer_link(self.coord["address"], self.coord["port"])
        self.t0 = self.attempt_t0 = clock()
        self.gate = None  # trainers held back until the pserver endpoints open (start_trainers_after)
        self.stopper = None
        self.stop_report = None
        self.stop_done_at = None
        self.restart_at = None  # coordinator: monotonic time of the next attempt, once every host stopped
        self.pending_restart = None  # peer: the attempt the coordinator asked for, started once the stop is done
        self.local_exits = []  # ExitEvents of this attempt on this host (a peer's hello repeats them)
        # the start barrier: a multi-host job's first attempt spawns nothing until every host joined (`go`)
        self.awaiting_go = False
        self.went = False  # coordinator: `go` was sent
        self.term_requested = self.term_handled = False
        self.my_ticks = self.started_at = None
        self.dirty = True
        self._counts_written = None

    @property
    def state(self):
        """The job state on this host (a JobState)."""
        return self.core.state

    def _entries(self, processes):
        """Process entries with the processes' shared secret (pserver / PMI auth) in their environment only,
        or `auth: none` said so."""
        entries = []
        for p in processes:
            env = dict(p["env"])
            if self.job.get("auth") == "none":
                env[AUTH_ENV] = "none"
            elif self.token:
                env[TOKEN_ENV] = process_token(self.token)
            entries.append(dict(p, env=env))
        return entries

    def _membership(self):
        """The coordinator's Membership: every other host of the job; an elastic job's members are its view's."""
        everyone = self.coord["hosts"] - 1
        if self.elastic is None:
            return Membership(everyone)
        labels = self.elastic.peer_labels()
        return Membership(len(labels), members=labels, everyone=everyone)

    def _peer_link(self, address, port):
        link = PeerLink(self.loop, self.job_id, self.host, address, port, self.coord["token"], self.timings, self,
                        self.log_bad, self.clock)
        # the first try now, not at the loop's first timer round: that came a tick (0.1 s) later, and every
        # multi-host start waited for it (the start barrier waits for the last host to join)
        link.tick(self.clock())
        return link

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
            "awaiting_go": self.awaiting_go,  # the start barrier: every host must join before anything spawns
        }
        if self.retired:
            state["retired"] = [r.to_json() for r in self.retired]
        if self.elastic is not None:
            idle = None
            if self.members is not None:
                idle = dict((h, self.members.joined_at.get(h, 0.0)) for h in self.members.connected
                            if not self.members.is_member(h))
            state["elastic"] = self.elastic.to_json(idle, time.time())
        if self.coord is not None:
            state["coordinator"] = {"address": self.coord["address"], "port": self.coord["port"],
                                    "hosts": self.coord["hosts"]}
            if self.members is not None:
                state["coordinator"]["trainers_total"] = core.trainers_total
                state["coordinator"].update(self.link.stats())
                state["hosts"] = self.members.to_json()
            else:
                state["coordinator"]["connected"] = self.link is not None and self.link.connected
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

    def report(self, obj, final=True):
        """A line of the launch report (`agent launch` relays the first, `agent up` may wait for the second):
        the `armed` line (not final) when the processes wait for the start barrier, then the final one, after
        which the pipe is closed. A launcher that stopped waiting is no error."""
        if self.report_fd is None:
            return
        try:
            os.write(self.report_fd, (json.dumps(obj, sort_keys=True) + "\n").encode())
        except BrokenPipeError:
            final = True  # nobody reads any more
        except OSError as e:
            log("cannot report to launcher: %s" % e)
        if not final:
            return
        try:
            os.close(self.report_fd)
        except OSError:
            pass
        self.report_fd = None

    def _report_launch(self, error):
        self.report({"ok": error is None, "error": error, "jobdir": self.jobdir, "supervisor_pid": os.getpid(),
                     "pids": self.procs.pids()})

    def _report_armed(self):
        """The supervisor is set (listening, or trying to join) and waits for every host: nothing started."""
        self.report({"ok": True, "error": None, "jobdir": self.jobdir, "supervisor_pid": os.getpid(), "pids": {},
                     "armed": True}, final=False)

    # -- main ----------------------------------------------------------------------------------------------------

    def run(self):
        """Run the job on this host until its verdict is final and its processes are stopped; 0, or 1 when the
        coordinator could not even listen."""
        self.my_ticks = (proc_stat(os.getpid()) or (None, None, None))[2]
        self.started_at = time.time()
        # the handlers are this run's: put back as they were when it returns (a supervisor run in-process, by
        # `agent run` in a pod's main process or by a test, leaves its process as it found it)
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD)}
        wakeup = self._wake_on_signals()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_term)
        # a handler, not SIG_IGN: ignored signals would be inherited by the children
        signal.signal(signal.SIGHUP, lambda s, f: None)
        signal.signal(signal.SIGCHLD, lambda s, f: None)  # a child's exit wakes the loop (its wakeup fd)
        log("supervisor %d for job %s on %s (%s), %d local processes" % (
            os.getpid(), self.job_id, self.host, "coordinator" if self.is_coord else "peer", len(self.procs.rows)))
        try:
            return self._run()
        finally:
            for sig, handler in previous.items():
                if handler is not None:
                    signal.signal(sig, handler)
            wakeup()

    def _wake_on_signals(self):
        """Make every signal the loop handles (a child's exit, SIGTERM) wake its wait at once: Python runs a
        handler between the loop's waits, not in them, so without this a stop or a process's exit was seen at
        the next tick, up to TICK later on every host (`stop` waited for it). Returns the undo."""
        rfd, wfd = os.pipe()
        for fd in (rfd, wfd):
            os.set_blocking(fd, False)
            os.set_inheritable(fd, False)
        previous = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)

        def drain(fd):
            try:
                while os.read(fd, 4096):
                    pass
            except (BlockingIOError, InterruptedError):
                pass

        self.loop.register(rfd, drain)

        def undo():
            signal.set_wakeup_fd(previous)
            self.loop.unregister(rfd)
            os.close(rfd)
            os.close(wfd)

        return undo

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
        elif self.awaiting_go:  # ended at the start barrier
            self._report_launch("job %s: %s before the processes started" % (self.core.state, self._reason()))
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
        """Start this attempt: a multi-host job's first attempt waits for every host (the start barrier: the
        coordinator's `go`); any other spawns its local processes at once."""
        attempt = self.core.attempt
        if attempt:
            log("attempt %d of job %s (restart %d of %d)" % (attempt, self.job_id, attempt, self.policy.restarts))
        if attempt == 0 and self.link is not None and self.coord["hosts"] > 1:
            self.awaiting_go = True
            self.write_state()
            log("waiting for every host of the job to join before starting anything")
            self._report_armed()
            self.procs.prepare()  # while it waits, not after the `go` (at once on every host)
            return
        self._spawn()

    def _spawn(self):
        """Spawn this attempt's local processes: pservers first, trainers at once or once the pservers listen."""
        self.awaiting_go = False
        attempt = self.core.attempt
        if attempt == 0 and self.start_problems:
            rules.mark_running(self.core)
            msg = "preflight: " + "; ".join(p["message"] for p in self.start_problems)
            self._fail_start(msg, msg, self.start_problems[0].get("process"))
            return
        after = self.after
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

    def _fail_start(self, msg, why, first=None):
        """The pending processes fail to start (`why`, each): the exit of the first (or of the one named `first`)
        brings the verdict (a failure to start is never restarted); `msg` is logged and is the launch report's error."""
        log(msg)
        rows = self.procs.not_started(why, state=ProcState.FAILED)
        self.dirty = True
        self._report_launch(msg)
        if rows:
            self._local_exit(next((r for r in rows if r.name == first), rows[0]))

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
        closed = set(gate.closed())
        gone = [r for r in self.procs.rows if r.role == "pserver" and r.exit_code is not None and set(r.ports) & closed]
        if gone:  # its endpoint will never open: fail now, not when the gate's timeout (120 s) runs out
            self.gate = None
            r = gone[0]
            msg = "%s exited with code %s before its endpoint %s accepted connections" % (
                r.name, r.exit_code, ", ".join(sorted(set(r.ports) & closed)))
            self._fail_start(msg, "not started: " + msg)
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
            self._fail_start(msg, "not started: " + msg)

    def _reap(self):
        for r in self.procs.reap():
            self.dirty = True
            self._local_exit(r)

    def _local_exit(self, r):
        note = abort_note(self.jobdir, r) if r.exit_code not in (0, None) else None
        ev = ExitEvent(r.role, r.id, r.exit_code, r.error, self.host, self.core.attempt, note)
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
            if self.awaiting_go:  # decided at the start barrier: nothing was started here
                self.awaiting_go = False
                self.procs.not_started("not started: the job ended first")
                self._report_launch("job %s: %s before the processes started" % (verdict.outcome, verdict.reason))
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
        self.procs.settle(SETTLE_S, skip=self.stopper.leftover)
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
            self.link.send(protocol.done(self.host, self.core.attempt,
                                         self.elastic.inventory() if self.elastic is not None else None))
        if self.core.restart_pending and self.pending_restart is not None:
            self._next_attempt(*self.pending_restart)

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
            if not self._restart_gathered(now):
                return
            delay = self.policy.restart_delay(self.core.attempt + 1)
            self.restart_at = self.clock() + delay  # not `now`: the stop that just ended took time
            self.dirty = True
            log("restart %d of %d in %.1fs" % (self.core.attempt + 1, self.policy.restarts, delay))
        if self.clock() >= self.restart_at:
            view = None
            if self.elastic is not None:
                view = self._next_view()
                if view is None:  # the job cannot go on: it ended
                    return
            self._next_attempt(self.core.attempt + 1, view)

    def _restart_gathered(self, now):
        """A host that took over as coordinator plans the next attempt once the last view's members joined
        it, or connect_timeout passed (rules.takeover_gathered)."""
        el = self.elastic
        if el is None or el.takeover_since is None:
            return True
        connected = self.members.connected
        missing = [h for h in el.peer_labels(exclude=(el.replaced,)) if h not in connected]
        return rules.takeover_gathered(missing, now, el.takeover_since, self.timings)

    def _next_view(self):
        """Coordinator of an elastic job: the next attempt's view (host/elastic.py next_view, the pserver
        checkpoint check), logged; None when the job cannot go on (it is then failed, final, in one line)."""
        el = self.elastic
        idle = dict((h, self.members.joined_at.get(h, 0.0)) for h in self.members.connected
                    if not self.members.is_member(h))
        try:
            view, change = el.plan_next(self.members.connected, idle, time.time(), el.inventory())
        except CannotContinue as e:
            failure = {"host": None, "role": None, "id": None, "exit_code": None}
            self.decide(Verdict(JobState.FAILED, str(e), (self.core.verdict.failure if self.core.verdict else None)
                                or failure))
            return None
        if change is not None:
            log(el.describe_change(change))
        return view

    def _next_attempt(self, attempt, view=None):
        """Start attempt number `attempt` on this host, on the same plan or, for an elastic job, on `view`'s
        hosts (the coordinator tells the peers)."""
        rules.begin_attempt(self.core, attempt, time.time())
        self.attempt_t0 = self.clock()
        self.restart_at = self.pending_restart = None
        self.stopper = self.stop_report = None
        self.local_exits = []
        self.gate = None
        if view is not None:
            self._adopt(view)
        else:
            self.procs.reset()
        if self.members is not None:
            self.members.new_attempt(time.time())
            self.link.broadcast(protocol.restart(attempt, view))  # a broken connection is noticed by the tick
        self.dirty = True
        self._start_attempt()

    def _adopt(self, view):
        """An elastic job's view becomes this host's: its part (processes, the pserver wait, the trainers the
        coordinator counts) replaces the last attempt's; a host that is not a member runs nothing."""
        el = self.elastic
        el.adopt(view)
        part = el.part()
        self.retired = self.procs.swap(self._entries(part["processes"]), self.retired)
        self.after = part["start_trainers_after"]
        self.core.trainers_total = part["coordinator"]["trainers_total"]
        if self.members is not None:
            self.members.set_members(el.peer_labels())
        log("attempt %d runs on %s; this host %s" % (view["attempt"], ", ".join(
            el.label(i) for i in view["members"]), "runs %d process(es)" % len(part["processes"])
            if el.member else "runs nothing (idle: a spare for the next change)"))

    # -- the coordinator's side (CoordinatorLink's handler) ----------------------------------------------------

    def _coordinator_tick(self, now):
        self.link.tick(now)
        stats = self.link.stats()
        if stats != self._counts_written:
            self._counts_written = stats
            self.dirty = True
        m = self.members
        if self.awaiting_go and rules.barrier_passed(self.core, m.all_joined(), len(m.connected_members()) >= m.expected,
                                                     now - self.attempt_t0, self.timings):
            self._go()
        verdict = rules.on_peers_missing(self.core, m.connected_members(), m.expected, now - self.attempt_t0,
                                         self.timings)
        if verdict is not None:
            self.decide(verdict)

    def _go(self):
        """The start barrier passed: tell every host, then spawn here."""
        log("every host joined (%d connected): starting the job's processes" % len(self.members.connected))
        self.went = True
        self.link.broadcast(protocol.go(self.core.attempt))
        self.dirty = True
        self._spawn()

    def refuse(self, host, hello):
        """CoordinatorLink's check of a hello with a good proof: an elastic host must say which host it is."""
        return None if self.elastic is None else self.elastic.refuse(host, hello["index"])

    def peer_joined(self, host, addr, hello):
        """A peer authenticated (or came back): bring it to the job's attempt and state."""
        log("host %s connected from %s" % (host, addr))
        core, el = self.core, self.elastic
        self.members.join(host, addr, time.time(), done=hello["idle"] and core.verdict is not None,
                          index=hello["index"])
        if el is not None:
            el.index_of[host] = hello["index"]
            if hello["ps"] is not None:
                el.inventories[hello["index"]] = hello["ps"]
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
        view = el.view if el is not None else None
        if hello["attempt"] != core.attempt:  # it stopped an earlier attempt on its own: it joins this one
            # (an elastic job's host that is not in this attempt's view runs nothing: it waits as a spare)
            log("host %s rejoined at attempt %d; sending it attempt %d%s" % (
                host, hello["attempt"], core.attempt, "" if self.members.is_member(host)
                else " (not one of its hosts: it waits, idle, as a spare for the next change)"))
            self.link.send(host, protocol.restart(core.attempt, view))
            return
        if self.went:  # the start barrier passed while it was away (or before it joined: a late spare)
            self.link.send(host, protocol.go(core.attempt))
        for e in hello["exits"]:
            self._on_exit(ExitEvent(e["role"], e["id"], e["code"], e["error"], host, e["attempt"], e.get("note")))
        if hello["failed"] and self.members.is_member(host):  # it stopped this attempt by itself
            verdict = rules.on_host_failed(core, host, hello["failed"])
            if verdict is not None:
                self.decide(verdict)

    def peer_message(self, host, msg):
        """A message from an authenticated peer."""
        kind = msg["type"]
        if kind == Msg.EXIT:
            self._on_exit(ExitEvent(msg["role"], msg["id"], msg["code"], msg["error"], host, msg["attempt"],
                                    msg.get("note")))
        elif kind == Msg.STOPPING:
            verdict = rules.on_stop_request(self.core, msg["reason"] or "stop requested on %s" % host)
            if verdict is not None:
                self.decide(verdict)
        elif kind == Msg.DONE:
            if msg["attempt"] == self.core.attempt:  # not a late "done" of an earlier attempt
                self.members.mark_done(host, time.time())
                self.dirty = True
            if self.elastic is not None and msg["ps"] is not None and host in self.elastic.index_of:
                self.elastic.inventories[self.elastic.index_of[host]] = msg["ps"]
        else:
            log("ignoring message type %r from %s" % (str(kind), host))

    def peer_left(self, host, why):
        """A peer's connection is gone: a lost host, unless it had finished its stop or runs nothing."""
        self.dirty = True
        if self.members.leave(host, why, time.time(), deciding=self.core.verdict is None):
            if self.elastic is not None and host in self.elastic.index_of:
                self.elastic.lost.add(self.elastic.index_of[host])
            self.decide(rules.on_host_lost(self.core, host, why))

    # -- the peer's side (PeerLink's handler) ------------------------------------------------------------------

    def _peer_tick(self, now):
        link, el = self.link, self.elastic
        link.tick(now, keep_trying=not self.core.final)
        if link.connected:
            return
        # an elastic job's peer that turned to a successor of its coordinator: not the coordinator's silence
        successor = el is not None and el.target != el.view["coordinator"] and not link.ever_connected
        if not successor:
            verdict = rules.on_coordinator_silence(self.core, self.timings, now, self.t0, link.ever_connected,
                                                   link.lost_since, link.why(), link.endpoint, elastic=el is not None)
            if verdict is not None:
                self.decide(verdict)
        if el is not None and rules.next_coordinator_due(self.core, self.timings, now, link.lost_since,
                                                         el.target_since, successor):
            self._next_coordinator(now)

    def _next_coordinator(self, now):
        """Elastic: the coordinator (or the successor this host tried) is gone: turn to the next successor
        (host/elastic.py successor), or take over when that is this host."""
        el = self.elastic
        gone = el.target
        nxt = el.next_candidate()
        if nxt is None:
            self.decide(Verdict(JobState.FAILED, "lost coordinator %s and none of its successors answered within "
                                "%.0fs" % (el.label(el.view["coordinator"]), self.timings.connect_timeout),
                                self.core.verdict.failure if self.core.verdict else None))
            return
        if nxt == el.me:
            self._take_over(now)
            return
        el.target, el.target_since = nxt, now
        address, port = el.endpoint(nxt)
        log("coordinator %s is gone; joining its successor %s (%s:%d)" % (el.label(gone), el.label(nxt), address,
                                                                           port))
        self.link.close()
        self.link = self._peer_link(address, port)
        self.dirty = True

    def _take_over(self, now):
        """Elastic: this host succeeds the lost coordinator: it listens on its own control endpoint, waits for
        the others (connect_timeout at most), then plans the next attempt without the lost ones."""
        el = self.elastic
        old = el.view["coordinator"]
        address, port = el.endpoint(el.me)
        self.link.close()
        link = CoordinatorLink(self.loop, self.job_id, address, port, self.coord["token"], self.timings, self,
                               self.log_bad, self.clock)
        why = link.listen()
        if why is not None:
            self.link = None
            log("cannot take over as coordinator: %s" % why)
            self.decide(Verdict(JobState.FAILED, "lost coordinator %s and cannot take over from it: %s"
                                % (el.label(old), why), self.core.verdict.failure if self.core.verdict else None))
            return
        log("coordinator %s is gone: this host takes over, listening on %s" % (el.label(old), link.endpoint))
        self.link, self.is_coord = link, True
        self.coord = dict(self.coord, address=address, port=port, is_coordinator=True)
        self.members = self._membership()
        el.takeover_since, el.replaced = now, old
        el.lost.add(old)
        el.target = el.me
        if self.core.stop_done:
            self.stop_done_at = self.clock()
        self.dirty = True

    def hello_fields(self):
        """What the hello repeats: this attempt's exits here, a stop request, the attempt, whether idle, failed;
        an elastic job's host index and pserver checkpoint shards."""
        v, el = self.core.verdict, self.elastic
        return {"exits": [e.to_json() for e in self.local_exits],
                "stopping": "stop requested on %s" % self.host if self.term_requested else None,
                "attempt": self.core.attempt, "idle": self.core.stop_done,
                "failed": v.reason if v is not None and v.outcome == JobState.FAILED else None,
                "index": el.me if el is not None else None, "ps": el.inventory() if el is not None else None}

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
        elif kind == Msg.GO:
            if msg["attempt"] == self.core.attempt and self.awaiting_go and self.core.verdict is None:
                log("every host joined: starting")
                self._spawn()
        elif kind == Msg.RESTART:
            view = None
            if self.elastic is not None:
                try:
                    view = self.elastic.check(msg["view"])
                except ValueError as e:
                    log("ignoring restart %d from the coordinator: %s" % (msg["attempt"], e))
                    return
            follow, verdict = rules.on_restart_order(self.core, msg["attempt"])
            if not follow:
                return
            if verdict is not None:
                self.decide(verdict)
            if self.core.stop_done:
                self._next_attempt(msg["attempt"], view)
            else:
                self.pending_restart = (msg["attempt"], view)
        else:
            log("ignoring message type %r from the coordinator" % str(kind))
