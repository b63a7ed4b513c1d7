"""CLI for the job lifecycle: dispatch, start, status, logs, stop."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

from rich.markup import escape
from rich.table import Table

from ..console import err, out, write_line
from ..host.states import ACTIVE_JOB_STATES, JobState
from .render import render_status

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
    from .slurm_cli import load, run_dispatch

    spec = load(args.spec)
    if spec.backend == "slurm":
        return run_dispatch(spec)
    t0 = time.monotonic()
    with open_session(spec) as session:
        results = dispatch(session)
    table = Table(title=f"dispatch ({time.monotonic() - t0:.1f}s)", title_justify="left")
    for col in ("host", "files sent", "bytes sent", "deleted", "generation"):
        table.add_column(col)
    for r in results:
        table.add_row(escape(r.host.label), str(r.files_sent), _human(r.bytes_sent), str(r.deleted), r.generation)
    out.print(table)
    return 0


def _raw_line(host, stream, line) -> None:
    # the agent already prefixes each line with [host role.id]
    write_line(sys.stdout if stream == "out" else sys.stderr, line)


def run_status(spec, *, as_json: bool = False) -> int:
    """Print the job's status; exit 0 unless a host is unreachable."""
    from . import slurm_cli

    spec = slurm_cli.load(spec)
    if spec.backend == "slurm":
        return slurm_cli.run_status(spec, as_json=as_json)
    from . import open_session
    from .job import status

    with open_session(spec) as session:
        st = status(session)
    if as_json:
        sys.stdout.write(json.dumps(st.to_json(), indent=2) + "\n")
    else:
        render_status(st)
    return 1 if st.unreachable else 0


def run_stop(spec) -> int:
    """Stop the job everywhere; say so when it was not running."""
    from . import slurm_cli

    spec = slurm_cli.load(spec)
    if spec.backend == "slurm":
        return slurm_cli.run_stop(spec)
    from . import open_session
    from .job import stop

    with open_session(spec) as session:
        results = stop(session)
    was_running = any(r.get("was_running") for r in results.values())
    killed = sum(len(r.get("killed") or []) for r in results.values())
    if was_running:
        out.print(f"job {escape(session.plan.job)} stopped on {len(results)} host(s)" + (f" ({killed} process(es) killed)" if killed else ""))
    else:
        out.print(f"job {escape(session.plan.job)} is not running")
    return 0


def run_logs(spec, *, follow=False, role=None, id=None, host=None, lines=None) -> int:
    """Print `[host role.id] line` for every selected log, optionally following."""
    from . import slurm_cli

    spec = slurm_cli.load(spec)
    if spec.backend == "slurm":
        return slurm_cli.run_logs(spec, follow=follow, role=role, id=id, host=host, lines=lines)
    from . import open_session
    from .job import logs

    with open_session(spec) as session:
        codes = logs(session, on_line=_raw_line, follow=follow, role=role, id=id, host=host, lines=lines)
    return max(codes.values(), default=0)


def _stop_after_interrupt(session) -> int:
    """Ctrl+C while a job was starting or followed: stop it everywhere through fresh connections."""
    from . import open_session
    from .job import status, stop

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl+C must not abort the cleanup
    try:
        err.print("[yellow]interrupted: stopping the job…[/]")
        session.remote.close()  # ends the follow channels, which hold the worker threads
        with open_session(session.spec) as fresh:
            stop(fresh)
            render_status(status(fresh))
    finally:
        signal.signal(signal.SIGINT, previous)
    return 130


def run_start(spec, *, dispatch_first: bool = False, follow: bool = False) -> int:
    """(Dispatch,) start, print the status; with follow, stream logs until the end and exit with the job's state."""
    from . import slurm_cli

    spec = slurm_cli.load(spec)
    if spec.backend == "slurm":
        return slurm_cli.run_start(spec, dispatch_first=dispatch_first, follow=follow)
    from . import open_session
    from .dispatch import dispatch
    from .job import logs, start, status

    with open_session(spec) as session:
        if dispatch_first:
            sent = dispatch(session)
            out.print(f"dispatched: {sum(d.files_sent for d in sent)} file(s), {_human(sum(d.bytes_sent for d in sent))}")
        t0 = time.monotonic()
        try:
            st = start(session, on_progress=lambda m: err.print(f"[dim]{escape(m)}…[/]"))
            out.print(f"started in {time.monotonic() - t0:.1f}s")
            render_status(st)
            if not follow:
                return 0
            logs(session, on_line=_raw_line, follow=True)
            final = status(session)
            # a host's logs end with its processes; the job's state (the coordinator's verdict) follows shortly
            deadline = time.monotonic() + 30
            while final.state in ACTIVE_JOB_STATES and time.monotonic() < deadline:
                time.sleep(0.2)
                final = status(session)
        except KeyboardInterrupt:
            return _stop_after_interrupt(session)
        render_status(final)
        return 0 if final.state == JobState.SUCCEEDED else 1


def cmd_start(args: argparse.Namespace) -> int:
    """clusterctl start."""
    return run_start(args.spec, dispatch_first=args.dispatch, follow=args.follow)


def cmd_status(args: argparse.Namespace) -> int:
    """clusterctl status."""
    return run_status(args.spec, as_json=args.json)


def cmd_logs(args: argparse.Namespace) -> int:
    """clusterctl logs."""
    return run_logs(args.spec, follow=args.follow, role=args.role, id=args.id, host=args.host, lines=args.lines)


def cmd_stop(args: argparse.Namespace) -> int:
    """clusterctl stop."""
    return run_stop(args.spec)


def add_cli(sub) -> None:
    """Register the lifecycle subcommands."""
    p = sub.add_parser("dispatch", help="ship the workspace (and data shards) to every host")
    p.add_argument("spec")
    p.set_defaults(func=cmd_dispatch)

    p = sub.add_parser("start", help="start pservers, then trainers, on every host")
    p.add_argument("spec")
    p.add_argument("--follow", action="store_true", help="stream logs and exit with the job's status")
    p.add_argument("--dispatch", action="store_true", help="dispatch the workspace first")
    p.set_defaults(func=cmd_start)

    p = sub.add_parser("status", help="every process's state")
    p.add_argument("spec")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("logs", help="prefixed logs of every process")
    p.add_argument("spec")
    p.add_argument("--follow", "-f", action="store_true")
    p.add_argument("--role", choices=("pserver", "trainer"))
    p.add_argument("--id", type=int)
    p.add_argument("--host")
    p.add_argument("-n", dest="lines", type=int, default=None, help="last LINES lines of each log")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("stop", help="stop the job everywhere (idempotent)")
    p.add_argument("spec")
    p.set_defaults(func=cmd_stop)
