"""A Kubernetes pod's main process: build this pod's job file, then run the host supervisor in the foreground.

`backend: kubernetes` (clusterctl/backends/kubernetes.py) runs one process per pod. Every pod's container runs
this module with the image's ``python3 -S -E`` from the host package that a ConfigMap carries, in two stages:

``pod start TEMPLATE -- ARGV...`` (PID 1, the container's environment)
    Reads the job's template (the ConfigMap's ``template.json``: what every pod shares) and this pod's facts
    from the environment the kubelet gave it: its role and completion index, its pod name (downward API),
    the job's token (a Secret, ``valueFrom.secretKeyRef``) and the environment contract (GUIDE section 2,
    expanded by the kubelet). It builds the pod's job file with jobfile.build_job (the coordinator is one
    well-known pod, named in the template), writes it 0600 in a 0700 job dir, and replaces itself
    (execve) with stage two, in an environment without the token or the contract: the raw token then lives
    in the job file only, as over SSH, and never in a process's environment (/proc/1/environ included).

``pod init JOBFILE --pod NAME`` (still PID 1)
    Starts ``agent run JOBFILE --preflight files`` (the supervisor, in the foreground: restarts, fail-fast,
    attempt logs, the sweep are its; a working directory, entrypoint or script missing in the image fails the
    job at its start, as the ssh path's preflight does) and, once the supervisor has written its state,
    ``agent logs --follow``, whose
    ``[pod role.id] line`` output is the container's stdout (the supervisor's own log is its stderr), so
    ``kubectl logs`` has every attempt's lines, also after the pod ended. It forwards SIGTERM (a deleted pod)
    to the supervisor, reaps orphans (it is PID 1), writes the supervisor's last status to the termination
    message file (``kubectl get pod`` shows it once the pod ended), lets ``kubectl exec`` commands still
    running (``agent stop``) finish, waits a while for the ``agent stop`` of a stop that ended the job before its
    ``kubectl exec`` reached this pod (so that it reports what the stop killed here), and exits with the
    supervisor's code (0: the job succeeded).

Stdlib only and Python 3.9, like the rest of the host package.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from .common import InputError, log, write_private
from .jobdir import StateFileError, read_state
from .jobfile import JOB_FILE, JOB_ENV, build_job, coordinator_entry, process_entry

__all__ = ["SECRET_ENV", "POD_NAME_ENV", "TEMPLATE_VERSION", "pod_job", "process_env", "clean_environ",
           "write_job_file", "termination_message", "main"]

TEMPLATE_VERSION = 1
# the job's token, from the job's Secret (valueFrom.secretKeyRef); read by stage one only
SECRET_ENV = "CLUSTERCTL_POD_SECRET"
# the pod's name (downward API, metadata.name): the supervisor's host label, the log prefix
POD_NAME_ENV = "CLUSTERCTL_POD_NAME"
TERMINATION_LIMIT = 4096  # bytes Kubernetes keeps of a container's termination message
TAIL_DRAIN_S = 10.0  # after the supervisor ended: how long the log follower may take to drain
EXEC_LINGER_S = 20.0  # after the supervisor ended: how long (beyond the grace) `kubectl exec` commands may finish
# after a stop ended the job: how long PID 1 waits for the `agent stop` that collects what the stop killed (clusterctl
# stop runs one in every pod at once, and the first one to land stops the job everywhere through the coordinator)
STOP_REPORT_WAIT_S = 30.0

# python3 -S -E -X pycache_prefix=... -c RUN PKGPARENT MODULE ARGS...: the host package's tools, as over SSH
RUN = ("import sys; sys.path[0] = sys.argv[1]; "
       "sys.exit(__import__(sys.argv[2], fromlist=['main']).main(sys.argv[3:]))")


def _need(template, key, kind):
    value = template.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise InputError("pod template: %s: expected %s, got %r" % (key, kind.__name__, value))
    return value


def load_template(path):
    """The job's template (template.json of the ConfigMap) as a dict; raise InputError."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except OSError as e:
        raise InputError("cannot read pod template %s: %s" % (path, e.strerror or e))
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError("pod template %s is not valid JSON: %s" % (path, e))
    if not isinstance(data, dict) or data.get("version") != TEMPLATE_VERSION:
        raise InputError("pod template %s: expected version %d (the controller's clusterctl and this package differ)"
                         % (path, TEMPLATE_VERSION))
    return data


