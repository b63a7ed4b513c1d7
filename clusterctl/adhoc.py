"""A spec built from a bare host list (`fab -H ip1,ip2 ...`): the seed-000 layout, no YAML needed.

One pserver and one trainer per host, pserver endpoints `ip:6173` (the seed's port), and the seed's
positional arguments: `ROLE PSERVER_ENDPOINTS CURRENT_ENDPOINT TRAINER_ID TRAINERS`.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

import yaml

from .errors import ClusterctlError, SpecError
from .spec import ClusterSpec, parse_spec

__all__ = ["AdhocOptions", "adhoc_spec_text", "adhoc_spec", "SEED_ARGS", "ADHOC_SOURCE"]

ADHOC_SOURCE = "<fab -H>"  # the name of a spec built from -H in its problems: no file, so no line and column
SEED_ARGS = ["{role}", "{pserver_endpoints}", "{current_endpoint}", "{trainer_id}", "{trainers}"]


@dataclass(frozen=True)
class AdhocOptions:
    """What `fab` tasks let a user set without a spec file. None: what the user's ssh config says."""

    name: str = "fabjob"
    user: str | None = None
    port: int | None = None
    identity_file: str | None = None
    known_hosts: str | None = None
    host_key_policy: str = "strict"
    ssh_config: str | None = None  # `fab -S FILE`; None: ssh's default config files
    connect_timeout: float | None = None  # `fab --connect-timeout N`; None: the spec's default
    entrypoint: str = "python3 dist_train_demo.py"
    workspace: str = "."
    remote_dir: str = "clusterctl/fabjob"  # relative to the login user's home: works for any user
    pserver_port: int = 6173
    positional: bool = True


def split_host(text: str) -> dict:
    """`[user@]host[:port]` as `fab -H` takes it -> a hosts[] entry of the spec."""
    from .spec import parse_jump

    try:
        user, host, port = parse_jump(text)
    except ValueError as exc:
        raise ClusterctlError(f"-H {text!r}: {exc}") from None  # quoted: `-H h:` read "-H h:: bad port"
    entry: dict = {"address": host}
    if user:
        entry["user"] = user
    if port:
        entry["port"] = port
    return entry


def adhoc_spec_text(hosts: list[str], opts: AdhocOptions) -> str:
    """The YAML of the spec (pure; shown by `fab plan`)."""
    port = opts.pserver_port
    ssh: dict = {"host_key_policy": opts.host_key_policy}
    for key in ("user", "port", "known_hosts", "identity_file", "connect_timeout"):
        if getattr(opts, key):
            ssh[key] = getattr(opts, key)
    if opts.ssh_config:
        ssh["config"] = opts.ssh_config
    spec = {
        "name": opts.name,
        "ssh": ssh,
        "hosts": [split_host(h) for h in hosts],
        "workspace": {"local": opts.workspace, "remote": opts.remote_dir},
        "job": {
            "mode": "pserver",
            "entrypoint": _words(opts.entrypoint),
            "args": SEED_ARGS if opts.positional else [],
            "pservers": {"per_host": 1},
            "trainers": 1,
            "ports": {"pserver": port, "trainer": port + 1, "master": port + 2, "control": port + 3},
        },
    }
    return yaml.safe_dump(spec, sort_keys=False)


def _words(entrypoint: str) -> list[str]:
    """`--entrypoint` split as a shell would, or a one-line error (an unclosed quote)."""
    try:
        return shlex.split(entrypoint)
    except ValueError as exc:
        raise ClusterctlError(f"--entrypoint: cannot split {entrypoint!r}: {exc}") from None


def adhoc_spec(hosts: list[str], opts: AdhocOptions, source: str = ADHOC_SOURCE) -> ClusterSpec:
    """Validated spec for `hosts`; relative paths resolve against the current directory. A value the spec
    refuses is one line naming the option that gave it, never a line of YAML the user never saw."""
    try:
        return parse_spec(adhoc_spec_text(hosts, opts), source)
    except SpecError as exc:
        lines = {}  # one line per option, its first problem
        for problem in exc.problems:
            given = _given(problem.path, hosts, opts)
            lines.setdefault(given, f"{given}: {problem.path}: {problem.message}" if given else str(problem))
        raise ClusterctlError("\n".join(lines.values())) from None


# the fab option behind each part of the spec built from -H (the first matching prefix of a problem's path)
_OPTIONS = (("hosts", "-H", None), ("name", "--name", "name"), ("job.entrypoint", "--entrypoint", "entrypoint"),
            ("job.ports", "--port", "pserver_port"), ("workspace.local", "--workspace", "workspace"),
            ("workspace.remote", "--remote-dir", "remote_dir"), ("ssh.known_hosts", "--known-hosts", "known_hosts"),
            ("ssh.identity_file", "-i", "identity_file"), ("ssh.config", "-S", "ssh_config"),
            ("ssh.connect_timeout", "--connect-timeout", "connect_timeout"))


def _given(path: str, hosts: list[str], opts: AdhocOptions) -> str:
    """`--port 70000`: the option and value a spec problem at `path` comes from ("" if none does)."""
    for prefix, option, field in _OPTIONS:
        if path == prefix or path.startswith((prefix + ".", prefix + "[")):
            value = ",".join(hosts) if field is None else str(getattr(opts, field))
            return f"{option} {shlex.quote(value)}"
    return ""
