"""The `clusterctl` command: parse arguments, call one operation, render the result, map errors to exit codes."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from . import __version__
from .console import LinePrinter, error, setup_logging
from .errors import ClusterctlError, SpecError

__all__ = ["main", "build_parser", "guarded"]

# Modules that add their own subcommands with `add_cli(subparsers)`; missing ones are skipped.
_PLUGINS = ("clusterctl.testcluster_cli", "clusterctl.ops.lifecycle_cli", "clusterctl.ops.provision_cli", "clusterctl.demo",
            "clusterctl.k8s", "clusterctl.testcluster_slurm", "clusterctl.ops.top_cli")
# The plugin that adds each command, so that `clusterctl status` imports that one plugin, not all of them
# (they cost up to ~0.2 s: yaml, rich, the spec models). A command missing here (a new one) or no command
# at all (`--help`) loads every plugin; tests/unit/test_cli_fast.py checks this table against the plugins.
_COMMAND_PLUGIN = {
    "testcluster": "clusterctl.testcluster_cli",
    **dict.fromkeys(("dispatch", "start", "status", "logs", "stop"), "clusterctl.ops.lifecycle_cli"),
    **dict.fromkeys(("provision", "doctor"), "clusterctl.ops.provision_cli"),
    "demo": "clusterctl.demo",
    "k8s": "clusterctl.k8s",
    "testcluster-slurm": "clusterctl.testcluster_slurm",
    "top": "clusterctl.ops.top_cli",
}
_CORE_COMMANDS = ("validate", "plan", "exec")


def cmd_validate(args: argparse.Namespace) -> int:
    """Validate a spec; print a one-line summary."""
    from rich.markup import escape

    from .console import out
    from .backends import load_spec
    from .ops import plan_for

    spec = load_spec(args.spec, layout=False)  # plan_for lays it out (once) and reports its problems
    plan = plan_for(spec)
    out.print(
        f"{escape(args.spec)}: valid: job {spec.name} ({spec.job.mode}), {len(plan.hosts)} host(s), "
        f"{len(plan.pservers)} pserver(s), {len(plan.trainers)} trainer(s)"
    )
    return 0


# `plan` as a table lists at most this many processes unless --all is given.
PLAN_ROWS = 40


def dumps_plan(doc: dict) -> str:
    """JSON text of a plan document: indented, but one line per process (10,000 processes stay fast)."""
    parts = []
    for key, value in doc.items():
        if key == "processes":
            rows = ",\n".join("    " + json.dumps(p, separators=(", ", ": ")) for p in value)
            text = "[\n" + rows + "\n  ]" if value else "[]"
        else:
            text = json.dumps(value, indent=2).replace("\n", "\n  ")
        parts.append(f"  {json.dumps(key)}: {text}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the plan as a table (summarised when large) or as JSON."""
    from .backends import load_spec
    from .ops import plan_for

    plan = plan_for(load_spec(args.spec, layout=False))
    if args.json:
        sys.stdout.write(dumps_plan(plan.to_json(expand=args.expand)))
        return 0
    from rich.markup import escape
    from rich.table import Table

    from .console import out

    procs = plan.processes
    shown = procs if args.all or len(procs) <= PLAN_ROWS else procs[: PLAN_ROWS - 8] + procs[-8:]
    table = Table(title=f"job {plan.job} ({plan.mode})", title_justify="left")
    for col in ("host", "role", "id", "rank", "local", "endpoint", "gpus"):
        table.add_column(col, no_wrap=True)
    table.add_column("argv", overflow="fold", min_width=20)
    for i, p in enumerate(shown):
        if len(shown) < len(procs) and i == PLAN_ROWS - 8:
            table.add_row("…", "", "", "", "", "", "", f"{len(procs) - len(shown):,} more")
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
    if len(shown) < len(procs):
        lo, hi = min(len(plan.on_host(h)) for h in plan.hosts), max(len(plan.on_host(h)) for h in plan.hosts)
        out.print(
            f"{len(plan.hosts):,} hosts ({lo if lo == hi else f'{lo}-{hi}'} processes each), "
            f"{len(plan.pservers):,} pserver(s), {len(plan.trainers):,} trainer(s); showing {len(shown)} of "
            f"{len(procs):,} processes: --all lists every one, --json prints everything (env included)"
        )
    hosts = Table(title="connections (as `ssh -G` resolves them)", title_justify="left")
    for col in ("host", "user", "hostname", "port", "jump", "endpoints at"):
        hosts.add_column(col, no_wrap=True)
    listed = plan.hosts if args.all or len(plan.hosts) <= PLAN_ROWS else plan.hosts[:PLAN_ROWS]
    for h in listed:
        hosts.add_row(escape(h.address), escape(h.user), escape(h.connect_name), str(h.port),
                      escape(",".join(h.jump)) or "-", escape(h.endpoint_address))
    out.print(hosts)
    if len(listed) < len(plan.hosts):
        out.print(f"showing {len(listed)} of {len(plan.hosts):,} hosts: --all lists every one")
    if plan.mpi is not None:
        out.print(f"launcher: mpi, on {escape(plan.mpi.host.label)}: {escape(' '.join(plan.mpi.argv))}")
        out.print(f"hostfile {escape(plan.mpi.hostfile_path)}:\n{escape(plan.mpi.hostfile)}", end="")
    return 0