def process_env(template, environ):
    """The process's own environment: the contract variables the template names, as the kubelet expanded them."""
    return dict((name, environ[name]) for name in template["env"] if name in environ and name != JOB_ENV)


def _pod_facts(template, environ):
    """(role, index, pod name) of this pod from its environment; raise InputError."""
    role = environ.get("CLUSTERCTL_ROLE")
    roles = _need(template, "roles", dict)
    if role not in roles:
        raise InputError("CLUSTERCTL_ROLE=%r is not a role of this job (%s)" % (role, "/".join(sorted(roles))))
    id_env = roles[role]["id_env"]
    text = environ.get(id_env, "")
    if not text.isdigit() or int(text) >= roles[role]["count"]:
        raise InputError("%s=%r is not a completion index below %d" % (id_env, text, roles[role]["count"]))
    name = environ.get(POD_NAME_ENV) or ""
    if not name:
        raise InputError("%s is not set (the pod's name, from the downward API)" % POD_NAME_ENV)
    return role, int(text), name


def pod_job(template, environ, argv, cwd):
    """This pod's job file (a dict, checked by the supervisor's own validator); raise InputError."""
    role, index, pod = _pod_facts(template, environ)
    if not argv:
        raise InputError("no command to run (pod start TEMPLATE -- ARGV...)")
    token = environ.get(SECRET_ENV) or ""
    if not token:
        raise InputError("%s is not set: the job's token comes from its Secret" % SECRET_ENV)
    job_id = _need(template, "job", str)
    jobdir = os.path.join(_need(template, "state_root", str), job_id)
    spec = template["roles"][role]
    endpoint = "%s:%d" % (spec["dns"].replace("{id}", str(index)), spec["port"])
    proc = process_entry(role, index, argv, process_env(template, environ), cwd,
                         os.path.join(jobdir, "logs", "%s.%d.log" % (role, index)), [endpoint])
    coord = template["coordinator"]
    entry = coordinator_entry(coord["address"], coord["port"], token,
                              [role, index] == list(coord["pod"]), coord["hosts"], coord["trainers_total"])
    entry.update(coord.get("timings") or {})
    after = template.get("start_trainers_after") if role == "trainer" else None
    try:
        return build_job(job_id, pod, [proc], template["state_root"], on_failure=template["on_failure"],
                         grace=template["grace"], restarts=template["restarts"],
                         restart_backoff=template["restart_backoff"], start_trainers_after=after,
                         coordinator=entry, auth=template["auth"], token=token)
    except (KeyError, ValueError) as e:
        raise InputError("pod %s: cannot build the job file: %s" % (pod, e))


def clean_environ(template, environ):
    """The environment of stage two (the supervisor's): the container's, without the token and the contract."""
    drop = set(template["env"]) | {SECRET_ENV, POD_NAME_ENV, JOB_ENV}
    return dict((k, v) for k, v in environ.items() if k not in drop)


def write_job_file(job, state_root):
    """Write `job` to <state_root>/<job>/job.json: the directory 0700, the file 0600 (it holds the token)."""
    jobdir = os.path.join(state_root, job["job"])
    os.makedirs(state_root, mode=0o700, exist_ok=True)
    os.makedirs(jobdir, mode=0o700, exist_ok=True)
    os.chmod(jobdir, 0o700)
    path = os.path.join(jobdir, JOB_FILE)
    write_private(path, json.dumps(job))
    return path


def _short(text, limit):
    if not isinstance(text, str) or len(text) <= limit:
        return text
    return text[:limit - 3] + "..."


