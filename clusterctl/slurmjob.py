"""The Slurm batch job's own program: stdlib-only, shipped inside the batch script (see docs/slurm.md).

The controller plans the job with placeholder node addresses (``slurm-node-<i>.invalid``, node i of
the allocation) and writes the plan's processes into a job file. Inside the allocation this program:

    batch DIR              (the batch script) reads DIR/job.json, asks Slurm for the allocated nodes
                           (`scontrol show hostnames $SLURM_JOB_NODELIST`) and their addresses, puts the
                           addresses into every env value and argv (resolve()), sbcasts itself and the
                           resolved tasks to the nodes, runs the pservers as one srun step and, once
                           their endpoints answer, the trainers as another (`-m arbitrary`: task i on the
                           plan's node), writes each task's output to <log_dir>/<role>.<id>.log, stops the
                           pservers when the trainers end, sweeps every node, exits with the trainers' code
    task TASKS ROLE        (each srun task) picks tasks[ROLE][$SLURM_PROCID], checks it runs on the planned
                           node, and starts its argv as a child (plan env, cwd), relaying its output
    sweep JOB [FILE...]    (one task per node) SIGTERM, then SIGKILL, every process whose environ has
                           CLUSTERCTL_JOB=JOB; removes FILEs
    logs LOG_DIR [...]     (over ssh) prints `[node role.id] line` from the job's logs, optionally following

The job file and the state file (<log_dir>/slurm-state.json) are defined here, once.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

__all__ = ["node_token", "resolve", "state_path", "STATE_FILE", "TOKEN_RE", "main"]

JOB_ENV = "CLUSTERCTL_JOB"
STATE_FILE = "slurm-state.json"
TOKEN_RE = re.compile(r"slurm-node-(\d+)\.invalid")
LABEL_RE = re.compile(r"^\s*(\d+): ?(.*)$", re.DOTALL)
# srun's word on a task that ended badly: "srun: error: NODE: task 1: Exited with exit code 3"
TASK_END_RE = re.compile(r"task (\d+): (?:Exited with exit code (\d+)|(Terminated)|(Killed))")
SWEEP_GRACE = 3.0


def node_token(index: int) -> str:
    """The placeholder address of node `index` of the allocation (replaced at run time)."""
    return "slurm-node-%d.invalid" % index


def state_path(log_dir: str) -> str:
    """Where the batch program records nodes, placement and outcome."""
    return os.path.join(log_dir, STATE_FILE)


def _say(msg: str) -> None:
    sys.stdout.write("clusterctl-slurm: %s\n" % msg)
    sys.stdout.flush()


def _sub(text: str, addresses: list) -> str:
    return TOKEN_RE.sub(lambda m: addresses[int(m.group(1))], text)


def resolve(job: dict, nodes: list, addresses: list) -> dict:
    """Tasks per role in id order, with node names and addresses put in place of the placeholders (pure)."""
    if len(nodes) != job["nodes"] or len(addresses) != len(nodes):
        raise ValueError("the job was planned for %d node(s) but Slurm allocated %d: %s"
                         % (job["nodes"], len(nodes), ",".join(nodes)))
    tasks = {"pserver": [], "trainer": []}
    for proc in sorted(job["processes"], key=lambda p: (p["role"], p["id"])):
        tasks[proc["role"]].append({
            "role": proc["role"],
            "id": proc["id"],
            "node": nodes[proc["node"]],
            "address": addresses[proc["node"]],
            "endpoint": _sub(proc["endpoint"], addresses),
            "env": {k: _sub(v, addresses) for k, v in proc["env"].items()},
            "argv": [_sub(a, addresses) for a in proc["argv"]],
            "cwd": proc["cwd"],
        })
    for role, items in tasks.items():
        if [t["id"] for t in items] != list(range(len(items))):
            raise ValueError("%s ids are not dense 0..%d" % (role, len(items) - 1))
    return tasks


# ------------------------------------------------------------------------------------------- batch


def _out(argv: list) -> str:
    return subprocess.run(argv, check=True, stdout=subprocess.PIPE, universal_newlines=True).stdout


def _allocation(endpoints: str) -> tuple:
    """Allocated node names in Slurm's order and the address each one's endpoints use."""
    nodes = _out(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]]).split()
    addrs = {}
    for line in _out(["scontrol", "show", "node", "--oneliner", ",".join(nodes)]).splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "NodeName" in fields:
            addrs[fields["NodeName"]] = fields.get("NodeAddr") or fields["NodeName"]
    out = []
    for n in nodes:
        addr = addrs.get(n, n) if endpoints == "ip" else n
        if endpoints == "ip":
            try:
                addr = socket.gethostbyname(addr)
            except OSError:
                pass  # NodeAddr is what Slurm itself uses; keep it
        out.append(addr)
    return nodes, out


def _home_path(path: str) -> str:
    return path if os.path.isabs(path) else os.path.join(os.path.expanduser("~"), path)


class _Step:
    """One srun step of a role: output demultiplexed by task label into <log_dir>/<role>.<id>.log."""

    def __init__(self, role: str, tasks: list, files: dict, log_dir: str, grace: float,
                 kill_on_bad_exit: bool = True):
        self.role, self.tasks = role, tasks
        hostfile = os.path.join(files["dir"], role + ".hosts")
        with open(hostfile, "w") as fh:
            fh.write("".join(t["node"] + "\n" for t in tasks))
        env = _step_env(SLURM_HOSTFILE=hostfile)
        argv = ["srun", "--overlap", "--mpi=none", "--kill-on-bad-exit=%d" % kill_on_bad_exit, "--label",
                "--job-name=" + role, "--distribution=arbitrary", "--ntasks=%d" % len(tasks),
                "--wait=0",
                sys.executable or "python3", files["program"], "task", files["tasks"], role]
        self.logs = {t["id"]: open(os.path.join(log_dir, "%s.%d.log" % (role, t["id"])), "wb", buffering=0)
                     for t in tasks}
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.readers = [threading.Thread(target=self._pump, args=(s,), daemon=True)
                        for s in (self.proc.stdout, self.proc.stderr)]
        for r in self.readers:
            r.start()
        self.grace = grace
        self.stopped = False  # True once we stopped it (not an exit of its own)
        self.codes = {}  # task id -> exit code, for the tasks srun reported as ending badly, in order

    def _pump(self, stream) -> None:
        for raw in iter(stream.readline, b""):
            m = LABEL_RE.match(raw.decode("utf-8", "replace"))
            if m and int(m.group(1)) in self.logs:
                self.logs[int(m.group(1))].write(m.group(2).encode())
            else:  # srun's own messages
                end = TASK_END_RE.search(raw.decode("utf-8", "replace"))
                if end:
                    code = end.group(2)
                    self.codes.setdefault(int(end.group(1)), int(code) if code else (143 if end.group(3) else 137))
                sys.stdout.write("[%s step] %s" % (self.role, raw.decode("utf-8", "replace")))
                sys.stdout.flush()

    def poll(self):
        """The step's exit code, or None while it runs."""
        return self.proc.poll()

    def stop(self) -> int:
        """SIGTERM the step's tasks (srun forwards it), SIGKILL after grace; the exit code."""
        if self.proc.poll() is None:
            self.stopped = True
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.grace)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGTERM)  # a second one makes srun kill the step
                try:
                    self.proc.wait(self.grace)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
        return self.wait()

    def wait(self) -> int:
        """Wait for the step and its output readers; the exit code."""
        rc = self.proc.wait()
        for r in self.readers:
            r.join(60)  # srun has exited: its pipes end once drained
        if not any(r.is_alive() for r in self.readers):
            for fh in self.logs.values():
                fh.close()
        return rc


