"""The one status type: what a job looks like to `clusterctl status`, whatever the backend.

Every backend (SSH, Slurm, Kubernetes, local) answers `status` with a `JobStatus` made of `ProcessStatus`
rows; the host side (the supervisor's describe) and the controller share these types, so the shape of a
status cannot differ by backend. One host's reply (`agent status`: the supervisor's state.json, described)
is a `HostStatus`, built on the host (clusterctl/host/jobdir.py's describe) and read back on the controller
(`HostStatus.from_json`, tolerant of anything a host may send); its attempts are `AttemptRecord`s, the
records the supervisor's rules keep (clusterctl/host/rules.py). Stdlib only, like the rest of the host package.
"""

from __future__ import annotations

import math

from .record import dataclass, field
from .states import JobState

__all__ = ["ProcessStatus", "JobStatus", "AttemptRecord", "HostStatus", "overall_state"]


@dataclass(frozen=True)
class ProcessStatus:
    """One process as its host's supervisor reports it."""

    host: str
    role: str
    id: int
    pid: int | None
    state: str  # a ProcState value: running | exited | failed | stopped | lost | pending | not started
    exit_code: int | None
    uptime_s: float | None
    error: str | None = None
    progress: dict | None = None  # {step, rate, done, metrics, age_s}: its last progress line (docs/lifecycle.md)


@dataclass(frozen=True)
class AttemptRecord:
    """One attempt of a job (0 = the first run): how it ended and when (state.json "attempts")."""

    attempt: int
    outcome: str | None  # a JobState value; the current attempt's is the job state
    reason: str | None = None
    failure: dict | None = None
    started_at: float | None = None
    ended_at: float | None = None

    def to_json(self) -> dict:
        """The record as state.json and `agent status` carry it."""
        return {"attempt": self.attempt, "outcome": self.outcome, "reason": self.reason, "failure": self.failure,
                "started_at": self.started_at, "ended_at": self.ended_at}

    @classmethod
    def from_json(cls, data) -> AttemptRecord | None:
        """A record from JSON (a host's reply: anything malformed gives None)."""
        if not isinstance(data, dict) or not _is_int(data.get("attempt")):
            return None
        return cls(data["attempt"], _str_or_none(data.get("outcome")), _str_or_none(data.get("reason")),
                   data.get("failure") if isinstance(data.get("failure"), dict) else None,
                   _num_or_none(data.get("started_at")), _num_or_none(data.get("ended_at")))

    def summary(self) -> dict:
        """What `clusterctl status --json` shows of it."""
        return {k: v for k, v in self.to_json().items() if k != "failure"}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _str_or_none(v):
    return v if isinstance(v, str) else None


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else "?" for c in text)


def _num_or_none(v):  # a host's NaN or Infinity (Python's json reads them) is no number of ours
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


