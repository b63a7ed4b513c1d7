"""`clusterctl provision` and `clusterctl doctor`: parse arguments, call the operation, render with rich."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

from rich.live import Live
from rich.table import Table

from ..console import err, markup_safe, out

__all__ = ["add_cli", "cmd_provision", "cmd_doctor"]

_STYLE = {"ok": "green", "changed": "yellow", "failed": "bold red", "skipped": "dim", "running": "cyan", "": "dim"}


def _cell(status: str, reason: str, check: bool) -> str:
    """A table cell: the status, plus the reason for failed/skipped (changes are listed below the table)."""
    label = "would change" if (check and status == "changed") else status
    text = f"[{_STYLE.get(status, '')}]{markup_safe(label)}[/]"
    if reason and status in ("failed", "skipped"):
        text += f": {markup_safe(reason)}"
    return text


def _changes(report) -> list[str]:
    """One line per (step, what changed), naming the hosts it applies to."""
    groups: dict[tuple[str, str], list[str]] = {}
    for step in report.steps:
        for host in report.hosts:
            o = report.outcomes.get((host, step))
            if o and o.status == "changed":
                groups.setdefault((step, o.reason), []).append(host.label)
    return [f"{step} on {', '.join(hosts)}: {reason}" for (step, reason), hosts in groups.items()]


class _Progress:
    """Live host × step grid while provisioning runs (stderr); with --verbose, every output line too."""

    def __init__(self, hosts, steps, verbose: bool):
        self.hosts, self.steps, self.verbose = hosts, steps, verbose
        self.state = {(h, s): "" for h in hosts for s in steps}
        self.current = {h: steps[0] if steps else "" for h in hosts}
        self.lock = threading.Lock()
        self.live: Live | None = None

    def table(self) -> Table:
        table = Table(title="provisioning…", title_justify="left")
        table.add_column("host")
        for step in self.steps:
            table.add_column(step)
        for host in self.hosts:
            cells = []
            for step in self.steps:
                status = self.state[(host, step)] or ("running" if self.current[host] == step else "")
                cells.append(f"[{_STYLE[status]}]{status or '·'}[/]")
            table.add_row(markup_safe(host.label), *cells)
        return table

    def __call__(self, host, step, kind, text) -> None:
        with self.lock:
            if kind == "status":
                self.state[(host, step)] = text
                later = self.steps[self.steps.index(step) + 1 :]
                self.current[host] = later[0] if later and text != "failed" else ""
            elif self.verbose and not text.startswith("CLUSTERCTL_STEP "):
                err.print(f"\\[{markup_safe(host.label)}] \\[{step}] {markup_safe(text)}", highlight=False)  # rich: a literal [
            if self.live is not None:
                self.live.update(self.table())


def cmd_provision(args: argparse.Namespace) -> int:
    """Provision every host of the spec; print the host × step table; exit 1 if any step failed."""
    from ..errors import ProvisionError, UsageError
    from ..provision.runner import provision
    from ..provision.steps import selected_steps
    from ..backends import ssh_session

    if args.spec is None:  # `provision --only apt SPEC`: --only took every word after it, the spec too
        named = (args.only or [])[-1:]
        if named and os.path.isdir(named[0]):  # `provision --only apt DIR`: not a step, and not a spec either
            raise UsageError(f"provision: {named[0]} is a directory: give the spec file: "
                             "clusterctl provision SPEC [--only STEP ...]")
        if not named or not (named[0].endswith((".yaml", ".yml")) or os.path.isfile(named[0])):
            raise UsageError("provision: give the spec: clusterctl provision SPEC [--only STEP ...]")
        args.spec = args.only.pop()
        if not args.only:  # never every step for an --only that named none
            raise UsageError("provision: --only needs a step (wheelhouse apt python gpu mpi ssh_mesh commands)")
    with ssh_session(args.spec) as session:
        # what the command line asks of this spec, not a host's failure: exit 2, as argparse's own errors
        if session.spec.provision is None:
            raise UsageError(f"{args.spec} has no provision: section (see docs/provisioning.md)")
        try:
            steps = selected_steps(session.spec.provision, args.only)
        except ProvisionError as exc:
            raise UsageError(str(exc)) from None
        progress = _Progress(session.plan.hosts, steps, args.verbose_lines)
        if err.is_terminal and not args.verbose_lines:
            with Live(progress.table(), console=err, refresh_per_second=4, transient=True) as live:
                progress.live = live
                report = provision(session, check=args.check, force=args.force, only=args.only, on_event=progress)
        else:
            report = provision(session, check=args.check, force=args.force, only=args.only, on_event=progress)

    title = f"provision {report.job}" + (" --check (nothing was changed)" if report.check else "")
    table = Table(title=title, title_justify="left")
    table.add_column("host")
    for step in report.steps:
        table.add_column(step, overflow="fold")
    for host in report.hosts:
        cells = []
        for step in report.steps:
            o = report.outcomes.get((host, step))
            cells.append(_cell(o.status, o.reason, report.check) if o else "[dim]-[/]")
        table.add_row(markup_safe(host.label), *cells)
    out.print(table)
    lines = _changes(report)
    if lines:
        out.print("would change:" if report.check else "changed:")
        for line in lines:
            out.print(f"  {markup_safe(line)}")
    changed, failed = report.count("changed"), report.count("failed")
    verb = "would change" if report.check else "changed"
    out.print(
        f"{changed} {verb}, {failed} failed, {report.count('ok')} ok in {report.seconds:.1f}s; "
        f"per-host logs: {markup_safe(str(report.log_dir))}/<host>.log"
    )
    return 0 if report.ok else 1


def cmd_doctor(args: argparse.Namespace) -> int:
    """Check every host and compare them; exit 1 on a problem or a cross-host mismatch."""
    from ..provision.doctor import doctor
    from ..backends import ssh_session

    with ssh_session(args.spec) as session:
        report = doctor(session)
    if args.json:
        sys.stdout.write(json.dumps(report.to_json(), indent=2, sort_keys=True, allow_nan=False) + "\n")
        return 0 if report.ok else 1
    table = Table(title=f"doctor {report.job}", title_justify="left")
    table.add_column("check")
    for host in report.hosts:
        table.add_column(markup_safe(host.label), overflow="fold")
    for row in report.rows():
        table.add_row(*[markup_safe(c) for c in row])
    out.print(table)
    for problem in report.problems:
        out.print(f"[bold red]problem:[/] {markup_safe(problem)}")
    out.print("all hosts agree" if report.ok else f"{len(report.problems)} problem(s)")
    return 0 if report.ok else 1


def add_cli(subparsers) -> None:
    """Register `provision` and `doctor` on the clusterctl argument parser."""
    p = subparsers.add_parser("provision", help="install what the spec's provision section asks for on every host")
    p.add_argument("spec", nargs="?")  # also after --only's steps (cmd_provision)
    p.add_argument("--check", action="store_true", help="report what would change; change nothing")
    p.add_argument("--force", action="store_true", help="re-run every step even where it is satisfied")
    p.add_argument("--only", nargs="+", action="extend", metavar="STEP", help="run only these steps (wheelhouse apt python gpu mpi ssh_mesh commands)")
    p.add_argument("--lines", dest="verbose_lines", action="store_true", help="print every host's output lines as they come")
    p.set_defaults(func=cmd_provision)

    p = subparsers.add_parser("doctor", help="check hosts (ssh, Python, MPI, CUDA, ports, peers) and compare them")
    p.add_argument("spec")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_doctor)
