"""Stopping a job on one host: SIGTERM to each process group, SIGKILL after the grace, the sweep by environ.

`Stopper` is the sequence (the supervisor drives it step by step; `agent stop` runs it to the end when the
supervisor is dead or left something); `cmd_stop` is `agent stop`.
"""

import fcntl
import os
import signal
import time

from .common import InputError, emit, log
from .jobdir import (LOCK_FILE, STATE_FILE, STOP_REQUEST, job_from_dir, read_state_or_none, settled_state,
                     supervisor_alive, write_json_atomic)
from .jobfile import JOB_ID_RE
from .procfs import group_members, mpi_files, pid_alive, proc_stat, release_mpi_files, tagged_processes
from .states import TERMINAL_JOB_STATES, JobState, ProcState

STOP_WAIT_EXTRA = 15.0  # agent stop: waits grace + this for the supervisor to finish


class Stopper:
    """SIGTERM to each process group, SIGKILL after grace, then a sweep by environ; at the end, the files of
    the MPI runtime (shared memory, mostly, and Open MPI's session directories once their launcher is gone) that
    nothing maps or holds open any more: those the job's processes used when the stop began (`segments`), and older
    ones (procfs.release_mpi_files: `removed`).

    groups: dicts with pid (== pgid, started with start_new_session), start_ticks,
    role, id.  `killed` has one entry per group or process signalled: {pid, via, signal
    (the last one sent), role, id (groups only)}.  A group is only signalled while it is provably ours: its leader is
    alive with the recorded start time, or the leader is gone (the kernel does not
    reuse a pid that is still a process-group id).  step() is non-blocking.
    """

    def __init__(self, job_id, jobdir, groups, grace, sweep=True):
        self.job_id = job_id
        self.jobdir = jobdir
        self.groups = [g for g in groups if g.get("pid")]
        self.grace = max(0.0, float(grace))
        self.sweep = sweep
        self.killed = []
        self._sent = {}  # (via, pid) -> its entry in killed
        self.phase = "new"
        self.leftover = []
        self._pids = []  # the job's live pids at the last snapshot
        self._strays_seen = {}  # pid -> start ticks of each stray the sweep has found
        self.segments, self.removed, self.began = set(), [], None
        self.deadline = self.kill_deadline = 0.0

    def _ours(self, g):
        st = proc_stat(g["pid"])
        return st is None or st[2] == g.get("start_ticks")

    def _signal(self, how, target, sig, g=None):
        try:
            if how == "killpg":
                os.killpg(target, sig)
            else:
                os.kill(target, sig)
        except ProcessLookupError:
            return
        except PermissionError as e:
            log("cannot signal %s %d: %s" % (how, target, e))
            return
        entry = self._sent.get((how, target))
        if entry is None:  # one entry per group or process, whatever it took: `killed` counts processes
            entry = self._sent[(how, target)] = {"pid": target, "via": how}
            if g is not None:
                entry["role"], entry["id"] = g.get("role"), g.get("id")
            self.killed.append(entry)
        entry["signal"] = signal.Signals(sig).name  # the last one sent

    def _snapshot(self):
        ours = [g for g in self.groups if self._ours(g)]
        members = group_members(set(g["pid"] for g in ours))
        live = [g for g in ours if members.get(g["pid"])]
        tagged = tagged_processes(self.job_id, self.jobdir) if self.sweep else {}
        grouped = set(g["pid"] for g in live)
        strays = {pid: pgid for pid, pgid in tagged.items() if pgid not in grouped}
        # A stray found before stays one until it is gone: a process on its way out has no environ left to be
        # found by, while it still holds its files and its MPI segment (which the end of the stop removes).
        for pid, start in list(self._strays_seen.items()):
            st = None if pid in strays else proc_stat(pid)
            if st is not None and st[0] not in ("Z", "X", "x") and st[2] == start and st[1] not in grouped:
                strays[pid] = st[1]
            elif pid not in strays:
                del self._strays_seen[pid]
        for pid in strays:
            if pid not in self._strays_seen:
                st = proc_stat(pid)
                if st is not None:
                    self._strays_seen[pid] = st[2]
        self._pids = [pid for g in live for pid in members[g["pid"]]] + list(strays)
        return live, strays

    def start(self, now):
        """Send SIGTERM to every live group and to tagged processes outside them (what they map first)."""
        self.phase = "term"
        self.deadline = now + self.grace
        self.began = time.time()
        self._term_round(first=True)

    def _term_round(self, first=False):
        live, strays = self._snapshot()
        if first:
            self.segments = mpi_files(self._pids)
        for g in live:
            self._signal("killpg", g["pid"], signal.SIGTERM, g)
        for pid in strays:
            self._signal("kill", pid, signal.SIGTERM)
        return bool(live or strays)

    def step(self, now):
        """Advance; return True when nothing of the job is left (or it gave up)."""
        if self.phase == "done":
            return True
        if self.phase == "term":
            if self._term_round() and now < self.deadline:
                return False
            self.phase = "kill"
            self.kill_deadline = now + 5.0
        live, strays = self._snapshot()
        if not live and not strays:
            self._done()
            return True
        for g in live:
            self._signal("killpg", g["pid"], signal.SIGKILL, g)
        for pid in strays:
            self._signal("kill", pid, signal.SIGKILL)
        if now >= self.kill_deadline:
            self.leftover = sorted(set([g["pid"] for g in live] + list(strays)))
            log("giving up on pids %s (uninterruptible?)" % self.leftover)
            self._done()
            return True
        return False

    def _done(self):
        self.phase = "done"
        self.removed = release_mpi_files(self.segments, self.began)
        if self.removed:
            log("removed the files the job's MPI left: %s" % " ".join(self.removed))

    def run(self, poll=0.05):
        """Blocking version of start() + step()."""
        self.start(time.monotonic())
        while not self.step(time.monotonic()):
            time.sleep(poll)
        return self.killed


