"""The exception tree: one root, a few children that carry what a user needs to act."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ClusterctlError",
    "SpecError",
    "SpecProblem",
    "RemoteError",
    "HostFailure",
    "HostError",
    "CannotConnect",
    "TimedOut",
    "CommandFailed",
    "ProvisionError",
    "JobError",
    "BadReply",
]


class ClusterctlError(Exception):
    """Root of every error clusterctl raises on purpose; the CLI turns it into a message and exit code."""

    exit_code = 1


class UsageError(ClusterctlError):
    """A command line argparse would have refused (a value out of its range): exit 2, as argparse does."""

    exit_code = 2


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
        message = _clip(self.message, 300)  # a value the message quotes may be any length: the line stays readable
        return f"{where}: {_clip(self.path, 160)}: {message}" if self.path else f"{where}: {message}"


def _clip(text: str, limit: int) -> str:
    """`text`, or its first `limit` characters and how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


MAX_PROBLEMS_SHOWN = 20  # a 65,000-host hostfile with a bad value on every line is 20 lines and a count, not 65,000


class SpecError(ClusterctlError):
    """The spec is invalid; carries every problem found, not only the first (its message: the first
    MAX_PROBLEMS_SHOWN of them, then how many more there are)."""

    exit_code = 2

    def __init__(self, problems: list[SpecProblem]):
        self.problems = list(problems)
        super().__init__("\n".join(self.lines()))

    def lines(self, limit: int = MAX_PROBLEMS_SHOWN) -> list[str]:
        """One line per problem, the first `limit` of them, then one line at the next one's place saying how many
        more there are (every line FILE:LINE:COL: ..., as the problems' own)."""
        lines = [str(p) for p in self.problems[:limit]]
        left = len(self.problems) - len(lines)
        if left > 0:
            nxt = self.problems[limit]
            more = "1 more problem" if left == 1 else f"{left} more problems"
            lines.append(f"{nxt.file}:{nxt.line}:{nxt.column}: ... and {more} (the first {limit} are shown)")
        return lines


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


class HostError(ClusterctlError):
    """One host's failure, typed: str() is the one-line reason a user reads (naming the host)."""

    def __init__(self, host: str, reason: str, command: str = ""):
        self.host, self.reason, self.command = host, reason, command
        super().__init__(reason)


class CannotConnect(HostError):
    """The host was never reached (or its connection was lost before the command could answer)."""


class TimedOut(HostError):
    """The command did not answer within our deadline (it was ended; Result exit code 124)."""


class CommandFailed(HostError):
    """The command ran and exited non-zero."""

    def __init__(self, host: str, reason: str, command: str = "", exit_code: int = 1, stderr_tail: str = ""):
        super().__init__(host, reason, command)
        self.exit_code, self.stderr_tail = exit_code, stderr_tail


class RemoteError(ClusterctlError):
    """One or more hosts failed; carries every host's outcome, as Fabric's GroupException does.

    `failures`: a HostFailure per failed host (what the message shows); `results`: the Results of the hosts
    that succeeded; `failed`: the Results of the hosts that failed (where they came from a command run);
    `outcomes`: every host's Result, successes and failures; `errors`: each failed host's typed error
    (CannotConnect, TimedOut or CommandFailed), by Host."""

    def __init__(self, failures: list[HostFailure], results: dict | None = None, what: str = "command",
                 failed: dict | None = None):
        self.failures = list(failures)
        self.results = results or {}
        self.failed = failed or {}
        names = ", ".join(f.host for f in self.failures)
        lines = [f"{what} failed on {len(self.failures)} host(s): {names}"]
        lines += [f"  {f}" for f in self.failures]
        super().__init__("\n".join(lines))

    @property
    def outcomes(self) -> dict:
        """Every host's Result (Host -> Result): the successes and the failures, in one mapping."""
        return {**self.results, **self.failed}

    @property
    def errors(self) -> dict:
        """Each failed host's typed error (Host -> CannotConnect | TimedOut | CommandFailed)."""
        return {host: res.error() for host, res in self.failed.items()}


class ProvisionError(ClusterctlError):
    """Provisioning could not bring a host to the requested state."""


class JobError(ClusterctlError):
    """A job could not be dispatched, started, inspected or stopped as asked."""


class BadReply(ValueError):
    """A host's reply that is not what clusterctl's host side prints (a broken or compromised host): that host
    fails, by name, with this one-line message; the other hosts go on. Not a ClusterctlError: the operation
    that reads the reply turns it into that host's failure."""
