"""Slurm allocation glue: what puts clusterctl's host supervisor on every node of a Slurm job (docs/slurm.md).

The controller plans the job with placeholder nodes (``slurm-node-<i>.invalid``) and placeholder homes
(``HOME_MARK``), builds one job file per node with the SSH path's builder (clusterctl/ops/job.py), strips
their token, and sends them with this package inside the batch script. Then, all stdlib (Python 3.9):

    batch   (the batch script, on the batch host) reads the allocation (`scontrol show hostnames`, NodeAddr),
            makes the job's token (secrets, never written outside the nodes' job files), and starts one
            srun task per node (`node`), giving each on stdin the package, the job files, the addresses and
            the token; it exits with the step's code (0: the job succeeded)
    node    (each srun task) installs the package under its content hash in the home if missing, creates
            the job's own directory ``~/.clusterctl/slurm/jobs/<job>/<slurm id>-<node>`` (0700, never
            reused), writes its job file there (0600, with the token) and runs the supervisor in the
            foreground (launch.run_job_file): restarts, fail-fast, attempt logs, the sweep are its own
    login   (over ssh on the login node) `submit` (sbatch, and the record ``~/.clusterctl/slurm/<job>.json``),
            `query` (Slurm's word, the nodes, their addresses; with --replies and a running job every
            supervisor's `agent status` through `srun --overlap`), `stop` (every supervisor's `agent stop`
            through `srun --overlap`, then scancel); one JSON object on stdout each
    node-status / node-stop   (one `srun --overlap` task per node, started by `login`) `agent status|stop`
            on this node's job directory; the reply in short base64 lines (srun cuts and interleaves long ones)
"""

import argparse
import base64
import contextlib
import fcntl
import io
import json
import os
import re
import secrets
import signal
import socket
import stat
import subprocess
import sys
import time

from .common import emit
from .jobdir import LOCK_FILE, STATE_FILE
from .jobfile import JOB_FILE, validate_job

__all__ = ["node_token", "node_job", "jobdir_rel", "create_jobdir", "gpu_map", "step_argv", "BOOT", "HOME_MARK",
           "RECORD_DIR", "JOBS_DIR", "main"]

NODE_RE = re.compile(r"slurm-node-(\d+)\.invalid")  # node i of the allocation, as planned
HOME_MARK = "/clusterctl-slurm-home.invalid"  # the job files' home directory, as planned
RECORD_DIR = ".clusterctl/slurm"  # on the login node, relative to the home: <job>.json
JOBS_DIR = ".clusterctl/slurm/jobs"  # on every node, relative to the home: <job>/<slurm id>-<node>/
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # Slurm node names and job ids we accept in paths
LIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "REQUEUE_HOLD",
        "REQUEUE_FED", "RESV_DEL_HOLD", "SIGNALING", "STAGE_OUT", "STOPPED")
STOP_CANCEL_WAIT = 15.0  # batch: after a user's stop, how long to wait for the scancel that follows it
STEP_TIMEOUT = 60.0  # login: a status step's deadline (an agent status answers in well under a second)
STOP_EXTRA = 30.0  # login: a stop step's deadline beyond the grace; scancel's wait too
_LAYOUT_ENV = ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
               "SLURM_DISTRIBUTION", "SLURM_CPUS_PER_TASK")
REPLY_MARK = "clusterctl-slurm-reply"  # starts the lines of a node command's reply in srun's output
REPLY_CHUNK = 600  # base64 characters per reply line: srun cuts lines longer than 1024 bytes (and interleaves them)

