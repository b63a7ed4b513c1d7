"""The other backends' sections: `kubernetes:` (backend: kubernetes, clusterctl k8s render) and `slurm:` (backend: slurm)."""

from __future__ import annotations

import posixpath
import re
from fractions import Fraction
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator

from .fields import _Model, _scalar_str, check_address
from .job import one_line

__all__ = ["KubernetesSpec", "KubernetesVolumeSpec", "SlurmSpec", "HOST_MOUNT", "STATE_MOUNT", "is_extended_resource"]

HOST_MOUNT = "/opt/clusterctl"  # clusterctl's ConfigMap in every pod (read-only): the host package and the template
STATE_MOUNT = "/var/lib/clusterctl"  # clusterctl's emptyDir in every pod: the job dir and the bytecode cache


K8S_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?\Z")  # an RFC 1123 label (object names, namespaces)
# What the API server itself refuses, checked here so that `validate` and `k8s render` say it at the key, not kubectl:
_SUBDOMAIN_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")  # a DNS-1123 subdomain
_QUALIFIED_RE = re.compile(r"(%s/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?" % _SUBDOMAIN_RE.pattern)  # a label key
_LABEL_VALUE_RE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
# not negative; ASCII digits only (`\d` took '٤' or '１６', which the API server does not)
_QUANTITY_RE = re.compile(r"([0-9]+(\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?")
MAX_QUANTITY = 64  # characters: the API server's own are far shorter; a 5000-digit one hit int()'s digit limit
_SCALE = {"Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40, "Pi": 2 ** 50, "Ei": 2 ** 60, "m": Fraction(1, 1000),
          "": 1, "k": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12, "P": 10 ** 15, "E": 10 ** 18}


def _amount(quantity: str) -> Fraction:
    """A Kubernetes quantity's value (`500m` 1/2, `1Gi` 2**30, `1e3` 1000), exactly; exponents past ±64 are clamped
    (the API server's own bound is far below: only an order is compared)."""
    m = _QUANTITY_RE.fullmatch(quantity)
    number, suffix = Fraction(m.group(1)), m.group(3) or ""
    if suffix[:1] in ("e", "E"):
        return number * Fraction(10) ** max(-64, min(64, int(suffix[1:])))
    return number * _SCALE[suffix]


def is_extended_resource(name: str) -> bool:
    """Whether resource `name` is an extended one (`nvidia.com/gpu`, `example.com/fpga`: a domain other than
    kubernetes.io), which Kubernetes counts in whole units, never overcommitted (a request equals its limit)."""
    return "/" in name and "kubernetes.io/" not in name and not name.startswith("requests.")


def _path_text(v: str) -> str:
    """A path in a pod's spec: one line of printable characters (no newline, no bidi override)."""
    for i, c in enumerate(v):
        if not c.isprintable():
            raise ValueError(f"character {c!r} at character {i + 1} of {v!r}: a path here is one line of printable "
                             "characters")
    return v


def _absolute_path(v: str) -> str:
    """An absolute path of a pod's filesystem, on one printable line."""
    if not (v.startswith("/") and one_line(v) == v):
        raise ValueError(f"expected an absolute path, got {v!r}")
    return _path_text(v)


def _clusterctls_mount(path: str) -> str | None:
    """Which of clusterctl's own mounts in every pod `path` is or is inside (None: neither). `//opt/clusterctl` is
    /opt/clusterctl (posixpath.normpath keeps two leading slashes, the kubelet does not)."""
    norm = "/" + posixpath.normpath(path).lstrip("/")
    return next((m for m in (HOST_MOUNT, STATE_MOUNT) if norm == m or norm.startswith(m + "/")), None)


def _subdomain(v: str | None) -> str | None:
    if v is not None and not (len(v) <= 253 and _SUBDOMAIN_RE.fullmatch(v)):
        raise ValueError(f"{v!r} is not a Kubernetes object name (lowercase letters, digits, '-' and '.')")
    return v


def _qualified(v: str, what: str) -> str:
    if not (len(v) <= 316 and _QUALIFIED_RE.fullmatch(v) and len(v.rpartition("/")[2]) <= 63):
        raise ValueError(f"{v!r} is not a Kubernetes {what} ([prefix/]name: letters, digits, '-', '_', '.')")
    return v


