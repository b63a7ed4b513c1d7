"""The one status type: what a job looks like to `clusterctl status`, whatever the backend.

Every backend (SSH, Slurm, Kubernetes, local) answers `status` with a `JobStatus` made of `ProcessStatus`
rows; the host side (the supervisor's describe) and the controller share these types, so the shape of a
status cannot differ by backend. Stdlib only, like the rest of the host package.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .states import JobState

__all__ = ["ProcessStatus", "JobStatus", "overall_state"]


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
        }


def overall_state(host_states: list) -> str:
    """Fold per-host job states into the job's state (pure)."""
    S = JobState
    states = set(host_states)
    if not states or states <= {S.UNKNOWN}:
        return S.NOT_RUNNING
    live = states & {S.RUNNING, S.STARTING, S.STOPPING, S.RESTARTING}
    if S.FAILED in states:
        if not live:
            return S.FAILED
        # not over yet: the rest is being stopped (fail-fast) or still working (on_failure: continue)
        return S.STOPPING if live & {S.STOPPING, S.RESTARTING} else S.RUNNING
    if S.LOST in states:
        return S.LOST
    if live:
        if live & {S.RUNNING, S.STARTING}:
            return S.RUNNING
        # a failed attempt being stopped, or the back-off before the next one
        return S.RESTARTING if S.RESTARTING in live else S.STOPPING
    if S.STOPPED in states:
        return S.STOPPED
    if states <= {S.SUCCEEDED, S.UNKNOWN}:
        return S.SUCCEEDED
    return sorted(states)[0]
