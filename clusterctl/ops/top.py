"""`top`: every process of a running job with what it uses (CPU, memory, GPUs) and how far it got, per host.

Each host's supervisor samples its own processes and replies with the job's status plus the figures, over its
control socket (clusterctl/host/control.py: no Python start on the host); where none runs, `agent top`
(clusterctl/host/topsnap.py) answers from the state files. How a host is asked is its backend's (`top_asks`):
over SSH (and on this machine) each host on its own (`ssh_asks` here); under Slurm every node in one `srun
--overlap` step (clusterctl/ops/slurm.py); under Kubernetes each pod with `kubectl exec`. This module folds the
answers into one `Snapshot` (a row per process, totals per host, the stragglers among the ranks) and keeps going
when hosts do not answer: a host is asked again only once its previous answer is in, and one that cannot be
reached is a row that says so.

A refresh over SSH sends a command line, not the package: a host whose fallback needs this version of the host
package and lacks it gets it once (clusterctl/ops/control.py `ask`). Replies are taken through allow-lists with
bounds (a host may be compromised).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import asdict, dataclass, field
from functools import partial

from ..errors import ClusterctlError, UsageError
from ..host.states import JobState
from ..host.status import HostStatus, overall_state
from ..plan import Host
from ..progress import (STRAGGLER_SLICES, STRAGGLER_THRESHOLD, STRAGGLER_WINDOW_S, clean_progress, stragglers)
from . import Session
from .control import Direct, Enough, ask, control_command, over_bound
from .elasticview import attempt_answered, in_attempt, latest_view
from .job import STATE_ROOT, not_its_own, placement, shown_value

_JOB_STATES = frozenset(JobState)

__all__ = ["ProcRow", "HostRow", "Snapshot", "Top", "TopRequest", "TopAnswer", "TopAsk", "answer_of", "ssh_asks",
           "DEFAULT_INTERVAL", "MIN_INTERVAL"]

DEFAULT_INTERVAL = 2.0  # seconds between refreshes (docs/benchmarks.md: what one costs)
MIN_INTERVAL = 0.5
MAX_GPUS = 64


@dataclass
class ProcRow:
    """One process (or one rank of a log that several ranks share, `rank` set) as its host reported it."""

    host: str
    role: str
    id: int
    pid: int | None
    state: str
    exit_code: int | None = None
    rank: str | None = None
    cpu_pct: float | None = None
    rss_bytes: int | None = None
    procs: int | None = None
    gpus: list = field(default_factory=list)  # [{index, util_pct, mem_used_mib, mem_total_mib}]
    gpu_mem_mib: float | None = None
    progress: dict | None = None  # {step, rate, done, metrics, age_s}
    straggler: dict | None = None  # {rate, median, ratio}

    @property
    def name(self) -> str:
        """`trainer.0`, or `trainer.0 rank 3`."""
        return f"{self.role}.{self.id}" + (f" rank {self.rank}" if self.rank is not None else "")


@dataclass
class HostRow:
    """One host: whether it answered, its own figures, and the sums over the job's processes on it."""

    host: str
    status: str  # ok | unreachable | no job | error | waiting
    error: str | None = None
    age_s: float | None = None  # since its last answer
    state: str | None = None  # the job's state on this host
    ncpu: int | None = None
    load1: float | None = None
    cpu_pct: float | None = None  # the whole host, %
    mem_total: int | None = None
    mem_available: int | None = None
    gpus: list = field(default_factory=list)
    gpu_error: str | None = None
    job_cpu_pct: float | None = None
    job_rss_bytes: int | None = None
    sample_wall_s: float | None = None
    sample_cpu_s: float | None = None


