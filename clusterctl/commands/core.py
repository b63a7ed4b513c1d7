"""The commands every spec has whatever its backend: validate, plan, exec (cli.py parses them)."""

from __future__ import annotations

import argparse
import json
import sys

from ..console import LinePrinter, error, note
from ..errors import UsageError

__all__ = ["cmd_validate", "cmd_plan", "cmd_exec", "dumps_plan", "PLAN_ROWS"]


def cmd_validate(args: argparse.Namespace) -> int:
    """Validate a spec; print a one-line summary."""
    from rich.markup import escape

    from ..console import out
    from ..backends import load_spec
    from ..ops import plan_for

    spec = load_spec(args.spec, layout=False)  # plan_for lays it out (once) and reports its problems
    plan = plan_for(spec)
    out.print(
        f"{escape(args.spec)}: valid: job {spec.name} ({spec.job.mode}), {len(plan.hosts)} host(s), "
        f"{len(plan.pservers)} pserver(s), {len(plan.trainers)} trainer(s)"
    )
    for line in plan.notes:
        note(line)
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
    from ..backends import load_spec
    from ..ops import plan_for

    if args.expand and not args.json:  # the table shows no env: the flag would be dropped without a word
        raise UsageError("plan: --expand goes with --json (the table shows no environment)")
    spec = load_spec(args.spec, layout=False)
    plan = plan_for(spec)
    for line in plan.notes:
        note(line)
    if args.json:
        sys.stdout.write(dumps_plan(plan.to_json(expand=args.expand)))
        return 0
    from rich.table import Table

    from ..console import markup_safe as escape  # rich's escape and control characters (ESC, BEL...) shown escaped
    from ..console import out

    procs = plan.processes
    shown = procs if args.all or len(procs) <= PLAN_ROWS else procs[: PLAN_ROWS - 8] + procs[-8:]
    from ..backends import backend_class

    placement = backend_class(spec.backend).placement(spec, plan)
    if placement is not None:  # not on the plan's hosts (Kubernetes: a pod per process)
        return _plan_places(plan, placement, placement.count > PLAN_ROWS and not args.all)
    table = Table(title=f"job {plan.job} ({plan.mode})", title_justify="left")
    for col in ("host", "role", "id", "rank", "local", "endpoint", "gpus"):
        table.add_column(col, no_wrap=True)
    table.add_column("argv", overflow="fold", min_width=20)
    for i, p in enumerate(shown):
        if len(shown) < len(procs) and i == PLAN_ROWS - 8:
            table.add_row("…", "", "", "", "", "", "", f"{len(procs) - len(shown):,} more")
        table.add_row(
            escape(p.host.label),
            p.role,
            str(p.id),
            "" if p.rank is None else str(p.rank),
            str(p.local_rank),
            escape(p.endpoint),  # an IPv6 one, `[fd00::5]:6180`, would read as a markup tag
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
        hostfile = "".join(escape(line) + "\n" for line in plan.mpi.hostfile.splitlines())
        out.print(f"hostfile {escape(plan.mpi.hostfile_path)}:\n{hostfile}", end="")
    return 0


def _plan_places(plan, placement, summarised: bool) -> int:
    """`plan` of a backend whose processes run elsewhere than on the plan's hosts (Backend.placement): its places,
    not the SSH hosts and connections they never use."""
    from rich.table import Table

    from ..console import markup_safe as escape  # rich's escape and control characters shown escaped
    from ..console import out

    n = placement.count
    shown = [*range(PLAN_ROWS - 8), *range(n - 8, n)] if summarised else range(n)
    table = Table(title=f"job {plan.job} ({plan.mode}), {escape(placement.title)}", title_justify="left")
    for col in (placement.called, "role", "id", "rank", "endpoint", "gpus"):
        table.add_column(col, no_wrap=True)
    table.add_column("argv", overflow="fold", min_width=20)
    for k, i in enumerate(shown):
        if summarised and k == PLAN_ROWS - 8:
            table.add_row("…", "", "", "", "", "", f"{n - len(shown):,} more")
        table.add_row(*(escape(cell) for cell in placement.row(i)))
    out.print(table)
    shows = f"showing {len(shown)} of {n:,} (--all lists every one); " if summarised else ""
    out.print(escape(shows + placement.note))
    return 0


#: `exec --timeout`'s upper bound (a week): beyond it a deadline is a mistake, and at inf it overflows the clock.
MAX_EXEC_TIMEOUT_S = 7 * 24 * 3600


def cmd_exec(args: argparse.Namespace) -> int:
    """Run a command on every host; exit with the worst host's exit code."""
    from ..backends import ssh_session
    from ..ops.execute import execute, worst_exit_code

    argv = args.argv
    if "--" in argv:  # exec's own options may also come after the spec: `exec SPEC --timeout 5 -- CMD`
        cut = argv.index("--")
        if cut:
            own = argparse.ArgumentParser(prog="clusterctl exec", add_help=False, exit_on_error=False)
            own.add_argument("--timeout", type=float, default=args.timeout)
            try:
                mine, unknown = own.parse_known_args(argv[:cut])
            except argparse.ArgumentError as exc:
                raise UsageError(f"exec: {exc}") from None
            if unknown:
                raise UsageError(f"exec: unknown option {' '.join(unknown)} (exec's options go before --, "
                                      "the command after it)")
            args.timeout = mine.timeout
        argv = argv[cut + 1:]
    elif argv and argv[0].startswith("-"):  # `exec SPEC --timeout 5 hostname`: argparse took it all as the command
        raise UsageError(f"exec: {argv[0]} is not a command: exec's options go before --, the command after it "
                         "(clusterctl exec SPEC --timeout 5 -- hostname)")
    if not argv or not argv[0].strip():  # `exec SPEC -- "$CMD"`, CMD unset: no program to run
        raise UsageError("exec needs a command after --, e.g. clusterctl exec cluster.yaml -- hostname")
    if args.timeout is not None and not 0 < args.timeout <= MAX_EXEC_TIMEOUT_S:  # also NaN: no comparison holds
        # coreutils `timeout 0` runs without a limit, a negative one is an option to it, inf overflows the clock
        raise UsageError(f"exec: --timeout must be more than 0 and at most {MAX_EXEC_TIMEOUT_S} seconds, "
                          f"not {args.timeout:g}")
    with ssh_session(args.spec) as session:
        width = max(len(h.label) for h in session.plan.hosts)
        results = execute(session.remote, argv, on_line=LinePrinter(width), timeout=args.timeout)
    for host, res in results.items():
        if res.unreachable:
            error(res.stderr)
        elif res.exit_code:
            from rich.markup import escape

            from ..console import err

            # coreutils `timeout` (exec --timeout) exits 124 when the time is up, 137 when it had to kill; a command
            # that exits so itself sooner is not said to have run out of time
            ended = (f" (--timeout {args.timeout:g}s)" if args.timeout is not None and res.exit_code in (124, 137)
                     and res.seconds >= args.timeout else "")
            err.print(f"[yellow]\\[{escape(host.label)}] exit {res.exit_code}{escape(ended)}[/]")
    return worst_exit_code(results)
