"""`backend: slurm`: dispatch · start · status · logs · stop of one Slurm batch job, over ssh to the login node.

The plan is made as for SSH, with node i of the allocation planned as ``slurm-node-<i>.invalid`` and every
node's home as ``HOME_MARK``; `start` builds the SSH path's job file for every node (ops/job.py's
`job_files`: processes, env, the coordinator on node 0, restarts, fail-fast), strips their token, and submits
one batch script carrying them and the host package. Inside the allocation clusterctl/host/slurm.py makes the
job's token and starts the host supervisor on every node (one srun task per node), with the real addresses
put in place. From then on the job is the supervisors': `status` folds their `agent status` replies (through
`srun --overlap` from the login node while the job runs, over ssh to the nodes once it has ended) with
Slurm's word (ops/slurm_status.py); `logs` reads every node's logs (every attempt) with `agent logs` over ssh;
`stop` runs every supervisor's `agent stop` (grace, then the sweep by CLUSTERCTL_JOB) through `srun --overlap`,
then scancel; `top` (`SlurmTop`) asks every node's supervisor for its `top` reply in one `srun --overlap` step a
refresh.
Which Slurm job is ours: the login node keeps ``~/.clusterctl/slurm/<job>.json``.
"""

from __future__ import annotations

import base64
import json
import posixpath
import time
import unicodedata
from collections.abc import Callable
from contextlib import contextmanager

from ..errors import ClusterctlError, JobError
from ..host import slurm as glue
from ..host import slurmctl
from ..host.states import JobState
from ..plan import Host, JobPlan
from ..quoting import join, quote
from ..remote import LineCallback, Remote, SshOptions
from ..spec import ClusterSpec
from ..spec.fields import check_address
from ..transport.base import cut_short
from . import Session
from .control import MAX_CONTROL_REPLY, agent_reply
from .hosttools import _package_payload, install_on, package_dir, tool_argv, tool_command
from .job import MAX_SAID, MAX_SAID_CHARS, JobStatus, job_files, own_log_line
from .slurm_status import node_placement, slurm_state, slurm_status
from .top import TopAnswer, TopRequest, answer_of

__all__ = ["job_templates", "batch_script", "sbatch_options", "slurm_state", "slurm_status",
           "dispatch", "start", "status", "logs", "stop", "SlurmTop", "SlurmError"]

WAIT_SUPERVISORS_S = 120.0  # logs --follow: how long a running job's supervisors may take to appear
LOGS_TIMEOUT_S = 600.0  # logs without --follow: a generous deadline for large logs
STOP_EXTRA_S = 2 * slurmctl.STOP_EXTRA  # the login's stop command: its step and scancel's wait, beyond the grace
_PLACEHOLDER_TOKEN = "planned"  # build_job wants one; stripped before the job files leave the controller


class SlurmError(ClusterctlError):
    """Slurm refused or failed a command (sbatch, scontrol, scancel) on the login node."""


def _host(spec: ClusterSpec, address: str, index: int) -> Host:
    """A host (the login node, or a node of the allocation) as `ssh` resolves it under the spec's ssh config."""
    from ..sshconfig import Target, config_path, resolve
    from . import bastion_routes

    config = config_path(spec)
    (r,) = resolve([Target(address, spec.ssh.user, spec.ssh.port)], config)
    jump = tuple(spec.ssh.proxy_jump or r.proxy_jump)
    before, hop = bastion_routes([jump[0]], config)[jump[0]] if jump else ((), None)  # as the planner's hosts
    return Host(address=address, port=r.port, user=r.user, index=index, hostname=r.hostname,
                jump=(*before, *jump), hop_command=hop or "")


def _node_plan(plan: JobPlan, hosts: tuple[Host, ...]) -> JobPlan:
    """A plan over real machines (no processes): what dispatch needs."""
    return JobPlan(job=plan.job, mode=plan.mode, hosts=hosts, processes=(), workdir=plan.workdir,
                   log_dir=plan.log_dir, control_endpoint="", on_failure=plan.on_failure, grace=plan.grace)


