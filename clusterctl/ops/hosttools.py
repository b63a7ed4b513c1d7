"""The host side on the hosts: the host package (clusterctl/host, stdlib only) uploaded as one content-addressed
directory, and run from there.

On a host, the package lives in ``~/.clusterctl/bin/host-<hash>/clusterctl_host/``: the directory is named by
a hash of every file of the package, so a host holds each version once, a new version is a new directory,
and concurrent installs race harmlessly (each writes a private temporary directory and renames it into
place; the loser removes its copy). The package is uploaded under the name ``clusterctl_host``, never
``clusterctl``, and run with ``python3 -S -E``, so a clusterctl (or anything else) installed on the host,
on PYTHONPATH or in site-packages, is never imported by mistake; inside the package every import is
relative. Tools run as imported modules, not as scripts, so Python keeps their bytecode in __pycache__
beside them (a script is compiled on every run): `agent status` took 37.8 ms (median) instead of 78.4 ms
for the single-file agent and 52.0 ms for a zipapp (docs/benchmarks.md, "Host package upload").

Under Slurm the package travels inside the batch script instead (clusterctl/ops/slurm.py), to the same
``~/.clusterctl/bin/host-<hash>/`` on every node.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import zlib

from ..host.unpack import IMPORTS, INSTALL
from ..quoting import join, quote
from ..remote import Remote

__all__ = ["tool_path", "tool_argv", "package_dir", "ensure_tools", "install_on", "tool_command", "TOOLS_DIR", "HOST_PACKAGE"]

TOOLS_DIR = ".clusterctl/bin"  # relative to the remote user's home (ssh sessions start there)
HOST_PACKAGE = "clusterctl_host"  # the host package's name on hosts: never the controller's own `clusterctl`

# argv: package directory, module, the tool's arguments. The package directory is made absolute (the agent's
# supervisor changes to / after it daemonizes), and replaces the -c entry ('' = the cwd) on sys.path.
_RUN = ("import os, sys; sys.path[0] = os.path.abspath(sys.argv[1]); "
        f"sys.exit(__import__('{HOST_PACKAGE}.' + sys.argv[2], fromlist=['main']).main(sys.argv[3:]))")
# The same, ending with os._exit once the tool's output is flushed: no interpreter teardown (freeing every module
# and object: ~5 ms of the host's CPU, a tenth of `agent up`, the command every start runs on every host). Only
# for tools that leave no thread, atexit handler or unflushed file behind when main() returns.
_RUN_QUICK_EXIT = ("import os, sys; sys.path[0] = os.path.abspath(sys.argv[1]); "
                   f"c = __import__('{HOST_PACKAGE}.' + sys.argv[2], fromlist=['main']).main(sys.argv[3:]); "
                   "sys.stdout.flush(); sys.stderr.flush(); os._exit(c or 0)")

# the host package's installer over ssh: its stdin is _package_payload()
_INSTALL = (IMPORTS + INSTALL + "inp = sys.stdin.buffer\nhead = json.loads(inp.readline())\n"
            "install(head, inp.read(head['size']), head['dir'], 'clusterctl')\n")


@functools.cache
def _package() -> tuple[str, tuple[tuple[str, int], ...], bytes, str]:
    """(content hash, ((path in the upload, size), ...), the files back to back, their sha256) of the host package."""
    from .. import host

    here = os.path.dirname(os.path.abspath(host.__file__))
    if os.path.isdir(here):  # a checkout or an installed wheel: plain files (no importlib.resources, ~4 ms to import)
        files = []
        for name in sorted(os.listdir(here)):
            if name.endswith(".py"):
                with open(os.path.join(here, name), "rb") as f:
                    files.append((name, f.read()))
    else:  # imported from an archive
        from importlib import resources

        root = resources.files("clusterctl.host")
        files = sorted((entry.name, entry.read_bytes()) for entry in root.iterdir() if entry.name.endswith(".py"))
    digest = hashlib.sha256()
    for name, data in files:
        digest.update(b"%s\0%d\0" % (name.encode(), len(data)))
        digest.update(data)
    data = b"".join(d for _, d in files)
    layout = tuple((f"{HOST_PACKAGE}/{name}", len(d)) for name, d in files)
    return digest.hexdigest()[:16], layout, data, hashlib.sha256(data).hexdigest()


def package_dir() -> str:
    """Remote directory of this version of the host package (it holds clusterctl_host/), relative to the home."""
    return f"{TOOLS_DIR}/host-{_package()[0]}"


def tool_path(module: str) -> str:
    """Remote path of host module `module` (e.g. 'hostws'): inside this version's package directory."""
    return f"{package_dir()}/{HOST_PACKAGE}/{module}.py"


def tool_argv(module: str, args: list[str], *, quick_exit: bool = False) -> list[str]:
    """The argv that runs host tool `module` (agent, hostws) with `args` on a host where the package is installed;
    `quick_exit`: skip the interpreter's teardown once main() returned (see _RUN_QUICK_EXIT)."""
    return ["python3", "-S", "-E", "-c", _RUN_QUICK_EXIT if quick_exit else _RUN, package_dir(), module, *args]


@functools.cache
def _package_payload() -> bytes:
    """The install script's stdin for the host package: a JSON line, then the files, zlib-compressed."""
    _, layout, data, sha = _package()
    blob = zlib.compress(data, 6)
    head = {"dir": package_dir(), "files": [list(f) for f in layout], "size": len(blob), "sha256": sha}
    return json.dumps(head).encode() + b"\n" + blob


def _install(modules: tuple[str, ...] | list[str]) -> tuple[str, bytes]:
    """The shell command that installs what `modules` need where missing, and the stdin it reads."""
    if not modules:
        return "true", b""
    return f"{{ test -d {quote(package_dir())} || python3 -S -E -c {quote(_INSTALL)}; }}", _package_payload()


def ensure_tools(remote: Remote, modules: tuple[str, ...], hosts=None, *, check: bool = True) -> dict[str, str]:
    """Make sure each host has the current host package; one round trip. Returns module → path."""
    _run_install(remote, modules, hosts, check)
    return {m: tool_path(m) for m in modules}


def install_on(remote: Remote, modules: tuple[str, ...], hosts) -> dict:
    """ensure_tools() that never raises: each host's Result of the install (failed ones: unreachable, or no
    python3), so that a caller can go on with the hosts that have the tools."""
    return _run_install(remote, modules, hosts, False)


def _run_install(remote: Remote, modules: tuple[str, ...], hosts, check: bool) -> dict:
    cmd, payload = _install(modules)
    return remote.run(cmd, hosts=hosts, stdin=payload, check=check, timeout=remote.control_timeout,
                      what="installing clusterctl's host tools")  # each host's cause follows (python3: not found, ...)


def tool_command(module: str, args: list[str]) -> tuple[str, bytes]:
    """One shell line that installs host tool `module` if missing, then runs it; and the stdin it needs.

    Saves a round trip over ensure_tools() + run. The tool's stdin is not available to it (the payload
    is), so use this only for commands that read no stdin.
    """
    install, payload = _install((module,))
    return f"{install} && {join(tool_argv(module, args))}", payload
