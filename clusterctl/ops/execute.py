"""`clusterctl exec`: one argv on every host, output streamed line by line."""

from __future__ import annotations

from collections.abc import Sequence

from ..quoting import join
from ..remote import LineCallback, Remote, Result, UNREACHABLE

__all__ = ["execute", "worst_exit_code"]


def execute(remote: Remote, argv: Sequence[str], *, on_line: LineCallback | None = None, timeout: float | None = None):
    """Run `argv` (quoted, never re-parsed) on every host in parallel; return each host's Result."""
    return remote.run(join(argv), on_line=on_line, timeout=timeout, check=False)


def worst_exit_code(results: dict[object, Result]) -> int:
    """The exit code of the worst host: unreachable (255) beats any failure, any failure beats 0."""
    codes = [r.exit_code for r in results.values()]
    if not codes:
        return 0
    if UNREACHABLE in codes:
        return UNREACHABLE
    return max(codes, key=lambda c: (c != 0, c))
