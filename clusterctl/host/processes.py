"""A host's processes of a job: one `ProcessRow` each, spawned and reaped by `LocalProcesses`.

`TrainerGate` holds the local trainers back until every pserver endpoint accepts connections
(`start_trainers_after`); its decision is a function of the clock and a probe, so it is tested without
sockets.
"""

from __future__ import annotations  # `X | None` on Python 3.9 hosts; no typing import (every start)

import os
import socket
import subprocess
import time

from .common import log
from .jobfile import RESTART_ENV, ROLES, parse_endpoint
from .procfs import proc_stat
from .record import dataclass, field
from .spawn import _pdeathsig_setup, _private_opener, attempt_log, base_env
from .states import ProcState

__all__ = ["ProcessRow", "LocalProcesses", "TrainerGate"]

GATE_INTERVAL = 0.2  # start_trainers_after: seconds between probes of the closed endpoints


@dataclass
class ProcessRow:
    """One process of the job on this host: what runs (from the job file) and how it stands now."""

    role: str
    id: int
    argv: list
    cwd: str
    first_log: str  # the job file's log: attempt 0's; attempt k logs to attempt_log(first_log, k)
    ports: list
    env: dict = field(repr=False)  # the job file's env for it (the host's base env and tags are added)
    log: str = ""
    pid: int | None = None
    start_ticks: int | None = None
    state: str = ProcState.PENDING
    exit_code: int | None = None
    started_at: float | None = None
    ended_at: float | None = None
    error: str | None = None
    signalled: bool = False  # a stop signalled it: its end is `stopped`, not an exit of its own
    logs: list = field(default_factory=list)  # [{"attempt": k, "path": log}] of every attempt so far

    def __post_init__(self):
        self.log = self.log or self.first_log

    @property
    def name(self):
        """role.id"""
        return "%s.%d" % (self.role, self.id)

    def to_json(self):
        """The row as state.json holds it."""
        return {"role": self.role, "id": self.id, "argv": self.argv, "cwd": self.cwd, "log": self.log,
                "ports": self.ports, "pid": self.pid, "start_ticks": self.start_ticks, "state": self.state,
                "exit_code": self.exit_code, "started_at": self.started_at, "ended_at": self.ended_at,
                "error": self.error, "logs": [dict(e) for e in self.logs]}

    def group(self):
        """The row as the Stopper takes it (its process group)."""
        return {"pid": self.pid, "start_ticks": self.start_ticks, "role": self.role, "id": self.id}

    def reset(self):
        """Back to `pending`, for the next attempt (the logs of earlier attempts stay listed)."""
        self.pid = self.start_ticks = self.exit_code = self.started_at = self.ended_at = self.error = None
        self.state = ProcState.PENDING
        self.signalled = False


