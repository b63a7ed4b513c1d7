"""The exception tree: one root, a few children that carry what a user needs to act."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ClusterctlError",
    "SpecError",
    "SpecProblem",
    "RemoteError",
    "HostFailure",
    "ProvisionError",
    "JobError",
]


class ClusterctlError(Exception):
    """Root of every error clusterctl raises on purpose; the CLI turns it into a message and exit code."""

    exit_code = 1


@dataclass(frozen=True)
class SpecProblem:
    """One problem in a spec file, located as precisely as the YAML allows."""

    file: str
    line: int
    column: int
    path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}:{self.column}"
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


class SpecError(ClusterctlError):
    """The spec is invalid; carries every problem found, not only the first."""

    exit_code = 2

    def __init__(self, problems: list[SpecProblem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


@dataclass(frozen=True)
class HostFailure:
    """What went wrong on one host: the command, its exit code (None if it never ran) and stderr's tail."""

    host: str
    command: str
    exit_code: int | None
    stderr_tail: str
    reason: str = ""

    def __str__(self) -> str:
        if self.exit_code is None:
            return f"{self.host}: {self.reason}"
        tail = self.stderr_tail.strip().splitlines()[-3:] if self.stderr_tail.strip() else []
        detail = f": {' | '.join(tail)}" if tail else ""
        return f"{self.host}: exit {self.exit_code}{detail}"


class RemoteError(ClusterctlError):
    """One or more hosts failed; carries every host's failure (and the successful results, if any)."""

    def __init__(self, failures: list[HostFailure], results: dict | None = None, what: str = "command"):
        self.failures = list(failures)
        self.results = results or {}
        names = ", ".join(f.host for f in self.failures)
        lines = [f"{what} failed on {len(self.failures)} host(s): {names}"]
        lines += [f"  {f}" for f in self.failures]
        super().__init__("\n".join(lines))


class ProvisionError(ClusterctlError):
    """Provisioning could not bring a host to the requested state."""


class JobError(ClusterctlError):
    """A job could not be dispatched, started, inspected or stopped as asked."""
