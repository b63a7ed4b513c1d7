"""The Slurm job's control commands: on the login node (over ssh) and their steps on the nodes (docs/slurm.md).

    login submit   sbatch the script on stdin (under umask 077), unless the job's previous Slurm job is still
                   pending or running (then its state and id, as `live`); record it in
                   ``~/.clusterctl/slurm/<job>.json`` (0600)
    login query    the record, Slurm's word (`scontrol show job`, else sacct), the nodes and their NodeAddr;
                   with --replies and a running job, every supervisor's `agent status` (one srun --overlap step)
    login top      the record, Slurm's word and, for a running job, every supervisor's `top` reply (figures,
                   progress: `clusterctl top`), in one srun --overlap step
    login stop     every supervisor's `agent stop` (grace, then the sweep by the job's tag) through srun
                   --overlap, then scancel, and the wait until Slurm has ended the job
    node-status / node-stop   (one srun --overlap task per node) `agent status|stop` on this node's job
                   directory; the reply in short base64 lines (srun cuts and interleaves long ones)
    node-top       (one task per node) the supervisor's `top` over its control socket (its sampler kept in
                   memory, nvidia-smi on its own thread), `agent top` where it cannot answer; replied as above

Which node a reply came from is Slurm's word, never the node's: the step is `srun --label --distribution=arbitrary
--nodelist=<the job's nodes, in scontrol show hostnames order>`, so task i runs on node i, and srun itself starts
every line task i prints with `i: ` (slurmstepd cuts a task's lines at 1024 bytes and ends an unfinished one, each
piece labelled). `StepOutput` takes node i's reply from the lines labelled i only, splits on newlines only, and
refuses a task's reply (that node then has none) whose reply lines name another node, repeat or garble a part, or
that prints more than its share: a node speaks for itself or not at all.

Each `login` command prints one JSON object. Stdlib only (Python 3.9), as the rest of the host package.
"""

import argparse
import base64
import contextlib
import hmac
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

from .common import emit
from .controlproto import CLIENT_HEADER_TIMEOUT, OK, read_control
from .slurm import NAME_RE, RECORD_DIR, _home_path, jobdir_rel

__all__ = ["overlap_argv", "read_record", "query_job", "live", "reply_lines", "read_replies", "StepOutput", "main",
           "STEP_TIMEOUT", "STOP_EXTRA"]

LIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "REQUEUE_HOLD",
        "REQUEUE_FED", "RESV_DEL_HOLD", "SIGNALING", "STAGE_OUT", "STOPPED")  # Slurm's words for a job not over
STEP_TIMEOUT = 60.0  # a status step's deadline (an agent status answers in well under a second)
UNKNOWN_JOB = "Invalid job id specified"  # scontrol show job: slurmctld has no such job (any more)
STOP_EXTRA = 30.0  # a stop step's deadline beyond the grace; scancel's wait too
MAX_TOP_REPLY = 8 << 20  # bytes of a supervisor's `top` reply read over its control socket
REPLY_MARK = "clusterctl-slurm-reply"  # starts the lines of a node command's reply in srun's output
REPLY_CHUNK = 600  # base64 characters per reply line: srun cuts lines longer than 1024 bytes (and interleaves them)
LABEL_RE = re.compile(rb"([0-9]{1,7}): ")  # srun --label's prefix of every line task N prints: `%0*d: `
MAX_STEP_LINE = 4096  # bytes of one line of a step's output read at once (srun's own are at most 1024 + label)
REPLY_SHARE = 16 << 20  # bytes of output one task of a step may print: a top reply's base64 lines (MAX_TOP_REPLY)


def overlap_argv(slurm_job, nodes, package, args, name):
    """srun's argv for a short step beside the running job (--overlap): one task per node runs this module's
    `ARGS` (node-status, node-stop) from `package` (the package's directory under the home the job installed).
    Task i runs on nodes[i] (--distribution=arbitrary lays the tasks out in --nodelist's order) and srun starts
    each line it prints with `i: ` (--label): which node printed a line is Slurm's word, not the node's."""
    for node in nodes:
        if not NAME_RE.match(str(node)):  # -w takes a name with `/` for a file's, and `,` splits names
            raise ValueError("Slurm named a node %r: not a node name srun --nodelist can be given" % (node,))
    run = ("import os, sys; sys.path[0] = os.path.join(os.path.expanduser('~'), sys.argv[1]); "
           "sys.exit(__import__(sys.argv[2], fromlist=['main']).main(sys.argv[3:]))")
    return ["srun", "--overlap", "--jobid=%s" % slurm_job, "--nodes=%d" % len(nodes), "--ntasks=%d" % len(nodes),
            "--ntasks-per-node=1", "--distribution=arbitrary", "--nodelist=" + ",".join(nodes), "--label",
            "--mpi=none", "--chdir=/", "--job-name=" + name, "--quiet",
            "python3", "-S", "-E", "-c", run, package, __name__, *args]


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
    """`Key=Value Key2=Value2` (scontrol --oneliner) as a dict, each value up to the next space."""
    return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", line))