# The first thing that runs on a node, as `python3 -S -E -c BOOT batch|node`, its stdin (base64 for `batch`,
# from the batch script's here-document): one JSON line (the package's directory under the home, its files,
# the blob's size and sha256), the zlib blob of the package's files, then the rest (the job, JSON). It installs the package where missing (a private temporary directory
# renamed into place, as clusterctl/ops/hosttools.py does over ssh) and hands the rest to boot() below.
BOOT = r"""
import base64, hashlib, json, os, shutil, sys, tempfile, zlib
os.umask(0o077)
raw = sys.stdin.buffer.read()
if sys.argv[1] == "batch":
    raw = base64.b64decode(raw)
line, _, raw = raw.partition(b"\n")
head = json.loads(line)
blob, rest = raw[:head["size"]], raw[head["size"]:]
if len(blob) != head["size"]:
    sys.exit("clusterctl-slurm: short read of the host package")
dest = os.path.join(os.path.expanduser("~"), head["dir"])
if not os.path.isdir(dest):
    data = zlib.decompress(blob)
    if hashlib.sha256(data).hexdigest() != head["sha256"]:
        sys.exit("clusterctl-slurm: corrupt host package")
    parent = os.path.dirname(dest)
    os.makedirs(parent, mode=0o700, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-host-", dir=parent)
    pos = 0
    for rel, size in head["files"]:
        path = os.path.join(tmp, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data[pos:pos + size])
        pos += size
    try:
        os.rename(tmp, dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isdir(dest):
            raise
sys.path[0] = dest
package = head["files"][0][0].split("/")[0]
sys.exit(__import__(package + ".slurm", fromlist=["boot"]).boot(sys.argv[1], head, blob, rest))
"""


def node_token(index):
    """The placeholder address of node `index` of the allocation (replaced on the node)."""
    return "slurm-node-%d.invalid" % index


def jobdir_rel(job, slurm_job, node):
    """A node's job directory for one Slurm job, relative to the home."""
    for what, value in (("job", job), ("Slurm job id", slurm_job), ("node name", node)):
        if not NAME_RE.match(str(value)):
            raise ValueError("unsafe %s for a path: %r" % (what, value))
    return "%s/%s/%s-%s" % (JOBS_DIR, job, slurm_job, node)


def _say(msg):
    sys.stderr.write("clusterctl-slurm: %s\n" % msg)
    sys.stderr.flush()


# ------------------------------------------------------------------------------------------- pure


def gpu_map(value, allocated):
    """A process's CUDA_VISIBLE_DEVICES (indices 0..N-1 of the node's GPUs, as planned) as the devices Slurm
    gave this node (its step's CUDA_VISIBLE_DEVICES, e.g. "2,3"); unchanged when Slurm said nothing."""
    if not allocated:
        return value
    devices = allocated.split(",")
    out = []
    for item in value.split(","):
        if not item.isdigit() or int(item) >= len(devices):
            raise ValueError("GPU %s planned but Slurm gave this node %s" % (item, allocated))
        out.append(devices[int(item)])
    return ",".join(out)


def node_job(template, addresses, home, node, token, gpus=None):
    """The job file of one node (pure): the planned one with the allocation's addresses, this node's home and
    name, and the job's token put in place; checked with the agent's own validator (raise ValueError)."""
    def sub(text):
        try:
            return NODE_RE.sub(lambda m: addresses[int(m.group(1))], text)
        except IndexError:
            raise ValueError("%r names a node the allocation does not have (%d nodes)" % (text, len(addresses)))

    def at_home(path):
        if path == HOME_MARK or path.startswith(HOME_MARK + "/"):
            return home.rstrip("/") + path[len(HOME_MARK):]
        return path

    job = json.loads(json.dumps(template))  # a deep copy
    job["host"] = node
    job["token"] = token
    if job.get("state_root"):
        job["state_root"] = at_home(job["state_root"])
    job["env"] = {k: sub(v) for k, v in (job.get("env") or {}).items()}
    for p in job["processes"]:
        p["env"] = {k: sub(v) for k, v in p["env"].items()}
        if "CUDA_VISIBLE_DEVICES" in p["env"]:
            p["env"]["CUDA_VISIBLE_DEVICES"] = gpu_map(p["env"]["CUDA_VISIBLE_DEVICES"], gpus)
        p["argv"] = [sub(a) for a in p["argv"]]
        p["ports"] = [sub(e) for e in p.get("ports") or []]
        p["cwd"], p["log"] = at_home(p["cwd"]), at_home(p["log"])
    after = job.get("start_trainers_after")
    if after:
        after["endpoints"] = [sub(e) for e in after["endpoints"]]
    coord = job.get("coordinator")
    if coord:
        coord["address"] = sub(coord["address"])
        coord["token"] = token
    try:
        validate_job(job, "job file for node %s" % node)
    except Exception as e:  # InputError: say what is wrong in the one error type callers catch
        raise ValueError(str(e))
    return job