@dataclass
class Snapshot:
    """The whole job at one moment: rows per process, per host, the stragglers, and the rule's settings."""

    job: str
    state: str
    rows: list  # [ProcRow]
    hosts: list  # [HostRow]
    stragglers: list  # [{host, process, rank, rate, median, ratio}]
    taken_at: float
    took_s: float
    interval: float | None = None
    threshold: float = STRAGGLER_THRESHOLD
    window_s: float = STRAGGLER_WINDOW_S
    elastic: dict | None = None  # an elastic job's view, as `status` reads it (job.latest_view)

    @property
    def unreachable(self) -> list:
        """The hosts that could not be asked (unreachable, timed out)."""
        return [h for h in self.hosts if h.status == "unreachable"]

    def to_json(self) -> dict:
        """JSON form for `clusterctl top --json`."""
        return {"job": self.job, "state": self.state, "taken_at": self.taken_at, "took_s": self.took_s,
                "interval": self.interval, "straggler_rule": {"threshold": self.threshold, "window_s": self.window_s},
                "stragglers": self.stragglers, "hosts": [asdict(h) for h in self.hosts],
                "processes": [dict(asdict(r), name=r.name) for r in self.rows], "elastic": self.elastic}


# ------------------------------------------------------------------------------------ replies (pure)

def _num(x, lo: float = 0.0, hi: float = math.inf) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) and lo <= x <= hi else None


def _int(x, lo: int = 0, hi: int = 2**63) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi else None


def _str(x, limit: int = 64) -> str | None:
    return x[:limit] if isinstance(x, str) else None


def _gpus(items) -> list:
    out = []
    for g in (items if isinstance(items, list) else [])[:MAX_GPUS]:
        if isinstance(g, dict) and _int(g.get("index"), 0, 4096) is not None:
            out.append({"index": g["index"], "util_pct": _num(g.get("util_pct"), 0, 100),
                        "mem_used_mib": _num(g.get("mem_used_mib")), "mem_total_mib": _num(g.get("mem_total_mib"))})
    return out


def rows_of(label: str, reply: dict) -> list[ProcRow]:
    """The process rows of one host's `agent top` reply (pure; every field checked)."""
    rows = []
    procs = reply.get("processes")
    for p in procs if isinstance(procs, list) else []:
        if not isinstance(p, dict) or _str(p.get("role")) is None or _int(p.get("id")) is None:
            continue
        res = p.get("resources") if isinstance(p.get("resources"), dict) else {}
        row = ProcRow(label, p["role"][:16], p["id"], _int(p.get("pid")), _str(p.get("state"), 32) or "?",
                      _int(p.get("exit_code"), -255, 255), None, _num(res.get("cpu_pct")), _int(res.get("rss_bytes")),
                      _int(res.get("procs")), _gpus(res.get("gpus")), _num(res.get("gpu_mem_mib")),
                      clean_progress(p.get("progress")))
        rows.append(row)
        for r in (p.get("ranks") or [])[:256] if isinstance(p.get("ranks"), list) else []:
            prog = clean_progress(r)
            if prog is not None and "rank" in prog:
                rows.append(ProcRow(label, row.role, row.id, None, row.state, None, prog.pop("rank"), progress=prog))
    return rows


def host_row(label: str, reply: dict, rows: list[ProcRow]) -> HostRow:
    """The host's row of a reply: its figures and the sums over its processes (pure)."""
    fig = reply.get("host_figures") if isinstance(reply.get("host_figures"), dict) else {}
    sample = reply.get("sample") if isinstance(reply.get("sample"), dict) else {}
    own = [r for r in rows if r.rank is None]
    cpus = [r.cpu_pct for r in own if r.cpu_pct is not None]
    rss = [r.rss_bytes for r in own if r.rss_bytes is not None]
    return HostRow(label, "ok", _str(reply.get("top_error"), 300), 0.0, _str(reply.get("state"), 32),
                   _int(fig.get("ncpu"), 1, 1 << 20), _num(fig.get("load1")), _num(fig.get("cpu_pct"), 0, 100),
                   _int(fig.get("mem_total")), _int(fig.get("mem_available")), _gpus(fig.get("gpus")),
                   _str(fig.get("gpu_error"), 300), round(sum(cpus), 1) if cpus else None, sum(rss) if rss else None,
                   _num(sample.get("wall_s")), _num(sample.get("cpu_s")))