def termination_message(status, limit=TERMINATION_LIMIT):
    """The supervisor's last `agent status` reply, cut to fit Kubernetes' termination message (JSON text)."""
    procs = [dict((k, p.get(k)) for k in ("role", "id", "pid", "state", "exit_code", "uptime_s", "error"))
             for p in status.get("processes") or []]
    attempts = [dict((k, a.get(k)) for k in ("attempt", "outcome", "reason", "started_at", "ended_at"))
                for a in status.get("attempts") or []]
    msg = {"v": 1, "state": status.get("state"), "reason": status.get("reason"), "attempt": status.get("attempt") or 0,
           "restarts": status.get("restarts") or 0, "processes": procs, "attempts": attempts}
    for cut in (400, 200, 100, 40):
        for item in [msg] + procs + attempts:
            for key in ("reason", "error"):
                if key in item:
                    item[key] = _short(item[key], cut)
        while True:
            text = json.dumps(msg, separators=(",", ":"), sort_keys=True)
            if len(text.encode("utf-8")) <= limit or len(attempts) <= 1:
                break
            attempts.pop(0)  # the oldest attempts go first; the latest stays
        if len(text.encode("utf-8")) <= limit:
            return text
    msg = {"v": 1, "state": status.get("state"), "reason": _short(status.get("reason"), 200), "truncated": True}
    return json.dumps(msg, separators=(",", ":"), sort_keys=True)


# -------------------------------------------------------------------------------------- the stages


def _package_parent():
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_argv(module, args, pycache):
    package = __package__ or "clusterctl_host"
    argv = [sys.executable, "-S", "-E"]
    if pycache:
        argv += ["-X", "pycache_prefix=" + pycache]  # the ConfigMap's files are read-only: bytecode goes here
    return argv + ["-c", RUN, _package_parent(), package + "." + module] + list(args)


def cmd_start(args):
    """Stage one: the pod's job file from the template and the environment, then execve stage two."""
    template = load_template(args.template)
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    job = pod_job(template, os.environ, argv, os.getcwd())
    path = write_job_file(job, template["state_root"])
    pycache = os.path.join(template["state_root"], ".pycache")
    env = clean_environ(template, os.environ)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, _python_argv("pod", ["init", path, "--pod", job["host"], "--termination-log",
                                                   template["termination_log"], "--grace", str(job["grace"])],
                                           pycache), env)


