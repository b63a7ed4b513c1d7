"""A spec built from a bare host list (`fab -H ip1,ip2 ...`): the seed-000 layout, no YAML needed.

One pserver and one trainer per host, pserver endpoints `ip:6173` (the seed's port), and the seed's
positional arguments: `ROLE PSERVER_ENDPOINTS CURRENT_ENDPOINT TRAINER_ID TRAINERS`.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

import yaml

from .errors import ClusterctlError
from .spec import ClusterSpec, parse_spec

__all__ = ["AdhocOptions", "adhoc_spec_text", "adhoc_spec", "SEED_ARGS"]

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
        raise ClusterctlError(f"-H {text}: {exc}") from None
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
    for key in ("user", "port", "known_hosts", "identity_file"):
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
            "entrypoint": shlex.split(opts.entrypoint),
            "args": SEED_ARGS if opts.positional else [],
            "pservers": {"per_host": 1},
            "trainers": 1,
            "ports": {"pserver": port, "trainer": port + 1, "master": port + 2, "control": port + 3},
        },
    }
    return yaml.safe_dump(spec, sort_keys=False)


def adhoc_spec(hosts: list[str], opts: AdhocOptions, source: str = "<fab -H>") -> ClusterSpec:
    """Validated spec for `hosts`; relative paths resolve against the current directory."""
    return parse_spec(adhoc_spec_text(hosts, opts), source)
