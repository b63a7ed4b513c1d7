"""A job's directory on the host: its file names, state.json (written atomically, read strictly), `agent status`.

A missing state.json means the job was never launched here; a state.json that cannot be read or parsed is
an error (`StateFileError`), never taken for "never launched".
"""

import json
import os
import time

from .common import InputError, emit, log, write_private
from .jobfile import JOB_FILE, load_job
from .procfs import pid_alive
from .states import TERMINAL_JOB_STATES, JobState, ProcState
from .status import AttemptRecord, HostStatus

STATE_FILE = "state.json"
LOCK_FILE = ".lock"
SUPERVISOR_LOG = "supervisor.log"
STOP_REQUEST = "stop-request.json"
# written by a rank that called MPI_Abort (clusterctl/collective/pmiclient.py, which names it too): who and why
ABORT_FILE = "abort.json"
_ABORT_MAX_BYTES = 16 << 10


class StateFileError(InputError):
    """state.json exists but cannot be read or is not a JSON object."""


def write_json_atomic(path, obj):
    """Write JSON to path atomically, 0600 (common.write_private)."""
    write_private(path, json.dumps(obj, sort_keys=True, indent=1) + "\n")


def abort_note(jobdir, row):
    """What abort.json says of a process that ended with an error code (a `ProcessRow`): "rank R called
    MPI_Abort with error code C" when the job's rank R (a trainer with that id) wrote it after the process
    started, else None. The file is the job's own, but read as any host input: bounded, one line, no link."""
    if row.role != "trainer" or row.started_at is None:
        return None
    path = os.path.join(jobdir, ABORT_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        rec = json.loads(os.read(fd, _ABORT_MAX_BYTES + 1)[:_ABORT_MAX_BYTES])
    except ValueError:
        return None
    finally:
        os.close(fd)
    if not isinstance(rec, dict) or rec.get("rank") != row.id or not isinstance(rec.get("time"), (int, float)):
        return None
    if rec["time"] < row.started_at - 1:  # an earlier attempt's abort
        return None
    message = " ".join(str(rec.get("message") or "called MPI_Abort").split())[:200]
    return message


def read_state(jobdir):
    """state.json of a job dir as a dict; None when there is none; raise StateFileError when it is unreadable."""
    path = os.path.join(jobdir, STATE_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise StateFileError("cannot read job state %s: %s" % (path, e.strerror or e))
    try:
        state = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise StateFileError("job state %s is corrupt (not JSON: %s)" % (path, e))
    if not isinstance(state, dict):
        raise StateFileError("job state %s is corrupt (not a JSON object)" % path)
    return state


def read_state_or_none(jobdir):
    """read_state, with an unreadable state.json logged and taken as none (launch, stop and logs go on)."""
    try:
        return read_state(jobdir)
    except StateFileError as e:
        log(str(e))
        return None


def supervisor_alive(state):
    """True when the supervisor recorded in state is running."""
    sup = (state or {}).get("supervisor") or {}
    return pid_alive(sup.get("pid"), sup.get("start_ticks"))


def settled_state(jobdir, state):
    """`state` as read from jobdir, or read again when its supervisor turned out dead while it says the job goes on.
    A supervisor writes its last state and then exits: a state.json read just before that write, and a look at
    /proc just after the exit, would call a finished job lost. Once the supervisor is seen dead its last write is
    on disk, so a second read has it (and a supervisor that died without one is lost, as before: then the state
    as read is kept, the very dicts the caller may hold)."""
    if state is None or state.get("state") in TERMINAL_JOB_STATES or supervisor_alive(state):
        return state
    again = read_state_or_none(jobdir)
    return again if again is not None and again.get("state") in TERMINAL_JOB_STATES else state


def job_from_dir(jobdir, strict=True):
    """(state.json, None) once launched, else (None, job.json or None); strict: a corrupt state.json raises."""
    state = read_state(jobdir) if strict else read_state_or_none(jobdir)
    if state is not None:
        return state, None
    path = os.path.join(jobdir, JOB_FILE)
    if os.path.exists(path):
        return None, load_job(path)
    return None, None


def describe(state, now=None, alive=None):
    """The status reply (a `HostStatus`, as JSON) for a state.json dict, resolving 'lost' processes and jobs.
    `alive`: whether its supervisor runs, when the caller knows (the supervisor itself: its control socket, which
    must not read itself dead when /proc cannot be opened, out of descriptors); None: looked up in /proc."""
    now = time.time() if now is None else now
    alive = supervisor_alive(state) if alive is None else alive
    job_state = state.get("state")
    reason = state.get("reason")
    if not alive and job_state not in TERMINAL_JOB_STATES:
        job_state = JobState.LOST
        reason = "supervisor is not running (was %s%s)" % (state.get("state"), ": %s" % reason if reason else "")
    procs = []
    for r in state.get("processes") or []:
        p = {k: r.get(k) for k in ("role", "id", "pid", "state", "exit_code", "started_at", "ended_at",
                                   "log", "error")}
        p["logs"] = r.get("logs") or ([{"attempt": 0, "path": r["log"]}] if r.get("log") else [])
        if p["state"] == ProcState.RUNNING and not pid_alive(r.get("pid"), r.get("start_ticks")):
            if not alive:
                p["state"] = ProcState.LOST
        if p["state"] == ProcState.RUNNING and not alive:
            p["orphaned"] = True
        if p["started_at"]:
            p["uptime_s"] = round((p["ended_at"] or now) - p["started_at"], 3)
        procs.append(p)
    attempt = state.get("attempt") or 0
    attempts = [a for a in map(AttemptRecord.from_json, state.get("attempts") or []) if a is not None]
    total = state.get("attempts_total") or len(attempts)
    if not any(a.attempt == attempt for a in attempts):  # the current attempt: its outcome is the job state
        attempts.append(AttemptRecord(attempt, job_state, reason, state.get("failure"),
                                      state.get("attempt_started_at"), None))
        total += 1
    extra = {k: state[k] for k in ("hosts", "coordinator", "elastic") if k in state}
    return HostStatus(
        job=state.get("job"), host=state.get("host"), jobdir=state.get("jobdir"), state=job_state, reason=reason,
        failure=state.get("failure"), failures=state.get("failures") or [],
        is_coordinator=state.get("is_coordinator"),
        supervisor={"pid": (state.get("supervisor") or {}).get("pid"), "alive": alive}, processes=procs,
        updated_at=state.get("updated_at"), attempt=attempt, restarts=state.get("restarts") or 0,
        attempts=attempts, attempts_total=total, restart_at=state.get("restart_at") if alive else None,
        restart_pending=bool(state.get("restart_pending")) and alive, extra=extra).to_json()


def cmd_status(args):
    """Print the job's state on this host."""
    jobdir = os.path.abspath(args.jobdir)
    try:
        state, job = job_from_dir(jobdir)
    except StateFileError as e:  # not "never launched": the job may be running; say what is wrong
        emit({"ok": False, "state": JobState.UNKNOWN, "jobdir": jobdir, "processes": [], "job": None,
              "error": str(e), "reason": str(e)})
        return 2
    if state is None:
        emit({"ok": False, "state": JobState.UNKNOWN, "jobdir": jobdir, "processes": [],
              "job": job["job"] if job else None,
              "error": "no job state in %s (never launched here?)" % jobdir})
        return 1
    emit(describe(settled_state(jobdir, state)))
    return 0