def cmd_stop(args):
    """Stop the job on this host: supervisor first, then anything left, then the environ sweep."""
    jobdir = os.path.abspath(args.jobdir)
    state, job = job_from_dir(jobdir, strict=False)  # a corrupt state.json: still stop by the job's tag
    state = settled_state(jobdir, state)  # a supervisor that just wrote its last state and exited: that state
    job_id = args.job or (state or {}).get("job") or (job or {}).get("job") or os.path.basename(jobdir)
    if not JOB_ID_RE.match(job_id):
        raise InputError("cannot tell the job id of %s; pass --job" % jobdir)
    if args.grace is not None and args.grace < 0:
        raise InputError("--grace must be >= 0")
    grace = args.grace if args.grace is not None else float(
        (state or {}).get("grace") or (job or {}).get("grace") or 10.0)
    killed = []
    was_running = False
    sup_stopped = None
    if state is not None and supervisor_alive(state):
        was_running = not state.get("lingering")  # a coordinator whose job is over waits for its peers only
        sup = state["supervisor"]
        try:
            write_json_atomic(os.path.join(jobdir, STOP_REQUEST), {"grace": grace, "requested_at": time.time()})
        except OSError as e:
            log("cannot write stop request: %s" % e)
        try:
            os.kill(sup["pid"], signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace + STOP_WAIT_EXTRA
        while supervisor_alive(state) and time.monotonic() < deadline:
            time.sleep(0.05)
        if supervisor_alive(state):
            log("supervisor %d did not finish in time; killing it" % sup["pid"])
            try:
                os.kill(sup["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
            sup_stopped = "killed"
        else:
            sup_stopped = "exited"
        state = read_state_or_none(jobdir) or state
    else:  # seen dead after the read above (a peer stopped by the coordinator's broadcast exits at any time): its
        state = settled_state(jobdir, state)  # last write, with the stop report to give, is on disk now
    changed = False
    report = (state or {}).get("stop")
    if (isinstance(report, dict) and report.get("requested") and not report.get("reported")
            and not supervisor_alive(state)):
        # what the supervisor killed for a stop request, reported once: also when the stop reached this host
        # first through the coordinator (a peer stopped by the coordinator's broadcast before we came)
        killed.extend(k for k in report.get("killed") or [] if isinstance(k, dict))
        report["reported"] = was_running = changed = True
    # whatever the supervisor left (or everything, when it was dead): same sequence, run here
    groups = []
    for r in (state or {}).get("processes") or []:
        if r.get("state") == ProcState.RUNNING and pid_alive(r.get("pid"), r.get("start_ticks")):
            groups.append(r)
    stopper = Stopper(job_id, jobdir, groups, grace)
    own = stopper.run()
    if own:
        was_running = True
        killed.extend(own)
    if state is not None and not supervisor_alive(state):
        state = settled_state(jobdir, state)  # it may have ended (and written its verdict) since the read above
        for r in state.get("processes") or []:
            if r.get("state") == ProcState.RUNNING:
                r["state"] = ProcState.STOPPED if any(g is r for g in groups) else ProcState.LOST
                r["ended_at"] = r.get("ended_at") or time.time()
                changed = True
        if state.get("state") not in TERMINAL_JOB_STATES:
            state["state"], state["reason"] = JobState.STOPPED, "stopped by 'agent stop' (supervisor was not running)"
            changed = True
        if changed:
            try:
                lockfd = os.open(os.path.join(jobdir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(lockfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    write_json_atomic(os.path.join(jobdir, STATE_FILE), state)
                finally:
                    os.close(lockfd)
            except OSError as e:
                log("cannot update %s: %s" % (STATE_FILE, e))
    left = sorted(tagged_processes(job_id, jobdir)) + stopper.leftover
    once = {}  # a group the supervisor signalled and this sweep again is one process killed
    for entry in killed:
        once[(entry.get("via"), entry.get("pid"))] = entry
    killed = list(once.values())
    out = {"ok": not left, "was_running": was_running, "job": job_id, "jobdir": jobdir,
           "state": (state or {}).get("state"), "reason": (state or {}).get("reason"),
           "supervisor": sup_stopped, "killed": killed, "left": sorted(set(left))}
    emit(out)
    return 0 if not left else 1
