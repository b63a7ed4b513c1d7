"""The fab workflow for an installed clusterctl: `clusterctl-fab -H ip1,ip2 start` is `fab` with clusterctl's fabfile.

The fabfile is package data (`clusterctl/fab/fabfile.py`, the repository's top-level fabfile.py), so it
works from any directory without a checkout. Plain `fab` finds it too:
`fab --search-root "$(clusterctl-fab --where)" -H ip1,ip2 start`. A `-r/--search-root` or `-c/--collection`
given on the command line wins (your own fabfile).
"""

from __future__ import annotations

import sys
from importlib import resources

__all__ = ["fabfile_dir", "main"]

_OWN_ROOT_FLAGS = ("-r", "--search-root", "-c", "--collection")


def fabfile_dir() -> str:
    """The installed directory that holds clusterctl's fabfile.py."""
    return str(resources.files(__package__))


def main(argv: list[str] | None = None) -> None:
    """Run Fabric's `fab` program with clusterctl's fabfile (unless the command line names another)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--where"]:
        print(fabfile_dir())
        return
    chosen = any(a in _OWN_ROOT_FLAGS or a.split("=", 1)[0] in _OWN_ROOT_FLAGS for a in args)
    if not chosen:
        args = ["--search-root", fabfile_dir(), *args]
    _program().run(["fab", *args])


def _program():
    """Fabric's `fab` program, plus a `--spec FILE` before the task names (`clusterctl-fab --spec cluster.yaml
    provision`, as a task's own `--spec` after its name); a missing `-S FILE`, or a word where Invoke wants a
    number, is one line instead of a traceback."""
    from fabric import Config, Executor, __version__
    from fabric.main import Fab
    from invoke import Argument, Exit

    class ClusterFab(Fab):
        def core_args(self):
            return [*super().core_args(), Argument(names=("spec",), help="a cluster spec (YAML) for every task")]

        def parse_core(self, *args, **kwargs):
            try:
                super().parse_core(*args, **kwargs)
            except ValueError as exc:  # Invoke converts --connect-timeout and -T/--command-timeout itself
                raise Exit(f"clusterctl: error: a whole number was expected: {exc}", code=1) from None

        def update_config(self):
            try:
                super().update_config()
            except FileNotFoundError as exc:  # Fabric's own `-S` check, a traceback otherwise
                raise Exit(f"clusterctl: error: ssh config {exc.filename}: no such file", code=1) from None

    return ClusterFab(name="Fabric", version=__version__, executor_class=Executor, config_class=Config)
