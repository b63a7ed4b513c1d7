"""CLI for the job lifecycle: dispatch, start, status, logs, stop."""

from __future__ import annotations

import argparse
import time

from rich.markup import escape
from rich.table import Table

from ..console import out

__all__ = ["add_cli"]


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cmd_dispatch(args: argparse.Namespace) -> int:
    """Ship the workspace to every host; print what each host received."""
    from . import open_session
    from .dispatch import dispatch

    t0 = time.monotonic()
    with open_session(args.spec) as session:
        results = dispatch(session)
    table = Table(title=f"dispatch ({time.monotonic() - t0:.1f}s)", title_justify="left")
    for col in ("host", "files sent", "bytes sent", "deleted", "generation"):
        table.add_column(col)
    for r in results:
        table.add_row(escape(r.host.label), str(r.files_sent), _human(r.bytes_sent), str(r.deleted), r.generation)
    out.print(table)
    return 0


def add_cli(sub) -> None:
    """Register the lifecycle subcommands."""
    p = sub.add_parser("dispatch", help="ship the workspace (and data shards) to every host")
    p.add_argument("spec")
    p.set_defaults(func=cmd_dispatch)
