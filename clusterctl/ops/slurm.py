"""`backend: slurm`: dispatch · start · status · logs · stop of one Slurm batch job, over ssh to the login node.

The plan is made as for SSH, with node i of the allocation planned as ``slurm-node-<i>.invalid``. `start`
submits one batch script (sbatch, over ssh to ``slurm.login``) carrying clusterctl/slurmjob.py and the
job file; inside the allocation that program puts the real node addresses in place and starts the
pservers and the trainers as srun steps (see its docs). `status` asks Slurm (scontrol, else sacct) and
reads the job's state file; `logs` reads the per-process output files; `stop` is scancel plus our sweep
of every node of the job by CLUSTERCTL_JOB. Which job is ours: the login node keeps
``~/.clusterctl/slurm/<job>.json`` (the Slurm job id and where the logs are).
"""

from __future__ import annotations

import base64
import json
import posixpath
import re
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import ClusterctlError, JobError
from ..host.states import JobState, ProcState
from ..plan import Host, JobPlan
from ..quoting import join, quote
from ..remote import LineCallback, Remote, SshOptions
from ..slurmjob import STATE_FILE
from ..spec import ClusterSpec
from . import Session
from .hosttools import _source, tool_command
from .job import JobStatus, ProcessStatus

__all__ = [
    "RECORD_DIR", "job_file", "batch_script", "slurm_state", "process_rows",
    "dispatch", "start", "status", "logs", "stop",
    "SlurmJob",
]

RECORD_DIR = ".clusterctl/slurm"  # on the login node, relative to its home
WAIT_PSERVERS_S = 120.0
STOP_WAIT_S = 30.0
_LIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING")
_STATES = {"PENDING": JobState.PENDING, "CONFIGURING": JobState.PENDING, "REQUEUED": JobState.PENDING,
           "RUNNING": JobState.RUNNING, "SUSPENDED": JobState.RUNNING, "RESIZING": JobState.RUNNING,
           "COMPLETING": JobState.STOPPING, "COMPLETED": JobState.SUCCEEDED, "CANCELLED": JobState.STOPPED}


class SlurmError(ClusterctlError):
    """Slurm refused or failed a command (sbatch, scontrol, scancel) on the login node."""


@dataclass(frozen=True)
class SlurmJob:
    """What Slurm says about our job: id, state (Slurm's word), exit code, nodes, batch host."""

    id: str
    state: str
    exit_code: str
    nodes: tuple[str, ...]
    batch_host: str | None
    reason: str | None


def _host(spec: ClusterSpec, address: str, index: int) -> Host:
    """A host (the login node, or a node of the allocation) as `ssh` resolves it under the spec's ssh config."""
    from ..sshconfig import Target, config_path, resolve

    (r,) = resolve([Target(address, spec.ssh.user, spec.ssh.port)], config_path(spec))
    return Host(address=address, port=r.port, user=r.user, index=index, hostname=r.hostname,
                jump=tuple(spec.ssh.proxy_jump or r.proxy_jump))


def _node_plan(plan: JobPlan, hosts: tuple[Host, ...]) -> JobPlan:
    """A plan over real machines (no processes): what dispatch and the sweep need."""
    return JobPlan(job=plan.job, mode=plan.mode, hosts=hosts, processes=(), workdir=plan.workdir,
                   log_dir=plan.log_dir, control_endpoint="", on_failure=plan.on_failure, grace=plan.grace)


@contextmanager
def _remote(spec: ClusterSpec, hosts: tuple[Host, ...]):
    with Remote(hosts, SshOptions.from_spec(spec)) as remote:
        yield remote


def _run(remote: Remote, host: Host, command: str, *, stdin: bytes | None = None, what: str) -> str:
    """One command on one host; SlurmError with its stderr when it fails."""
    res = remote.run(command, hosts=[host], stdin=stdin, check=False, what=what)[host]
    if res.exit_code != 0:
        why = (res.stderr or res.stdout).strip()[-800:] or f"exit {res.exit_code}"
        raise SlurmError(f"{what} on {host.label} failed: {why}")
    return res.stdout


# ------------------------------------------------------------------------------------------- pure