def mark_stragglers(rows: list[ProcRow], *, threshold: float = STRAGGLER_THRESHOLD,
                    slices: int = STRAGGLER_SLICES) -> list[dict]:
    """Apply the straggler rule to the running trainers' ranks; set each straggler's row and return them."""
    ranks = {i: r.progress for i, r in enumerate(rows)
             if r.role == "trainer" and r.state == "running" and r.progress is not None}
    found = stragglers(ranks, threshold=threshold, slices=slices)
    out = []
    for i in sorted(found):
        rows[i].straggler = found[i]
        out.append({"host": rows[i].host, "process": rows[i].name, "rank": rows[i].rank, **found[i]})
    return out


def job_state(host_states: list[str]) -> str:
    """The job's state from the hosts' (as `status` folds them)."""
    return overall_state(host_states)


# ------------------------------------------------------------------------------------ asking the hosts

@dataclass(frozen=True)
class TopRequest:
    """What every host is asked: the rate slices of the straggler rule, whether to ask nvidia-smi, and how long one
    request may take (None: the backend's own deadline; a backend never waits longer than its own)."""

    slice_s: float
    slices: int
    gpu: bool = True
    timeout: float | None = None
    # one whole snapshot of an elastic SSH job (`top --once`): {"enough": control.Enough} shared by its hosts' asks,
    # so that a host outside the attempt is not waited for once the attempt's hosts answered (as `status`)
    snapshot: dict = field(default_factory=dict, compare=False)

    def agent_args(self, jobdir: str) -> list[str]:
        """`agent top`'s argv after `agent` for the job dir `jobdir`."""
        return ["top", jobdir, "--slice", f"{self.slice_s:g}", "--slices", str(self.slices)] + (
            [] if self.gpu else ["--no-gpu"])

    def control_args(self) -> dict:
        """The supervisor's `top` request over its control socket (clusterctl/host/controlproto.py)."""
        return {"slice": self.slice_s, "slices": self.slices, "gpu": self.gpu}

    def deadline(self, own: float) -> float:
        """The request's deadline under a backend whose own is `own`."""
        return min(own, self.timeout or math.inf)


@dataclass
class TopAnswer:
    """One host's latest answer: its `agent top` reply, or why there is none (and what that says of the job)."""

    at: float  # monotonic time it came
    status: str  # ok | unreachable | no job | error | waiting
    reply: dict | None = None
    error: str | None = None
    state: str | None = None  # not ok: the job's state this host stands for (default: lost when unreachable)


_Answer = TopAnswer  # the name it had


def answer_of(data: dict | None, *, exit_code: int | None = None, output: str = "", job: str | None = None,
              address: str | None = None, placed: frozenset | None = None) -> TopAnswer:
    """A host's TopAnswer from the agent's (or the supervisor's) JSON reply, `data` None when none came; `output`
    is what the host printed instead (its last 300 characters are the error). A reply that is not that host's word
    on `job` at `address` with the processes `placed` there (ops/job.py not_its_own: a state of its own making, a
    reply for another job or host, another host's process rows) is that host's error row, as in `status`."""
    now = time.monotonic()
    if data is None:
        tail = output.strip()[-300:]
        return TopAnswer(now, "error", error=tail or (f"exit {exit_code} without a reply" if exit_code is not None
                                                      else "no reply"))
    if "state" in data and not (isinstance(data["state"], str) and data["state"] in _JOB_STATES):  # else the job's
        return TopAnswer(now, "error", error=f"a job state clusterctl does not know: {shown_value(data['state'])}")
    wrong = not_its_own(HostStatus.from_json(data), job, address, placed)
    if wrong:
        return TopAnswer(now, "error", error=wrong)
    if data.get("ok") is False:
        if data.get("state") == JobState.UNKNOWN and exit_code in (None, 1):
            return TopAnswer(now, "no job", data, _str(data.get("error"), 300))
        return TopAnswer(now, "error", data, _str(data.get("error"), 300) or "failed")
    return TopAnswer(now, "ok", data)