@contextmanager
def _remote(spec: ClusterSpec, hosts: tuple[Host, ...]):
    with Remote(hosts, SshOptions.from_spec(spec)) as remote:
        yield remote


def _reached(res, login: Host):
    """res, unless the login node could not be reached: then SlurmError, said alike by every command."""
    if res.unreachable:
        raise SlurmError(f"cannot reach the Slurm login node {login.label}: {res.stderr.strip()[-300:]}")
    return res


def _run(remote: Remote, host: Host, command: str, *, stdin: bytes | None = None, what: str) -> str:
    """One command on one host; SlurmError with its stderr when it fails."""
    res = _reached(remote.run(command, hosts=[host], stdin=stdin, check=False, what=what)[host], host)
    if res.exit_code != 0:
        why = (res.stderr or res.stdout).strip()[-800:] or f"exit {res.exit_code}"
        raise SlurmError(f"{what} on {host.label} failed: {why}")
    return res.stdout


# ------------------------------------------------------------------------------------------- pure


def job_templates(plan: JobPlan) -> list[dict]:
    """Node i's job file as planned, for every node (pure): the SSH path's (ops/job.py `job_files`, checked
    by the agent's validator) with placeholder addresses and home, and no token (the job makes its own)."""
    files = job_files(plan, {h: glue.HOME_MARK for h in plan.hosts}, _PLACEHOLDER_TOKEN)
    out = []
    for host in plan.hosts:
        f = dict(files[host])
        f.pop("token", None)
        f["coordinator"] = {k: v for k, v in f["coordinator"].items() if k != "token"}
        out.append(f)
    return out


def _control(text: str) -> str | None:
    """The first control or line-separator character in text; None when there is none."""
    return next((c for c in text if unicodedata.category(c) in ("Cc", "Zl", "Zp")), None)


def sbatch_options(spec: ClusterSpec, plan: JobPlan) -> list[str]:
    """The #SBATCH options (pure): one supervisor task per node, with a CPU for each of its processes."""
    s = spec.slurm
    per_node = max((len(plan.on_host(h)) for h in plan.hosts), default=1) or 1
    output = posixpath.join(plan.log_dir.replace("%", "%%"), "slurm-%j.out")  # % starts Slurm's patterns
    opts = [f"--job-name=clusterctl-{plan.job}", f"--nodes={len(plan.hosts)}", "--ntasks-per-node=1",
            f"--cpus-per-task={per_node}", f"--output={output}"]
    for flag, value in (("partition", s.partition), ("time", s.time), ("account", s.account), ("qos", s.qos)):
        if value:
            opts.append(f"--{flag}={value}")
    if s.gpus_per_node:
        opts.append(f"--gres=gpu:{s.gpus_per_node}")
    opts += list(s.sbatch_args)
    for opt in opts:  # the spec refuses these at their line; a spec made in code is checked here
        bad = _control(opt)
        if bad:
            raise JobError(f"#SBATCH {opt!r} holds the control character {bad!r}: it would end the option's line")
    return opts


def batch_script(spec: ClusterSpec, plan: JobPlan) -> str:
    """The sbatch script (pure): #SBATCH options, then python3 running the glue (clusterctl/host/slurm.py BOOT)
    with the host package and every node's job file (no token) on stdin, base64 in a here-document."""
    job = {"job": plan.job, "log_dir": plan.log_dir, "endpoints": spec.slurm.endpoints,
           "gpus_per_node": spec.slurm.gpus_per_node, "templates": job_templates(plan)}
    blob = base64.encodebytes(_package_payload() + json.dumps(job, sort_keys=True).encode()).decode()
    lines = ["#!/bin/bash", *(f"#SBATCH {opt}" for opt in sbatch_options(spec, plan))]
    lines += [f"# clusterctl job {plan.job}: {len(plan.pservers)} pserver(s), {len(plan.trainers)} trainer(s); "
              "one clusterctl supervisor per node (docs/slurm.md)", "umask 077",
              f"exec python3 -S -E -c {quote(glue.BOOT)} batch <<'CLUSTERCTL_EOF'", blob.rstrip("\n"), "CLUSTERCTL_EOF"]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------- login node