class LocalProcesses:
    """The job's processes on this host: spawn them (own session, log per attempt), reap them."""

    def __init__(self, job_id, jobdir, entries):
        self.job_id = job_id
        self.jobdir = jobdir
        self._held = {}  # working directory as the job file gives it -> the directory its processes run in (pin())
        self._fds = []  # the flocks pin() holds
        self.rows = [self._row(p) for p in entries]
        self.popens = {}  # (role, id) -> Popen of the current attempt
        self._preexec = None  # (pid it was made in, the children's preexec_fn): prepare()

    def _row(self, p):
        return ProcessRow(p["role"], p["id"], list(p["argv"]), self.pin(p["cwd"]), p["log"], list(p["ports"]),
                          dict(p["env"]))

    def pin(self, cwd):
        """The directory the processes of working directory `cwd` run in, every attempt of this supervisor's: `cwd` with
        its symlinks resolved once (the workspace's path is a symlink to its live generation, hostws.py), held by a
        shared flock on it for as long as this process lives. A dispatch meanwhile makes a new generation live and
        neither recycles nor removes a generation held so (hostws.in_use): the files the job reads or writes there
        stay, and a restarted process runs the code its job started with, as the other hosts' processes do."""
        held = self._held.get(cwd)
        if held is None:
            held = self._held[cwd] = cwd
            real = os.path.realpath(cwd)
            try:
                fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                return held  # not there (preflight says so) or not ours to hold: the processes start in `cwd`
            try:
                import fcntl

                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:  # exclusively held: a dispatch that is removing it right now (in_use() found it free)
                os.close(fd)
                return held
            self._fds.append(fd)  # held until this process exits (the supervisor lives as long as its job)
            held = self._held[cwd] = real
        return held

    def spawn(self, attempt, roles=ROLES):
        """Start the pending processes of `roles` for `attempt`; None, or why one could not start (it is then
        `failed` and the rest of `roles` is `stopped`: not started)."""
        preexec = self.prepare()
        for r in self.rows:
            if r.role not in roles or r.state != ProcState.PENDING:
                continue
            env = base_env(self.job_id, self.jobdir, r.env)
            for name in RESTART_ENV:
                env[name] = str(attempt)
            r.log = attempt_log(r.first_log, attempt)
            if not any(entry["attempt"] == attempt for entry in r.logs):
                r.logs.append({"attempt": attempt, "path": r.log})
            try:
                os.makedirs(os.path.dirname(r.log), mode=0o700, exist_ok=True)
                if os.path.exists(r.log):  # keep the previous run's log, start this one fresh
                    os.replace(r.log, r.log + ".1")
                with open(r.log, "ab", opener=_private_opener) as logf:  # 0600: logs may hold secrets
                    popen = subprocess.Popen(
                        r.argv, cwd=r.cwd, env=env, stdin=subprocess.DEVNULL, stdout=logf,
                        stderr=subprocess.STDOUT, start_new_session=True, close_fds=True, preexec_fn=preexec)
            except (OSError, ValueError, subprocess.SubprocessError) as e:  # ValueError: a NUL in argv or env
                err = "cannot start %s (%s in %s): %s" % (r.name, r.argv[0], r.cwd,
                                                          getattr(e, "strerror", None) or e)
                log(err)
                r.state, r.error, r.ended_at = ProcState.FAILED, err, time.time()
                self.not_started("not started: an earlier process failed to start", roles)
                return err
            st = proc_stat(popen.pid)
            r.pid, r.start_ticks = popen.pid, st[2] if st else None
            r.state, r.started_at = ProcState.RUNNING, time.time()
            self.popens[(r.role, r.id)] = popen
            log("started %s pid %d: %s" % (r.name, popen.pid, r.argv))
        return None

    def prepare(self):
        """What every spawn needs and is costly to make once (the children's preexec_fn: it imports ctypes for
        prctl), made now: a multi-host job's supervisor calls this while it waits at the start barrier, so that
        every host does not spend those milliseconds at once after the `go`. The preexec_fn."""
        if self._preexec is None or self._preexec[0] != os.getpid():
            self._preexec = (os.getpid(), _pdeathsig_setup(os.getpid()))
        return self._preexec[1]

    def not_started(self, why, roles=ROLES, state=ProcState.STOPPED):
        """Mark the pending processes of `roles` as never started (`why`); return them."""
        rows = [r for r in self.rows if r.state == ProcState.PENDING and r.role in roles]
        for r in rows:
            r.state, r.error = state, why
            if state == ProcState.FAILED:
                r.ended_at = time.time()
        return rows

    def reap(self):
        """Collect the processes that ended; return those that ended on their own (not by our signal)."""
        ended = []
        for r in self.rows:
            popen = self.popens.get((r.role, r.id))
            if popen is None or r.state != ProcState.RUNNING:
                continue
            rc = popen.poll()
            if rc is None:
                continue
            r.exit_code, r.ended_at = rc, time.time()
            if r.signalled:
                r.state = ProcState.STOPPED
            else:
                r.state = ProcState.EXITED if rc == 0 else ProcState.FAILED
                ended.append(r)
            log("%s pid %d ended with %s -> %s" % (r.name, r.pid, rc, r.state))
        return ended

    def settle(self, timeout, skip=()):
        """Wait (`timeout` seconds in all) for the signalled processes still `running` to be reapable, pids in
        `skip` aside (those the stopper gave up on). A group whose processes all left /proc's live list may not
        be reapable yet: a multi-threaded process's leader shows as a zombie while its other threads still exit,
        and waitpid waits for them (28 of 30 SIGTERMed 8-thread processes on the development machine); the
        caller reaps afterwards, so that no row stays `running` past the stop."""
        deadline = time.monotonic() + timeout
        for r in self.rows:
            popen = self.popens.get((r.role, r.id))
            if popen is None or r.state != ProcState.RUNNING or not r.signalled or r.pid in skip:
                continue
            try:
                popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log("%s pid %d: still not reapable after the stop" % (r.name, r.pid))

    def failed(self, roles=ROLES):
        """The processes of `roles` that could not start."""
        return [r for r in self.rows if r.state == ProcState.FAILED and r.role in roles and r.pid is None]

    def to_stop(self):
        """Everything running is signalled from now on (and returned); nothing pending will start."""
        running = []
        for r in self.rows:
            if r.state == ProcState.RUNNING:
                r.signalled = True
                running.append(r)
            elif r.state == ProcState.PENDING:
                r.state = ProcState.STOPPED
        return running

    def reset(self):
        """Every row back to pending, for the next attempt."""
        self.popens = {}
        for r in self.rows:
            r.reset()

    def swap(self, entries, retired=()):
        """This host's processes of another attempt's layout (an elastic job's new view): a process that stays
        (same role and id; or comes back: `retired`, the rows an earlier swap returned) keeps its list of earlier
        attempts' logs; the rows that go are returned (their logs stay readable: state.json "retired"). Every
        row is pending."""
        old = {(r.role, r.id): r for r in list(retired) + self.rows}
        self.popens = {}
        rows = []
        for p in entries:
            row = self._row(p)
            prev = old.pop((row.role, row.id), None)
            if prev is not None:
                row.logs = list(prev.logs)
            rows.append(row)
        self.rows = rows
        return [r for r in old.values() if r.logs]

    def pids(self):
        """{"role.id": pid} of the processes started in this attempt (the launch report)."""
        return {r.name: r.pid for r in self.rows if r.pid}

    def has(self, role):
        """Whether any local process has `role`."""
        return any(r.role == role for r in self.rows)

    def to_json(self):
        """state.json "processes"."""
        return [r.to_json() for r in self.rows]


