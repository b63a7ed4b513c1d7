"""start · status · logs · stop: the job lifecycle, driven through the per-host agent (clusterctl/host/agent.py).

The controller decides everything (the plan) and writes one job file per host; each host's agent
supervises its processes, and the agents talk to each other (through the coordinator on the first
host) so that a failed trainer stops the whole job and a finished job stops its pservers, also when
nobody is watching from the controller.
"""

from __future__ import annotations

import json
import posixpath
import secrets
from collections.abc import Callable

from ..errors import ClusterctlError, HostFailure, JobError, RemoteError
from ..plan import Host, JobPlan, factor_env
from ..quoting import join, quote
from ..remote import LineCallback, Remote
from ..host.jobfile import build_job, coordinator_entry, parse_endpoint, process_entry
from ..host.states import ACTIVE_JOB_STATES, JobState
from ..host.status import HostStatus, JobStatus, ProcessStatus, overall_state
from . import Session
from .hosttools import ensure_tools, install_on, tool_argv, tool_command

__all__ = [
    "STATE_ROOT",
    "job_files",
    "start",
    "status",
    "stop",
    "logs",
    "JobStatus",
    "ProcessStatus",
    "overall_state",
]

STATE_ROOT = ".clusterctl/jobs"  # relative to each host's home
WAIT_PSERVERS_S = 120.0


def _abs(home: str, path: str) -> str:
    return path if posixpath.isabs(path) else posixpath.join(home, path)


def job_files(plan: JobPlan, homes: dict[Host, str], token: str) -> dict[Host, dict]:
    """The agent's job file for every host that runs processes (pure): paths made absolute, ordering, coordinator.

    Built with clusterctl/host/jobfile.py's `build_job`, which checks each file with the agent's own validator.
    """
    if plan.mpi is not None:
        return {plan.mpi.host: _mpi_job_file(plan, homes[plan.mpi.host], token)}
    ctl_addr, ctl_port = parse_endpoint(plan.control_endpoint)  # an IPv6 address without its brackets
    pserver_eps = [p.endpoint for p in plan.pservers]
    files = {}
    for host in plan.hosts:
        home = homes[host]
        on_host = plan.on_host(host)
        # what the host's processes share (the endpoint lists above all) is written once, as "env"
        shared_env, own_env = factor_env([p.env for p in on_host])
        procs = [
            process_entry(p.role, p.id, p.argv, env, _abs(home, plan.workdir), _abs(home, plan.log_path(p)), [p.endpoint])
            for p, env in zip(on_host, own_env)
        ]
        files[host] = build_job(
            plan.job,
            host.address,
            procs,
            posixpath.join(home, STATE_ROOT),
            plan.policy,
            start_trainers_after={"endpoints": pserver_eps, "timeout": WAIT_PSERVERS_S} if pserver_eps else None,
            coordinator=coordinator_entry(
                ctl_addr, int(ctl_port), token, host == plan.hosts[0], len(plan.hosts), len(plan.trainers)
            ),
            env=shared_env,
            auth=plan.auth,
            token=token,
        )
    return files


def _mpi_job_file(plan: JobPlan, home: str, token: str) -> dict:
    """`launcher: mpi`: the first host supervises one process, mpiexec, run from the home directory."""
    mpi = plan.mpi
    first = plan.trainers[0]
    env = dict(mpi.env)  # mpiexec passes these to every rank by name (-genvlist / -x NAME)
    return build_job(
        plan.job,
        mpi.host.address,
        [process_entry("trainer", 0, mpi.argv, env, home, _abs(home, plan.log_path(first)))],
        posixpath.join(home, STATE_ROOT),
        plan.policy,
        auth=plan.auth,
        token=token,
    )


# ------------------------------------------------------------------------------------------ status


_HOME_MARK = "clusterctl-home:"


def _homes(remote: Remote) -> dict[Host, str]:
    # a framed line: what a shell's start-up files print before it (even without a newline) is skipped
    results = remote.run(f'printf "\\n{_HOME_MARK}%s\\n" "$HOME"', timeout=remote.control_timeout, what="finding home directories")
    homes = {}
    for h, r in results.items():
        found = [ln[len(_HOME_MARK):] for ln in r.stdout.splitlines() if ln.startswith(_HOME_MARK)]
        if not found or not found[-1].startswith("/"):
            raise JobError(f"{h.label}: cannot read the home directory (got {r.stdout.strip()[-200:]!r})")
        homes[h] = found[-1]
    return homes


def _jobdir(plan: JobPlan) -> str:
    # relative to the home directory, where every ssh session starts
    return posixpath.join(STATE_ROOT, plan.job)


def _agent_cmd(*args: str) -> str:
    return join(tool_argv("agent", list(args)))