def _login(spec: ClusterSpec) -> Host:
    return _host(spec, spec.slurm.login, 0)


# bytes of a login node's reply kept (`slurmctl login ...`): it speaks for every node of the job (a node's status is
# a few kB), but the login node may be compromised too: what it prints beyond this is dropped as it comes
LOGIN_REPLY = 64 << 20


def _reply(res, login: Host, what: str, job: str | None = None) -> dict:
    """The login node's JSON reply, or SlurmError; with `job`, a submit refused because that job's Slurm job is
    still pending or running (slurmctl's `live`) is a JobError that says so, not a failed sbatch."""
    if cut_short(_reached(res, login).stdout):
        raise SlurmError(f"{what} on {login.label}: a reply over the {LOGIN_REPLY >> 20} MiB a login node's may be")
    try:
        data = res.reply()
    except ClusterctlError:
        why = (res.stderr or res.stdout).strip()[-800:] or f"exit {res.exit_code}"
        raise SlurmError(f"{what} on {login.label} failed: {why}") from None
    live = data.get("live")
    if job and not data.get("ok") and isinstance(live, dict) and _name(live.get("state")) and _name(
            live.get("slurm_job")):  # sbatch never ran
        raise JobError(f"job {job} is already {live['state']} as Slurm job {live['slurm_job']}; stop it first "
                       "(clusterctl stop)")
    if not data.get("ok"):
        raise SlurmError(f"{what} on {login.label} failed: {data.get('error')}")
    return data


def _name(value) -> bool:
    """A Slurm node name or job id as we take one into paths and onto the screen (clusterctl/host/slurm.py's
    jobdir_rel): letters, digits and ``._-``, not first."""
    return isinstance(value, str) and glue.NAME_RE.fullmatch(value) is not None


def _text(value) -> bool:
    return isinstance(value, str) and _control(value) is None


def _address(value) -> bool:
    try:
        return isinstance(value, str) and check_address(value) == value
    except ValueError:
        return False


def _query_of(data: dict) -> dict:
    """The login node's reply to `slurmctl login query|stop|top` (clusterctl/host/slurmctl.py), checked field by
    field before anything reads it (the login node may be compromised): SlurmError names the first field of the
    wrong shape. A node's reply that is not a JSON object is left out, as if that node had not answered."""

    def check(ok: bool, what: str) -> None:
        if not ok:
            raise SlurmError(f"unexpected reply from the login node: {what}")

    rec, sj = data.get("record"), data.get("slurm")
    check("record" in data and (rec is None or isinstance(rec, dict) and _name(rec.get("slurm_job"))),
          "'record' is not a job record with a Slurm job id")
    check(sj is None or isinstance(sj, dict), "'slurm' is not Slurm's word for a job")
    if sj is not None:
        check(_name(sj.get("id")), "'slurm.id' is not a Slurm job id")
        for key in ("state", "exit_code"):
            check(_text(sj.get(key)), f"'slurm.{key}' is not one line of text")
        check(sj.get("reason") is None or _text(sj["reason"]), "'slurm.reason' is not one line of text")
        check(isinstance(sj.get("nodes"), list) and all(map(_name, sj["nodes"])),
              "'slurm.nodes' is not a list of node names")
        check(sj.get("batch_host") is None or _name(sj["batch_host"]), "'slurm.batch_host' is not a node name")
    addresses, replies = data.get("addresses", {}), data.get("replies")
    check(isinstance(addresses, dict) and all(_name(n) and _address(a) for n, a in addresses.items()),
          "'addresses' is not a map of node name to address")
    check(replies is None or isinstance(replies, dict) and all(map(_name, replies)),
          "'replies' is not a map of node name to reply")
    nodes = set(sj["nodes"]) if sj is not None else set()
    for key, names in (("addresses", addresses), ("replies", replies or {})):
        outside = sorted(set(names) - nodes)  # the job's nodes are all a login node may speak for
        check(not outside, f"'{key}' names {', '.join(outside[:3])}{' ...' if len(outside) > 3 else ''}, "
              "not a node of the job")
    check(isinstance(data.get("was_running", False), bool), "'was_running' is not true or false")
    check(isinstance(data.get("step_error", ""), str), "'step_error' is not text")
    return dict(data, slurm=sj, addresses=addresses, replies=None if replies is None else {  # a key left out: none
        n: r for n, r in replies.items() if isinstance(r, dict)})