def step_argv(nodes, cpus=None, gpus=0):
    """srun's argv for the supervisors' step: one task per node, each given the whole of srun's stdin."""
    argv = ["srun", "--nodes=%d" % nodes, "--ntasks=%d" % nodes, "--ntasks-per-node=1", "--input=all", "--label",
            "--kill-on-bad-exit=0", "--wait=0", "--mpi=none", "--chdir=/", "--job-name=clusterctl-supervisor"]
    if cpus:
        argv.append("--cpus-per-task=%s" % cpus)
    if gpus:
        argv.append("--gres=gpu:%d" % gpus)
    return argv + ["python3", "-S", "-E", "-c", BOOT, "node"]


def overlap_argv(slurm_job, nodes, package, args, name):
    """srun's argv for a short step beside the running job (--overlap): one task per node runs this package's
    `slurm ARGS` from `package` (the directory under the home the job installed)."""
    run = ("import os, sys; sys.path[0] = os.path.join(os.path.expanduser('~'), sys.argv[1]); "
           "sys.exit(__import__(sys.argv[2], fromlist=['main']).main(sys.argv[3:]))")
    return ["srun", "--overlap", "--jobid=%s" % slurm_job, "--nodes=%d" % nodes, "--ntasks=%d" % nodes,
            "--ntasks-per-node=1", "--mpi=none", "--chdir=/", "--job-name=" + name, "--quiet",
            "python3", "-S", "-E", "-c", run, package, __name__, *args]


# ------------------------------------------------------------------------------------------ files


def _private(path, uid):
    """Refuse a directory that is a symlink, not ours, or writable by others."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ValueError("%s is not a directory (a symlink?)" % path)
    if st.st_uid != uid:
        raise ValueError("%s belongs to uid %d, not to this job's user (uid %d)" % (path, st.st_uid, uid))
    if st.st_mode & 0o022:
        raise ValueError("%s is writable by others (mode %o)" % (path, stat.S_IMODE(st.st_mode)))


def create_jobdir(home, rel):
    """Create the job's directory `home/rel` (0700; it must not exist) under directories of this user that no
    one else can write (each component from ~/.clusterctl down is checked, created 0700 when missing)."""
    uid = os.getuid()
    parts = rel.split("/")
    path = home
    for i, part in enumerate(parts):
        path = os.path.join(path, part)
        last = i == len(parts) - 1
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            if last:
                raise ValueError("job directory %s already exists: refusing to reuse it" % path)
        _private(path, uid)
    return path


def write_private(path, data):
    """Write a new file 0600 (it must not exist)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def _prune(home, job, slurm_job, node):
    """Remove this node's job directories of the job's earlier Slurm jobs whose supervisor has ended."""
    import shutil

    parent = os.path.join(home, JOBS_DIR, job)
    for name in os.listdir(parent):
        sid, _, owner = name.partition("-")
        if owner != node or sid == str(slurm_job) or not sid.isdigit():
            continue
        path = os.path.join(parent, name)
        try:
            fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR)
        except OSError:
            shutil.rmtree(path, ignore_errors=True)  # never run (or no lock file): nothing holds it
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live supervisor holds its job dir's lock
        except OSError:
            continue
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------------ batch


def _out(argv):
    return subprocess.run(argv, check=True, stdout=subprocess.PIPE, universal_newlines=True).stdout


def allocation(endpoints):
    """The allocated node names in Slurm's order and the address each one's endpoints use."""
    nodes = _out(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]]).split()
    addrs = {}
    for line in _out(["scontrol", "show", "node", "--oneliner", ",".join(nodes)]).splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "NodeName" in fields:
            addrs[fields["NodeName"]] = fields.get("NodeAddr") or fields["NodeName"]
    out = []
    for n in nodes:
        addr = n
        if endpoints == "ip":
            addr = addrs.get(n, n)
            try:
                addr = socket.gethostbyname(addr)
            except OSError:
                pass  # NodeAddr is what Slurm itself uses; keep it
        out.append(addr)
    return nodes, out


