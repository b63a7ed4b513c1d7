"""Host-side helper scripts (stdlib-only Python files) installed on demand, content-addressed."""

from __future__ import annotations

import hashlib
import json
from importlib import resources

from ..quoting import quote
from ..remote import Remote

__all__ = ["tool_path", "ensure_tools", "tool_command", "TOOLS_DIR"]

TOOLS_DIR = ".clusterctl/bin"  # relative to the remote user's home (ssh sessions start there)


def _source(module: str) -> bytes:
    return resources.files("clusterctl.host" if module != "slurmjob" else "clusterctl").joinpath(f"{module}.py").read_bytes()


def tool_path(module: str) -> str:
    """Remote path of host tool `module` (e.g. 'hostws'), named by a hash of its content."""
    digest = hashlib.sha256(_source(module)).hexdigest()[:12]
    return f"{TOOLS_DIR}/{module}-{digest}.py"


_INSTALL = """\
import json, os, sys
inp = sys.stdin.buffer
sizes = json.loads(inp.readline())
for path, size in sizes:
    data = inp.read(size)
    if len(data) != size:
        sys.exit("short read installing " + path)
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "wb") as fh:
            fh.write(data)
        os.replace(path + ".tmp", path)
"""


def ensure_tools(remote: Remote, modules: tuple[str, ...], hosts=None, *, check: bool = True) -> dict[str, str]:
    """Make sure each host has the current version of each tool; one round trip. Returns module → path."""
    paths = {m: tool_path(m) for m in modules}
    sources = [_source(m) for m in modules]
    header = json.dumps([[paths[m], len(src)] for m, src in zip(modules, sources)]).encode() + b"\n"
    remote.run(
        f"python3 -c {quote(_INSTALL)}",
        hosts=hosts,
        stdin=header + b"".join(sources),
        check=check,
        timeout=remote.control_timeout,
        what="installing clusterctl's host tools (needs python3 on the host)",
    )
    return paths


def tool_command(module: str, args: list[str]) -> tuple[str, bytes]:
    """One shell line that installs host tool `module` if missing, then runs it; and the stdin it needs.

    Saves a round trip over ensure_tools() + run. The tool's stdin is not available to it (the payload
    is), so use this only for commands that read no stdin.
    """
    from ..quoting import join

    path = tool_path(module)
    src = _source(module)
    header = json.dumps([[path, len(src)]]).encode() + b"\n"
    line = f"{{ test -f {quote(path)} || python3 -c {quote(_INSTALL)}; }} && {join(['python3', path, *args])}"
    return line, header + src