def _hostnames(nodelist):
    if not nodelist or nodelist in ("(null)", "None assigned", "None"):
        return []
    try:
        res = subprocess.run(["scontrol", "show", "hostnames", nodelist], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, universal_newlines=True)
    except OSError:
        return []
    return res.stdout.split() if res.returncode == 0 else []


def query_job(slurm_job):
    """Slurm's view of a job (`scontrol show job` while slurmctld remembers it, else sacct), or None when Slurm
    does not know it; raise ValueError when Slurm cannot be asked (slurmctld down, no scontrol): a job Slurm
    cannot speak for is not a job that is over."""
    try:
        res = subprocess.run(["scontrol", "--oneliner", "show", "job", str(slurm_job)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, universal_newlines=True)
    except OSError as e:
        raise ValueError("cannot ask Slurm about Slurm job %s: scontrol: %s" % (slurm_job, e))
    if res.returncode == 0 and "JobState=" in res.stdout:
        f = _fields(res.stdout)
        reason = f.get("Reason")
        return {"id": str(slurm_job), "state": f.get("JobState", ""), "exit_code": f.get("ExitCode", ""),
                "nodes": _hostnames(f.get("NodeList", "")), "batch_host": f.get("BatchHost") or None,
                "reason": reason if reason not in (None, "None") else None}
    refused = res.returncode != 0 and UNKNOWN_JOB not in res.stderr  # not "no such job": Slurm did not answer
    why = (res.stderr or res.stdout).strip()[-300:] or "exit %d" % res.returncode
    try:
        res = subprocess.run(["sacct", "-n", "-P", "-X", "-j", str(slurm_job), "-o", "State,ExitCode,NodeList"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)
    except OSError:
        res = None
    rows = [r.split("|") for r in res.stdout.splitlines() if r.count("|") == 2] if res is not None else []
    if res is None or res.returncode != 0 or not rows:
        if refused:
            raise ValueError("cannot ask Slurm about Slurm job %s: %s" % (slurm_job, " ".join(why.split())))
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
    try:
        res = subprocess.run(["scontrol", "show", "node", "--oneliner", ",".join(nodes)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, universal_newlines=True)
    except OSError:
        return {}
    found = {}
    for line in res.stdout.splitlines():
        f = _fields(line)
        if "NodeName" in f:
            found[f["NodeName"]] = f.get("NodeAddr") or f["NodeName"]
    return found


def _node_step(rec, sj, args, timeout, name):
    """Run `slurm ARGS` on every node of a running job (srun --overlap): {node: reply}, and srun's complaint (with
    why a node's reply was refused). srun's output is read as it comes, a line and a task's share at a time."""
    nodes = list(sj["nodes"])
    argv = overlap_argv(sj["id"], nodes, rec["package"], args, name)
    step, err = StepOutput(nodes), bytearray()

    def read_err(stream):
        for chunk in iter(lambda: stream.read(4096), b""):
            err.extend(chunk)
            del err[:-2000]

    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as e:
        return {}, "srun: %s" % e
    readers = [threading.Thread(target=step.read, args=(proc.stdout,), daemon=True),
               threading.Thread(target=read_err, args=(proc.stderr,), daemon=True)]
    for t in readers:
        t.start()
    why = None
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        why = "srun did not end within %gs" % timeout
    for t in readers:
        t.join(5.0)
    replies, refused = step.result()
    why = why or bytes(err).decode("utf-8", "replace")
    if not any(t.is_alive() for t in readers):  # else left to the reader still blocked on it
        proc.stdout.close()
        proc.stderr.close()
    missing = [n for n in nodes if n not in replies]
    if not missing:
        return replies, ""
    said = ["%s: its reply refused (%s)" % (n, refused[n]) for n in nodes if n in refused]
    if [n for n in missing if n not in refused]:
        said.append(why.strip()[-500:] or "no answer")
    return replies, "; ".join(said)


def cmd_login_submit(args):
    """sbatch the script on stdin, unless the job's previous Slurm job is still pending or running; record it."""
    rec = read_record(args.job)
    if rec is not None:
        prev = query_job(rec["slurm_job"])
        if live(prev):
            emit({"ok": False, "error": "job %s is already %s as Slurm job %s; stop it first (clusterctl stop)"
                  % (args.job, _word(prev).lower(), prev["id"]), "live": {"state": _word(prev).lower(),
                                                                         "slurm_job": prev["id"]}})
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


def cmd_login_top(args):
    """The job's record and Slurm's word; for a running job, every node's `top` reply (node-top, one srun --overlap
    step within --timeout): what `clusterctl top` shows."""
    rec = read_record(args.job)
    out = {"ok": True, "record": rec, "slurm": None, "replies": None, "step_error": ""}
    if rec is not None:
        sj = query_job(rec["slurm_job"])
        out["slurm"] = sj
        if sj and _word(sj) == "RUNNING" and sj["nodes"] and rec.get("package"):
            step = ["node-top", "--job", args.job, "--slurm-job", sj["id"]] + _top_args(args)
            out["replies"], out["step_error"] = _node_step(rec, sj, step, args.timeout, "clusterctl-top")
    emit(out)
    return 0


def _top_args(args):
    """`agent top`'s rate options, as this command was given them."""
    return ["--slice", "%g" % args.slice, "--slices", str(args.slices)] + (["--no-gpu"] if args.no_gpu else [])


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


class StepOutput:
    """The output of a step whose task i ran on nodes[i] (overlap_argv), fed a line at a time: each node's reply
    from the lines srun labelled with its task's number only. Lines without a label (srun writes one before every
    line a task prints) or with one past the tasks are nobody's, and ignored; a task's other lines are its own
    noise. A task whose reply lines name another node, repeat, disagree on the count or are not base64, a line over
    MAX_STEP_LINE or more than REPLY_SHARE bytes in all is refused: its node has no reply, the others' stand."""

    def __init__(self, nodes):
        self.nodes = list(nodes)
        self._parts = [{} for _ in self.nodes]
        self._size = [0] * len(self.nodes)
        self._refused = {}  # task -> why
        self._lock = threading.Lock()
        self._closed = False

    def line(self, raw, whole=True):
        """One line of srun's output (bytes, its newline or not); whole=False: the start of a longer one."""
        m = LABEL_RE.match(raw)
        task = int(m.group(1)) if m else -1
        with self._lock:
            if self._closed or not 0 <= task < len(self.nodes) or task in self._refused:
                return
            self._size[task] += len(raw)
            if not whole:
                return self._refuse(task, "a line over %d bytes" % MAX_STEP_LINE)
            if self._size[task] > REPLY_SHARE:
                return self._refuse(task, "more than %d bytes of output" % REPLY_SHARE)
            fields = raw[m.end():].rstrip(b"\n").split(b" ")
            if fields[0] != REPLY_MARK.encode():
                return None  # its own noise (a warning, a stray print)
            node = self.nodes[task]
            i, _, n = fields[2].partition(b"/") if len(fields) == 4 else (b"", b"", b"")
            if fields[1:2] != [node.encode()]:
                return self._refuse(task, "a reply line naming another node")
            if not (i.isdigit() and n.isdigit() and len(i) < 8 and len(n) < 8 and int(i) < int(n)):
                return self._refuse(task, "a garbled reply line")
            parts, i, n = self._parts[task], int(i), int(n)
            if i in parts or any(count != n for count, _ in parts.values()):
                return self._refuse(task, "a reply line repeated or out of step")
            parts[i] = (n, fields[3])
        return None

    def _refuse(self, task, why):
        self._refused[task] = why
        self._parts[task] = {}

    def read(self, stream):
        """Feed every line of a binary stream, none read longer than MAX_STEP_LINE (the rest of one skipped)."""
        skipping = False
        for raw in iter(lambda: stream.readline(MAX_STEP_LINE), b""):
            if not skipping:
                self.line(raw, whole=raw.endswith(b"\n") or len(raw) < MAX_STEP_LINE)
            skipping = not raw.endswith(b"\n")

    def result(self):
        """({node: reply} of every node whose reply came whole, {node: why} of those refused); no more lines."""
        with self._lock:
            self._closed = True
        out = {}
        for task, got in enumerate(self._parts):
            if task in self._refused or not got:
                continue
            count = next(iter(got.values()))[0]
            if sorted(got) != list(range(count)):
                continue  # cut short (srun ended, or was ended): no reply, as from a node that did not answer
            try:
                data = base64.b64decode(b"".join(got[i][1] for i in range(count)), validate=True)
                out[self.nodes[task]] = json.loads(data.decode("utf-8"))
            except (ValueError, UnicodeDecodeError):
                self._refused[task] = "a garbled reply"
        return out, {self.nodes[t]: why for t, why in self._refused.items()}


def read_replies(text, nodes):
    """({node: reply}, {node: why refused}) from a step's whole output (text or bytes), read as _node_step reads
    srun's (StepOutput.read)."""
    step = StepOutput(nodes)
    step.read(io.BytesIO(text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text))
    return step.result()


def _emit_reply(node, reply):
    sys.stdout.write("".join(line + "\n" for line in reply_lines(node, reply)))
    sys.stdout.flush()


def _this_node():
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def cmd_node_status(args):
    """This node's status with each process's progress (what `clusterctl status` shows over SSH): its supervisor's
    `top --progress-only` over the control socket, `agent top --progress-only` where it cannot answer; as reply
    lines."""
    node = _this_node()
    jobdir = _home_path(jobdir_rel(args.job, args.slurm_job, node))
    reply = _supervisor_top(jobdir, {"progress_only": True}, STEP_TIMEOUT)
    if reply is None:
        reply = _agent(["top", jobdir, "--progress-only"])
    _emit_reply(node, reply)
    return 0


def _supervisor_top(jobdir, request, timeout):
    """The running supervisor's `top` reply over its control socket (clusterctl/host/control.py), or None where it
    cannot answer (no control file, a dead supervisor, a refusal, no reply in time): then the agent answers."""
    ctl = read_control(jobdir)
    if ctl is None or not os.path.isdir("/proc/%d" % ctl[0]):
        return None
    _, port, client, server = ctl
    line = "%s top %s\n" % (client, json.dumps(request, sort_keys=True, separators=(",", ":")))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=CLIENT_HEADER_TIMEOUT) as sock:
            sock.sendall(line.encode())
            reader = sock.makefile("rb")
            head = reader.readline(512).decode("ascii", "replace").strip()
            if not hmac.compare_digest(head.encode(), ("%s %s" % (OK, server)).encode()):
                return None
            sock.settimeout(timeout)
            body = reader.readline(MAX_TOP_REPLY)
        reply = json.loads(body.decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return reply if isinstance(reply, dict) else None


def cmd_node_top(args):
    """This node's supervisor's `top` reply (its control socket, else `agent top`), as reply lines."""
    node = _this_node()
    jobdir = _home_path(jobdir_rel(args.job, args.slurm_job, node))
    request = {"slice": args.slice, "slices": args.slices, "gpu": not args.no_gpu}
    reply = _supervisor_top(jobdir, request, STEP_TIMEOUT)
    if reply is None:
        reply = _agent(["top", jobdir] + _top_args(args))
    _emit_reply(node, reply)
    return 0


def cmd_node_stop(args):
    """This node's `agent stop` (the supervisor's stop with grace, then the sweep by the job's tag), as one line."""
    node = _this_node()
    jobdir = _home_path(jobdir_rel(args.job, args.slurm_job, node))
    _emit_reply(node, _agent(["stop", jobdir, "--grace", "%g" % args.grace, "--job", args.job]))
    return 0


def _rate_options(parser):
    """`top`'s options, bounded as `agent top` bounds them (clusterctl/host/topsnap.py)."""
    parser.add_argument("--slice", type=float, required=True, help="seconds per rate slice (straggler rule)")
    parser.add_argument("--slices", type=int, required=True, help="rate slices reported per rank")
    parser.add_argument("--no-gpu", action="store_true", help="do not ask nvidia-smi")


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
    q = lsub.add_parser("top")
    q.add_argument("--job", required=True)
    q.add_argument("--timeout", type=float, default=STEP_TIMEOUT, help="the srun step's deadline")
    _rate_options(q)
    q.set_defaults(func=cmd_login_top)
    for name, func in (("node-status", cmd_node_status), ("node-stop", cmd_node_stop), ("node-top", cmd_node_top)):
        q = sub.add_parser(name)
        q.add_argument("--job", required=True)
        q.add_argument("--slurm-job", required=True)
        if name == "node-stop":
            q.add_argument("--grace", type=float, required=True)
        if name == "node-top":
            _rate_options(q)
        q.set_defaults(func=func)
    args = parser.parse_args(argv)
    os.umask(0o077)  # sbatch records it: the batch's output file, logs and job dirs are the user's alone
    if not getattr(args, "func", None):
        parser.error("a command is required")
    if not NAME_RE.match(args.job):
        emit({"ok": False, "error": "not a job name: %r" % args.job})
        return 2
    if hasattr(args, "slices") and not (0 <= args.slices <= 60 and 0.5 <= args.slice <= 600
                                        and 1 <= getattr(args, "timeout", STEP_TIMEOUT) <= 600):
        emit({"ok": False, "error": "top: --slices must be 0..60, --slice 0.5..600 and --timeout 1..600 seconds"})
        return 2
    try:
        return args.func(args)
    except ValueError as e:
        emit({"ok": False, "error": str(e)})
        return 2
