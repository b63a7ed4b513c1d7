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

from ..errors import HostFailure, JobError, RemoteError
from ..plan import Host, JobPlan, factor_env
from ..quoting import join, quote
from ..remote import LineCallback
from ..host.jobfile import build_job, coordinator_entry, parse_endpoint, process_entry
from ..host.record import replace
from ..host.states import JobState, ProcState
from ..host.status import HostStatus, JobStatus, ProcessStatus, overall_state
from ..progress import clean_progress, stragglers
from . import Session
from .control import MAX_CONTROL_REPLY, NEEDS_PACKAGE, Direct, Enough, agent_reply, ask, control_command, forget, remember
from .elasticview import attempt_answered, forget_left, in_attempt, latest_view, left_enough, note_left
from .hosttools import ensure_tools, package_dir, tool_argv
from ..host.jobfile import elastic_entry, with_elastic  # elastic jobs (hosts[].spare, job.min_hosts)

__all__ = ["STATE_ROOT", "job_files", "start", "status", "fold_status", "not_its_own",
           "bounded_reply", "progress_rows", "job_stragglers", "shown_value", "stop", "logs", "JobStatus",
           "ProcessStatus", "overall_state"]

STATE_ROOT = ".clusterctl/jobs"  # relative to each host's home
WAIT_PSERVERS_S = 120.0


def _abs(home: str | None, path: str) -> str:
    return path if home is None or posixpath.isabs(path) else posixpath.join(home, path)


def job_files(plan: JobPlan, homes: dict[Host, str] | None, token: str) -> dict[Host, dict]:
    """The agent's job file for every host that runs processes (pure): ordering, coordinator, paths made
    absolute against `homes` (None: left relative to each host's home, which `agent up` resolves there).

    Built with clusterctl/host/jobfile.py's `build_job`, which checks each file with the agent's own validator.
    """
    homes = homes if homes is not None else dict.fromkeys(plan.hosts)
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
            _abs(home, STATE_ROOT),
            plan.policy,
            start_trainers_after={"endpoints": pserver_eps, "timeout": WAIT_PSERVERS_S} if pserver_eps else None,
            coordinator=coordinator_entry(
                ctl_addr, int(ctl_port), token, host == plan.members[0], len(plan.hosts), len(plan.trainers)
            ),
            env=shared_env,
            auth=plan.auth,
            token=token,
        )
    if plan.elastic is not None:  # spares too: any host may run its part of a later attempt (host/elastic.py)
        e = plan.elastic
        section = elastic_entry(None, e["hosts"], e["job"], e["members"], e["spares"], e["min_hosts"],
                                e["max_host_changes"], e["host_change_window"], e["workdir"], e["log_dir"])
        files = dict(zip(files, with_elastic([(job, host.index) for host, job in files.items()], section)))
    return files


def _mpi_job_file(plan: JobPlan, home: str | None, token: str) -> dict:
    """`launcher: mpi`: the first host supervises one process, mpiexec, run from the home directory."""
    mpi = plan.mpi
    first = plan.trainers[0]
    env = dict(mpi.env)  # mpiexec passes these to every rank by name (-genvlist / -x NAME)
    return build_job(
        plan.job,
        mpi.host.address,
        [process_entry("trainer", 0, mpi.argv, env, home or ".", _abs(home, plan.log_path(first)))],
        _abs(home, STATE_ROOT),
        plan.policy,
        auth=plan.auth,
        token=token,
    )


# ------------------------------------------------------------------------------------------ status


def _jobdir(plan: JobPlan) -> str:
    # relative to the home directory, where every ssh session starts
    return posixpath.join(STATE_ROOT, plan.job)


def _agent_cmd(*args: str) -> str:
    return join(tool_argv("agent", list(args)))