class _UsageError(ClusterctlError):
    """A command line argparse would have refused: exit 2, as argparse does."""

    exit_code = 2


def cmd_exec(args: argparse.Namespace) -> int:
    """Run a command on every host; exit with the worst host's exit code."""
    from .backends import ssh_session
    from .ops.execute import execute, worst_exit_code

    argv = args.argv
    if "--" in argv:  # exec's own options may also come after the spec: `exec SPEC --timeout 5 -- CMD`
        cut = argv.index("--")
        if cut:
            own = argparse.ArgumentParser(prog="clusterctl exec", add_help=False, exit_on_error=False)
            own.add_argument("--timeout", type=float, default=args.timeout)
            try:
                mine, unknown = own.parse_known_args(argv[:cut])
            except argparse.ArgumentError as exc:
                raise _UsageError(f"exec: {exc}") from None
            if unknown:
                raise _UsageError(f"exec: unknown option {' '.join(unknown)} (exec's options go before --, "
                                      "the command after it)")
            args.timeout = mine.timeout
        argv = argv[cut + 1:]
    if not argv:
        raise ClusterctlError("exec needs a command after --, e.g. clusterctl exec cluster.yaml -- hostname")
    with ssh_session(args.spec) as session:
        width = max(len(h.label) for h in session.plan.hosts)
        results = execute(session.remote, argv, on_line=LinePrinter(width), timeout=args.timeout)
    for host, res in results.items():
        if res.unreachable:
            error(res.stderr)
        elif res.exit_code:
            from rich.markup import escape

            from .console import err

            err.print(f"[yellow]\\[{escape(host.label)}] exit {res.exit_code}[/]")
    return worst_exit_code(results)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser, plugins included: all of them, or with `argv` given only the one (if any)
    that adds the command `argv` names."""
    parser = argparse.ArgumentParser(prog="clusterctl", description="Run distributed training over SSH.")
    parser.add_argument("--version", action="version", version=f"clusterctl {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("validate", help="check a spec; no connection is made")
    p.add_argument("spec")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("plan", help="show every process, id, endpoint, env and argv")
    p.add_argument("spec")
    p.add_argument("--json", action="store_true", help="machine-readable output (shared env factored out)")
    p.add_argument("--expand", action="store_true", help="with --json: every process's env in full")
    p.add_argument("--all", action="store_true", help=f"list every process (default: at most {PLAN_ROWS} rows)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("exec", help="run a command on every host")
    p.add_argument("spec")
    p.add_argument("--timeout", type=float, default=None, help="seconds per host")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    p.set_defaults(func=cmd_exec)

    for name in _plugins_for(argv):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.add_cli(sub)
    return parser


def _plugins_for(argv: list[str] | None) -> tuple[str, ...]:
    """The plugins to import to parse `argv` (None: all of them)."""
    for arg in argv if argv is not None else ():
        if arg in ("-h", "--help", "--version"):
            break  # the top-level help lists every command
        if not arg.startswith("-"):  # the only global option (-v) takes no value: this is the command
            if arg in _CORE_COMMANDS:
                return ()
            plugin = _COMMAND_PLUGIN.get(arg)
            return (plugin,) if plugin in _PLUGINS else _PLUGINS
    return _PLUGINS


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `clusterctl` console script."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    return guarded(lambda: args.func(args))


def guarded(fn) -> int:
    """Run `fn` (an operation's front end returning an exit code) and turn clusterctl's errors into their
    message on stderr and their exit code: the one place where errors meet the terminal (CLI and fab)."""
    try:
        return int(fn() or 0)
    except SpecError as exc:
        from rich.markup import escape

        from .console import err

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
