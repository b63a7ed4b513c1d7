"""The whole spec as validated, typed, frozen objects: ClusterSpec and the section models it is made of.

Imports neither the plan nor the loading: clusterctl.plan and the semantic checks work on these."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from .backends import KubernetesSpec, KubernetesVolumeSpec, SlurmSpec
from .fields import _Model
from .hosts import HostSpec, SshSpec
from .job import CONTRACT_ENV, PLACEHOLDERS, RESTART_ENV, DataSpec, JobSpec, PortsSpec, PserversPerHost, WorkspaceSpec

__all__ = ["ClusterSpec", "SshSpec", "HostSpec", "JobSpec", "PortsSpec", "PserversPerHost", "WorkspaceSpec", "DataSpec",
           "KubernetesSpec", "KubernetesVolumeSpec", "SlurmSpec", "PLACEHOLDERS", "CONTRACT_ENV", "RESTART_ENV"]


NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z")


class ClusterSpec(_Model):
    """A whole cluster spec. `source` is the file it came from (for messages and relative paths)."""

    name: str
    backend: Literal["ssh", "slurm", "local", "kubernetes"] = "ssh"  # clusterctl.backends' registry (a unit test keeps them equal)
    slurm: SlurmSpec | None = None
    ssh: SshSpec = SshSpec()
    hosts: tuple[HostSpec, ...] = ()
    hostfile: str | None = None
    workspace: WorkspaceSpec = WorkspaceSpec()
    data: DataSpec | None = None
    job: JobSpec
    # A ProvisionSpec, validated by parse_spec: its schema is built (and its ~70 ms paid) only by specs
    # that have a provision: section.
    provision: Any = None
    kubernetes: KubernetesSpec | None = None
    source: str = Field("<spec>", exclude=True)
    # the YAML it came from, with every key's line:column (clusterctl.yamlpos.Located): set by the loader, so
    # that checks made later (a backend's keys: clusterctl.backends) still point at the spec's lines
    _located: Any = PrivateAttr(default=None)

    @property
    def located(self):
        """The spec's YAML with positions (None for a spec built in code)."""
        return self._located

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError("use 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit")
        return v

    @model_validator(mode="before")
    @classmethod
    def _slurm_shapes(cls, data: Any) -> Any:
        return _slurm_shapes(data)

    @model_validator(mode="after")
    def _defaults(self) -> "ClusterSpec":
        if not self.workspace.remote:
            ws = self.workspace.model_copy(update={"remote": f"clusterctl/{self.name}"})
            object.__setattr__(self, "workspace", ws)
        if self.slurm is not None:  # Slurm places the nodes (a slurm: section under another backend is refused)
            object.__setattr__(self, "hosts", _slurm_hosts(self.slurm, self.hosts))
        return self

    @property
    def base_dir(self) -> Path:
        """Directory that relative paths in the spec are resolved against."""
        return Path.cwd() if self.source.startswith("<") else Path(self.source).resolve().parent

    def local_path(self, value: str) -> Path:
        """Resolve a controller-side path from the spec (`~` expanded, relative to the spec file)."""
        p = Path(value).expanduser()
        return p if p.is_absolute() else self.base_dir / p


def _slurm_shapes(data: Any) -> Any:
    """With a slurm: section, hosts: entries give only the shape of node i: one without an address gets node
    i's placeholder (an address given is refused by the Slurm backend, at its line)."""
    from ..host.slurm import node_token

    if not isinstance(data, dict) or data.get("slurm") is None or not isinstance(data.get("hosts"), list):
        return data
    hosts = [dict(h, address=node_token(i)) if isinstance(h, dict) and "address" not in h else h
             for i, h in enumerate(data["hosts"])]
    return dict(data, hosts=hosts)


def _slurm_hosts(slurm: SlurmSpec, hosts: tuple[HostSpec, ...]) -> tuple[HostSpec, ...]:
    """Under Slurm, node i of the allocation is planned as host `slurm-node-<i>.invalid` (set at run time)."""
    from ..host.slurm import node_token

    if hosts:  # the hosts give the shape (gpus, slots) of node i; Slurm picks the machines
        keep = {"address": None, "port": None, "user": None, "proxy_jump": None, "train_address": None}
        return tuple(h.model_copy(update={**keep, "address": node_token(i)}) for i, h in enumerate(hosts))
    gpus = tuple(range(slurm.gpus_per_node))
    return tuple(HostSpec(address=node_token(i), gpus=gpus) for i in range(slurm.nodes or 0))
