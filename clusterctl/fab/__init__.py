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
    from fabric.main import program

    chosen = any(a in _OWN_ROOT_FLAGS or a.split("=", 1)[0] in _OWN_ROOT_FLAGS for a in args)
    if not chosen:
        args = ["--search-root", fabfile_dir(), *args]
    program.run(["fab", *args])
