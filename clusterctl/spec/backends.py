"""The other backends' sections: `kubernetes:` (backend: kubernetes, clusterctl k8s render) and `slurm:` (backend: slurm)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from .fields import _Model, _scalar_str, check_address
from .job import one_line

__all__ = ["KubernetesSpec", "KubernetesVolumeSpec", "SlurmSpec"]


K8S_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")  # an RFC 1123 label (object names, namespaces)


class KubernetesVolumeSpec(_Model):
    """The workspace volume of every pod: a PersistentVolumeClaim or a directory of the node (hostPath)."""

    pvc: str | None = None
    host_path: str | None = None
    mount_path: str = "/workspace"
    sub_path: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> "KubernetesVolumeSpec":
        if (self.pvc is None) == (self.host_path is None):
            raise ValueError("give exactly one of pvc (a PersistentVolumeClaim's name) or host_path")
        return self


class KubernetesSpec(_Model):
    """`backend: kubernetes` and `clusterctl k8s render`: one pod per process, from an image (docs/kubernetes.md)."""

    image: str = Field(min_length=1)
    namespace: str = "default"
    context: str | None = None  # kubectl --context (default: the kubeconfig's current context)
    python: str = "python3"  # the image's Python (>= 3.9), which runs clusterctl's host package in every pod
    name: str | None = None  # object names' prefix; default: the spec's name, lowercased, '_' and '.' as '-'
    workspace: KubernetesVolumeSpec | None = None  # None: the code is in the image
    working_dir: str | None = None  # default: workspace.mount_path, else the image's
    gpus_per_trainer: int | None = Field(None, ge=0, le=64)  # default: the plan's GPUs per trainer
    gpu_resource: str = "nvidia.com/gpu"
    resources: dict[Literal["pserver", "trainer"], dict[Literal["requests", "limits"], dict[str, str]]] = {}
    node_selector: dict[str, str] = {}
    service_account: str | None = None
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    image_pull_secrets: tuple[str, ...] = ()
    # init container: the pod's and the coordinator's names resolve (0: none); the supervisors wait as long for
    # their peers and for the pservers to listen
    wait_timeout: float = Field(120.0, ge=0, le=86400)

    @field_validator("namespace", "name")
    @classmethod
    def _k8s_name(cls, v: str | None) -> str | None:
        if v is not None and not (len(v) <= 63 and K8S_NAME_RE.match(v)):
            raise ValueError(f"{v!r} is not a Kubernetes name (lowercase letters, digits and '-', at most 63)")
        return v

    @field_validator("context", "python")
    @classmethod
    def _word(cls, v: str | None) -> str | None:  # an argv item of kubectl / the pods: never read as an option
        if v is not None and not re.fullmatch(r"[A-Za-z0-9_.:@/+=][A-Za-z0-9_.:@/+=-]*", v):
            raise ValueError(f"expected one word not starting with '-' (letters, digits, _.:@/+=-), got {v!r}")
        return v

    @field_validator("resources", mode="before")
    @classmethod
    def _quantities(cls, v: Any) -> Any:  # YAML `cpu: 4` is the quantity "4"
        if isinstance(v, dict):
            return {r: {k: {n: _scalar_str(q) for n, q in qs.items()} if isinstance(qs, dict) else qs
                        for k, qs in kinds.items()} if isinstance(kinds, dict) else kinds for r, kinds in v.items()}


def _sbatch_arg(arg: str) -> str:
    """One item of slurm.sbatch_args: an #SBATCH line of its own (a newline would end it, and every option after)."""
    one_line(arg)
    if not arg.startswith("-"):
        raise ValueError(f"each item is one sbatch option on one line, starting with '-': {arg!r}")
    return arg


class SlurmSpec(_Model):
    """`backend: slurm`: one batch job submitted with sbatch over ssh to the login node (docs/slurm.md)."""

    login: str = Field(min_length=1)  # host or ssh alias of a node where sbatch/squeue/scancel work
    nodes: int | None = Field(None, ge=1, le=100000)  # default: len(hosts) when hosts give the shape
    gpus_per_node: int = Field(0, ge=0, le=64)
    partition: str | None = None
    time: str | None = None  # sbatch --time, e.g. "01:00:00"
    account: str | None = None
    qos: str | None = None
    sbatch_args: tuple[Annotated[str, AfterValidator(_sbatch_arg)], ...] = ()  # extra sbatch options, one per item
    workspace: Literal["dispatch", "shared"] = "dispatch"  # shared: workspace.remote is on a shared fs
    endpoints: Literal["ip", "hostname"] = "ip"  # what endpoints use: the node's IP or its Slurm name

    @field_validator("partition", "time", "account", "qos")
    @classmethod
    def _word(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9_.:,+=@/-]+", v):
            raise ValueError(f"expected one word (letters, digits, _.:,+=@/-), got {v!r}")
        return v

    @field_validator("login")
    @classmethod
    def _login(cls, v: str) -> str:
        try:
            return check_address(v)  # as every host address: never read by ssh as an option
        except ValueError:
            raise ValueError(f"not a host name, ssh alias or IP address: {v!r}") from None