def _login_tool(remote: Remote, login: Host, args: list[str], *, what: str, timeout: float | None = None) -> dict:
    """One `slurmctl login query|stop ...` command on the login node (the host package installed there first if
    missing): its reply, checked (`_query_of`)."""
    cmd, payload = tool_command("slurmctl", ["login", *args])
    res = remote.run(cmd, hosts=[login], stdin=payload, check=False, timeout=timeout, what=what,
                     max_output=LOGIN_REPLY)[login]
    return _query_of(_reply(res, login, what))


def _query(remote: Remote, login: Host, plan: JobPlan, *, replies: bool) -> dict:
    args = ["query", "--job", plan.job] + (["--replies"] if replies else [])
    return _login_tool(remote, login, args, what="asking Slurm", timeout=remote.control_timeout + slurmctl.STEP_TIMEOUT)


def _nodes(spec: ClusterSpec, sj: dict, addresses: dict) -> list[tuple[str, Host]]:
    """(node name, how ssh reaches it: NodeAddr) for each node of `sj["nodes"]`, in that order."""
    return [(n, _host(spec, addresses.get(n) or n, i)) for i, n in enumerate(sj["nodes"])]


_CONTROL = -1.0  # _agent_on_nodes' default deadline: the spec's command_timeout


def _agent_on_nodes(spec: ClusterSpec, nodes: list[tuple[str, Host]], args: Callable[[str], list[str]], *,
                    what: str, timeout: float | None = _CONTROL, on_line=None) -> dict:
    """`agent ARGS(node)` on each node over ssh: {node name: Result}; timeout None: no deadline."""
    by_host = {h: n for n, h in nodes}
    cmds = {h: tool_command("agent", args(n))[0] for n, h in nodes}
    payload = tool_command("agent", [])[1]
    with _remote(spec, tuple(by_host)) as remote:
        results = remote.run(lambda h: cmds[h], hosts=list(by_host), stdin=payload, check=False,
                             timeout=remote.control_timeout if timeout == _CONTROL else timeout, what=what,
                             on_line=on_line, max_output=MAX_CONTROL_REPLY)
    return {by_host[h]: r for h, r in results.items()}


def _jobdir(plan: JobPlan, sj: dict, node: str) -> str:
    return glue.jobdir_rel(plan.job, sj["id"], node)


def _node_replies(spec: ClusterSpec, plan: JobPlan, sj: dict, addresses: dict) -> tuple[dict, dict]:
    """Every node's status (`agent top --progress-only`: each process's last step too) over ssh (the job has ended,
    so no srun step can ask): replies, unreachable."""
    results = _agent_on_nodes(spec, _nodes(spec, sj, addresses),
                              lambda n: ["top", _jobdir(plan, sj, n), "--progress-only"], what="status")
    replies = {n: agent_reply(r) for n, r in results.items() if r.answered}
    unreachable = {n: r.stderr.strip()[-300:] for n, r in results.items() if not r.answered}
    return replies, unreachable


def _batch_tail(spec: ClusterSpec, plan: JobPlan, sj: dict, addresses: dict, lines: int = 3) -> str:
    """The last lines of the batch's output file (on the batch host), for a job that failed before any supervisor."""
    where = spec.slurm.login if spec.slurm.workspace == "shared" else (
        addresses.get(sj.get("batch_host") or "") or sj.get("batch_host"))
    if not where:
        return ""
    host = _host(spec, where, 1)
    path = posixpath.join(plan.log_dir, f"slurm-{sj['id']}.out")
    with _remote(spec, (host,)) as remote:
        res = remote.run(join(["tail", "-n", str(lines), path]), hosts=[host], check=False, what="batch output")[host]
    return " | ".join(res.stdout.strip().splitlines()) if res.exit_code == 0 else ""