class KubernetesVolumeSpec(_Model):
    """The workspace volume of every pod: a PersistentVolumeClaim or a directory of the node (hostPath)."""

    pvc: str | None = None
    host_path: str | None = None
    mount_path: str = "/workspace"
    sub_path: str | None = None

    @field_validator("pvc")
    @classmethod
    def _pvc(cls, v: str | None) -> str | None:
        return _subdomain(v)

    @field_validator("host_path", "mount_path")
    @classmethod
    def _absolute(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return v
        _absolute_path(v)
        mount = _clusterctls_mount(v) if info.field_name == "mount_path" else None
        if mount is not None:  # a mount path is used once in a container; one inside the ConfigMap's is read-only
            where = "where" if "/" + posixpath.normpath(v).lstrip("/") == mount else f"inside {mount}, where"
            raise ValueError(f"{v} is {where} clusterctl mounts its own volume in every pod; choose another")
        return v

    @field_validator("sub_path")
    @classmethod
    def _relative(cls, v: str | None) -> str | None:
        if v is not None and (v.startswith("/") or ".." in v.split("/") or one_line(v) != v):
            raise ValueError(f"expected a relative path inside the volume (no '..'), got {v!r}")
        return v if v is None else _path_text(v)

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
    wait_timeout: float = Field(120.0, ge=0, le=86400, allow_inf_nan=False)

    @field_validator("namespace", "name")
    @classmethod
    def _k8s_name(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and not (len(v) <= 63 and K8S_NAME_RE.match(v)):
            raise ValueError(f"{v!r} is not a Kubernetes name (lowercase letters, digits and '-', at most 63)")
        if v is not None and info.field_name == "name" and not v[0].isalpha():  # the Service's: an RFC 1035 label
            raise ValueError(f"{v!r}: the job's Service takes this name, and a Service's name starts with a letter")
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

    @field_validator("resources")
    @classmethod
    def _resources(cls, v: dict) -> dict:
        for kinds in v.values():
            for quantities in kinds.values():
                for name, quantity in quantities.items():
                    _qualified(name, "resource name")
                    if len(quantity) > MAX_QUANTITY:
                        raise ValueError(f"{name}: a quantity of {len(quantity)} characters is not one Kubernetes "
                                         f"takes (at most {MAX_QUANTITY}: a number with a suffix such as m, Mi or Gi)")
                    if not _QUANTITY_RE.fullmatch(quantity):
                        raise ValueError(f"{name}: {quantity!r} is not a Kubernetes quantity (a number of 0 or more, "
                                         "with a suffix such as m, Mi or Gi)")
                    if is_extended_resource(name) and _amount(quantity).denominator != 1:
                        raise ValueError(f"{name}: {quantity!r} is not a whole number, and Kubernetes counts an "
                                         "extended resource (a name whose domain is not kubernetes.io) in whole units")
        for role, kinds in v.items():  # the API server refuses a pod that requests more than its limit
            requests, limits = kinds.get("requests", {}), kinds.get("limits", {})
            for name in requests.keys() & limits.keys():
                if _amount(requests[name]) > _amount(limits[name]):
                    raise ValueError(f"{role}: requests.{name} {requests[name]} is more than limits.{name} "
                                     f"{limits[name]} (Kubernetes creates no such pod)")
        return v

    @field_validator("working_dir")
    @classmethod
    def _working_dir(cls, v: str | None) -> str | None:  # the container's workingDir: absolute (the API server's rule)
        return v if v is None else _absolute_path(v)

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        if any(c.isspace() or not c.isprintable() for c in v):
            raise ValueError(f"an image reference has no spaces or control characters: {v!r}")
        return v

    @field_validator("gpu_resource")
    @classmethod
    def _gpu_resource(cls, v: str) -> str:
        return _qualified(v, "resource name")

    @field_validator("node_selector")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            _qualified(key, "label key")
            if not (len(value) <= 63 and _LABEL_VALUE_RE.fullmatch(value)):
                raise ValueError(f"{key}: {value!r} is not a Kubernetes label value (at most 63 letters, digits, "
                                 "'-', '_', '.')")
        return v

    @field_validator("service_account")
    @classmethod
    def _account(cls, v: str | None) -> str | None:
        return _subdomain(v)

    @field_validator("image_pull_secrets")
    @classmethod
    def _secrets(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for name in v:
            _subdomain(name)
        return v


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

    @field_validator("time", mode="before")
    @classmethod
    def _time_text(cls, v: Any) -> Any:
        return _scalar_str(v)  # `time: 90` is sbatch's 90 minutes (as written: TEXT_PATHS)

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