@dataclass(frozen=True)
class TopAsk:
    """One request a backend can have in flight: `call()` asks some hosts (one SSH host; every node of a Slurm job
    in one srun step; one pod) and returns {label: TopAnswer}; `labels` names its rows before it answered."""

    labels: tuple[str, ...]
    call: Callable[[], dict[str, TopAnswer]]


def _ask_ssh_host(session: Session, host: Host, request: TopRequest, placed: frozenset | None = None
                  ) -> dict[str, TopAnswer]:
    """The supervisor's `top` over its control socket (its Sampler kept in memory, nvidia-smi on a thread of its
    own), or `agent top` where no supervisor runs (clusterctl/ops/control.py)."""
    remote = session.remote
    jobdir = f"{STATE_ROOT}/{session.plan.job}"
    timeout = request.deadline(remote.control_timeout)
    args, agent = request.control_args(), request.agent_args(jobdir)
    res = ask(remote, control_command(jobdir, "top", args, agent), hosts=[host], timeout=timeout, what="top",
              direct=Direct(session.plan.job, "top", args, agent), enough=request.snapshot.get("enough"))[host]
    if not res.answered:
        if res.timed_out and res.stderr.startswith("timed out after"):  # not a host the snapshot did not wait for
            why = f"did not answer within {timeout:g}s" + (
                " (ssh.command_timeout)" if timeout == remote.control_timeout else "")
        else:
            why = res.stderr.strip()[-300:] or "no answer"
        return {host.label: TopAnswer(time.monotonic(), "unreachable", error=why)}
    try:  # a reply over MAX_CONTROL_REPLY is not parsed (control.agent_reply)
        data = None if over_bound(res) else res.reply()
    except ClusterctlError:
        data = None
    return {host.label: answer_of(data, exit_code=res.exit_code, output=res.stderr or res.stdout,
                                  job=session.plan.job, address=host.address, placed=placed)}


def ssh_asks(session: Session, request: TopRequest) -> list[TopAsk]:
    """One TopAsk per host of an SSH session (the SSH and local backends'): a slow host holds up only its own row."""
    placed = placement(session.plan)  # each host's processes: the rows its replies may have (once, not per refresh)
    return [TopAsk((h.label,), partial(_ask_ssh_host, session, h, request,
                                       None if placed is None else placed.get(h.label, frozenset())))
            for h in session.plan.hosts]