def job_file(spec: ClusterSpec, plan: JobPlan) -> dict:
    """The job file slurmjob.py reads inside the allocation (pure): processes with placeholder addresses."""
    return {
        "version": 1,
        "job": plan.job,
        "nodes": len(plan.hosts),
        "log_dir": plan.log_dir,
        "grace": plan.grace,
        "on_failure": plan.on_failure,
        "endpoints": spec.slurm.endpoints,
        "wait_pservers": WAIT_PSERVERS_S,
        "processes": [
            {"role": p.role, "id": p.id, "node": p.host.index, "endpoint": p.endpoint, "env": dict(p.env),
             "argv": list(p.argv), "cwd": plan.workdir}
            for p in plan.processes
        ],
    }


def _sbatch_options(spec: ClusterSpec, plan: JobPlan) -> list[str]:
    s = spec.slurm
    per_node = max((len(plan.on_host(h)) for h in plan.hosts), default=1) or 1
    opts = [f"--job-name=clusterctl-{plan.job}", f"--nodes={len(plan.hosts)}", f"--ntasks-per-node={per_node}",
            f"--output={posixpath.join(plan.log_dir, 'slurm-%j.out')}"]
    for flag, value in (("partition", s.partition), ("time", s.time), ("account", s.account), ("qos", s.qos)):
        if value:
            opts.append(f"--{flag}={value}")
    if s.gpus_per_node:
        opts.append(f"--gres=gpu:{s.gpus_per_node}")
    return opts + list(s.sbatch_args)


def batch_script(spec: ClusterSpec, plan: JobPlan, program: bytes) -> str:
    """The sbatch script (pure): #SBATCH options, then slurmjob.py and the job file unpacked and run."""
    for arg in spec.slurm.sbatch_args:
        if "\n" in arg or "\r" in arg:
            raise JobError(f"slurm.sbatch_args: {arg!r} spans lines")
    lines = ["#!/bin/bash", *(f"#SBATCH {opt}" for opt in _sbatch_options(spec, plan))]
    lines += [
        f"# clusterctl job {plan.job}: {len(plan.pservers)} pserver(s), {len(plan.trainers)} trainer(s)",
        "set -eu",
        'd=$(mktemp -d "/tmp/clusterctl-slurm-$SLURM_JOB_ID.XXXXXX")',
    ]
    job = json.dumps(job_file(spec, plan), sort_keys=True).encode()
    for name, data in (("slurmjob.py", program), ("job.json", job)):
        b64 = base64.encodebytes(data).decode()
        lines += [f'base64 -d > "$d/{name}" <<\'CLUSTERCTL_EOF\'', b64.rstrip("\n"), "CLUSTERCTL_EOF"]
    lines.append('exec python3 "$d/slurmjob.py" batch "$d"')
    return "\n".join(lines) + "\n"


def _fields(line: str) -> dict[str, str]:
    """`Key=Value Key2=Value2` (scontrol --oneliner) as a dict; values hold no spaces except Reason's."""
    return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", line))


def slurm_state(state: str) -> str:
    """Our job state for Slurm's JobState word (pure)."""
    word = state.split()[0].rstrip("+") if state else ""
    return _STATES.get(word, JobState.FAILED if word else JobState.NOT_RUNNING)


# ------------------------------------------------------------------------------------- login node


def _login(spec: ClusterSpec) -> Host:
    return _host(spec, spec.slurm.login, 0)


def _record_path(plan: JobPlan) -> str:
    return posixpath.join(RECORD_DIR, f"{plan.job}.json")


def _read_record(remote: Remote, login: Host, plan: JobPlan) -> dict | None:
    res = remote.run(f"cat {quote(_record_path(plan))}", hosts=[login], check=False,
                     what="reading the job record")[login]
    if res.unreachable:
        raise SlurmError(f"cannot reach the Slurm login node {login.label}: {res.stderr.strip()[-300:]}")
    if res.exit_code != 0:
        return None
    try:
        return json.loads(res.stdout)
    except ValueError:
        raise SlurmError(f"{login.label}:~/{_record_path(plan)} is not JSON; remove it") from None