def status(session: Session) -> JobStatus:
    """Every process's state on every host; unreachable hosts are reported, not fatal. Each host's supervisor
    answers over its control socket (no Python start on the host); where none runs, the agent reads the state
    files (clusterctl/ops/control.py)."""
    plan, remote = session.plan, session.remote
    jobdir = _jobdir(plan)
    # `agent top --progress-only`: `agent status`'s reply plus each process's progress from its log (no sampling)
    args, agent = {"progress_only": True}, ["top", jobdir, "--progress-only"]
    results = ask(remote, control_command(jobdir, "top", args, agent), timeout=remote.control_timeout,
                  what="status", direct=Direct(plan.job, "top", args, agent),
                  enough=Enough(attempt_answered(plan, not_its_own)) if plan.min_hosts is not None else None)
    replies: dict[str, dict] = {}
    unreachable: dict[str, str] = {}
    for host, res in results.items():
        if not res.answered:  # not reached, or its command never answered (our deadline)
            unreachable[host.label] = res.stderr.strip()[-300:]  # ssh's words (or a host's flood: the end of it)
        elif "state" in (reply := agent_reply(res)):
            replies[host.label] = reply
        else:  # no status at all (the agent failed; a reply garbled, or over its bound): that host's, said, not dropped
            unreachable[host.label] = f"no status: {str(reply.get('error') or 'a reply without a state')[-300:]}"
    st = fold_status(plan.job, replies, unreachable, {h.label: h.address for h in plan.hosts},
                     elastic_job=plan.min_hosts is not None, placed=placement(plan))
    if plan.min_hosts is not None:  # the hosts the job left, for `logs` (elasticview.left_enough)
        note_left(plan, st, [h for h, r in results.items() if r.answered])
    return st


def placement(plan) -> dict[str, frozenset] | None:
    """Host label -> the (role, id) of the processes the plan places there: what that host's replies may report.
    None where a host's rows are not the plan's to check: an elastic job lays its ranks out again on the hosts left,
    and under mpiexec the job file holds mpiexec alone."""
    if plan.min_hosts is not None or plan.mpi is not None:
        return None
    placed: dict[str, set] = {h.label: set() for h in plan.hosts}
    for p in plan.processes:
        placed.setdefault(p.host.label, set()).add((p.role, p.id))
    return {label: frozenset(ids) for label, ids in placed.items()}


def fold_status(job: str, replies: dict[str, dict], unreachable: dict[str, str],
                addresses: dict[str, str] | None = None, *, elastic_job: bool = False,
                placed: dict[str, frozenset] | None = None) -> JobStatus:
    """The job's status from every host's `agent status` reply (host label -> reply) and the hosts that did
    not answer (label -> why), whatever started the supervisors (pure). Only well-typed fields of a reply are
    read (HostStatus.from_json); progress in the replies (`agent top --progress-only`) is kept per process,
    and the job's stragglers found from it. An elastic job's state is its current attempt's hosts' (the view
    of the latest attempt, the coordinator's first: `addresses` maps labels to the addresses it names): a host
    lost and replaced, or one that waits idle, neither decides it nor gives its reason; its rows are shown.

    A view is a host's word about the others, so it is read only where the plan is elastic (`elastic_job`), and
    only one that names the plan's hosts alone and its sender among them: a host (possibly compromised) cannot
    take another host's failure out of a job's state by sending a view that leaves that host out. Nor can it report
    rows of processes the plan placed elsewhere (`placed`: placement), which would show as another host's, or, with
    step rates of its choosing, make another host's trainer a straggler."""
    unreachable = dict(unreachable)
    parsed = {}
    for label, data in replies.items():
        reply = HostStatus.from_json(data)
        wrong = not_its_own(reply, job, (addresses or {}).get(label), None if placed is None else placed.get(label))
        if wrong:  # that host's word is not this job's status on it: said, in one line, as a reply without a state
            unreachable[label] = f"no status: {wrong}"
        else:
            parsed[label] = bounded_reply(reply)
    known = set((addresses or {}).values()) if addresses else set(parsed) | set(unreachable)
    elastic = latest_view(parsed, addresses, known) if elastic_job else None
    counts = in_attempt(elastic, addresses)
    procs: list[ProcessStatus] = []
    host_states: list[str] = [JobState.LOST for label in unreachable if counts(label, None)]
    reasons: dict[str, list[str]] = {}  # a reason -> the hosts that give it: the job's verdict is every host's word
    attempt, restarts, attempts, attempts_total = 0, 0, [], 0
    for label, reply in parsed.items():
        if not counts(label, reply.host):  # an elastic job's host that is not in its current attempt
            procs.extend(reply.process_status(label))
            continue
        # a failed attempt being stopped reads `restarting` when another follows
        host_states.append(reply.folded_state)
        restarts = max(restarts, reply.restarts)
        # the host that got furthest knows the most attempts (the coordinator, unless it was cut off)
        if (reply.attempt, reply.attempts_total) > (attempt, attempts_total):
            attempt, attempts, attempts_total = reply.attempt, reply.attempts, reply.attempts_total
        if reply.reason and reply.state not in (JobState.RUNNING, JobState.SUCCEEDED):
            reasons.setdefault(reply.reason[:MAX_WORDS], []).append(label)
        procs.extend(progress_rows(reply, label))
    procs.sort(key=lambda p: (p.role != "pserver", p.id))
    found = job_stragglers(procs)
    state = overall_state(host_states)
    down = [label for label in unreachable if counts(label, None)]
    said = [f"{', '.join(by) if len(by) <= 3 else f'{by[0]}, {by[1]} and {len(by) - 2} more hosts'}: {text}"
            for text, by in reasons.items()]
    reason = "; ".join(said) or ("unreachable: " + ", ".join(down) if down else None)
    return JobStatus(job, state, reason, procs, dict(unreachable), attempt, restarts, [a.summary() for a in attempts],
                     stragglers=found, elastic=elastic)


