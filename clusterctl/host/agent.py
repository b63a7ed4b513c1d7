#!/usr/bin/env python3
"""clusterctl host agent: a per-host, per-job supervisor for training processes.

The package this module belongs to (clusterctl/host, stdlib only) is uploaded to every host of a job and
run there with the host's ``python3`` (>= 3.9); this module is its command line.  Each subcommand lives in
its own module, imported only when it runs (``status`` never imports the supervisor).

Subcommands (each prints exactly one JSON object on stdout, except ``logs``)::

    launch JOBFILE                 start the supervisor daemon for the job
    run JOBFILE                    run the supervisor in the foreground (Slurm tasks, Kubernetes pods)
    up                             start in one round trip: the job document on stdin (see up.py)
    status JOBDIR                  job and per-process state
    stop JOBDIR [--grace S]        SIGTERM groups, SIGKILL after grace, sweep by environ
    preflight JOBFILE              ports / entrypoints / log dirs problems
    wait-ports HOST:PORT,... --timeout S
    logs JOBDIR [--follow] [--role R] [--id N] [-n LINES] [--host-label H]
    top JOBDIR [--progress-only] [--slice S] [--slices N] [--wait S] [--no-gpu]

Exit codes: 0 success, 1 the operation did not succeed (details in the JSON),
2 bad input (JSON ``{"ok": false, "error": ...}``), 3 internal error.
See docs/agent.md for the design and the full JSON contract.
"""

if __name__ == "__main__" and not __package__:
    # Run as a file (python3 .../agent.py): import the package this file is part of, so that the
    # relative imports below work (PEP 366), with the package's own directory off sys.path.
    import os
    import sys

    _here = os.path.dirname(os.path.abspath(__file__))
    _top, _parts = _here, []
    while os.path.isfile(os.path.join(_top, "__init__.py")):
        _top, _name = os.path.split(_top)
        _parts.insert(0, _name)
    if sys.path and os.path.abspath(sys.path[0] or ".") == _here:
        sys.path[0] = _top
    else:
        sys.path.insert(0, _top)
    __package__ = ".".join(_parts)
    __import__(__package__)

import importlib
import sys
import types

from .common import InputError, UsageError, emit

__all__ = ["main", "build_parser"]

# Subcommands that take no arguments, run without argparse: `up` is every start's command on every host, and
# argparse (its import, gettext's, and building the parser) was ~10 ms of the host's CPU for it, a sixth of the
# command. Anything else after them (`up --help`, `up x`) goes through the parser, and its errors, as before.
_NO_ARGUMENTS = {"up": ("up", "cmd_up")}

# names other code (and tests) take from this module, each from the module that defines it (loaded on use)
_MOVED = {
    "load_job": "jobfile", "validate_job": "jobfile", "parse_endpoint": "jobfile", "format_endpoint": "jobfile",
    "tagged_processes": "procfs", "proc_stat": "procfs", "pid_alive": "procfs",
    "auth_proof": "protocol", "PROTOCOL_VERSION": "protocol",
    "attempt_log": "spawn", "process_token": "spawn", "Policy": "policy",
    "Stopper": "stopping", "Supervisor": "supervisor", "describe": "jobdir", "read_state": "jobdir",
    "preflight": "preflight",
}


def __getattr__(name):
    """The names that moved out of this module (PEP 562): loaded from their own module on first use."""
    if name in _MOVED:
        return getattr(importlib.import_module("." + _MOVED[name], __package__), name)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def build_parser():
    """The agent's argparse parser."""
    import argparse

    from .jobfile import ROLES

    class _Parser(argparse.ArgumentParser):
        """argparse, with errors raised as UsageError (one JSON object on stdout) instead of printed."""

        def error(self, message):  # argparse would print usage and exit 2 with text
            raise UsageError("%s: %s" % (self.prog, message))

    p = _Parser(prog="agent.py", description="clusterctl host agent (see docs/agent.md)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    s = sub.add_parser("launch", help="start the job's supervisor on this host")
    s.add_argument("jobfile")
    s.set_defaults(func=("launch", "cmd_launch"))

    s = sub.add_parser("run", help="run the job's supervisor in the foreground (exit code: the job's outcome)")
    s.add_argument("jobfile")
    s.add_argument("--preflight", choices=("all", "files"), default=None,
                   help="check the job on this host first; its problems fail the first attempt (files: no port binds)")
    s.set_defaults(func=("launch", "cmd_run"))

    s = sub.add_parser("up", help="start's one round trip: check, write the job file (stdin), preflight, launch")
    s.set_defaults(func=("up", "cmd_up"))

    s = sub.add_parser("status", help="job state on this host")
    s.add_argument("jobdir")
    s.set_defaults(func=("jobdir", "cmd_status"))

    s = sub.add_parser("stop", help="stop the job on this host (idempotent)")
    s.add_argument("jobdir")
    s.add_argument("--grace", type=float, default=None, help="seconds between SIGTERM and SIGKILL")
    s.add_argument("--job", default=None, help="job id to sweep when the job dir has no state")
    s.set_defaults(func=("stopping", "cmd_stop"))

    s = sub.add_parser("preflight", help="check ports, entrypoints, log dirs")
    s.add_argument("jobfile")
    s.set_defaults(func=("preflight", "cmd_preflight"))

    s = sub.add_parser("wait-ports", help="wait until endpoints accept TCP connections")
    s.add_argument("endpoints", help="HOST:PORT[,HOST:PORT...]")
    s.add_argument("--timeout", type=float, default=60.0)
    s.set_defaults(func=("preflight", "cmd_wait_ports"))

    s = sub.add_parser("logs", help="prefixed, multiplexed process logs")
    s.add_argument("jobdir")
    s.add_argument("--follow", "-f", action="store_true")
    s.add_argument("--role", choices=ROLES)
    s.add_argument("--id", type=int)
    s.add_argument("-n", dest="lines", type=int, default=None, help="only the last LINES lines of each file")
    s.add_argument("--host-label", default=None)
    s.add_argument("--interval", type=float, default=0.2, help=argparse.SUPPRESS)
    s.set_defaults(func=("logtail", "cmd_logs"))

    s = sub.add_parser("top", help="job state with each process's resources and progress", add_help=False)
    s.add_argument("args", nargs=argparse.REMAINDER)  # topsnap.parse_args reads them
    s.set_defaults(func=("topsnap", "cmd_top"))
    return p


def main(argv=None):
    """Run one subcommand; return the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if len(argv) == 1 and argv[0] in _NO_ARGUMENTS:
            module, name = _NO_ARGUMENTS[argv[0]]
            args = types.SimpleNamespace(command=argv[0], func=(module, name))  # what parse_args would give
        else:
            args = build_parser().parse_args(argv)
            module, name = args.func
        return getattr(importlib.import_module("." + module, __package__), name)(args)
    except InputError as e:
        emit({"ok": False, "error": str(e)})
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug: still one JSON object on stdout, details on stderr
        import traceback

        traceback.print_exc()
        emit({"ok": False, "error": "internal error: %s: %s" % (type(e).__name__, e)})
        return 3


if __name__ == "__main__":
    sys.exit(main())
