"""A spec built from a bare host list (`fab -H ip1,ip2 ...`): the seed-000 layout, no YAML needed.

One pserver and one trainer per host, pserver endpoints `ip:6173` (the seed's port), and the seed's
positional arguments: `ROLE PSERVER_ENDPOINTS CURRENT_ENDPOINT TRAINER_ID TRAINERS`.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

import yaml

from .spec import ClusterSpec, parse_spec

__all__ = ["AdhocOptions", "adhoc_spec_text", "adhoc_spec", "SEED_ARGS"]

SEED_ARGS = ["{role}", "{pserver_endpoints}", "{current_endpoint}", "{trainer_id}", "{trainers}"]


@dataclass(frozen=True)
class AdhocOptions:
    """What `fab` tasks let a user set without a spec file."""

    name: str = "fabjob"
    user: str = "root"
    port: int = 22
    identity_file: str | None = None
    known_hosts: str = "~/.ssh/known_hosts"
    host_key_policy: str = "strict"
    entrypoint: str = "python3 dist_train_demo.py"
    workspace: str = "."
    remote_dir: str = "/root/work"
    pserver_port: int = 6173
    positional: bool = True


def adhoc_spec_text(hosts: list[str], opts: AdhocOptions) -> str:
    """The YAML of the spec (pure; shown by `fab plan`)."""
    port = opts.pserver_port
    ssh = {
        "user": opts.user,
        "port": opts.port,
        "known_hosts": opts.known_hosts,
        "host_key_policy": opts.host_key_policy,
    }
    if opts.identity_file:
        ssh["identity_file"] = opts.identity_file
    spec = {
        "name": opts.name,
        "ssh": ssh,
        "hosts": [{"address": h} for h in hosts],
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