def progress_rows(reply: HostStatus, label: str) -> list[ProcessStatus]:
    """A reply's process rows, each with the progress the reply gives it (`agent top --progress-only`), cleaned."""
    return [replace(row, progress=clean_progress(raw.get("progress")))
            for row, raw in zip(reply.process_status(label), reply.processes)]


def job_stragglers(procs: list[ProcessStatus]) -> list[dict]:
    """The running trainers the straggler rule marks, wherever they run ({host, process, rate, median, ratio});
    the rows' rate slices, which only the rule reads, are dropped from them."""
    slow = stragglers({i: p.progress for i, p in enumerate(procs) if p.role == "trainer" and p.state == "running"})
    for p in procs:
        if p.progress is not None:
            p.progress.pop("slices", None)
    return [{"host": procs[i].host, "process": f"{procs[i].role}.{procs[i].id}", **v} for i, v in sorted(slow.items())]


# What `status` takes of a host's reply beyond the types HostStatus.from_json checks (a host may be compromised):
# states clusterctl knows, numbers a process can have, words of a bounded length. A state of a host's own making
# became the job's (overall_state sorts what it does not know), a 300-digit pid, exit code or attempt widened the
# table past any terminal, and a reason of megabytes was one line.
MAX_PID = 1 << 22  # Linux's PID_MAX_LIMIT
MAX_COUNT = 1 << 20  # process ids, attempts, restarts
MAX_UPTIME_S = 1e9  # 31 years
MAX_WORDS = 500  # characters of a host's reason or error
MAX_ATTEMPTS_SHOWN = 64  # a supervisor keeps its last ATTEMPTS_KEPT (20)
_JOB_STATES = frozenset(JobState)
_PROC_STATES = frozenset(ProcState)


def shown_value(value) -> str:
    text = value if isinstance(value, str) else str(value)
    return repr(text[:60] + ("..." if len(text) > 60 else ""))  # repr: control characters escaped


def not_its_own(reply: HostStatus, job: str | None = None, address: str | None = None,
                placed: frozenset | None = None) -> str | None:
    """Why a host's status reply is not its word on `job` at `address` (None: it is): a state clusterctl does not
    know, a reply that names another job or another host (a compromised host answering for another; a state
    directory copied from elsewhere), or a process row the plan did not place there (`placed`: its (role, id)s)."""
    if reply.state not in _JOB_STATES:
        return f"a job state clusterctl does not know: {shown_value(reply.state)}"
    if job is not None and reply.job is not None and reply.job != job:
        return f"a reply for job {shown_value(reply.job)}, not {job}"
    if address is not None and reply.host is not None and reply.host != address:
        return f"a reply for host {shown_value(reply.host)}, not {address}"
    if placed is not None:
        for row in reply.processes:
            if (row["role"], row["id"]) not in placed:
                return (f"a row for {shown_value(row['role'])[1:-1]}.{row['id']}, which the plan does not place on "
                        f"this host (was the spec changed since the job started?)")
    return None


