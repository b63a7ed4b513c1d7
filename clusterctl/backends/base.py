"""The one interface every backend implements: check · dispatch · start · status · logs · stop.

A backend is where a job's processes run (SSH hosts, a Slurm allocation, Kubernetes pods, this machine).
Every backend starts the same host supervisor (clusterctl/host) with the same job file, so the
guarantees (the job token, restarts and back-off, fail-fast, attempt logs, the sweep, the status reply)
are the supervisor's and hold everywhere. What differs is how the supervisor gets started, and where.

A backend declares the spec keys it cannot honour (`unsupported`); a spec that sets one is refused at
the key's line:column by `check`, never silently dropped. TorchX's `Scheduler` (schedule, describe,
log_iter, cancel, run options declared per scheduler) is the model.
"""

from __future__ import annotations

import abc
import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from ..host.status import JobStatus

if TYPE_CHECKING:
    from ..errors import SpecProblem
    from ..ops.top import TopAsk, TopRequest
    from ..plan import JobPlan
    from ..spec import ClusterSpec

__all__ = ["Backend", "Placement", "StopReport", "Progress", "LineCallback", "killed_count", "unsupported_problems"]

Progress = Callable[[str], None]  # "verifying workspaces", "launching", ... (the CLI prints them dim)
LineCallback = Callable[[object, str, str], None]  # (host, "out" | "err", line)


@dataclass(frozen=True)
class StopReport:
    """What `stop` did, the same for every backend: whether the job was running, where it was stopped,
    how many of its processes were killed (every host's count), and what is left (must be nothing)."""

    job: str
    was_running: bool
    hosts: int = 0  # hosts (nodes, pods) the stop reached
    killed: int = 0  # processes ended by this stop, on every host
    left: dict = field(default_factory=dict)  # host label -> pids still tagged with the job (an orphan: a bug)
    detail: str = ""  # backend words, e.g. "Slurm job 42 cancelled"


def killed_count(replies: Iterable[object]) -> int:
    """StopReport.killed from the hosts' `agent stop` replies, the same way on every backend: each host's distinct
    pids in its `killed` list (entries are {pid, via, ...}: a group signalled with killpg and its leader again with
    kill count once). Only integer pids count, and only in a list: the replies come from hosts that may be
    compromised."""
    def pid(entry: object) -> int | None:
        value = entry.get("pid") if isinstance(entry, dict) else entry
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    total = 0
    for reply in replies:
        killed = reply.get("killed") if isinstance(reply, dict) else None
        if isinstance(killed, list):
            total += len({pid(e) for e in killed} - {None})
    return total


@dataclass(frozen=True)
class Placement:
    """`plan`'s rows for a backend whose processes run elsewhere than on the plan's hosts (Kubernetes: pods).
    `row(i)`: process i's (place, role, id, rank, endpoint, gpus, argv), made only for the rows shown."""

    called: str  # what one place is called (the table's first column): "pod"
    count: int
    row: Callable[[int], tuple[str, str, str, str, str, str, str]]
    title: str  # after `job NAME (MODE)`
    note: str  # one line after the table