def _status_from(spec: ClusterSpec, plan: JobPlan, q: dict) -> JobStatus:
    rec, sj = q["record"], q["slurm"]
    if rec is None:
        return JobStatus(plan.job, JobState.NOT_RUNNING, "never submitted from this login node", backend="slurm")
    if sj is None:
        return JobStatus(plan.job, JobState.UNKNOWN, f"Slurm job {rec['slurm_job']} is no longer known to Slurm",
                         backend="slurm")
    replies, unreachable = dict(q.get("replies") or {}), {}
    missing = [n for n in sj["nodes"] if n not in replies]
    if missing and slurm_state(sj["state"]) != JobState.PENDING:
        # the job ended (no step can ask), or the step missed a node: ask those nodes over ssh
        more, unreachable = _node_replies(spec, plan, dict(sj, nodes=missing), q["addresses"])
        replies.update(more)
    tail = ""
    if slurm_state(sj["state"]) == JobState.FAILED and not any(
            r and r.get("state") not in (None, JobState.UNKNOWN) for r in replies.values()):
        tail = _batch_tail(spec, plan, sj, q["addresses"])  # the batch itself failed before any supervisor
    return slurm_status(plan.job, sj, replies, unreachable, tail, placed=node_placement(plan, sj["nodes"]))


# ------------------------------------------------------------------------------------- operations


def _mkdir(remote: Remote, path: str, what: str = "creating the log directory") -> None:
    remote.run(f"umask 077 && mkdir -p {quote(path)}", what=what)


def _partition_nodes(spec: ClusterSpec, remote: Remote, login: Host) -> tuple[Host, ...]:
    """Every node of the partition, as ssh reaches it (NodeAddr): where a dispatched workspace must be."""
    argv = ["sinfo", "--noheader", "--Node", "--format=%N %o"]
    if spec.slurm.partition:
        argv.append(f"--partition={spec.slurm.partition}")
    found: dict[str, str] = {}
    for line in _run(remote, login, join(argv), what="sinfo").splitlines():
        parts = line.split()
        if len(parts) == 2:
            found.setdefault(parts[0], parts[1])
    if not found:
        raise SlurmError(f"sinfo on {login.label} lists no nodes" + (
            f" in partition {spec.slurm.partition}" if spec.slurm.partition else ""))
    return tuple(_host(spec, a, i) for i, a in enumerate(dict.fromkeys(found.values())))


def dispatch(spec: ClusterSpec, plan: JobPlan) -> list:
    """Ship the workspace: to every node of the partition (dispatch), or to the login node (shared fs)."""
    from .dispatch import dispatch as ssh_dispatch

    login = _login(spec)
    if spec.slurm.workspace == "shared":
        hosts: tuple[Host, ...] = (login,)
    else:
        with _remote(spec, (login,)) as remote:
            hosts = _partition_nodes(spec, remote, login)
    with _remote(spec, hosts) as remote:
        results = ssh_dispatch(Session(spec, _node_plan(plan, hosts), remote))
        _mkdir(remote, plan.log_dir)
    return results