def _within(value, lo, hi):
    return value if value is not None and lo <= value <= hi else None


def bounded_reply(reply: HostStatus) -> HostStatus:
    """`reply` with what no supervisor sends left out: process rows of an id past MAX_COUNT, pids, exit codes and
    uptimes out of range (blank), process states clusterctl does not know (`unknown`), attempts and restarts past
    MAX_COUNT (0), roles cut at 32 characters, reasons and errors at MAX_WORDS."""
    rows = []
    for p in reply.processes:
        if not 0 <= p["id"] <= MAX_COUNT:
            continue
        p = dict(p)
        for key, lo, hi in (("pid", 1, MAX_PID), ("exit_code", -255, 255), ("uptime_s", 0, MAX_UPTIME_S)):
            if key in p and not (isinstance(p[key], (int, float)) and _within(p[key], lo, hi) is not None):
                p[key] = None
        if not (isinstance(p.get("state"), str) and p["state"] in _PROC_STATES):  # a list or dict: no hash
            p["state"] = "unknown"
        p["role"] = p["role"][:32]
        if isinstance(p.get("error"), str):
            p["error"] = p["error"][:MAX_WORDS]
        rows.append(p)
    attempts = [replace(a, reason=a.reason[:MAX_WORDS] if a.reason else a.reason,
                        outcome=a.outcome if a.outcome in _JOB_STATES else None)
                for a in reply.attempts[-MAX_ATTEMPTS_SHOWN:] if 0 <= a.attempt <= MAX_COUNT]
    reply.processes, reply.attempts = rows, attempts
    reply.reason = reply.reason[:MAX_WORDS] if reply.reason else reply.reason
    reply.attempt = _within(reply.attempt, 0, MAX_COUNT) or 0
    reply.restarts = _within(reply.restarts, 0, MAX_COUNT) or 0
    reply.attempts_total = _within(reply.attempts_total, 0, MAX_COUNT) or len(attempts)
    return reply


def stop(session: Session, *, grace: float | None = None, hosts: list[Host] | None = None) -> dict[Host, dict]:
    """Stop the job everywhere (or on `hosts`): SIGTERM, SIGKILL after grace, sweep by CLUSTERCTL_JOB. Idempotent.
    A running supervisor stops its processes itself and answers over its control socket; where none runs, the
    agent stops what is left (clusterctl/ops/control.py)."""
    plan, remote = session.plan, session.remote
    g = plan.grace if grace is None else grace
    jobdir = _jobdir(plan)
    args, agent = {"grace": g}, ["stop", jobdir, "--grace", f"{g:g}", "--job", plan.job]
    results = ask(remote, control_command(jobdir, "stop", args, agent), hosts=hosts, timeout=g + 60, what="stop",
                  direct=Direct(plan.job, "stop", args, agent))
    failures = [HostFailure(h.label, r.command, r.exit_code, r.stderr) for h, r in results.items() if r.exit_code not in (0, 1)]
    parsed = {h: agent_reply(r) for h, r in results.items()}
    # exit 1 (the agent) or `ok: false` (either): processes survived SIGKILL, or no reply said the stop happened
    failures += [
        HostFailure(h.label, results[h].command, 1,
                    (d["error"] if isinstance(d.get("error"), str) else "") or json.dumps(d.get("left", ""))[:500])
        for h, d in parsed.items()
        if results[h].exit_code in (0, 1) and (results[h].exit_code == 1 or d.get("ok") is False)
    ]
    if failures:
        failed = {f.host for f in failures}  # the others' Results go with the error: what the stop did there
        raise RemoteError(failures, {h: r for h, r in results.items() if h.label not in failed}, what="stop")
    forget(plan.job, hosts)  # their supervisors have ended
    return parsed