class _Init:
    """Stage two: PID 1 of the pod around the supervisor (signals, reaping, logs, the termination message)."""

    def __init__(self, args):
        self.jobfile = os.path.abspath(args.jobfile)
        self.jobdir = os.path.dirname(self.jobfile)
        self.pod = args.pod
        self.termination_log = args.termination_log
        self.grace = args.grace
        self.pycache = os.path.join(os.path.dirname(self.jobdir), ".pycache")
        self.sup = None
        self.code = None
        self.tail = None
        self.term = False

    def _spawn(self, module, args):
        argv = _python_argv(module, args, self.pycache)
        pid = os.fork()
        if pid == 0:  # the child: default signals, then the tool
            try:
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    signal.signal(sig, signal.SIG_DFL)
                os.execv(argv[0], argv)
            finally:
                os._exit(127)
        return pid

    def _on_term(self, signum, frame):
        self.term = True
        if self.sup is not None and self.code is None:
            try:
                os.kill(self.sup, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def _reap(self):
        """Collect every ended child (the supervisor, the follower, orphans of the job); never blocks."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.sup:
                self.code = os.waitstatus_to_exitcode(status)
            elif pid == self.tail:
                self.tail = None

    def _others(self):
        """Live processes in this pod besides this one (e.g. `kubectl exec` commands still running)."""
        me, found = os.getpid(), []
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == me:
                continue
            try:
                with open("/proc/%s/stat" % name, "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state not in (b"Z", b"X"):
                found.append(int(name))
        return found

    def _stop_unreported(self):
        """Whether the job ended by a stop whose kills no `agent stop` has reported yet (state.json's stop report)."""
        try:
            report = (read_state(self.jobdir) or {}).get("stop")
        except StateFileError:
            return False
        return isinstance(report, dict) and bool(report.get("requested")) and not report.get("reported")

    def _status(self):
        argv = _python_argv("agent", ["status", self.jobdir], self.pycache)
        try:
            res = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=30)
            return json.loads(res.stdout.decode("utf-8").strip().splitlines()[-1])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError, UnicodeDecodeError) as e:
            return {"state": "unknown", "reason": "no status from the supervisor: %s" % e}

    def run(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_term)
        signal.signal(signal.SIGHUP, lambda s, f: None)
        # the preflight of `agent up` on the ssh path and of Slurm's node, less its port binds (preflight.preflight):
        # a missing script or working directory fails the job at its start, never restarted
        self.sup = self._spawn("agent", ["run", self.jobfile, "--preflight", "files"])
        state = os.path.join(self.jobdir, "state.json")
        tailing = False  # one follower: it ends once nothing more will be logged (agent logs --follow)
        while self.code is None:
            self._reap()
            if not tailing and self.code is None and os.path.exists(state):
                self.tail, tailing = self._spawn("agent", ["logs", self.jobdir, "--follow", "--host-label", self.pod]), True
            time.sleep(0.05)
        if not tailing and os.path.exists(state):  # the job ended before the follower started: its logs once
            self.tail = self._spawn("agent", ["logs", self.jobdir, "--host-label", self.pod])
        deadline = time.monotonic() + TAIL_DRAIN_S
        while self.tail is not None and time.monotonic() < deadline:  # it ends by itself: the job is over
            self._reap()
            time.sleep(0.05)
        if self.tail is not None:
            os.kill(self.tail, signal.SIGKILL)
        status = self._status()
        try:
            with open(self.termination_log, "w") as f:
                f.write(termination_message(status))
        except OSError as e:
            log("pod %s: cannot write the termination message %s: %s" % (self.pod, self.termination_log, e))
        log("pod %s: supervisor exited %s, job %s" % (self.pod, self.code, status.get("state")))
        # the kernel ends every process of the pod with PID 1: stay while a `kubectl exec` command still runs, and
        # while a stop's report waits for its `agent stop` (a stop that reached this pod through the coordinator
        # before the exec did); a deleted pod (SIGTERM) goes at once
        began = time.monotonic()
        while not self.term:
            self._reap()
            waited = time.monotonic() - began
            if not (waited < self.grace + EXEC_LINGER_S and self._others()
                    or waited < STOP_REPORT_WAIT_S and self._stop_unreported()):
                break
            time.sleep(0.1)
        return 0 if self.code == 0 else 1


def cmd_init(args):
    """Stage two: see _Init."""
    return _Init(args).run()


def build_parser():
    """The pod glue's argparse parser."""
    p = argparse.ArgumentParser(prog="pod", description="clusterctl's pod main process (docs/kubernetes.md)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    s = sub.add_parser("start", help="build this pod's job file, then run the supervisor")
    s.add_argument("template")
    s.add_argument("argv", nargs=argparse.REMAINDER)
    s.set_defaults(func=cmd_start)
    s = sub.add_parser("init", help=argparse.SUPPRESS)
    s.add_argument("jobfile")
    s.add_argument("--pod", required=True)
    s.add_argument("--termination-log", required=True)
    s.add_argument("--grace", type=float, default=10.0)
    s.set_defaults(func=cmd_init)
    return p


def main(argv=None):
    """Run one stage; the exit code is the pod's (0: the job succeeded)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except InputError as e:
        log("clusterctl pod: %s" % e)
        path = "/dev/termination-log"
        try:
            with open(path, "w") as f:
                f.write(json.dumps({"v": 1, "state": "failed", "reason": "pod: %s" % _short(str(e), 1000)}))
        except OSError:
            pass
        return 2


if __name__ == "__main__":
    sys.exit(main())