def start(spec: ClusterSpec, plan: JobPlan, *, on_progress: Callable[[str], None] | None = None) -> JobStatus:
    """Submit the job as one batch script; refused while our previous Slurm job of this name is pending or running."""
    say = on_progress or (lambda msg: None)
    login = _login(spec)
    script = batch_script(spec, plan)
    with _remote(spec, (login,)) as remote:
        res = _reached(install_on(remote, ("slurmctl",), [login])[login], login)  # not as a failed install
        if not res.ok:
            raise SlurmError(f"installing clusterctl's host tools on the Slurm login node {login.label} failed: "
                             f"{res.error() or res.stderr.strip()[-300:] or f'exit {res.exit_code}'}")
        if spec.slurm.workspace == "shared":
            _mkdir(remote, plan.log_dir)
        else:  # sbatch --output must be writable on whichever node becomes the batch host
            say("creating the log directory on the partition's nodes")
            with _remote(spec, _partition_nodes(spec, remote, login)) as nodes:
                _mkdir(nodes, plan.log_dir)
        say("submitting the batch job")
        record = {"log_dir": plan.log_dir, "workspace": spec.slurm.workspace, "package": package_dir(),
                  "nodes": len(plan.hosts)}
        cmd = join(tool_argv("slurmctl", ["login", "submit", "--job", plan.job, "--record", json.dumps(record)]))
        res = remote.run(cmd, hosts=[login], stdin=script.encode(), check=False, what="sbatch",
                         max_output=LOGIN_REPLY)[login]
        _reply(res, login, "sbatch", plan.job)
        return _status_from(spec, plan, _query(remote, login, plan, replies=True))


def status(spec: ClusterSpec, plan: JobPlan) -> JobStatus:
    """Slurm's word for the job, folded with every supervisor's own status."""
    login = _login(spec)
    with _remote(spec, (login,)) as remote:
        q = _query(remote, login, plan, replies=True)
    return _status_from(spec, plan, q)


def _pending(q: dict) -> bool:
    return q["slurm"] is not None and slurm_state(q["slurm"]["state"]) == JobState.PENDING


def _supervisors_up(q: dict) -> bool:
    """Whether every node's supervisor answered (or the job no longer runs); never while the job is pending."""
    sj = q["slurm"]
    if sj is None or slurm_state(sj["state"]) not in (JobState.RUNNING, JobState.PENDING):
        return True
    replies = q.get("replies") or {}
    return not _pending(q) and all((replies.get(n) or {}).get("state") not in (None, JobState.UNKNOWN)
                                   for n in sj["nodes"])


def logs(spec: ClusterSpec, plan: JobPlan, *, on_line: LineCallback, follow: bool = False, role: str | None = None,
         id: int | None = None, lines: int | None = None) -> int:
    """Stream `[node role.id] line` from every selected log of every attempt (`agent logs` on each node, over
    ssh); with follow, until the job ends (a pending job is waited for)."""
    login = _login(spec)
    with _remote(spec, (login,)) as remote:
        q = _query(remote, login, plan, replies=follow)
        deadline = time.monotonic() + WAIT_SUPERVISORS_S
        while follow and not _supervisors_up(q) and time.monotonic() < deadline:
            time.sleep(1.0)
            q = _query(remote, login, plan, replies=True)
            if _pending(q):  # waited for as `start --follow` waits; the supervisors' deadline runs from the allocation
                deadline = time.monotonic() + WAIT_SUPERVISORS_S
    rec, sj = q["record"], q["slurm"]
    if rec is None:
        raise JobError(f"job {plan.job} was never submitted from {login.label}")
    if sj is None or not sj["nodes"]:
        raise JobError(f"job {plan.job} (Slurm job {rec['slurm_job']}) has not started: no logs yet")
    wanted = [i for i, h in enumerate(plan.hosts)
              if any(role in (None, p.role) and id in (None, p.id) for p in plan.on_host(h))]
    if not wanted:
        what = " ".join(f"{k}={v}" for k, v in (("role", role), ("id", id)) if v is not None)
        raise JobError(f"no process of job {plan.job} matches {what}")
    nodes = [pair for i, pair in enumerate(_nodes(spec, sj, q["addresses"])) if i in wanted]
    hosts = tuple(h for _, h in nodes)
    with _remote(spec, hosts) as remote:
        installed = install_on(remote, ("agent",), list(hosts))
    missing = [f"{n}: {r.error() or r.stderr.strip() or f'exit {r.exit_code}'}" for n, h in nodes
               for r in [installed[h]] if not r.ok]
    nodes = [(n, h) for n, h in nodes if installed[h].ok]
    if not nodes:
        raise JobError("logs: no node could be asked:\n" + "\n".join(missing))

    def args(node: str) -> list[str]:
        out = ["logs", _jobdir(plan, sj, node), "--host-label", node]
        out += ["--follow"] if follow else []
        out += ["--role", role] if role else []
        out += ["--id", str(id)] if id is not None else []
        return out + (["-n", str(lines)] if lines is not None else [])

    problems: list[str] = []
    relay = _LogRelay({h: n for n, h in nodes}, on_line, problems)
    results = _agent_on_nodes(spec, nodes, args, what="logs", timeout=None if follow else LOGS_TIMEOUT_S,
                              on_line=relay)
    problems += relay.counted()
    unreachable = [f"{n}: {r.stderr.strip()[-300:]}" for n, r in results.items() if r.unreachable]
    if problems or unreachable or missing:
        raise JobError("logs incomplete:\n" + "\n".join(problems + unreachable + missing))
    return max((r.exit_code for r in results.values()), default=0)


