"""`agent up`: everything `clusterctl start` needs on one host, in one command (one round trip).

The controller sends one JSON document on stdin: the host's job file (its paths may be relative to the
home directory, as an ssh session's are), the workspace the job runs in (checked against its last
dispatch), and small files to write first (the MPI hostfile). On the host, in order, stopping at the first
that fails:

    1. running    the job is not already running here (a live supervisor in its job dir)
    2. workspace  the workspace is as it was dispatched (no file missing or changed)
    3. job file   written 0600 in the 0700 job dir, with the extra files
    4. preflight  ports free, entrypoints and scripts present, log dirs writable
    5. launch     the supervisor daemonized, its launch report awaited: armed (a multi-host job starts nothing
                  until every host joined), then up to START_WAIT for the processes to start

The reply is one JSON object: `ok`, the `stage` that failed (or "launched"), what it found (`error`,
`drift`, `problems`), the launch report's `pids`, and the host's `status` (as `agent status` gives it)
once launched, so that `start` needs no further round trip.
"""

import json
import os
import sys

from .common import InputError, emit, write_private
from .controlproto import read_control
from .jobdir import JOB_FILE, describe, read_state_or_none, settled_state, supervisor_alive
from .jobfile import validate_job

MAX_DOC_BYTES = 64 << 20  # a job document larger than this is refused (the endpoint lists of ~10,000 trainers fit)
# A multi-host job starts nothing until every host's supervisor joined (the start barrier). Once this host's is
# armed, `up` waits this long for the job's processes to start here, so that the reply shows them running when
# every host came up together; otherwise (another host failed a check, or came up later) it replies with them
# pending, and `start` goes on from the replies.
START_WAIT = 3.0
_PATH_KEYS = ("cwd", "log")


def _home_path(home, path):
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(home, path))


def resolve_paths(job, home):
    """The job file with every path made absolute against `home` (pure; the controller writes them relative)."""
    job = dict(job)
    if job.get("state_root"):
        job["state_root"] = _home_path(home, job["state_root"])
    procs = []
    for p in job.get("processes") or []:
        if isinstance(p, dict):
            p = dict(p)
            for key in _PATH_KEYS:
                if isinstance(p.get(key), str) and p[key]:
                    p[key] = _home_path(home, p[key])
        procs.append(p)
    job["processes"] = procs
    return job


def _read_doc():
    data = sys.stdin.buffer.read(MAX_DOC_BYTES + 1)
    if len(data) > MAX_DOC_BYTES:
        raise InputError("job document larger than %d bytes" % MAX_DOC_BYTES)
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise InputError("job document is not JSON: %s" % e)
    if not isinstance(doc, dict) or not isinstance(doc.get("job"), dict) or not isinstance(doc.get("jobdir"), str):
        raise InputError("job document: expected an object with job and jobdir")
    return doc


def _drift(workspace):
    """The workspace's drift from its last dispatch ([] when as dispatched)."""
    from . import hostws

    try:
        root, gens = hostws.paths(workspace)
        gen = hostws.current_gen(root)
        if gen is None:
            return [{"path": "", "problem": "never dispatched"}]
        return hostws.find_drift(os.path.join(gens, gen), hostws.load_manifest(gens, gen))
    except SystemExit as e:  # hostws says what is wrong and exits
        return [{"path": workspace, "problem": "cannot be checked (%s)" % e}]


def up(doc, home):
    """Run the stages for one host's job document; (exit code, reply)."""
    from .launch import launch_job
    from .preflight import preflight

    raw = resolve_paths(doc["job"], home)
    jobdir = _home_path(home, doc["jobdir"])
    job = validate_job(raw, "job file for %s" % raw.get("host"))
    reply = {"ok": False, "job": job["job"], "host": job["host"], "jobdir": jobdir}
    os.makedirs(jobdir, mode=0o700, exist_ok=True)
    os.chmod(jobdir, 0o700)
    state = read_state_or_none(jobdir)
    if state is not None and supervisor_alive(state):
        reply.update(stage="running", error="job %s is already running here (supervisor pid %s); stop it first"
                     % (job["job"], (state.get("supervisor") or {}).get("pid")))
        return 1, reply
    if doc.get("workspace"):
        drift = _drift(_home_path(home, doc["workspace"]))
        if drift:
            reply.update(stage="workspace", drift=drift, error="workspace differs from its last dispatch")
            return 1, reply
    jobfile = os.path.join(jobdir, JOB_FILE)
    write_private(jobfile, json.dumps(raw))
    for rel, text in sorted((doc.get("files") or {}).items()):
        path = _home_path(home, rel)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        write_private(path, text)
    problems = preflight(job, jobdir)
    if problems:
        reply.update(stage="preflight", problems=problems, error="; ".join(p["message"] for p in problems))
        return 1, reply
    code, report = launch_job(jobfile, wait_started=START_WAIT, job=job)
    reply.update(report, stage="launched" if code == 0 else "launch")
    state = settled_state(jobdir, read_state_or_none(jobdir))
    if state is not None:
        reply["status"] = describe(state)
    ctl = read_control(jobdir) if code == 0 else None
    if ctl is not None:  # for the controller that started the job: it asks this supervisor directly from now on
        reply["control"] = {"port": ctl[1], "client": ctl[2], "server": ctl[3]}
    return code, reply


def cmd_up(args):
    """`agent up` (the job document on stdin): check, write, preflight and launch; one JSON reply."""
    code, reply = up(_read_doc(), os.path.expanduser("~"))
    emit(reply)
    return code