def _parse(res) -> dict:
    try:
        return res.reply()  # the agent's JSON line, whatever a shell's start-up printed before it
    except ClusterctlError:
        return {"ok": False, "error": (res.stderr or res.stdout).strip()[-500:] or f"exit {res.exit_code}"}


def status(session: Session) -> JobStatus:
    """Every process's state on every host; unreachable hosts are reported, not fatal."""
    plan, remote = session.plan, session.remote
    cmd, payload = tool_command("agent", ["status", _jobdir(plan)])
    results = remote.run(cmd, stdin=payload, check=False, timeout=remote.control_timeout, what="status")
    procs: list[ProcessStatus] = []
    host_states: list[str] = []
    unreachable: dict[str, str] = {}
    reasons: list[str] = []
    attempt, restarts, attempts, attempts_total = 0, 0, [], 0
    for host, res in results.items():
        if not res.answered:  # not reached, or its command never answered (our deadline)
            unreachable[host.label] = res.stderr.strip()
            host_states.append(JobState.LOST)
            continue
        reply = HostStatus.from_json(_parse(res))  # only well-typed fields of what the host sent
        # a failed attempt being stopped reads `restarting` when another follows
        host_states.append(reply.folded_state)
        restarts = max(restarts, reply.restarts)
        # the host that got furthest knows the most attempts (the coordinator, unless it was cut off)
        if (reply.attempt, reply.attempts_total) > (attempt, attempts_total):
            attempt, attempts, attempts_total = reply.attempt, reply.attempts, reply.attempts_total
        if reply.reason and reply.state not in (JobState.RUNNING, JobState.SUCCEEDED):
            reasons.append(f"{host.label}: {reply.reason}")
        procs.extend(reply.process_status(host.label))
    procs.sort(key=lambda p: (p.role != "pserver", p.id))
    state = overall_state(host_states)
    reason = "; ".join(reasons) or (
        "unreachable: " + ", ".join(unreachable) if unreachable else None
    )
    return JobStatus(plan.job, state, reason, procs, unreachable, attempt, restarts, [a.summary() for a in attempts])


def stop(session: Session, *, grace: float | None = None) -> dict[Host, dict]:
    """Stop the job everywhere: SIGTERM, SIGKILL after grace, sweep by CLUSTERCTL_JOB. Idempotent."""
    plan, remote = session.plan, session.remote
    g = plan.grace if grace is None else grace
    cmd, payload = tool_command("agent", ["stop", _jobdir(plan), "--grace", f"{g:g}", "--job", plan.job])
    results = remote.run(
        cmd,
        stdin=payload,
        timeout=g + 60,
        check=False,
        what="stop",
    )
    failures = [HostFailure(h.label, r.command, r.exit_code, r.stderr) for h, r in results.items() if r.exit_code not in (0, 1)]
    parsed = {h: _parse(r) for h, r in results.items()}
    failures += [
        HostFailure(h.label, results[h].command, 1, d.get("error") or json.dumps(d.get("left", ""))[:500])
        for h, d in parsed.items()
        if results[h].exit_code == 1
    ]
    if failures:
        raise RemoteError(failures, what="stop")
    return parsed


def preflight(session: Session, tool: str, jobfiles: dict[Host, str]) -> list[str]:
    """Problems that would stop the job from starting, one line each (`host:port in use`, ...)."""
    results = session.remote.run(
        lambda h: _agent_cmd("preflight", jobfiles[h]), hosts=list(jobfiles), check=False,
        timeout=session.remote.control_timeout,
        what="preflight"
    )
    problems = []
    for host, res in results.items():
        if res.exit_code not in (0, 1):
            problems.append(f"{host.label}: {res.stderr.strip() or 'preflight failed'}")
            continue
        for p in _parse(res).get("problems", []):
            problems.append(f"{host.label}: {p.get('message') or p}")
    return problems