def _home_path(path):
    return path if os.path.isabs(path) else os.path.join(os.path.expanduser("~"), path)


def _step_env():
    """The batch's environment without the allocation's task layout (the step says its own)."""
    return {k: v for k, v in os.environ.items() if k not in _LAYOUT_ENV}


def cmd_batch(head, blob, job):
    """The batch script's body (see the module docs); the exit code is the supervisors' step's."""
    slurm_job = os.environ["SLURM_JOB_ID"]
    output = os.path.join(_home_path(job["log_dir"]), "slurm-%s.out" % slurm_job)
    try:
        os.chmod(output, 0o600)  # sbatch made it with the submitter's umask (077 when clusterctl submits)
    except OSError:
        pass
    nodes, addresses = allocation(job.get("endpoints", "ip"))
    if len(nodes) != len(job["templates"]):
        _say("job %s was planned for %d node(s) but Slurm allocated %d: %s"
             % (job["job"], len(job["templates"]), len(nodes), ",".join(nodes)))
        return 2
    bad = [n for n in nodes if not NAME_RE.match(n)]
    if bad:
        _say("node name(s) %s cannot name a job directory" % ", ".join(map(repr, bad)))
        return 2
    payload = {"job": job["job"], "slurm_job": slurm_job, "nodes": nodes, "addresses": addresses,
               "templates": job["templates"], "gpus": job.get("gpus_per_node", 0),
               "token": secrets.token_hex(32)}  # the job's secret: from here only to the nodes' job files
    stream = (json.dumps(head) + "\n").encode() + blob + json.dumps(payload).encode()
    _say("job %s: Slurm job %s on %s: a supervisor on each node" % (job["job"], slurm_job, ",".join(nodes)))
    cancelled = []
    signal.signal(signal.SIGTERM, lambda signum, frame: cancelled.append(signum))
    argv = step_argv(len(nodes), os.environ.get("SLURM_CPUS_PER_TASK"), job.get("gpus_per_node", 0))
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, env=_step_env())
    try:
        proc.stdin.write(stream)
        proc.stdin.close()
    except BrokenPipeError:  # srun ended before reading: its own message says why
        pass
    rc = proc.wait()
    if not cancelled and _stopped_by_user(job["job"], slurm_job, nodes[0]):
        deadline = time.monotonic() + STOP_CANCEL_WAIT  # `clusterctl stop` cancels the job right after
        while not cancelled and time.monotonic() < deadline:
            time.sleep(0.2)
    _say("job %s: supervisors' step ended with exit %d%s" % (job["job"], rc, " (cancelled)" if cancelled else ""))
    return 128 + cancelled[0] if cancelled else rc


def _stopped_by_user(job, slurm_job, first):
    """Whether node 0's supervisor (the coordinator, on this batch host) recorded a stop."""
    if os.environ.get("SLURMD_NODENAME", socket.gethostname()) != first:
        return False
    try:
        with open(os.path.join(_home_path(jobdir_rel(job, slurm_job, first)), STATE_FILE)) as fh:
            return json.load(fh).get("state") == "stopped"
    except (OSError, ValueError):
        return False


# ------------------------------------------------------------------------------------------- node


def cmd_node(payload):
    """One srun task: this node's job directory and job file, then the supervisor in the foreground."""
    from .common import InputError
    from .launch import run_job_file

    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    if node not in payload["nodes"]:
        _say("node %s is not in the allocation %s" % (node, ",".join(payload["nodes"])))
        return 2
    index = payload["nodes"].index(node)
    home = os.path.expanduser("~")
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES") if payload.get("gpus") else None
    try:
        rel = jobdir_rel(payload["job"], payload["slurm_job"], node)
        job = node_job(payload["templates"][index], payload["addresses"], home, node, payload["token"], gpus)
        jobdir = create_jobdir(home, rel)
        path = os.path.join(jobdir, JOB_FILE)
        write_private(path, json.dumps(job).encode())
    except (ValueError, OSError) as e:
        _say("%s: cannot set up the job: %s" % (node, e))
        return 2
    try:
        _prune(home, payload["job"], payload["slurm_job"], node)
    except OSError:
        pass
    try:
        return run_job_file(path)
    except InputError as e:
        _say("%s: %s" % (node, e))
        return 2


