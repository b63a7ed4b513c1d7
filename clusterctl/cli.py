"""The `clusterctl` command: parse arguments, call one operation, render the result, map errors to exit codes."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from rich.markup import escape
from rich.table import Table

from . import __version__
from .console import LinePrinter, err, error, out, setup_logging
from .errors import ClusterctlError, SpecError

__all__ = ["main", "build_parser", "guarded"]

# Modules that add their own subcommands with `add_cli(subparsers)`; missing ones are skipped.
_PLUGINS = ("clusterctl.testcluster", "clusterctl.ops.lifecycle_cli", "clusterctl.ops.provision_cli", "clusterctl.demo")


def cmd_validate(args: argparse.Namespace) -> int:
    """Validate a spec; print a one-line summary."""
    from .ops import plan_for
    from .spec import load_spec

    spec = load_spec(args.spec)
    plan = plan_for(spec)
    out.print(
        f"{escape(args.spec)}: valid: job {spec.name} ({spec.job.mode}), {len(plan.hosts)} host(s), "
        f"{len(plan.pservers)} pserver(s), {len(plan.trainers)} trainer(s)"
    )
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the plan as a table or as JSON."""
    from .ops import plan_for
    from .spec import load_spec

    plan = plan_for(load_spec(args.spec))
    if args.json:
        sys.stdout.write(json.dumps(plan.to_json(), indent=2) + "\n")
        return 0
    table = Table(title=f"job {plan.job} ({plan.mode})", title_justify="left")
    for col in ("host", "role", "id", "rank", "local", "endpoint", "gpus"):
        table.add_column(col, no_wrap=True)
    table.add_column("argv", overflow="fold", min_width=20)
    for p in plan.processes:
        table.add_row(
            p.host.label,
            p.role,
            str(p.id),
            "" if p.rank is None else str(p.rank),
            str(p.local_rank),
            p.endpoint,
            ",".join(map(str, p.gpus)),
            escape(" ".join(p.argv)),
        )
    out.print(table)
    hosts = Table(title="connections (as `ssh -G` resolves them)", title_justify="left")
    for col in ("host", "user", "hostname", "port", "jump", "endpoints at"):
        hosts.add_column(col, no_wrap=True)
    for h in plan.hosts:
        hosts.add_row(escape(h.address), escape(h.user), escape(h.connect_name), str(h.port),
                      escape(",".join(h.jump)) or "-", escape(h.endpoint_address))
    out.print(hosts)
    if plan.mpi is not None:
        out.print(f"launcher: mpi, on {escape(plan.mpi.host.label)}: {escape(' '.join(plan.mpi.argv))}")
        out.print(f"hostfile {escape(plan.mpi.hostfile_path)}:\n{escape(plan.mpi.hostfile)}", end="")
    return 0


def cmd_exec(args: argparse.Namespace) -> int:
    """Run a command on every host; exit with the worst host's exit code."""
    from .ops import open_session
    from .ops.execute import execute, worst_exit_code

    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise ClusterctlError("exec needs a command after --, e.g. clusterctl exec cluster.yaml -- hostname")
    with open_session(args.spec) as session:
        width = max(len(h.label) for h in session.plan.hosts)
        results = execute(session.remote, argv, on_line=LinePrinter(width), timeout=args.timeout)
    for host, res in results.items():
        if res.exit_code == 255 and not res.stdout:
            error(res.stderr)
        elif res.exit_code:
            err.print(f"[yellow]\\[{escape(host.label)}] exit {res.exit_code}[/]")
    return worst_exit_code(results)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, plugins included."""
    parser = argparse.ArgumentParser(prog="clusterctl", description="Run distributed training over SSH.")
    parser.add_argument("--version", action="version", version=f"clusterctl {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("validate", help="check a spec; no connection is made")
    p.add_argument("spec")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("plan", help="show every process, id, endpoint, env and argv")
    p.add_argument("spec")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("exec", help="run a command on every host")
    p.add_argument("spec")
    p.add_argument("--timeout", type=float, default=None, help="seconds per host")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    p.set_defaults(func=cmd_exec)

    for name in _PLUGINS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `clusterctl` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    return guarded(lambda: args.func(args))


def guarded(fn) -> int:
    """Run `fn` (an operation's front end returning an exit code) and turn clusterctl's errors into their
    message on stderr and their exit code: the one place where errors meet the terminal (CLI and fab)."""
    try:
        return int(fn() or 0)
    except SpecError as exc:
        for problem in exc.problems:
            err.print(escape(str(problem)))
        return exc.exit_code
    except ClusterctlError as exc:
        error(str(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        error("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
