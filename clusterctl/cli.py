"""The `clusterctl` command: parse arguments, call one operation, render the result, map errors to exit codes."""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__
from .commands.core import PLAN_ROWS, cmd_exec, cmd_plan, cmd_validate, dumps_plan  # noqa: F401 (dumps_plan: API)
from .console import error, hold_std_fds, output_error, setup_logging, to_devnull, tolerate_encoding
from .errors import MAX_PROBLEMS_SHOWN, ClusterctlError, SpecError

__all__ = ["main", "build_parser", "guarded"]

# Modules that add their own subcommands with `add_cli(subparsers)`; missing ones are skipped.
_PLUGINS = ("clusterctl.testcluster_cli", "clusterctl.commands.lifecycle", "clusterctl.commands.provision", "clusterctl.demo",
            "clusterctl.k8s", "clusterctl.testcluster_slurm", "clusterctl.commands.top")
# The plugin that adds each command, so that `clusterctl status` imports that one plugin, not all of them
# (they cost up to ~0.2 s: yaml, rich, the spec models). A command missing here (a new one) or no command
# at all (`--help`) loads every plugin; tests/unit/test_plancache.py checks this table against the plugins.
_COMMAND_PLUGIN = {
    "testcluster": "clusterctl.testcluster_cli",
    **dict.fromkeys(("dispatch", "start", "status", "logs", "stop"), "clusterctl.commands.lifecycle"),
    **dict.fromkeys(("provision", "doctor"), "clusterctl.commands.provision"),
    "demo": "clusterctl.demo",
    "k8s": "clusterctl.k8s",
    "testcluster-slurm": "clusterctl.testcluster_slurm",
    "top": "clusterctl.commands.top",
}
_CORE_COMMANDS = ("validate", "plan", "exec")


class _Parser(argparse.ArgumentParser):
    """argparse's parser, except that help or version text that cannot be written (`--help > /dev/full`) is an
    OSError, not dropped by argparse on the way to exit 0 (its subcommands' parsers are of this class too)."""

    def _print_message(self, message, file=None):
        if message and file is sys.stdout:  # usage errors go to stderr as argparse has it (exit 2)
            file.write(message)
            file.flush()
        else:
            super()._print_message(message, file)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser, plugins included: all of them, or with `argv` given only the one (if any)
    that adds the command `argv` names."""
    parser = _Parser(prog="clusterctl", description="Run distributed training over SSH.")
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
    hold_std_fds()
    tolerate_encoding()
    if sys.stdout is None:  # started with `>&-`: `--help` was argparse's AttributeError traceback (see guarded)
        if sys.stderr is not None:
            error("standard output is closed")
        return 1
    parser = build_parser(argv)
    try:
        args = parser.parse_args(argv)
    except BrokenPipeError:  # `clusterctl --help | head -1`
        to_devnull(sys.stdout)
        return 0
    except OSError as failed:  # `--help > /dev/full` (_Parser)
        to_devnull(sys.stdout)
        error(f"cannot write the output: {failed.strerror or failed}")
        return 1
    setup_logging(args.verbose)
    return guarded(lambda: args.func(args))


def guarded(fn) -> int:
    """Run `fn` (an operation's front end returning an exit code) and turn clusterctl's errors into their
    message on stderr and their exit code: the one place where errors meet the terminal (CLI and fab)."""
    if sys.stdout is None or sys.stderr is None:  # started with `>&-` (`2>&-`: console.hold_std_fds, unless embedded)
        if sys.stderr is not None:
            error("standard output is closed")
        return 1
    try:
        code = int(fn() or 0)
        failed = output_error()
        if failed is not None:  # a line the command printed from another thread (`logs > /dev/full`)
            _drop_stdout()
            error(f"cannot write the output: {failed.strerror or failed}")
            return code or 1
        return code
    except SpecError as exc:
        from rich.markup import escape

        from .adhoc import ADHOC_SOURCE
        from .console import err, printable

        if exc.problems and all(p.file == ADHOC_SOURCE for p in exc.problems):  # no file: no line and column in one
            for p in exc.problems[:MAX_PROBLEMS_SHOWN]:
                error(f"-H: {p.path}: {p.message}" if p.path else f"-H: {p.message}")
            return exc.exit_code
        for line in exc.lines():  # one line each (the first 20, then a count), whatever the file's name holds
            err.print(escape(printable(line)))
        return exc.exit_code
    except ClusterctlError as exc:
        error(str(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        error("interrupted")
        return 130
    except OSError as exc:  # an output that cannot be written (`> /dev/full`), or a local file system's error
        _drop_stdout()
        error(f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else ""))
        return 1


def _drop_stdout() -> None:
    """Point stdout at /dev/null when it cannot take what is left in its buffer, so that the interpreter's exit
    does not fail on it again ("Exception ignored ... OSError")."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError, AttributeError):
        to_devnull(sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