def boot(role, head, blob, rest):
    """Called by BOOT once the package is in place: `batch` or `node` with the rest of stdin (JSON)."""
    os.umask(0o077)
    try:
        data = json.loads(rest.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        _say("the job's description is not JSON: %s" % e)
        return 2
    if role == "batch":
        return cmd_batch(head, blob, data)
    if role == "node":
        return cmd_node(data)
    _say("unknown role %r" % role)
    return 2


# ------------------------------------------------------------------------------------------ login


def _record_path(job):
    return os.path.join(os.path.expanduser("~"), RECORD_DIR, "%s.json" % job)


def read_record(job):
    """The login node's record of the job's last submission, or None; raise ValueError when it is garbage."""
    try:
        with open(_record_path(job), "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return None
    try:
        rec = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        rec = None
    if not isinstance(rec, dict) or not NAME_RE.match(str(rec.get("slurm_job", ""))):
        raise ValueError("~/%s/%s.json is not a job record; remove it" % (RECORD_DIR, job))
    return rec


def _fields(line):
    """`Key=Value Key2=Value2` (scontrol --oneliner) as a dict; Reason's value may hold spaces up to the next key."""
    return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", line))


def _hostnames(nodelist):
    if not nodelist or nodelist in ("(null)", "None assigned", "None"):
        return []
    res = subprocess.run(["scontrol", "show", "hostnames", nodelist], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, universal_newlines=True)
    return res.stdout.split() if res.returncode == 0 else []


def query_job(slurm_job):
    """Slurm's view of a job (`scontrol show job` while slurmctld remembers it, else sacct), or None."""
    res = subprocess.run(["scontrol", "--oneliner", "show", "job", str(slurm_job)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, universal_newlines=True)
    if res.returncode == 0 and "JobState=" in res.stdout:
        f = _fields(res.stdout)
        reason = f.get("Reason")
        return {"id": str(slurm_job), "state": f.get("JobState", ""), "exit_code": f.get("ExitCode", ""),
                "nodes": _hostnames(f.get("NodeList", "")), "batch_host": f.get("BatchHost") or None,
                "reason": reason if reason not in (None, "None") else None}
    try:
        res = subprocess.run(["sacct", "-n", "-P", "-X", "-j", str(slurm_job), "-o", "State,ExitCode,NodeList"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)
    except OSError:
        return None
    rows = [r.split("|") for r in res.stdout.splitlines() if r.count("|") == 2]
    if res.returncode != 0 or not rows:
        return None
    state, code, nodelist = rows[0]
    nodes = _hostnames(nodelist)
    return {"id": str(slurm_job), "state": state, "exit_code": code, "nodes": nodes,
            "batch_host": nodes[0] if nodes else None, "reason": None}


def live(sj):
    """Whether Slurm's word for the job says it still holds (or waits for) its allocation."""
    return _word(sj) in LIVE


def _word(sj):
    return sj["state"].split()[0].rstrip("+") if sj and sj["state"] else ""


def node_addresses(nodes):
    """NodeName -> NodeAddr (where ssh reaches it) for the given nodes."""
    if not nodes:
        return {}
    res = subprocess.run(["scontrol", "show", "node", "--oneliner", ",".join(nodes)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, universal_newlines=True)
    found = {}
    for line in res.stdout.splitlines():
        f = _fields(line)
        if "NodeName" in f:
            found[f["NodeName"]] = f.get("NodeAddr") or f["NodeName"]
    return found


def _node_step(rec, sj, args, timeout, name):
    """Run `slurm ARGS` on every node of a running job (srun --overlap): {node: reply}, and srun's complaint."""
    argv = overlap_argv(sj["id"], len(sj["nodes"]), rec["package"], args, name)
    try:
        res = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             universal_newlines=True, timeout=timeout)
        out, err = res.stdout, res.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode("utf-8", "replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = "srun did not end within %gs" % timeout
    replies = {n: r for n, r in read_replies(out).items() if n in sj["nodes"]}
    missing = [n for n in sj["nodes"] if n not in replies]
    return replies, (err.strip()[-500:] or "no answer") if missing else ""


def cmd_login_submit(args):
    """sbatch the script on stdin, unless the job's previous Slurm job is still pending or running; record it."""
    rec = read_record(args.job)
    if rec is not None:
        prev = query_job(rec["slurm_job"])
        if live(prev):
            emit({"ok": False, "error": "job %s is already %s as Slurm job %s; stop it first (clusterctl stop)"
                  % (args.job, _word(prev).lower(), prev["id"])})
            return 1
    script = sys.stdin.buffer.read()
    res = subprocess.run(["sbatch", "--parsable"], input=script, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = res.stdout.decode("utf-8", "replace"), res.stderr.decode("utf-8", "replace")
    if res.returncode != 0:
        emit({"ok": False, "error": "sbatch failed: %s" % ((err or out).strip()[-800:] or "exit %d" % res.returncode)})
        return 1
    job_id = out.strip().split(";")[0]
    if not job_id.isdigit():
        emit({"ok": False, "error": "sbatch answered %r, not a job id" % out.strip()[-200:]})
        return 1
    record = dict(json.loads(args.record), slurm_job=job_id, submitted_at=time.time())
    path = _record_path(args.job)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(record, fh)
    os.replace(tmp, path)
    emit({"ok": True, "slurm_job": job_id})
    return 0


def cmd_login_query(args):
    """The job's record, Slurm's word, its nodes and their addresses; with --replies (and a running job) every
    node's `agent status` through srun --overlap."""
    rec = read_record(args.job)
    out = {"ok": True, "record": rec, "slurm": None, "addresses": {}, "replies": None, "step_error": ""}
    if rec is None:
        emit(out)
        return 0
    sj = query_job(rec["slurm_job"])
    out["slurm"] = sj
    if sj:
        out["addresses"] = node_addresses(sj["nodes"])
        if args.replies and _word(sj) == "RUNNING" and sj["nodes"] and rec.get("package"):
            out["replies"], out["step_error"] = _node_step(
                rec, sj, ["node-status", "--job", args.job, "--slurm-job", sj["id"]], STEP_TIMEOUT,
                "clusterctl-status")
    emit(out)
    return 0


def cmd_login_stop(args):
    """Stop a running job's supervisors (their `agent stop`, with grace, through srun --overlap), then scancel
    and wait until Slurm has ended the job."""
    rec = read_record(args.job)
    out = {"ok": True, "record": rec, "slurm": None, "was_running": False, "replies": None, "step_error": "",
           "addresses": {}, "error": None}
    if rec is None:
        emit(out)
        return 0
    sj = query_job(rec["slurm_job"])
    out["slurm"] = sj
    if sj:
        out["addresses"] = node_addresses(sj["nodes"])
    if not live(sj):
        emit(out)
        return 0
    out["was_running"] = True
    if _word(sj) == "RUNNING" and sj["nodes"] and rec.get("package"):
        out["replies"], out["step_error"] = _node_step(
            rec, sj, ["node-stop", "--job", args.job, "--slurm-job", sj["id"], "--grace", "%g" % args.grace],
            args.grace + STOP_EXTRA, "clusterctl-stop")
    cancel = subprocess.run(["scancel", sj["id"]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            universal_newlines=True)
    deadline = time.monotonic() + args.grace + STOP_EXTRA
    now = query_job(sj["id"])
    while live(now) and time.monotonic() < deadline:
        time.sleep(0.3)
        now = query_job(sj["id"])
    out["slurm"] = now or sj
    if live(now):
        out["ok"] = False
        out["error"] = "Slurm job %s is still %s %gs after scancel%s" % (
            sj["id"], now["state"], args.grace + STOP_EXTRA,
            ": " + cancel.stderr.strip()[-300:] if cancel.returncode else "")
    emit(out)
    return 0


def _agent(argv):
    """Run an `agent` subcommand here, its one JSON reply captured (None when it printed none)."""
    from . import agent

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        agent.main(argv)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.startswith("{")]
    try:
        return json.loads(lines[-1]) if lines else None
    except ValueError:
        return None


def reply_lines(node, reply):
    """A node command's reply as short lines (`MARK node i/n base64`), whole through srun's output whatever its
    size, among the other nodes' lines."""
    data = base64.b64encode(json.dumps(reply).encode()).decode()
    parts = [data[i:i + REPLY_CHUNK] for i in range(0, len(data), REPLY_CHUNK)] or [""]
    return ["%s %s %d/%d %s" % (REPLY_MARK, node, i, len(parts), part) for i, part in enumerate(parts)]


def read_replies(text):
    """{node: reply} from srun's output holding reply_lines() of several nodes (other lines ignored; a node
    whose reply is incomplete or garbled is left out)."""
    parts = {}
    for line in text.splitlines():
        fields = line.split(" ")
        if len(fields) != 4 or fields[0] != REPLY_MARK or "/" not in fields[2]:
            continue
        i, _, n = fields[2].partition("/")
        if i.isdigit() and n.isdigit():
            parts.setdefault(fields[1], {})[int(i)] = (int(n), fields[3])
    out = {}
    for node, got in parts.items():
        counts = set(n for n, _ in got.values())
        if len(counts) != 1 or sorted(got) != list(range(counts.pop())):
            continue
        try:
            out[node] = json.loads(base64.b64decode("".join(got[i][1] for i in sorted(got))).decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            continue
    return out


def _emit_reply(node, reply):
    sys.stdout.write("".join(line + "\n" for line in reply_lines(node, reply)))
    sys.stdout.flush()


def _this_node():
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def cmd_node_status(args):
    """This node's supervisor's `agent status`, as one JSON line."""
    node = _this_node()
    jobdir = _home_path(jobdir_rel(args.job, args.slurm_job, node))
    _emit_reply(node, _agent(["status", jobdir]))
    return 0


def cmd_node_stop(args):
    """This node's `agent stop` (the supervisor's stop with grace, then the sweep by the job's tag), as one line."""
    node = _this_node()
    jobdir = _home_path(jobdir_rel(args.job, args.slurm_job, node))
    _emit_reply(node, _agent(["stop", jobdir, "--grace", "%g" % args.grace, "--job", args.job]))
    return 0


def main(argv=None):
    """Command line: `login submit|query|stop`, `node-status`, `node-stop` (see the module docs)."""
    parser = argparse.ArgumentParser(prog="clusterctl-slurm")
    sub = parser.add_subparsers(dest="cmd")
    p = sub.add_parser("login")
    lsub = p.add_subparsers(dest="what")
    q = lsub.add_parser("submit")
    q.add_argument("--job", required=True)
    q.add_argument("--record", required=True, help="JSON: what the record keeps besides the Slurm job id")
    q.set_defaults(func=cmd_login_submit)
    q = lsub.add_parser("query")
    q.add_argument("--job", required=True)
    q.add_argument("--replies", action="store_true")
    q.set_defaults(func=cmd_login_query)
    q = lsub.add_parser("stop")
    q.add_argument("--job", required=True)
    q.add_argument("--grace", type=float, required=True)
    q.set_defaults(func=cmd_login_stop)
    for name, func in (("node-status", cmd_node_status), ("node-stop", cmd_node_stop)):
        q = sub.add_parser(name)
        q.add_argument("--job", required=True)
        q.add_argument("--slurm-job", required=True)
        if name == "node-stop":
            q.add_argument("--grace", type=float, required=True)
        q.set_defaults(func=func)
    args = parser.parse_args(argv)
    os.umask(0o077)  # sbatch records it: the batch's output file, logs and job dirs are the user's alone
    if not getattr(args, "func", None):
        parser.error("a command is required")
    if not NAME_RE.match(args.job):
        emit({"ok": False, "error": "not a job name: %r" % args.job})
        return 2
    try:
        return args.func(args)
    except ValueError as e:
        emit({"ok": False, "error": str(e)})
        return 2
