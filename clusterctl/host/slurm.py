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

The commands that control a submitted job (sbatch, status, stop, from the login node) are in slurmctl.py.
"""

import fcntl
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

from .jobdir import LOCK_FILE, STATE_FILE
from .jobfile import JOB_FILE, validate_job
from .unpack import IMPORTS, INSTALL

__all__ = ["node_token", "node_job", "jobdir_rel", "create_jobdir", "write_private", "gpu_map", "step_argv", "boot",
           "BOOT", "HOME_MARK", "RECORD_DIR", "JOBS_DIR"]

NODE_RE = re.compile(r"slurm-node-(\d+)\.invalid")  # node i of the allocation, as planned
HOME_MARK = "/clusterctl-slurm-home.invalid"  # the job files' home directory, as planned
RECORD_DIR = ".clusterctl/slurm"  # on the login node, relative to the home: <job>.json
JOBS_DIR = ".clusterctl/slurm/jobs"  # on every node, relative to the home: <job>/<slurm id>-<node>/
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")  # Slurm node names and job ids we accept in paths
STOP_CANCEL_WAIT = 15.0  # batch: after a user's stop, how long to wait for the scancel that follows it
_LAYOUT_ENV = ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
               "SLURM_DISTRIBUTION", "SLURM_CPUS_PER_TASK")

# The first thing that runs on a node, as `python3 -S -E -c BOOT batch|node`. Its stdin (base64 for `batch`,
# from the batch script's here-document): one JSON line (the package's directory under the home, its files,
# the blob's size and sha256), the zlib blob of the package's files, then the rest (the job, JSON). It
# installs the package where missing (a private temporary directory renamed into place, as
# clusterctl/ops/hosttools.py does over ssh) and hands the rest to boot() below.
BOOT = IMPORTS + "import base64\nos.umask(0o077)\n" + INSTALL + r"""
raw = sys.stdin.buffer.read()
if sys.argv[1] == "batch":
    raw = base64.b64decode(raw)
line, _, raw = raw.partition(b"\n")
head = json.loads(line)
blob, rest = raw[:head["size"]], raw[head["size"]:]
dest = os.path.join(os.path.expanduser("~"), head["dir"])
install(head, blob, dest, "clusterctl-slurm")
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
    try:
        nodes, addresses = allocation(job.get("endpoints", "ip"))
    except (OSError, subprocess.CalledProcessError, KeyError) as e:
        _say("job %s: cannot read the allocation from scontrol: %s" % (job["job"], e))
        return 2
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
    try:  # preflight as `agent up` does on the ssh path; a problem fails the job at its start, on every node
        return run_job_file(path, preflight=True)
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