def tcp_probe(endpoint, timeout=GATE_INTERVAL):
    """True if `endpoint` ("host:port") accepts a TCP connection now."""
    try:
        socket.create_connection(parse_endpoint(endpoint), timeout=timeout).close()
        return True
    except OSError:
        return False


class TrainerGate:
    """The local trainers wait until every pserver endpoint accepts connections, `timeout` at most."""

    WAIT, OPEN, TIMEOUT = "wait", "open", "timeout"

    def __init__(self, endpoints, timeout, now, probe=tcp_probe, interval=GATE_INTERVAL):
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.deadline = now + timeout
        self.probe = probe
        self.interval = interval
        self.opened = set()
        self.next_probe = now

    def poll(self, now):
        """Probe the closed endpoints (every `interval`): OPEN once all accepted, TIMEOUT past the deadline."""
        if now < self.next_probe:
            return self.WAIT
        self.next_probe = now + self.interval
        for ep in self.endpoints:
            if ep not in self.opened and self.probe(ep):
                self.opened.add(ep)
        if len(self.opened) == len(self.endpoints):
            return self.OPEN
        return self.TIMEOUT if now >= self.deadline else self.WAIT

    def closed(self):
        """The endpoints that never accepted, in the job file's order."""
        return [ep for ep in self.endpoints if ep not in self.opened]

    def timeout_message(self):
        """The one line that says which endpoints never opened."""
        return "pserver endpoint(s) %s did not accept connections within %gs" % (", ".join(self.closed()),
                                                                                  self.timeout)