def start(session: Session, *, on_progress: Callable[[str], None] | None = None) -> JobStatus:
    """Verify workspaces, preflight every host, then launch; on a partial start stop what started."""
    from .dispatch import verify

    plan, remote = session.plan, session.remote
    say = on_progress or (lambda msg: None)
    homes = _homes(remote)
    tool = ensure_tools(remote, ("agent", "hostws"))["agent"]  # one package: the agent and the workspace tool

    current = status(session)
    if current.state in ACTIVE_JOB_STATES:
        raise JobError(f"job {plan.job} is already running; stop it first (clusterctl stop)")

    say("verifying workspaces")
    drift = verify(session)
    problems = [
        f"{h.label}: workspace {'not dispatched' if not d['path'] else d['path'] + ' ' + d['problem']} since the last dispatch"
        for h, items in drift.items()
        for d in items
    ]
    if problems:
        raise JobError("workspace drift; run clusterctl dispatch first:\n" + "\n".join(problems))

    token = secrets.token_hex(16)
    files = job_files(plan, homes, token)
    hosts = list(files)  # with launcher: mpi, only the first host
    paths = {h: posixpath.join(homes[h], STATE_ROOT, plan.job, "job.json") for h in hosts}
    say("writing job files")
    remote.run(
        lambda h: f"umask 077 && mkdir -p {quote(posixpath.dirname(paths[h]))} && cat > {quote(paths[h])}",
        hosts=hosts,
        stdin=lambda h: [json.dumps(files[h]).encode()],
        timeout=remote.control_timeout,
        what="writing job files",
    )
    if plan.mpi is not None:
        hostfile = posixpath.join(homes[plan.mpi.host], plan.mpi.hostfile_path)
        remote.run(f"cat > {quote(hostfile)}", hosts=[plan.mpi.host], stdin=plan.mpi.hostfile.encode(),
                   timeout=remote.control_timeout, what="writing the MPI hostfile")
    say("preflight")
    problems = preflight(session, tool, paths)
    if problems:
        raise JobError("preflight failed, nothing started:\n" + "\n".join(problems))

    say("launching")
    results = remote.run(
        lambda h: _agent_cmd("launch", paths[h]), hosts=hosts, check=False, timeout=WAIT_PSERVERS_S + 60, what="launch"
    )
    failed = {h: r for h, r in results.items() if r.exit_code != 0}
    if failed:
        reasons = [f"{h.label}: {_parse(r).get('error') or r.stderr.strip()}" for h, r in failed.items()]
        try:
            stop(session)
        except RemoteError as exc:
            reasons.append(f"(cleanup also failed: {exc})")
        raise JobError("start failed; everything started was stopped, logs kept:\n" + "\n".join(reasons))
    return status(session)


def logs(
    session: Session,
    *,
    on_line: LineCallback,
    follow: bool = False,
    role: str | None = None,
    id: int | None = None,
    host: str | None = None,
    lines: int | None = None,
) -> dict[Host, int]:
    """Stream `[host role.id] line` from every selected log; with follow, until the job ends everywhere."""
    plan, remote = session.plan, session.remote
    def wanted(p) -> bool:
        return role in (None, p.role) and id in (None, p.id)

    if plan.mpi is not None:  # every rank's output goes to mpiexec's log on the first host, as trainer.0
        targets = [plan.mpi.host] if host in (None, plan.mpi.host.address, plan.mpi.host.label) and role != "pserver" else []
    else:
        targets = [h for h in plan.hosts if host in (None, h.address, h.label) and any(map(wanted, plan.on_host(h)))]
    if not targets:
        what = " ".join(f"{k}={v}" for k, v in (("host", host), ("role", role), ("id", id)) if v is not None)
        raise JobError(f"no process of job {plan.job} matches {what}")
    installed = install_on(remote, ("agent",), targets)  # a host down: the others' logs still come
    missing = [f"{h.label}: {(r.error() or r.stderr.strip() or f'exit {r.exit_code}')}" for h, r in installed.items()
               if not r.ok]
    targets = [h for h in targets if installed[h].ok]
    if not targets:
        raise JobError("logs: no host could be asked:\n" + "\n".join(missing))

    def cmd(h: Host) -> str:
        args = ["logs", _jobdir(plan), "--host-label", h.label]
        if follow:
            args.append("--follow")
        if role:
            args += ["--role", role]
        if id is not None:
            args += ["--id", str(id)]
        if lines is not None:
            args += ["-n", str(lines)]
        return _agent_cmd(*args)

    problems: list[str] = []

    def relay(h: Host, stream: str, line: str) -> None:
        if line.startswith("{"):  # the agent's own JSON message, not a log line
            try:
                problems.append(f"{h.label}: {json.loads(line).get('error', line)}")
                return
            except ValueError:
                pass
        on_line(h, stream, line)

    # a follow ends with the job; a plain read of (possibly large) logs gets a generous deadline
    results = remote.run(cmd, hosts=targets, on_line=relay, check=False, timeout=None if follow else 10 * remote.control_timeout,
                         what="logs")
    unreachable = [f"{h.label}: {r.stderr.strip()}" for h, r in results.items() if r.unreachable]
    if len(problems) == len(targets) and problems:
        raise JobError(f"job {plan.job} has no logs on any host (never started?)")
    if problems or unreachable or missing:
        raise JobError("logs incomplete:\n" + "\n".join(problems + unreachable + missing))
    return {h: r.exit_code for h, r in results.items()}