def _query(remote: Remote, login: Host, job_id: str) -> SlurmJob | None:
    """Slurm's view of job_id: `scontrol show job` while slurmctld remembers it, else sacct; None if neither."""
    res = remote.run(join(["scontrol", "--oneliner", "show", "job", job_id]), hosts=[login], check=False,
                     what="scontrol show job")[login]
    if res.exit_code == 0 and "JobState=" in res.stdout:
        f = _fields(res.stdout)
        nodes = _hostnames(remote, login, f.get("NodeList", ""))
        batch = f.get("BatchHost") or None
        return SlurmJob(job_id, f.get("JobState", ""), f.get("ExitCode", ""), nodes, batch,
                        f.get("Reason") if f.get("Reason") not in (None, "None") else None)
    res = remote.run(join(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,ExitCode,NodeList"]),
                     hosts=[login], check=False, what="sacct")[login]
    rows = [r.split("|") for r in res.stdout.splitlines() if r.count("|") == 2]
    if res.exit_code != 0 or not rows:
        return None
    state, code, nodelist = rows[0]
    nodes = _hostnames(remote, login, nodelist)
    return SlurmJob(job_id, state, code, nodes, nodes[0] if nodes else None, None)


def _hostnames(remote: Remote, login: Host, nodelist: str) -> tuple[str, ...]:
    if not nodelist or nodelist in ("(null)", "None assigned"):
        return ()
    out = _run(remote, login, join(["scontrol", "show", "hostnames", nodelist]), what="scontrol show hostnames")
    return tuple(out.split())


def _addresses(remote: Remote, login: Host, partition: str | None, names: tuple[str, ...] = ()) -> dict[str, str]:
    """NodeName → NodeAddr (how ssh reaches it) for the given nodes, or every node of the partition."""
    argv = ["sinfo", "--noheader", "--Node", "--format=%N %o"]
    if names:
        argv.append("--nodes=" + ",".join(names))
    elif partition:
        argv.append(f"--partition={partition}")
    out = _run(remote, login, join(argv), what="sinfo")
    found: dict[str, str] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2:
            found.setdefault(parts[0], parts[1])
    return found


def _node_hosts(spec: ClusterSpec, addrs: dict[str, str]) -> tuple[Host, ...]:
    return tuple(_host(spec, a, i) for i, a in enumerate(dict.fromkeys(addrs.values())))


# ------------------------------------------------------------------------------------- operations


def _mkdir_on_nodes(spec: ClusterSpec, plan: JobPlan, addrs: dict[str, str]) -> None:
    hosts = _node_hosts(spec, addrs)
    with _remote(spec, hosts) as remote:
        remote.run(join(["mkdir", "-p", plan.log_dir]), what="creating the log directory")


def dispatch(spec: ClusterSpec, plan: JobPlan) -> list:
    """Ship the workspace: to every node of the partition (dispatch), or to the login node (shared fs)."""
    from .dispatch import dispatch as ssh_dispatch

    login = _login(spec)
    if spec.slurm.workspace == "shared":
        hosts = (login,)
    else:
        with _remote(spec, (login,)) as remote:
            addrs = _addresses(remote, login, spec.slurm.partition)
        if not addrs:
            raise SlurmError(f"sinfo on {login.label} lists no nodes" + (
                f" in partition {spec.slurm.partition}" if spec.slurm.partition else ""))
        hosts = _node_hosts(spec, addrs)
    node_plan = _node_plan(plan, hosts)
    with _remote(spec, hosts) as remote:
        results = ssh_dispatch(Session(spec, node_plan, remote))
        remote.run(join(["mkdir", "-p", plan.log_dir]), what="creating the log directory")
    return results


def start(spec: ClusterSpec, plan: JobPlan, *, on_progress: Callable[[str], None] | None = None) -> JobStatus:
    """Submit the job as one batch script; refuse while our previous job of this name is pending or running."""
    say = on_progress or (lambda msg: None)
    login = _login(spec)
    with _remote(spec, (login,)) as remote:
        record = _read_record(remote, login, plan)
        if record is not None:
            prev = _query(remote, login, str(record["slurm_job"]))
            if prev is not None and prev.state.split()[0].rstrip("+") in _LIVE:
                raise JobError(f"job {plan.job} is already {prev.state.lower()} as Slurm job {prev.id}; "
                               "stop it first (clusterctl stop)")
        if spec.slurm.workspace == "shared":
            _run(remote, login, join(["mkdir", "-p", plan.log_dir]), what="creating the log directory")
        else:  # sbatch --output must be writable on whichever node becomes the batch host
            say("creating the log directory on the partition's nodes")
            _mkdir_on_nodes(spec, plan, _addresses(remote, login, spec.slurm.partition))
        say("submitting the batch job")
        script = batch_script(spec, plan, _source("slurmjob"))
        out = _run(remote, login, "sbatch --parsable", stdin=script.encode(), what="sbatch")
        job_id = out.strip().split(";")[0]
        if not job_id.isdigit():
            raise SlurmError(f"sbatch on {login.label} answered {out.strip()[-200:]!r}, not a job id")
        record = {"slurm_job": job_id, "log_dir": plan.log_dir, "workspace": spec.slurm.workspace,
                  "submitted_at": time.time()}
        _run(remote, login, f"mkdir -p {quote(RECORD_DIR)} && cat > {quote(_record_path(plan))}",
             stdin=json.dumps(record).encode(), what="writing the job record")
        return _status(spec, plan, remote, login)


def _log_host(spec: ClusterSpec, remote: Remote, login: Host, sj: SlurmJob | None) -> Host | None:
    """Where the job's logs are: the login node (shared fs), else the batch host."""
    if spec.slurm.workspace == "shared":
        return login
    if sj is None or not sj.batch_host:
        return None
    addr = _addresses(remote, login, None, (sj.batch_host,)).get(sj.batch_host, sj.batch_host)
    return _host(spec, addr, 1)


def _read_state_file(spec: ClusterSpec, plan: JobPlan, host: Host) -> dict | None:
    path = posixpath.join(plan.log_dir, STATE_FILE)
    with _remote(spec, (host,)) as remote:
        res = remote.run(f"cat {quote(path)}", hosts=[host], check=False, what="reading the job state")[host]
    try:
        return json.loads(res.stdout) if res.exit_code == 0 else None
    except ValueError:
        return None


def process_rows(state: str, found: dict) -> list[ProcessStatus]:
    """Each process's row from the job's state (ours) and the batch program's state file (pure)."""
    rows = []
    steps = found.get("steps") or {}
    for p in found.get("processes", []):
        if state in (JobState.RUNNING, JobState.STOPPING) and found.get("state") == JobState.RUNNING:
            pstate, code = ProcState.RUNNING, None
        elif p["role"] in steps:
            step = steps[p["role"]]
            codes = step.get("tasks") or {}  # srun's reports of tasks that ended badly, first one first
            first = next(iter(codes), None)
            code = codes.get(str(p["id"]), 0 if step["code"] == 0 or codes else None)
            if code == 0:
                pstate = ProcState.EXITED
            elif step["stopped"] or state == JobState.STOPPED or (str(p["id"]) != first and code in (137, 143)):
                pstate = ProcState.STOPPED  # by us, by scancel, or by srun's kill-on-bad-exit after the first failure
            else:
                pstate = ProcState.FAILED
        else:
            pstate, code = (ProcState.STOPPED if state == JobState.STOPPED else ProcState.NOT_STARTED), None
        rows.append(ProcessStatus(p["node"], p["role"], p["id"], None, pstate, code, None))
    return rows


def _batch_tail(spec: ClusterSpec, plan: JobPlan, host: Host, job_id: str, lines: int = 3) -> str:
    path = posixpath.join(plan.log_dir, f"slurm-{job_id}.out")
    with _remote(spec, (host,)) as remote:
        res = remote.run(join(["tail", "-n", str(lines), path]), hosts=[host], check=False, what="batch output")[host]
    return " | ".join(res.stdout.strip().splitlines()) if res.exit_code == 0 else ""


def _status(spec: ClusterSpec, plan: JobPlan, remote: Remote, login: Host) -> JobStatus:
    record = _read_record(remote, login, plan)
    if record is None:
        return JobStatus(plan.job, JobState.NOT_RUNNING, "never submitted from this login node")
    sj = _query(remote, login, str(record["slurm_job"]))
    if sj is None:
        return JobStatus(plan.job, JobState.UNKNOWN, f"Slurm job {record['slurm_job']} is no longer known to Slurm")
    state = slurm_state(sj.state)
    where = f" on {','.join(sj.nodes)}" if sj.nodes else ""
    reason = f"Slurm job {sj.id} {sj.state} (exit {sj.exit_code}){where}" + (f": {sj.reason}" if sj.reason else "")
    procs: list[ProcessStatus] = []
    log_host = _log_host(spec, remote, login, sj) if state != JobState.PENDING else None
    found = _read_state_file(spec, plan, log_host) if log_host else None
    if log_host and state == JobState.FAILED and not (found and found.get("slurm_job") == sj.id):
        tail = _batch_tail(spec, plan, log_host, sj.id)  # the batch program itself failed early
        reason += f"; slurm-{sj.id}.out ends: {tail}" if tail else ""
    if found and found.get("slurm_job") == sj.id:
        if found.get("reason"):
            reason += f"; {found['reason']}"
        procs = process_rows(state, found)
    return JobStatus(plan.job, state, reason, procs)


def status(spec: ClusterSpec, plan: JobPlan) -> JobStatus:
    """The job's state from Slurm (scontrol, else sacct) and, when readable, its processes from the state file."""
    login = _login(spec)
    with _remote(spec, (login,)) as remote:
        return _status(spec, plan, remote, login)


def logs(
    spec: ClusterSpec,
    plan: JobPlan,
    *,
    on_line: LineCallback,
    follow: bool = False,
    role: str | None = None,
    id: int | None = None,
    lines: int | None = None,
) -> int:
    """Stream `[node role.id] line` from the job's output files; with follow, until the job ends."""
    login = _login(spec)
    with _remote(spec, (login,)) as remote:
        record = _read_record(remote, login, plan)
        if record is None:
            raise JobError(f"job {plan.job} was never submitted from {login.label}")
        sj = _query(remote, login, str(record["slurm_job"]))
        host = _log_host(spec, remote, login, sj)
    if host is None:
        raise JobError(f"job {plan.job} (Slurm job {record['slurm_job']}) has not started: no logs yet")
    args = ["logs", plan.log_dir]
    if follow:
        args.append("--follow")
    if role:
        args += ["--role", role]
    if id is not None:
        args += ["--id", str(id)]
    if lines is not None:
        args += ["-n", str(lines)]
    cmd, payload = tool_command("slurmjob", args)
    problems: list[str] = []

    def relay(h: Host, stream: str, line: str) -> None:
        if line.startswith("{"):
            try:
                problems.append(json.loads(line).get("error", line))
                return
            except ValueError:
                pass
        on_line(h, stream, line)

    with _remote(spec, (host,)) as remote:
        res = remote.run(cmd, hosts=[host], stdin=payload, on_line=relay, check=False, what="logs")[host]
    if problems:
        raise JobError(f"{host.label}: " + "; ".join(problems))
    if res.unreachable:
        raise JobError(f"cannot reach {host.label} for the logs: {res.stderr.strip()[-300:]}")
    return res.exit_code


def stop(spec: ClusterSpec, plan: JobPlan, *, grace: float | None = None) -> dict:
    """scancel the job, wait until Slurm has ended it, then sweep its nodes by CLUSTERCTL_JOB. Idempotent."""
    from .job import stop as sweep

    login = _login(spec)
    g = plan.grace if grace is None else grace
    with _remote(spec, (login,)) as remote:
        record = _read_record(remote, login, plan)
        if record is None:
            return {"was_running": False, "slurm_job": None, "nodes": [], "killed": []}
        job_id = str(record["slurm_job"])
        sj = _query(remote, login, job_id)
        was_running = sj is not None and sj.state.split()[0].rstrip("+") in _LIVE
        if was_running:
            _run(remote, login, join(["scancel", job_id]), what="scancel")
            deadline = time.monotonic() + g + STOP_WAIT_S
            while sj is not None and sj.state.split()[0].rstrip("+") in _LIVE and time.monotonic() < deadline:
                time.sleep(0.5)
                sj = _query(remote, login, job_id)
            if sj is not None and sj.state.split()[0].rstrip("+") in _LIVE:
                raise SlurmError(f"Slurm job {job_id} is still {sj.state} {g + STOP_WAIT_S:g}s after scancel")
        names = sj.nodes if sj is not None else ()
        addrs = _addresses(remote, login, None, names) if names else {}
    killed: list = []
    if addrs:
        hosts = _node_hosts(spec, addrs)
        with _remote(spec, hosts) as remote:
            swept = sweep(Session(spec, _node_plan(plan, hosts), remote), grace=min(g, 5.0))
        killed = [pid for r in swept.values() for pid in (r.get("killed") or [])]
    return {"was_running": was_running, "slurm_job": job_id, "nodes": list(names), "killed": killed}