class _LogRelay:
    """What `logs` does with each line a node's `agent logs` sends: a follower's keepalive dropped, the agent's own
    JSON message kept in `problems` under the node's name (the first MAX_SAID of a node; the rest counted, said by
    counted()), and every other line, stdout and stderr alike, passed on under that node's name (own_log_line): a
    node, possibly compromised, cannot pass its lines off as another node's. As over SSH (ops/job.py `logs`)."""

    def __init__(self, node_of: dict[Host, str], on_line: LineCallback, problems: list[str]):
        self.node_of, self.on_line, self.problems = node_of, on_line, problems
        self.said: dict[Host, int] = {}

    def __call__(self, h: Host, stream: str, line: str) -> None:
        if stream == "out" and not line:  # a follower's keepalive (clusterctl/host/logtail.py)
            return
        if line.startswith("{"):  # the agent's own JSON message, not a log line
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError):  # not JSON after all (or nested too deep to read): a log line
                obj = None
            if isinstance(obj, dict):
                self.said[h] = self.said.get(h, 0) + 1
                if self.said[h] <= MAX_SAID:
                    self.problems.append(f"{self.node_of[h]}: {str(obj.get('error', line))[:MAX_SAID_CHARS]}")
                return
        self.on_line(h, stream, own_log_line(self.node_of[h], line))

    def counted(self) -> list[str]:
        """`NODE: N more error messages` for each node that said more than MAX_SAID."""
        return [f"{self.node_of[h]}: {n - MAX_SAID:,} more error messages" for h, n in self.said.items() if n > MAX_SAID]


def stop(spec: ClusterSpec, plan: JobPlan, *, grace: float | None = None) -> dict:
    """Every supervisor's stop (grace, then the sweep by CLUSTERCTL_JOB), then scancel; nodes of a job that had
    already ended are swept over ssh. Idempotent. Returns what happened, for the backend's StopReport."""
    login = _login(spec)
    g = plan.grace if grace is None else grace
    with _remote(spec, (login,)) as remote:
        res = _login_tool(remote, login, ["stop", "--job", plan.job, "--grace", f"{g:g}"], what="stop",
                          timeout=remote.control_timeout + g + STOP_EXTRA_S)
    rec, sj = res["record"], res["slurm"]
    out = {"was_running": res.get("was_running", False), "slurm_job": rec and rec["slurm_job"], "slurm": sj,
           "nodes": list(sj["nodes"]) if sj else [], "replies": dict(res.get("replies") or {})}
    if sj is None:
        return out
    todo = [(n, h) for n, h in _nodes(spec, sj, res["addresses"]) if n not in out["replies"]]
    if todo:  # the job had ended (or the step did not reach them): the sweep over ssh, by the job's tag
        swept = _agent_on_nodes(spec, todo, lambda n: ["stop", _jobdir(plan, sj, n), "--grace", f"{min(g, 5.0):g}",
                                                       "--job", plan.job], what="stop", timeout=g + 60)
        out["replies"].update({n: agent_reply(r) for n, r in swept.items() if r.answered})
        lost = {n: r.stderr.strip()[-300:] or f"exit {r.exit_code}" for n, r in swept.items() if not r.answered}
        if lost:
            raise SlurmError(f"Slurm job {sj['id']} is {sj['state']}, but the sweep of its nodes by the job's tag "
                             "could not reach " + "; ".join(f"{n}: {why}" for n, why in lost.items()))
    return out


