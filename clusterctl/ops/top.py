"""`top`: every process of a running job with what it uses (CPU, memory, GPUs) and how far it got, per host.

Each host's supervisor samples its own processes and replies with the job's status plus the figures, over its
control socket (clusterctl/host/control.py: no Python start on the host); where none runs, `agent top`
(clusterctl/host/topsnap.py) answers from the state files; this module asks every host, folds the replies into one `Snapshot` (a row per
process, totals per host, the stragglers among the ranks) and keeps going when hosts do not answer: a host
is asked again only once its previous answer is in, and one that cannot be reached is a row that says so.

A refresh sends a command line, not the package: a host whose fallback needs this version of the host package
and lacks it gets it once (clusterctl/ops/control.py `ask`). Replies are taken through
allow-lists with bounds (a host may be compromised).
"""

from __future__ import annotations

import math
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field

from ..errors import ClusterctlError
from ..host.states import JobState
from ..host.status import overall_state
from ..plan import Host
from ..progress import (STRAGGLER_SLICES, STRAGGLER_THRESHOLD, STRAGGLER_WINDOW_S, clean_progress, stragglers)
from . import Session
from .control import ask, control_command
from .job import STATE_ROOT

__all__ = ["ProcRow", "HostRow", "Snapshot", "Top", "DEFAULT_INTERVAL", "MIN_INTERVAL"]

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

    @property
    def unreachable(self) -> list:
        """The hosts that could not be asked (unreachable, timed out)."""
        return [h for h in self.hosts if h.status == "unreachable"]

    def to_json(self) -> dict:
        """JSON form for `clusterctl top --json`."""
        return {"job": self.job, "state": self.state, "taken_at": self.taken_at, "took_s": self.took_s,
                "interval": self.interval, "straggler_rule": {"threshold": self.threshold, "window_s": self.window_s},
                "stragglers": self.stragglers, "hosts": [asdict(h) for h in self.hosts],
                "processes": [dict(asdict(r), name=r.name) for r in self.rows]}


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
    for p in reply.get("processes") or []:
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

@dataclass
class _Answer:
    at: float  # monotonic time it came
    status: str  # ok | unreachable | no job | error
    reply: dict | None = None
    error: str | None = None


class Top:
    """Asks every host of a session for its `agent top` reply, at most one request per host in flight.

    `snapshot(wait)` starts a request on every host that has none running, waits up to `wait` seconds
    (None: until every host has answered or timed out) and folds the latest answer of each host. Use as a
    context manager (or close())."""

    def __init__(self, session: Session, *, threshold: float = STRAGGLER_THRESHOLD,
                 window_s: float = STRAGGLER_WINDOW_S, slices: int = STRAGGLER_SLICES, gpu: bool = True,
                 request_timeout: float | None = None):
        if not 0 < threshold <= 1:
            raise ClusterctlError(f"top: the straggler threshold must be in (0, 1], not {threshold:g}")
        if not 6 <= window_s <= 180:
            raise ClusterctlError(f"top: the straggler window must be 6 to 180 seconds, not {window_s:g}")
        self.session, self.threshold, self.window_s, self.slices, self.gpu = session, threshold, window_s, slices, gpu
        # a host's request ends (unreachable) after this: ssh.command_timeout unless the view asks for less
        self.request_timeout = min(session.remote.control_timeout, request_timeout or math.inf)
        self.hosts: tuple[Host, ...] = tuple(session.plan.hosts)
        self._answers: dict[Host, _Answer] = {}
        self._inflight: dict[Host, Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(64, len(self.hosts))), thread_name_prefix="top")

    def __enter__(self) -> "Top":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop asking (requests in flight end with their deadline)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _args(self) -> list[str]:
        args = ["top", f"{STATE_ROOT}/{self.session.plan.job}", "--slice", f"{self.window_s / self.slices:g}",
                "--slices", str(self.slices)]
        return args + ([] if self.gpu else ["--no-gpu"])

    def _command(self) -> str:
        """The supervisor's `top` over its control socket (its Sampler kept in memory, nvidia-smi on a thread of
        its own), or `agent top` where no supervisor runs (clusterctl/ops/control.py)."""
        request = {"slice": self.window_s / self.slices, "slices": self.slices, "gpu": self.gpu}
        return control_command(f"{STATE_ROOT}/{self.session.plan.job}", "top", request, self._args())

    def _ask(self, host: Host) -> _Answer:
        remote = self.session.remote
        res = ask(remote, self._command(), hosts=[host], timeout=self.request_timeout, what="top")[host]
        now = time.monotonic()
        if not res.answered:
            if res.timed_out:
                why = f"did not answer within {self.request_timeout:g}s" + (
                    " (ssh.command_timeout)" if self.request_timeout == remote.control_timeout else "")
            else:
                why = res.stderr.strip()[-300:] or "no answer"
            return _Answer(now, "unreachable", error=why)
        try:
            data = res.reply()
        except ClusterctlError:
            tail = (res.stderr or res.stdout).strip()[-300:]
            return _Answer(now, "error", error=tail or f"exit {res.exit_code} without a reply")
        if data.get("ok") is False:
            if data.get("state") == JobState.UNKNOWN and res.exit_code == 1:
                return _Answer(now, "no job", data, _str(data.get("error"), 300))
            return _Answer(now, "error", data, _str(data.get("error"), 300) or "failed")
        return _Answer(now, "ok", data)

    def snapshot(self, wait_s: float | None = None, *, interval: float | None = None) -> Snapshot:
        """Ask every idle host, wait up to `wait_s` (None: for all), and fold the latest answers."""
        t0 = time.monotonic()
        for h in self.hosts:
            if h not in self._inflight:
                self._inflight[h] = self._pool.submit(self._ask, h)
        pending = set(self._inflight.values())
        deadline = None if wait_s is None else t0 + wait_s
        while pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            done, pending = wait(pending, timeout=left, return_when=FIRST_COMPLETED)
        for h, fut in list(self._inflight.items()):
            if fut.done():
                del self._inflight[h]
                try:
                    self._answers[h] = fut.result()
                except Exception as exc:  # noqa: BLE001 - a bug in one host's request must not end the view
                    self._answers[h] = _Answer(time.monotonic(), "error", error=f"{type(exc).__name__}: {exc}")
        return self._fold(t0, interval)

    def _fold(self, t0: float, interval: float | None) -> Snapshot:
        now = time.monotonic()
        rows: list[ProcRow] = []
        hosts: list[HostRow] = []
        host_states: list[str] = []
        for h in self.hosts:
            ans = self._answers.get(h)
            if ans is None:
                hosts.append(HostRow(h.label, "waiting", "no answer yet"))
                continue
            age = round(now - ans.at, 3)
            if ans.status == "unreachable":
                hosts.append(HostRow(h.label, "unreachable", ans.error, age))
                host_states.append(JobState.LOST)
                continue
            if ans.status != "ok":
                hosts.append(HostRow(h.label, ans.status, ans.error, age))
                host_states.append(JobState.UNKNOWN)
                continue
            mine = rows_of(h.label, ans.reply)
            row = host_row(h.label, ans.reply, mine)
            row.age_s = age
            hosts.append(row)
            state = row.state or JobState.UNKNOWN
            if state == JobState.STOPPING and ans.reply.get("restart_pending"):
                state = JobState.RESTARTING
            host_states.append(state)
            rows.extend(mine)
        found = mark_stragglers(rows, threshold=self.threshold, slices=self.slices)
        return Snapshot(self.session.plan.job, job_state(host_states), rows, hosts, found, time.time(),
                        round(now - t0, 3), interval, self.threshold, self.window_s)
