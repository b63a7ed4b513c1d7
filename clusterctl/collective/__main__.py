"""``python -m clusterctl.collective [-m MODULE | -c CODE | SCRIPT] [ARGS...]``: run an unmodified MPI program
as one rank of the job's MPI world under clusterctl's ssh launcher.

It does what ``clusterctl.collective.init()`` does before MPI starts (joins the PMI server of rank 0 on
MASTER_ADDR:MASTER_PORT, so ``MPI_Init`` gives every rank one ``MPI_COMM_WORLD``), then runs the program
as ``python`` would, like ``python -m mpi4py``: plain mpi4py scripts, ``mpi4py.futures`` and mpi4py's
own test suite need no change.  Under mpiexec (or any MPI launcher) it only runs the program.
Timeout: ``CLUSTERCTL_COLLECTIVE_TIMEOUT`` (seconds, default 300).
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python -m clusterctl.collective [-m MODULE | -c CODE | SCRIPT] [ARGS...]"


def main(argv: list[str]) -> int:
    """Join the MPI world, then run the module, code or script given in ``argv``."""
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{__doc__.split(chr(10) + chr(10))[1]}", file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    if argv[0] in ("-m", "-c") and len(argv) < 2:
        print(f"python -m clusterctl.collective: {argv[0]} needs an argument\n{USAGE}", file=sys.stderr)
        return 2
    from ._mpi import DEFAULT_TIMEOUT, TIMEOUT_ENV, _env_float
    from .errors import CollectiveError
    from .rendezvous import prepare_environment
    try:
        prepare_environment(timeout=_env_float(TIMEOUT_ENV, DEFAULT_TIMEOUT))
    except CollectiveError as e:
        print(f"clusterctl.collective: {e}", file=sys.stderr)
        return 1
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path.insert(0, "")
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
