"""`clusterctl exec`: one argv on every host, output streamed line by line."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import UsageError
from ..quoting import join
from ..remote import LineCallback, Remote, Result, UNREACHABLE

__all__ = ["execute", "worst_exit_code"]


#: After the remote deadline: SIGTERM to the command's process group, then SIGKILL this much later.
KILL_AFTER_S = 5
#: The controller's own deadline is the remote one plus this (the remote `timeout` fires first).
LOCAL_MARGIN_S = 15
#: The longest command exec sends: the ssh client gets it as one argument (execve takes at most 128 KiB), inside
#: the transport's own wrapping (the host tools' check, a cd), which this leaves room for.
MAX_COMMAND = 128 * 1024 - 8 * 1024


def execute(remote: Remote, argv: Sequence[str], *, on_line: LineCallback | None = None, timeout: float | None = None):
    """Run `argv` (quoted, never re-parsed) on every host in parallel; return each host's Result.

    With `timeout`, the deadline is enforced on the host too: coreutils `timeout` runs the command in its
    own process group and ends the whole group (SIGTERM, SIGKILL 5 s later; exit 124), so nothing is
    left running there when the controller gives up; hosts without `timeout` run the command as before.
    """
    command = join(argv)
    if timeout is not None:
        limited = join(["timeout", "-k", str(KILL_AFTER_S), f"{timeout:g}", "sh", "-c", command])
        command = f"if command -v timeout >/dev/null 2>&1; then exec {limited}; else exec sh -c {join([command])}; fi"
    size = len(command.encode("utf-8", "surrogateescape"))
    if size > MAX_COMMAND:  # the ssh client takes it as one argument: execve's E2BIG, "Argument list too long: ssh"
        raise UsageError(f"exec: the command is {size:,} bytes as sent, over the {MAX_COMMAND:,} ssh can take as one "
                         "argument (Linux's 128 KiB less our own wrapping): put it in a script, dispatch it and run that")
    if timeout is None:
        return remote.run(command, on_line=on_line, check=False)
    return remote.run(command, on_line=on_line, timeout=timeout + KILL_AFTER_S + LOCAL_MARGIN_S, check=False)


def worst_exit_code(results: dict[object, Result]) -> int:
    """The exit code of the worst host: unreachable (255) beats any failure, any failure beats 0."""
    codes = [r.exit_code for r in results.values()]
    if not codes:
        return 0
    if UNREACHABLE in codes:
        return UNREACHABLE
    return max(codes, key=lambda c: (c != 0, c))