def _up_command() -> str:
    up = join(tool_argv("agent", ["up"], quick_exit=True))  # it leaves no thread: the supervisor is a forked daemon
    return f"{{ test -d {quote(package_dir())} || exit {NEEDS_PACKAGE}; }} && {up}"


def _up_docs(plan: JobPlan, token: str) -> dict[Host, bytes]:
    """The `agent up` document for every host that runs a supervisor (pure): its job file (paths relative to
    its home), the workspace to check, and the files to write first."""
    files = job_files(plan, None, token)
    docs = {}
    for host, job in files.items():
        doc: dict = {"job": job, "jobdir": _jobdir(plan), "workspace": plan.workdir}
        if plan.mpi is not None and host == plan.mpi.host:
            doc["files"] = {plan.mpi.hostfile_path: plan.mpi.hostfile}
        docs[host] = json.dumps(doc).encode()
    return docs


def _up_reply(res) -> dict:
    """`agent up`'s reply, with only the fields `start` reads and each of the type the agent writes (the host
    may be compromised: a field of another type is left out, so a failure falls back to the host's stderr or
    exit code instead of a traceback)."""
    raw = agent_reply(res) if res.answered else {}
    out = {k: raw[k] for k, kind in (("stage", str), ("error", str), ("pids", dict), ("status", dict),
                                      ("control", dict)) if isinstance(raw.get(k), kind)}
    if isinstance(raw.get("drift"), list):
        out["drift"] = [{"path": d["path"], "problem": str(d.get("problem"))} for d in raw["drift"]
                        if isinstance(d, dict) and isinstance(d.get("path"), str)]
    if isinstance(raw.get("problems"), list):
        out["problems"] = [{"message": p["message"] if isinstance(p, dict) and isinstance(p.get("message"), str)
                            else str(p)} for p in raw["problems"]]
    return out


def _drift_line(host: Host, d: dict) -> str:
    """One line of a host's workspace drift: a path and what happened to it, or (no path) no workspace yet."""
    if not d.get("path"):
        return f"{host.label}: no workspace dispatched yet"
    return f"{host.label}: workspace {d['path']} {d.get('problem')} since the last dispatch"


def _reason(host: Host, res, reply: dict) -> str:
    stage = reply.get("stage")
    if stage == "workspace":
        items = reply.get("drift") or []
        if not items:  # a host that says so without saying what (the agent always lists the paths)
            return f"{host.label}: workspace differs from its last dispatch"
        return "\n".join(_drift_line(host, d) for d in items[:20])
    if stage == "preflight":
        return "\n".join(f"{host.label}: {p['message']}" for p in reply.get("problems") or [])
    if res.answered and res.exit_code == 0 and stage is None:  # exit 0, but no launch report (agent_reply's words)
        said = (reply.get("error") or res.stdout.strip() or res.stderr.strip())[-200:]
        return f"{host.label}: `agent up` exited 0 without its report" + (f" (it printed: {said})" if said else "")
    return f"{host.label}: {reply.get('error') or (res.error() if not res.answered else None) or res.stderr.strip() or f'exit {res.exit_code}'}"