def _step_env(**extra) -> dict:
    """The batch's environment without the allocation's task layout (each step says its own)."""
    env = {k: v for k, v in os.environ.items() if k not in _LAYOUT_ENV}
    env.update(extra)
    return env


_LAYOUT_ENV = ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_DISTRIBUTION")


def _endpoints_up(endpoints: list) -> bool:
    for ep in endpoints:
        host, port = ep.rsplit(":", 1)
        try:
            with socket.create_connection((host, int(port)), timeout=1):
                pass
        except OSError:
            return False
    return True


def _write_state(log_dir: str, state: dict) -> None:
    tmp = state_path(log_dir) + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(state, fh)
    os.replace(tmp, state_path(log_dir))


def cmd_batch(args) -> int:
    """The batch script's body; see the module docs."""
    with open(os.path.join(args.dir, "job.json")) as fh:
        job = json.load(fh)
    slurm_job = os.environ["SLURM_JOB_ID"]
    log_dir = _home_path(job["log_dir"])
    os.makedirs(log_dir, exist_ok=True)
    nodes, addresses = _allocation(job.get("endpoints", "ip"))
    tasks = resolve(job, nodes, addresses)
    prefix = "/tmp/clusterctl-slurm-%s-" % slurm_job
    files = {"dir": args.dir, "program": prefix + "slurmjob.py", "tasks": prefix + "tasks.json"}
    local_tasks = os.path.join(args.dir, "tasks.json")
    with open(local_tasks, "w") as fh:
        json.dump(tasks, fh)
    state = {"job": job["job"], "slurm_job": slurm_job, "nodes": nodes, "addresses": addresses,
             "processes": [{"role": t["role"], "id": t["id"], "node": t["node"], "endpoint": t["endpoint"]}
                           for items in tasks.values() for t in items],
             "state": "running", "steps": {}, "reason": None, "started_at": time.time()}
    _write_state(log_dir, state)
    _say("job %s: slurm job %s on %s" % (job["job"], slurm_job, ",".join(nodes)))
    for src, dst in ((os.path.abspath(__file__), files["program"]), (local_tasks, files["tasks"])):
        subprocess.run(["sbcast", "--force", src, dst], check=True)

    grace = float(job.get("grace", 10))
    steps = {}
    reason = None

    def cancelled(signum, _frame):  # scancel: Slurm kills the steps; record why we end
        state.update(state="stopped", reason="cancelled (signal %d)" % signum, ended_at=time.time())
        _write_state(log_dir, state)
        shutil.rmtree(args.dir, ignore_errors=True)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, cancelled)
    try:
        if tasks["pserver"]:
            steps["pserver"] = _Step("pserver", tasks["pserver"], files, log_dir, grace)
            eps = [t["endpoint"] for t in tasks["pserver"]]
            deadline = time.monotonic() + float(job.get("wait_pservers", 120))
            while not _endpoints_up(eps):
                if steps["pserver"].poll() is not None:
                    reason = "the pservers exited (code %s) before listening" % steps["pserver"].poll()
                    break
                if time.monotonic() > deadline:
                    reason = "pserver endpoints %s did not answer in time" % ",".join(eps)
                    break
                time.sleep(0.2)
        if reason is None:
            steps["trainer"] = _Step("trainer", tasks["trainer"], files, log_dir, grace,
                                     kill_on_bad_exit=job.get("on_failure", "stop") == "stop")
            while steps["trainer"].poll() is None:
                ps = steps.get("pserver")
                if ps is not None and ps.poll() not in (None, 0):
                    reason = "a pserver failed (step exit %s)" % ps.poll()
                    steps["trainer"].stop()
                    break
                time.sleep(0.2)
            rc = steps["trainer"].wait()
            if rc != 0 and reason is None:
                reason = "a trainer failed (step exit %d)" % rc
                if steps["trainer"].codes:
                    first, code = next(iter(steps["trainer"].codes.items()))
                    reason = "trainer.%d failed (exit %d)" % (first, code)
        if "pserver" in steps:  # pservers end on their own once every trainer completed; else stopped
            deadline = time.monotonic() + grace
            while steps["pserver"].poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            steps["pserver"].stop()
    finally:
        for role, step in steps.items():
            state["steps"][role] = {"code": step.stop(), "stopped": step.stopped, "tasks": step.codes}
        _sweep_nodes(job["job"], nodes, files)
        shutil.rmtree(args.dir, ignore_errors=True)
        state["state"] = "failed" if reason else "succeeded"
        state["reason"] = reason
        state["ended_at"] = time.time()
        _write_state(log_dir, state)
        _say("job %s %s%s" % (job["job"], state["state"], ": " + reason if reason else ""))
    return 1 if reason else 0