@dataclass
class HostStatus:
    """One host's answer to `agent status`: the job there, its processes and attempts (docs/agent.md 3.2).

    `to_json` is the reply's JSON; `from_json` reads a reply back on the controller and keeps only what has
    the right type (a host may be compromised)."""

    job: str | None
    host: str | None
    state: str  # a JobState value
    reason: str | None = None
    failure: dict | None = None
    failures: list = field(default_factory=list)
    jobdir: str | None = None
    is_coordinator: bool | None = None
    supervisor: dict = field(default_factory=dict)  # {"pid": N, "alive": bool}
    processes: list = field(default_factory=list)  # process rows (dicts, docs/agent.md 3.2)
    updated_at: float | None = None
    attempt: int = 0
    restarts: int = 0
    attempts: list = field(default_factory=list)  # [AttemptRecord], oldest first, the current one last
    attempts_total: int = 0  # every attempt so far, also those no longer listed
    restart_at: float | None = None
    restart_pending: bool = False
    extra: dict = field(default_factory=dict)  # "hosts", "coordinator": the coordinator's and a peer's view;
    # "elastic": an elastic job's view on this host ({"index", "member", "view", "lines", "idle"})

    def to_json(self) -> dict:
        """The reply's JSON (one object, `ok: true`)."""
        out = {"ok": True, "job": self.job, "host": self.host, "jobdir": self.jobdir, "state": self.state,
               "reason": self.reason, "failure": self.failure, "failures": self.failures,
               "is_coordinator": self.is_coordinator, "supervisor": self.supervisor, "processes": self.processes,
               "updated_at": self.updated_at, "attempt": self.attempt, "restarts": self.restarts,
               "attempts": [a.to_json() for a in self.attempts], "attempts_total": self.attempts_total,
               "restart_at": self.restart_at, "restart_pending": self.restart_pending}
        out.update(self.extra)
        return out

    @classmethod
    def from_json(cls, data) -> HostStatus:
        """A host's reply read back (anything of the wrong type is left out); state `unknown` if it has none."""
        data = data if isinstance(data, dict) else {}
        attempts = [a for a in map(AttemptRecord.from_json, data.get("attempts") or []) if a is not None] \
            if isinstance(data.get("attempts"), list) else []
        procs = [p for p in data.get("processes") or [] if isinstance(p, dict) and isinstance(p.get("role"), str)
                 and _is_int(p.get("id"))] if isinstance(data.get("processes"), list) else []
        return cls(
            job=_str_or_none(data.get("job")), host=_str_or_none(data.get("host")),
            state=_str_or_none(data.get("state")) or JobState.UNKNOWN, reason=_str_or_none(data.get("reason")),
            failure=data.get("failure") if isinstance(data.get("failure"), dict) else None,
            failures=[f for f in data.get("failures") or [] if isinstance(f, dict)]
            if isinstance(data.get("failures"), list) else [],
            jobdir=_str_or_none(data.get("jobdir")),
            is_coordinator=data.get("is_coordinator") if isinstance(data.get("is_coordinator"), bool) else None,
            supervisor=data.get("supervisor") if isinstance(data.get("supervisor"), dict) else {},
            processes=procs, updated_at=_num_or_none(data.get("updated_at")),
            attempt=data["attempt"] if _is_int(data.get("attempt")) else 0,
            restarts=data["restarts"] if _is_int(data.get("restarts")) else 0,
            attempts=attempts,
            attempts_total=data["attempts_total"] if _is_int(data.get("attempts_total")) else len(attempts),
            restart_at=_num_or_none(data.get("restart_at")), restart_pending=data.get("restart_pending") is True,
            extra={k: data[k] for k in ("hosts", "coordinator", "elastic") if isinstance(data.get(k), dict)})

    @property
    def elastic(self) -> dict | None:
        """An elastic job's view as this host holds it: {"attempt", "member" (this host), "members": [the
        attempt's hosts], "lines": [status lines], "idle": [hosts connected that run nothing]}, only what has
        the right type (None: not an elastic job, or nothing usable)."""
        raw = self.extra.get("elastic")
        if not isinstance(raw, dict) or not isinstance(raw.get("lines"), list):
            return None
        lines = [_printable(line)[:500] for line in raw["lines"][:200] if isinstance(line, str)]
        view = raw.get("view") if isinstance(raw.get("view"), dict) else {}
        return {"attempt": view["attempt"] if _is_int(view.get("attempt")) else self.attempt,
                "member": raw.get("member") is True, "lines": lines,
                "members": [h for h in raw.get("members") or [] if isinstance(h, str)][:10000]
                if isinstance(raw.get("members"), list) else [],
                "idle": [_printable(h)[:255] for h in raw.get("idle") or [] if isinstance(h, str)][:1000]
                if isinstance(raw.get("idle"), list) else []}

    @property
    def folded_state(self) -> str:
        """The state to fold into the job's: `stopping` a failed attempt that another follows reads `restarting`."""
        if self.state == JobState.STOPPING and self.restart_pending:
            return JobState.RESTARTING
        return self.state

    def process_status(self, label: str) -> list:
        """The processes as `ProcessStatus` rows of host `label`."""
        return [ProcessStatus(label, p["role"], p["id"], p["pid"] if _is_int(p.get("pid")) else None,
                              _str_or_none(p.get("state")) or "unknown",
                              p["exit_code"] if _is_int(p.get("exit_code")) else None,
                              _num_or_none(p.get("uptime_s")), _str_or_none(p.get("error"))) for p in self.processes]


@dataclass
class JobStatus:
    """The whole job: overall state, per-process rows, per-host problems."""

    job: str
    state: str  # a JobState value
    reason: str | None = None
    processes: list = field(default_factory=list)  # [ProcessStatus]
    unreachable: dict = field(default_factory=dict)  # host label -> why
    attempt: int = 0  # 0 = the first run; job.restarts bounds it
    restarts: int = 0
    attempts: list = field(default_factory=list)  # {attempt, outcome, reason, started_at, ended_at}, oldest first
    backend: str = "ssh"
    stragglers: list = field(default_factory=list)  # {host, process, rate, median, ratio}: the straggler rule's finds
    elastic: dict | None = None  # an elastic job: {"attempt", "lines": [which hosts run it, spares, changes]}

    def to_json(self) -> dict:
        """JSON form for `clusterctl status --json`."""
        return {
            "job": self.job,
            "backend": self.backend,
            "state": self.state,
            "reason": self.reason,
            "attempt": self.attempt,
            "restarts": self.restarts,
            "attempts": self.attempts,
            "processes": [vars(p) for p in self.processes],
            "unreachable": self.unreachable,
            "stragglers": self.stragglers,
            "elastic": self.elastic,
        }


def overall_state(host_states: list) -> str:
    """Fold per-host job states into the job's state (pure)."""
    S = JobState
    states = set(host_states)
    if not states or states <= {S.UNKNOWN}:
        return S.NOT_RUNNING
    live = states & {S.RUNNING, S.STARTING, S.STOPPING, S.RESTARTING}
    # every live host still starting (supervisors at the start barrier, pods not scheduled): not running yet
    going = S.STARTING if live == {S.STARTING} else S.RUNNING
    if S.FAILED in states:
        if not live:
            return S.FAILED
        # not over yet: the rest is being stopped (fail-fast) or still working (on_failure: continue)
        return S.STOPPING if live & {S.STOPPING, S.RESTARTING} else going
    if S.LOST in states:
        return S.LOST
    if live:
        if live & {S.RUNNING, S.STARTING}:
            return going
        # a failed attempt being stopped, or the back-off before the next one
        return S.RESTARTING if S.RESTARTING in live else S.STOPPING
    if S.STOPPED in states:
        return S.STOPPED
    if states <= {S.SUCCEEDED, S.UNKNOWN}:
        return S.SUCCEEDED
    return sorted(states)[0]