class Backend(abc.ABC):
    """A place where jobs run. Use as a context manager: connections are kept between operations."""

    #: the value of the spec's `backend:` key
    name: ClassVar[str]
    #: one line for `clusterctl backends` and the docs
    summary: ClassVar[str] = ""
    #: spec keys this backend cannot honour, as (dotted path pattern, why); `*` matches a list index or key.
    #: A spec that sets one is refused at the key's line:column.
    unsupported: ClassVar[tuple[tuple[str, str], ...]] = ()
    #: whether the spec's hosts are machines that `ssh` reaches (provision, doctor, exec work on them)
    ssh_hosts: ClassVar[bool] = False
    #: whether the plan resolves the spec's hosts through the user's ssh config (`ssh -G`)
    resolve_hosts: ClassVar[bool] = True

    def __init__(self, spec: ClusterSpec | None, plan: JobPlan, *, spec_path: str | None = None, options=None):
        self._spec, self.plan, self.spec_path, self.options = spec, plan, spec_path, options

    # -- the spec ---------------------------------------------------------------------------------

    @property
    def spec(self) -> ClusterSpec:
        """The validated spec (loaded on first use when the backend was opened from a cached plan)."""
        if self._spec is None:
            from ..spec import load_spec

            self._spec = load_spec(self.spec_path, layout=False)
        return self._spec

    @classmethod
    def check(cls, spec: ClusterSpec) -> list[SpecProblem]:
        """Every problem this backend has with `spec`, each at its key's line:column: the keys it does not
        honour first, then its own rules (`check_spec`)."""
        return unsupported_problems(spec, cls.unsupported, cls.name) + cls.check_spec(spec)

    @classmethod
    def check_spec(cls, spec: ClusterSpec) -> list[SpecProblem]:
        """The backend's own rules about a spec (beyond `unsupported`); none by default."""
        return []

    @classmethod
    def placement(cls, spec: ClusterSpec, plan: JobPlan) -> Placement | None:
        """Where the processes run when that is not the plan's hosts (`plan`'s table then lists these places, and no
        SSH connections); None: on the plan's hosts."""
        return None

    # -- lifetime ---------------------------------------------------------------------------------

    def __enter__(self) -> "Backend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close what the backend holds open (connections)."""

    # -- operations -------------------------------------------------------------------------------

    def notes(self) -> tuple[str, ...]:
        """What the user should know before the job starts, one line each (`start` prints them): the plan's."""
        return self.plan.notes

    @abc.abstractmethod
    def dispatch(self, *, on_progress: Progress | None = None) -> list:
        """Ship the workspace (and data shards) where the job's processes will run; per-host results."""

    @abc.abstractmethod
    def start(self, *, on_progress: Progress | None = None) -> JobStatus:
        """Start the job's supervisors; refuse while the job is running; the status once started."""

    @abc.abstractmethod
    def status(self) -> JobStatus:
        """The job's state and every process's row; unreachable hosts reported, not fatal."""

    @abc.abstractmethod
    def logs(self, *, on_line: LineCallback, follow: bool = False, role: str | None = None, id: int | None = None,
             host: str | None = None, lines: int | None = None) -> int:
        """Stream `[host role.id] line` from every selected log (every attempt); with follow, until the job
        ends. Returns an exit code (0: every selected log was read)."""

    @abc.abstractmethod
    def stop(self, *, grace: float | None = None) -> StopReport:
        """Stop the job everywhere (SIGTERM, SIGKILL after grace, the sweep by the job's tag). Idempotent."""

    def top_asks(self, request: TopRequest) -> list[TopAsk]:
        """How `clusterctl top` asks this backend's hosts for their supervisors' `top` replies: TopAsks (each
        answers {host label: TopAnswer} for one host or several at once; clusterctl/ops/top.py keeps at most one of
        each in flight, so a host that does not answer holds up only its own TopAsk's rows)."""
        from ..errors import ClusterctlError

        raise ClusterctlError(f"top: not available with backend: {self.name}; `clusterctl status` shows the job")


def _matches(path: tuple, pattern: tuple) -> bool:
    return len(path) == len(pattern) and all(p == "*" or fnmatch.fnmatchcase(str(k), p) for k, p in zip(path, pattern))


def unsupported_problems(spec: ClusterSpec, unsupported, backend: str) -> list[SpecProblem]:
    """A problem for every key of `spec`'s YAML that matches one of `unsupported` ((pattern, why), pattern a
    dotted path with `*` for any index or key), at that key's line:column."""
    from ..spec.errors import problem

    loc = getattr(spec, "located", None)
    if loc is None:
        return []
    given = set(loc.keys) | set(loc.values)
    problems, seen = [], set()
    for pattern, why in unsupported:
        pat = tuple(pattern.split("."))
        for path in sorted((p for p in given if _matches(p, pat)), key=loc.position):
            if path not in seen:
                seen.add(path)
                problems.append(problem(loc, spec.source, path, f"not supported with backend: {backend}: {why}"))
    return problems