def start(session: Session, *, on_progress: Callable[[str], None] | None = None) -> JobStatus:
    """One round trip per host (`agent up`: not already running, workspace as dispatched, job file, preflight,
    launch); on any host's failure, stop what this start launched and say why, host by host."""
    plan, remote = session.plan, session.remote
    say = on_progress or (lambda msg: None)
    token = secrets.token_hex(16)
    docs = _up_docs(plan, token)
    hosts = list(docs)  # with launcher: mpi, only the first host runs a supervisor (mpiexec)
    others = [h for h in plan.hosts if h not in docs]
    drift: dict = {}
    if others:  # mpiexec's ranks run in the other hosts' workspaces: check them as well
        from .dispatch import verify

        say("verifying workspaces")
        drift = {h: items for h, items in verify(session, hosts=others).items() if items}
    if drift:
        problems = [_drift_line(h, d) for h, items in drift.items() for d in items]
        raise JobError("workspace drift; run clusterctl dispatch first:\n" + "\n".join(problems))
    say("launching")
    timeout = WAIT_PSERVERS_S + 60
    results = remote.run(_up_command(), hosts=hosts, stdin=lambda h: [docs[h]], check=False, timeout=timeout,
                         what="start", max_output=MAX_CONTROL_REPLY)
    missing = [h for h, r in results.items() if r.exit_code == NEEDS_PACKAGE]
    if missing:  # the first start with this version of clusterctl on these hosts: upload the host package once
        say("installing clusterctl's host package")
        ensure_tools(remote, ("agent",), missing)
        results.update(remote.run(_up_command(), hosts=missing, stdin=lambda h: [docs[h]], check=False,
                                  timeout=timeout, what="start", max_output=MAX_CONTROL_REPLY))
    replies = {h: _up_reply(r) for h, r in results.items()}
    endpoints = {h: replies[h].pop("control") for h in hosts if "control" in replies[h]}
    # launched is what the agent says (`stage`), not an exit 0 alone: a host that answered nothing runs no supervisor
    failed = {h: r for h, r in results.items() if r.exit_code != 0 or replies[h].get("stage") != "launched"}
    if failed:
        reasons = [_reason(h, r, replies[h]) for h, r in failed.items()]
        # stop what this start launched, and only that: a host that refused because the job already runs
        # there keeps running it
        launched = [h for h in hosts if replies[h].get("stage") in ("launched", "launch")]
        if launched:
            try:
                stop(session, hosts=launched)
            except RemoteError as exc:
                reasons.append(f"(cleanup also failed: {exc})")
        # with every host's supervisor waiting for the others before it starts anything, a start that failed
        # somewhere started no process: the launch reports say which processes did start
        started = any(replies[h].get("pids") for h in launched)
        stages = {replies[h].get("stage") for h in failed}
        if stages == {"running"}:
            raise JobError(f"job {plan.job} is already running; stop it first (clusterctl stop):\n" + "\n".join(reasons))
        if stages == {"workspace"}:
            what = "workspace drift; run clusterctl dispatch first" + (" (everything started was stopped)" if started else "")
        else:
            what = "preflight failed" if stages == {"preflight"} else "start failed"
            what += "; everything started was stopped, logs kept" if started else ", nothing started"
        raise JobError(what + ":\n" + "\n".join(reasons))
    # each supervisor's control endpoint (checked by control.remember): later commands on this controller ask the
    # supervisors straight through the kept connections
    remember(plan.job, endpoints)
    forget_left(plan.job)  # a new job: no host left yet
    return fold_status(plan.job, {h.label: replies[h].get("status") or {} for h in hosts}, {},
                       {h.label: h.address for h in plan.hosts}, elastic_job=plan.min_hosts is not None)


# what `logs` keeps of a host's words beside its log lines (a host may send any number of them)
MAX_NOTES = 200  # stderr lines shown; the rest counted
MAX_SAID = 5  # the agent's error messages; the rest counted
MAX_SAID_CHARS = 2000  # of each


