"""`agent launch`: validate the job file, daemonize the supervisor, relay its launch report."""

import errno
import fcntl
import json
import os
import selectors
import signal
import sys
import time

from .common import InputError, emit, log
from .jobdir import LOCK_FILE, STATE_FILE, STOP_REQUEST, SUPERVISOR_LOG, read_state_or_none, supervisor_alive
from .jobfile import load_job
from .procfs import tagged_processes
from .states import JobState
from .supervisor import LAUNCH_REPORT_TIMEOUT, Supervisor

LINGER_YIELD = 5.0  # launch: how long a finished coordinator that still waits for late peers may take to exit


def _close_fds(keep):
    try:
        fds = [int(x) for x in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 256))
    for fd in fds:
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError as e:
                if e.errno != errno.EBADF:
                    raise


def _lock(fd):
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def _ask_to_go(state, lockfd):
    """A finished job's coordinator still answering late peers (state.json `lingering`) gives way to a new
    launch: SIGTERM ends its wait at once. True once it let go of the job dir (LINGER_YIELD at most)."""
    try:
        os.kill(state["supervisor"]["pid"], signal.SIGTERM)
    except OSError:
        pass
    deadline = time.monotonic() + LINGER_YIELD
    while time.monotonic() < deadline:
        if _lock(lockfd):
            return True
        time.sleep(0.05)
    return _lock(lockfd)


def _claim(jobfile, job=None):
    """Load the job file (unless `job`, the file's content already validated, is given) and take its job dir for a
    new supervisor: (job, jobdir, lock fd), or (job, jobdir, refusal) when a supervisor or a process of the job
    is still there (the refusal is the JSON reply)."""
    job = load_job(jobfile) if job is None else job
    jobdir = os.path.dirname(jobfile)
    try:
        lockfd = os.open(os.path.join(jobdir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise InputError("cannot use job dir %s: %s" % (jobdir, e.strerror))
    if not _lock(lockfd):
        state = read_state_or_none(jobdir) or {}
        if not (state.get("lingering") and supervisor_alive(state) and _ask_to_go(state, lockfd)):
            os.close(lockfd)
            return job, jobdir, {"ok": False, "error": "job %s already has a supervisor in %s (pid %s)" % (
                job["job"], jobdir, (state.get("supervisor") or {}).get("pid")), "pids": {}, "jobdir": jobdir}
    prev = read_state_or_none(jobdir)  # a corrupt one: the lock above proves no supervisor holds the dir
    if prev is not None and supervisor_alive(prev):
        os.close(lockfd)
        return job, jobdir, {"ok": False, "error": "job %s already has a supervisor in %s (pid %s)" % (
            job["job"], jobdir, prev["supervisor"]["pid"]), "pids": {}, "jobdir": jobdir}
    lingering = tagged_processes(job["job"], jobdir)
    if lingering:
        os.close(lockfd)
        return job, jobdir, {"ok": False, "pids": {}, "jobdir": jobdir, "error": "job %s still has %d process(es) "
                             "on this host (pids %s); run 'stop' first" % (job["job"], len(lingering), sorted(lingering))}
    for name in (STATE_FILE, STOP_REQUEST):
        try:
            os.unlink(os.path.join(jobdir, name))
        except FileNotFoundError:
            pass
    return job, jobdir, lockfd


def cmd_run(args):
    """`agent run JOBFILE [--preflight all|files]`: see run_job_file."""
    return run_job_file(args.jobfile, preflight=args.preflight is not None, ports=args.preflight != "files")


def run_job_file(path, preflight=False, ports=True):
    """Run the job's supervisor in the foreground (a Slurm task, a Kubernetes pod's main process): its log
    on stderr, the exit code the job's outcome (0: succeeded, 1: anything else). Raise InputError on a bad
    job file. The job dir is the job file's directory (0700: it holds the token). `preflight`: check the job
    on this host first (as `agent up` does); its problems fail the first attempt (Supervisor start_problems).
    `ports`: the preflight binds the job's endpoints too (not in a Kubernetes pod: preflight.preflight)."""
    job, jobdir, lock = _claim(os.path.abspath(path))
    if isinstance(lock, dict):
        emit(lock)
        return 1
    try:
        problems = []
        if preflight:
            from .preflight import preflight as check
            problems = check(job, jobdir, ports=ports)
        sup = Supervisor(job, jobdir, start_problems=problems)
        sup.run()
        return 0 if sup.core.state == JobState.SUCCEEDED else 1
    finally:
        os.close(lock)


def cmd_launch(args):
    """Validate the job, daemonize a supervisor, report the spawned pids (none yet when it waits for the other
    hosts: the start barrier)."""
    code, result = launch_job(args.jobfile)
    emit(result)
    return code


def _report_lines(rfd, deadline, wait_started):
    """Read the supervisor's report lines until it closes the pipe, or until the first (`armed`: it waits for
    every host before it starts anything) plus up to `wait_started` seconds for the next; the last whole line."""
    sel = selectors.DefaultSelector()
    sel.register(rfd, selectors.EVENT_READ)
    data, last = b"", None
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                continue
            chunk = os.read(rfd, 65536)
            if not chunk:
                break
            data += chunk
            *lines, data = data.split(b"\n")
            for line in lines:
                try:
                    last = json.loads(line.decode("utf-8"))
                except (ValueError, UnicodeDecodeError):
                    continue
            if isinstance(last, dict) and last.get("armed"):
                if wait_started <= 0:
                    break
                deadline = min(deadline, time.monotonic() + wait_started)
                wait_started = 0
    finally:
        sel.close()
    return last if isinstance(last, dict) else None


def launch_job(path, wait_started=0.0, job=None):
    """Daemonize a supervisor for the job file at `path`: (exit code, the launch report: ok, pids, error).

    A host of a multi-host job reports as soon as its supervisor is armed (listening, or set to join the
    coordinator) with no pids and `armed: true`: its processes start once every host joined. `wait_started`:
    how long to wait after that for them to start (then the report has their pids). `job`: the job file's
    content, validated (`agent up` wrote it): not read again."""
    job, jobdir, lockfd = _claim(os.path.abspath(path), job)
    if isinstance(lockfd, dict):
        return 1, lockfd
    logpath = os.path.join(jobdir, SUPERVISOR_LOG)
    rfd, wfd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # first child: new session, fork again so the daemon is no session leader
        code = 70
        try:
            os.close(rfd)
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            devnull = os.open(os.devnull, os.O_RDONLY)
            logfd = os.open(logpath, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.dup2(devnull, 0)
            os.dup2(logfd, 1)
            os.dup2(logfd, 2)
            _close_fds({wfd, lockfd})
            os.chdir("/")
            code = Supervisor(job, jobdir, wfd).run()
        except BaseException:
            try:
                import traceback

                log("supervisor crashed:\n" + traceback.format_exc())
            except OSError:  # nowhere left to report to; the exit code (70) still says it
                code = 71
        finally:
            os._exit(code)
    os.close(wfd)
    os.close(lockfd)
    os.waitpid(pid, 0)
    after = job.get("start_trainers_after") or {}
    report_timeout = LAUNCH_REPORT_TIMEOUT + after.get("timeout", 0)
    try:
        result = _report_lines(rfd, time.monotonic() + report_timeout, wait_started)
    finally:
        os.close(rfd)
    if result is None:
        result = {"ok": False, "pids": {}, "jobdir": jobdir,
                  "error": "supervisor did not report within %.0fs; see %s" % (report_timeout, logpath)}
    result["job"] = job["job"]
    result["host"] = job["host"]
    return (0 if result.get("ok") else 1), result