class Top:
    """Asks every host of a job for its `agent top` reply, at most one request per TopAsk in flight.

    `source` is an ops Session (its SSH hosts, each asked on its own) or a backend: anything with a `plan` and
    `top_asks(request) -> [TopAsk]` (Slurm: one srun step for every node; Kubernetes: one `kubectl exec` per pod).
    `snapshot(wait)` starts every TopAsk that has none running, waits up to `wait` seconds (None: until every one
    has answered or timed out) and folds the latest answer of each host. Use as a context manager (or close())."""

    def __init__(self, source, *, threshold: float = STRAGGLER_THRESHOLD, window_s: float = STRAGGLER_WINDOW_S,
                 slices: int = STRAGGLER_SLICES, gpu: bool = True, request_timeout: float | None = None):
        if not 0 < threshold <= 1:
            raise UsageError(f"top: the straggler threshold must be in (0, 1], not {threshold:g}")
        if not 6 <= window_s <= 180:
            raise UsageError(f"top: the straggler window must be 6 to 180 seconds, not {window_s:g}")
        self.threshold, self.window_s, self.slices, self.gpu = threshold, window_s, slices, gpu
        self.job: str = source.plan.job
        self.plan = source.plan
        # an elastic job's state is its current attempt's hosts' (as `status` folds it): label -> address
        self.elastic_hosts = ({h.label: h.address for h in source.plan.hosts} if source.plan.min_hosts is not None
                              else None)
        # a host's request ends (unreachable) after the backend's deadline (ssh.command_timeout, ...), or this
        self.request = TopRequest(window_s / slices, slices, gpu, request_timeout)
        if isinstance(source, Session):
            self.asks = ssh_asks(source, self.request)
        else:
            self.asks = list(source.top_asks(self.request))
        self._answers: dict[int, dict[str, TopAnswer]] = {}
        self._inflight: dict[int, Future] = {}
        self._closed = False

    def __enter__(self) -> "Top":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop asking. Requests in flight end with their deadline, on daemon threads: the program may exit
        before (a view ended with Ctrl+C does not wait for a host that stopped answering)."""
        self._closed = True

    def _submit(self, ask) -> Future:
        """Run one request on a thread of its own (at most one per TopAsk in flight, so as many as the asks)."""
        fut: Future = Future()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(ask.call())
            except BaseException as exc:  # noqa: BLE001 - handed to snapshot(), which makes it the host's row
                fut.set_exception(exc)

        threading.Thread(target=run, name="top-request", daemon=True).start()
        return fut

    def snapshot(self, wait_s: float | None = None, *, interval: float | None = None) -> Snapshot:
        """Ask every idle TopAsk, wait up to `wait_s` (None: for all; an elastic job's hosts outside its attempt only
        until the attempt's hosts answered, as `status`), and fold the latest answers."""
        t0 = time.monotonic()
        if wait_s is None and self.elastic_hosts is not None and not self._inflight:
            self.request.snapshot["enough"] = Enough(attempt_answered(self.plan, not_its_own))
        for i, a in enumerate(self.asks):
            if i not in self._inflight and not self._closed:
                self._inflight[i] = self._submit(a)
        pending = set(self._inflight.values())
        deadline = None if wait_s is None else t0 + wait_s
        while pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            done, pending = wait(pending, timeout=left, return_when=FIRST_COMPLETED)
        self.request.snapshot.pop("enough", None)
        for i, fut in list(self._inflight.items()):
            if fut.done():
                del self._inflight[i]
                try:
                    self._answers[i] = dict(fut.result())
                except Exception as exc:  # noqa: BLE001 - a bug in one host's request must not end the view
                    now = time.monotonic()
                    self._answers[i] = {label: TopAnswer(now, "error", error=f"{type(exc).__name__}: {exc}")
                                        for label in self.asks[i].labels or ("?",)}
        return self._fold(t0, interval)

    def _fold(self, t0: float, interval: float | None) -> Snapshot:
        now = time.monotonic()
        rows: list[ProcRow] = []
        hosts: list[HostRow] = []
        host_states: list[str] = []
        view, senders = None, {}
        if self.elastic_hosts is not None:  # the view `status` reads (elasticview), and who each answer is from
            parsed = {label: HostStatus.from_json(ans.reply) for answers in self._answers.values()
                      for label, ans in answers.items() if ans.status == "ok"}
            view = latest_view(parsed, self.elastic_hosts, set(self.elastic_hosts.values()))
            senders = {label: r.host for label, r in parsed.items()}
        in_view = in_attempt(view, self.elastic_hosts)
        for i, a in enumerate(self.asks):
            answers = self._answers.get(i)
            if answers is None:
                hosts.extend(HostRow(label, "waiting", "no answer yet") for label in a.labels)
                continue
            for label, ans in answers.items():
                age = round(now - ans.at, 3)
                # a host outside an elastic job's attempt (lost and replaced, a spare) does not decide its state
                counts = in_view(label, senders.get(label))
                if ans.status != "ok":
                    hosts.append(HostRow(label, ans.status, ans.error, age, ans.state))
                    if counts:
                        host_states.append(ans.state or (JobState.LOST if ans.status == "unreachable"
                                                         else JobState.UNKNOWN))
                    continue
                mine = rows_of(label, ans.reply)
                row = host_row(label, ans.reply, mine)
                row.age_s = age
                hosts.append(row)
                state = row.state or JobState.UNKNOWN
                if state == JobState.STOPPING and ans.reply.get("restart_pending"):
                    state = JobState.RESTARTING
                if counts:
                    host_states.append(state)
                rows.extend(mine)
        found = mark_stragglers(rows, threshold=self.threshold, slices=self.slices)
        return Snapshot(self.job, job_state(host_states), rows, hosts, found, time.time(),
                        round(now - t0, 3), interval, self.threshold, self.window_s,
                        None if view is None else {k: view[k] for k in ("attempt", "members", "lines")})