def own_log_line(label: str, line: str) -> str:
    """A log line from the host labelled `label`, as shown: the host side starts each one `[LABEL role.id] `
    (clusterctl/host/logtail.py); any other line is shown under `[LABEL] `, so that a host (possibly compromised)
    cannot pass its lines off as another host's."""
    return line if line.startswith(f"[{label} ") else f"[{label}] {line}"


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
        # an elastic job's processes may have moved (a spare that took a lost host's place has logs): every host
        targets = [h for h in plan.hosts if host in (None, h.address, h.label)
                   and (plan.elastic is not None or any(map(wanted, plan.on_host(h))))]
    if not targets:
        what = " ".join(f"{k}={v}" for k, v in (("host", host), ("role", role), ("id", id)) if v is not None)
        raise JobError(f"no process of job {plan.job} matches {what}")

    def asked(h: Host) -> tuple[dict, list[str]]:
        """The supervisor's request for host `h`, and the agent's argv where no supervisor answers."""
        args: dict = {"host_label": h.label}
        agent = ["logs", _jobdir(plan), "--host-label", h.label]
        if follow:
            args["follow"] = True
            agent.append("--follow")
        if role:
            args["role"] = role
            agent += ["--role", role]
        if id is not None:
            args["id"] = id
            agent += ["--id", str(id)]
        if lines is not None:
            args["lines"] = lines
            agent += ["-n", str(lines)]
        return args, agent

    def cmd(h: Host) -> str:
        return control_command(_jobdir(plan), "logs", *asked(h))

    # the last lines, a bounded answer, straight from the supervisors this controller started (whole logs and a
    # follow are streams: by the line, which passes each line on as it comes)
    direct = Direct(plan.job, "logs", lambda h: asked(h)[0], lambda h: asked(h)[1]) \
        if lines is not None and not follow else None

    problems: list[str] = []
    unmatched: list[str] = []  # elastic: hosts that ran no such process (a spare, a host left out)
    said: dict[Host, int] = {}  # hosts whose agent said why it failed (its JSON messages), how many times
    notes: dict[Host, list[str]] = {}  # stderr: the agent's notes, or ssh's own words for a host it never reached
    more: dict[Host, int] = {}  # stderr lines past MAX_NOTES: counted (a host may send any number of them)

    def relay(h: Host, stream: str, line: str) -> None:
        if stream != "out":  # held until the host's outcome is known (a failure is said once, below)
            kept = notes.setdefault(h, [])
            if len(kept) < MAX_NOTES:
                kept.append(line)
            else:
                more[h] = more.get(h, 0) + 1
            return
        if not line:  # a follower's keepalive (clusterctl/host/logtail.py): every log line has its prefix
            return
        if line.startswith("{"):  # the agent's own JSON message, not a log line
            try:
                message = json.loads(line)
            except (ValueError, RecursionError):  # a host may send anything: nested 50,000 deep, say
                message = None
            error = str(message.get("error", line)) if isinstance(message, dict) else None
            if error is not None:
                said[h] = said.get(h, 0) + 1
                if said[h] > MAX_SAID:  # the agent says why once; a host that says it without end is counted
                    return
                if plan.elastic is not None and error.startswith("no process matches"):
                    unmatched.append(h.label)
                else:
                    problems.append(f"{h.label}: {error[:MAX_SAID_CHARS]}")
                return
        on_line(h, stream, own_log_line(h.label, line))

    # a running supervisor streams them over its control socket, elsewhere the agent reads the files; a follow
    # ends with the job, a plain read of (possibly large) logs gets a generous deadline
    results = ask(remote, cmd, hosts=targets, on_line=relay, timeout=None if follow else 10 * remote.control_timeout,
                  what="logs", direct=direct, enough=left_enough(plan, targets))
    # not reached, no host package to be had (no python3), timed out, or the agent failed (2: its JSON error above)
    unreachable = [f"{h.label}: {r.error() or r.stderr.strip() or f'exit {r.exit_code}'}" for h, r in results.items()
                   if not r.answered or r.exit_code not in (0, 2)]
    unreachable += [f"{h.label}: exit 2 without the agent's message" for h, r in results.items()
                    if r.answered and r.exit_code == 2 and h not in said]  # a host that failed without saying why
    for h, lines_ in notes.items():
        if results[h].answered:
            for line in lines_:  # under the host's label too: which host said it, and never another's
                on_line(h, "err", own_log_line(h.label, line))
            if more.get(h):
                on_line(h, "err", own_log_line(h.label, f"[clusterctl: {more[h]:,} more stderr lines not shown]"))
    problems += [f"{h.label}: {n - MAX_SAID:,} more error messages" for h, n in said.items() if n > MAX_SAID]
    if len(problems) == len(targets) and problems:
        raise JobError(f"job {plan.job} has no logs on any host (never started?)")
    if unmatched and len(unmatched) + len(problems) == len(targets) and not problems:
        what = " ".join(f"{k}={v}" for k, v in (("host", host), ("role", role), ("id", id)) if v is not None)
        raise JobError(f"no process of job {plan.job} matches {what or 'anything'}")
    if unreachable and len(unreachable) == len(targets) and not problems:
        raise JobError("logs: no host could be asked:\n" + "\n".join(unreachable))
    if problems or unreachable:
        raise JobError("logs incomplete:\n" + "\n".join(problems + unreachable))
    return {h: r.exit_code for h, r in results.items()}