class SlurmTop:
    """`clusterctl top` under Slurm: each call is one `slurmctl login top` on the login node (one ssh connection,
    kept until close()), whose one `srun --overlap` step brings every node's supervisor's `top` reply. Returns
    {node: TopAnswer}: a node the step did not bring an answer from is a row that says so; a job that is not
    running is one row under the login node's name."""

    def __init__(self, spec: ClusterSpec, plan: JobPlan, request: TopRequest):
        self.spec, self.plan, self.request = spec, plan, request
        self.login = _login(spec)
        self._remote: Remote | None = None

    def close(self) -> None:
        """Close the connection to the login node."""
        if self._remote is not None:
            self._remote.close()
            self._remote = None

    def __call__(self) -> dict[str, TopAnswer]:
        r, login = self.request, self.login
        step = r.deadline(slurmctl.STEP_TIMEOUT)
        args = ["login", "top", "--job", self.plan.job, "--timeout", f"{step:g}", "--slice", f"{r.slice_s:g}",
                "--slices", str(r.slices)] + ([] if r.gpu else ["--no-gpu"])
        if self._remote is None:
            self._remote = Remote((login,), SshOptions.from_spec(self.spec))
        cmd, payload = tool_command("slurmctl", args)
        res = self._remote.run(cmd, hosts=[login], stdin=payload, check=False, what="top",
                               timeout=self._remote.control_timeout + step, max_output=LOGIN_REPLY)[login]
        now = time.monotonic()
        if not res.answered:
            why = "did not answer in time" if res.timed_out else res.stderr.strip()[-300:] or "no answer"
            return {login.label: TopAnswer(now, "unreachable", error=f"the Slurm login node: {why}")}
        try:
            if cut_short(res.stdout):
                raise ClusterctlError(f"a reply over the {LOGIN_REPLY >> 20} MiB a login node's may be")
            q = res.reply()
        except ClusterctlError:
            q = {"ok": False, "error": (res.stderr or res.stdout).strip()[-300:] or f"exit {res.exit_code}"}
        if not q.get("ok"):
            return {login.label: TopAnswer(now, "error", error=f"slurmctl login top: {q.get('error')}")}
        try:
            return self._answers(_query_of(q), now)
        except SlurmError as e:
            return {login.label: TopAnswer(now, "error", error=str(e))}

    def _answers(self, q: dict, now: float) -> dict[str, TopAnswer]:
        rec, sj, login = q.get("record"), q.get("slurm"), self.login.label
        if rec is None:
            return {login: TopAnswer(now, "no job", error=f"job {self.plan.job} was never submitted from {login}",
                                     state=JobState.NOT_RUNNING)}
        if not sj:
            return {login: TopAnswer(now, "no job", error=f"Slurm job {rec['slurm_job']} is no longer known to Slurm")}
        word = slurm_state(sj["state"])
        replies = q.get("replies")
        if not isinstance(replies, dict):  # no step: the job waits, or has ended
            what = f"Slurm job {sj['id']} {sj['state']}" + (f": {sj['reason']}" if sj.get("reason") else "")
            if word == JobState.PENDING:
                return {login: TopAnswer(now, "waiting", error=what, state=word)}
            return {login: TopAnswer(now, "no job", error=what + "; top shows a running job (clusterctl status: how "
                                     "it ended)", state=word)}
        why = q.get("step_error") or "no answer"
        placed = node_placement(self.plan, sj["nodes"])  # as `status`: a node's reply is its own processes' word
        out = {}
        for node in sj["nodes"]:
            if node not in replies:
                out[node] = TopAnswer(now, "unreachable", error=f"no answer from its srun --overlap step: {why}")
                continue
            out[node] = answer_of(replies[node] if isinstance(replies[node], dict) else None,
                                  output="its step printed no reply", job=self.plan.job, address=node,
                                  placed=None if placed is None else placed.get(node))
        return out