def _sweep_nodes(job_id: str, nodes: list, files: dict) -> None:
    """One task per node sweeps what carries the job's tag (orphans that left their step) and our files."""
    argv = ["srun", "--overlap", "--mpi=none", "--nodes=%d" % len(nodes), "--ntasks=%d" % len(nodes),
            "--ntasks-per-node=1",
            "--job-name=sweep", sys.executable or "python3", files["program"], "sweep", job_id,
            files["program"], files["tasks"]]
    res = subprocess.run(argv, env=_step_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         universal_newlines=True)
    for line in res.stdout.splitlines():
        _say("sweep: " + line)


# --------------------------------------------------------------------------------------------- task


def cmd_task(args) -> int:
    """One srun task: start tasks[role][SLURM_PROCID] (env, cwd, argv) as a child and relay its output.

    A middleman rather than exec: a process the user's program leaves behind (setsid, daemonised) keeps
    the child's pipe, not the step's, so the step ends when the program does; the sweep ends the rest.
    """
    with open(args.tasks) as fh:
        tasks = json.load(fh)[args.role]
    rank = int(os.environ["SLURM_PROCID"])
    task = tasks[rank]
    here = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    if here != task["node"]:
        sys.stderr.write("clusterctl-slurm: %s.%d planned on %s but started on %s\n"
                         % (args.role, rank, task["node"], here))
        return 2
    env = dict(os.environ)
    env.update(task["env"])
    cwd = _home_path(task["cwd"])
    try:
        child = subprocess.Popen(task["argv"], env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except OSError as e:
        what = "workspace %s" % task["cwd"] if not os.path.isdir(cwd) else task["argv"][0]
        sys.stderr.write("clusterctl-slurm: %s.%d: cannot run %s: %s%s\n" % (
            args.role, rank, what, e.strerror, " (not dispatched?)" if not os.path.isdir(cwd) else ""))
        return 127

    def forward(signum, _frame):
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    _relay(child)
    rc = child.wait()
    sys.stdout.flush()
    return rc if rc >= 0 else 128 - rc


def _relay(child) -> None:
    """Copy the child's output to ours until EOF, or until it has exited and nothing more is waiting.

    What the child wrote before it exited is already in the pipe, so it is never lost; a process it left
    behind that keeps the pipe open is not waited for.
    """
    fd, out = child.stdout.fileno(), sys.stdout.buffer
    while True:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if not ready:
            if child.poll() is not None:
                return
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return
        out.write(chunk)
        out.flush()


# -------------------------------------------------------------------------------------------- sweep


def _tagged(job_id: str) -> list:
    needle = ("%s=%s" % (JOB_ENV, job_id)).encode()
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open("/proc/%s/environ" % name, "rb") as fh:
                if needle in fh.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            continue
    return found


def _signal(pids: list, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def sweep(job_id: str, grace: float = SWEEP_GRACE) -> list:
    """SIGTERM every process tagged with the job, SIGKILL what is left after grace; the pids found."""
    found = _tagged(job_id)
    _signal(found, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _tagged(job_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    _signal(_tagged(job_id), signal.SIGKILL)
    return found


def cmd_sweep(args) -> int:
    """Sweep this node; remove the job's files; print what was killed."""
    left = _tagged(args.job)
    if left:
        sweep(args.job)
        print("%s: swept %s" % (socket.gethostname(), " ".join(map(str, left))))
    for path in args.files:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return 0


# --------------------------------------------------------------------------------------------- logs


def _read_state(log_dir: str):
    try:
        with open(state_path(log_dir)) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def cmd_logs(args) -> int:
    """Print `[node role.id] line` from every selected log; with --follow, until the job has ended."""
    log_dir = _home_path(args.log_dir)
    state = _read_state(log_dir)
    if state is None:
        print(json.dumps({"error": "no state in %s (job not started yet?)" % log_dir}))
        return 1
    procs = [p for p in state["processes"] if args.role in (None, p["role"]) and args.id in (None, p["id"])]
    files = {}
    for p in procs:
        path = os.path.join(log_dir, "%s.%d.log" % (p["role"], p["id"]))
        files[path] = ("[%s %s.%d] " % (p["node"], p["role"], p["id"]), b"")
    offsets = {path: 0 for path in files}
    if args.lines is not None:
        for path in files:
            try:
                with open(path, "rb") as fh:
                    data = fh.read()
            except OSError:
                continue
            keep = data.splitlines(True)[-args.lines:] if args.lines else []
            offsets[path] = len(data) - sum(map(len, keep))
    out = sys.stdout
    while True:
        ended = (_read_state(log_dir) or {}).get("state") not in (None, "running")
        for path, (prefix, _) in files.items():
            try:
                with open(path, "rb") as fh:
                    fh.seek(offsets[path])
                    data = fh.read()
            except OSError:
                continue
            complete = data if ended else data[: data.rfind(b"\n") + 1]
            offsets[path] += len(complete)
            for line in complete.decode("utf-8", "replace").splitlines():
                out.write(prefix + line + "\n")
        out.flush()
        if not args.follow or ended:
            return 0
        time.sleep(0.3)


def main(argv=None) -> int:
    """Command-line entry point (see the module docs)."""
    parser = argparse.ArgumentParser(prog="slurmjob")
    sub = parser.add_subparsers(dest="cmd")
    p = sub.add_parser("batch")
    p.add_argument("dir")
    p.set_defaults(func=cmd_batch)
    p = sub.add_parser("task")
    p.add_argument("tasks")
    p.add_argument("role", choices=("pserver", "trainer"))
    p.set_defaults(func=cmd_task)
    p = sub.add_parser("sweep")
    p.add_argument("job")
    p.add_argument("files", nargs="*")
    p.set_defaults(func=cmd_sweep)
    p = sub.add_parser("logs")
    p.add_argument("log_dir")
    p.add_argument("--follow", action="store_true")
    p.add_argument("--role", choices=("pserver", "trainer"))
    p.add_argument("--id", type=int)
    p.add_argument("-n", dest="lines", type=int)
    p.set_defaults(func=cmd_logs)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.error("a command is required")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
