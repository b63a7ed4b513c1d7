"""The cluster spec: YAML → validated, typed, frozen objects. Knows YAML, nothing about SSH.

Every problem is reported at once as ``FILE:LINE:COL: dotted.key.path: message``.
"""

from __future__ import annotations

import difflib
import re
import shlex
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .errors import SpecError, SpecProblem
from .yamlpos import MAX_BYTES as MAX_SPEC_BYTES
from .yamlpos import Located, YamlSyntaxError, load_located

__all__ = [
    "ClusterSpec",
    "HostSpec",
    "JobSpec",
    "SshSpec",
    "WorkspaceSpec",
    "DataSpec",
    "PortsSpec",
    "KubernetesSpec",
    "SlurmSpec",
    "load_spec",
    "parse_spec",
    "parse_hostfile",
    "parse_jump",
    "check_address",
    "check_user",
    "PLACEHOLDERS",
]

Port = Annotated[int, Field(ge=1, le=65535)]
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PASSWORD_KEY_RE = re.compile(r"(^|[_-])(password|passwd|passphrase|pass)$", re.IGNORECASE)

# Placeholders allowed in job.args (see docs/spec.md).
PLACEHOLDERS = (
    "role",
    "id",
    "trainer_id",
    "trainers",
    "pserver_endpoints",
    "trainer_endpoints",
    "current_endpoint",
    "host",
    "local_rank",
    "job",
)

# Env names the plan owns; a user setting one in job.env would silently break the contract.
CONTRACT_ENV = frozenset(
    """CLUSTERCTL_JOB CLUSTERCTL_ROLE TRAINING_ROLE POD_IP PADDLE_PORT PADDLE_CURRENT_ENDPOINT
    PADDLE_TRAINER_ID PADDLE_PSERVER_ID PADDLE_TRAINERS_NUM PADDLE_TRAINER_ENDPOINTS
    PADDLE_PSERVERS_IP_PORT_LIST RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT
    CUDA_VISIBLE_DEVICES FLAGS_selected_gpus CLUSTERCTL_DATA_FILES""".split()
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)


class SshSpec(_Model):
    """How to reach the hosts. Keys or ssh-agent only: there is no password field.

    Unset keys (None) are left to the user's OpenSSH config, as `ssh HOST` would resolve them."""

    user: str | None = None
    port: Port | None = None
    config: str | None = None  # None: ssh's own config files; "none": no config file; else a path
    proxy_jump: tuple[str, ...] = ()  # bastions, first hop first (like `ssh -J a,b`)
    identity_file: str | None = None
    known_hosts: str | None = None  # None: what the ssh config says (default ~/.ssh/known_hosts)
    host_key_policy: Literal["strict", "accept-new", "off"] = "strict"
    connect_timeout: float = Field(10.0, gt=0, le=600)
    keepalive: int = Field(15, ge=0, le=3600)
    forward_agent: bool = False
    persist: int = Field(60, ge=0, le=86400)  # seconds the OpenSSH client keeps an idle connection for reuse
    command_timeout: float = Field(60.0, gt=0, le=86400)  # deadline of control commands on a host

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        return None if v is None else check_user(v)

    @field_validator("proxy_jump", mode="before")
    @classmethod
    def _proxy_jump(cls, v: Any) -> Any:
        return _jump_chain(v)


class HostSpec(_Model):
    """One machine: where to reach it and what it offers."""

    address: str = Field(min_length=1)
    port: Port | None = None
    user: str | None = None
    proxy_jump: tuple[str, ...] | None = None  # None: ssh.proxy_jump; () ("none"): direct
    train_address: str | None = None  # what the other hosts use for this host's endpoints
    gpus: tuple[int, ...] = ()
    slots: int | None = Field(None, ge=1, le=1024)
    labels: dict[str, str] = {}

    @field_validator("address", "train_address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        return None if v is None else check_address(v)

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        return None if v is None else check_user(v)

    @field_validator("proxy_jump", mode="before")
    @classmethod
    def _proxy_jump(cls, v: Any) -> Any:
        return None if v is None else _jump_chain(v)

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpus(cls, v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError("expected a GPU count or a list of GPU indices")
        if isinstance(v, int):
            if not 0 <= v <= 1024:
                raise ValueError("GPU count must be between 0 and 1024")
            return tuple(range(v))
        if isinstance(v, list):
            if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i <= 1024 for i in v):
                raise ValueError("GPU indices must be integers between 0 and 1024")
            if len(set(v)) != len(v):
                raise ValueError("GPU indices must be distinct")
        return v

    @field_validator("labels", mode="before")
    @classmethod
    def _labels(cls, v: Any) -> Any:
        if isinstance(v, dict):
            return {str(k): _scalar_str(x) for k, x in v.items()}
        return v


class WorkspaceSpec(_Model):
    """What to ship: a local directory, where it lands on every host, and what to leave out."""

    local: str = "."
    remote: str = ""
    exclude: tuple[str, ...] = (".git/", "__pycache__/", "*.pyc", ".venv/")

    @field_validator("remote")
    @classmethod
    def _remote(cls, v: str) -> str:
        if v.startswith("~/"):
            v = v[2:]  # ssh sessions start in $HOME: relative paths are relative to it
        if ".." in Path(v).parts:
            raise ValueError("must not contain '..'")
        return v


class DataSpec(_Model):
    """Optional data shards: files matching `pattern` are dealt to trainers by index % trainers."""

    local: str
    pattern: str = "*"
    remote: str = "data"


class PortsSpec(_Model):
    """Base ports. A process's port is its base plus its local index on the host."""

    pserver: Port = 6170
    trainer: Port = 6180
    master: Port = 6169
    control: Port = 6168


class PserversPerHost(_Model):
    per_host: int = Field(ge=0, le=256)


RESTART_ENV = ("CLUSTERCTL_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")  # the attempt number, set by the agent


class JobSpec(_Model):
    """What to run and how processes are laid out."""

    mode: Literal["pserver", "collective"] = "collective"
    launcher: Literal["ssh", "mpi"] = "ssh"
    mpi: Literal["mpich", "openmpi"] = "mpich"
    mpiexec: str = "mpiexec"
    mpi_args: tuple[str, ...] = ()
    entrypoint: tuple[str, ...] = Field(min_length=1)
    args: tuple[str, ...] = ()
    env: dict[str, str] = {}
    pservers: Union[int, PserversPerHost, tuple[str, ...]] = 0
    trainers: Union[int, Literal["gpu"]] = 1
    ports: PortsSpec = PortsSpec()
    log_dir: str = "."  # relative to <workspace.remote>.logs/
    on_failure: Literal["stop", "continue"] = "stop"
    grace: float = Field(10.0, ge=0, le=3600)
    restarts: int = Field(0, ge=0, le=1000)  # a failed job starts again on the same plan, up to this many times
    restart_backoff: float = Field(1.0, ge=0, le=300)  # seconds before the first restart, doubled for each next
    sync: Literal["sync", "async", "geo"] = "sync"
    k_steps: int = Field(100, ge=1)

    @field_validator("entrypoint", mode="before")
    @classmethod
    def _entrypoint(cls, v: Any) -> Any:
        if isinstance(v, str):
            return shlex.split(v)
        if isinstance(v, list):
            return [_scalar_str(x) for x in v]
        return v

    @field_validator("args", mode="before")
    @classmethod
    def _args(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [_scalar_str(x) for x in v]
        return v

    @field_validator("args")
    @classmethod
    def _placeholders(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for arg in v:
            for name in _placeholder_names(arg):
                if name not in PLACEHOLDERS:
                    hint = _did_you_mean(name, PLACEHOLDERS)
                    raise ValueError(f"unknown placeholder {{{name}}} in {arg!r}{hint}")
        return v

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        out = {}
        for k, x in v.items():
            k = str(k)
            if not ENV_NAME_RE.match(k):
                raise ValueError(f"{k!r} is not a valid environment variable name")
            if k in CONTRACT_ENV or k in RESTART_ENV:
                raise ValueError(f"{k} is set by clusterctl from the plan; remove it from job.env")
            out[k] = _scalar_str(x)
        return out

    @field_validator("pservers", mode="before")
    @classmethod
    def _pservers(cls, v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError("expected a count, {per_host: N} or a list of host addresses")
        if isinstance(v, int) and v < 0:
            raise ValueError("pserver count must be >= 0")
        if isinstance(v, dict):
            unknown = [k for k in v if k != "per_host"]
            if unknown:
                raise ValueError(f"unknown key {unknown[0]!r}{_did_you_mean(unknown[0], ['per_host'])}; expected {{per_host: N}}")
            if not isinstance(v.get("per_host"), int) or isinstance(v.get("per_host"), bool):
                raise ValueError("expected {per_host: N} with N an integer")
        elif not isinstance(v, (int, list, tuple)):
            raise ValueError("expected a count, {per_host: N} or a list of host addresses")
        return v

    @field_validator("trainers", mode="before")
    @classmethod
    def _trainers(cls, v: Any) -> Any:
        if isinstance(v, bool) or (not isinstance(v, int) and v != "gpu"):
            raise ValueError("expected trainers per host (an integer) or 'gpu' (one per GPU)")
        if isinstance(v, int) and not 0 <= v <= 1024:
            raise ValueError("trainers per host must be between 0 and 1024")
        return v


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
    """`clusterctl k8s render`: one pod per process, from an image (docs/kubernetes.md)."""

    image: str = Field(min_length=1)
    namespace: str = "default"
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
    wait_timeout: float = Field(120.0, ge=0, le=86400)  # init container: names resolve, pservers listen; 0: none

    @field_validator("namespace", "name")
    @classmethod
    def _k8s_name(cls, v: str | None) -> str | None:
        if v is not None and not (len(v) <= 63 and K8S_NAME_RE.match(v)):
            raise ValueError(f"{v!r} is not a Kubernetes name (lowercase letters, digits and '-', at most 63)")
        return v

    @field_validator("resources", mode="before")
    @classmethod
    def _quantities(cls, v: Any) -> Any:  # YAML `cpu: 4` is the quantity "4"
        if isinstance(v, dict):
            return {r: {k: {n: _scalar_str(q) for n, q in qs.items()} if isinstance(qs, dict) else qs
                        for k, qs in kinds.items()} if isinstance(kinds, dict) else kinds for r, kinds in v.items()}
class SlurmSpec(_Model):
    """`backend: slurm`: one batch job submitted with sbatch over ssh to the login node (docs/slurm.md)."""

    login: str = Field(min_length=1)  # host or ssh alias of a node where sbatch/squeue/scancel work
    nodes: int | None = Field(None, ge=1, le=100000)  # default: len(hosts) when hosts give the shape
    gpus_per_node: int = Field(0, ge=0, le=64)
    partition: str | None = None
    time: str | None = None  # sbatch --time, e.g. "01:00:00"
    account: str | None = None
    qos: str | None = None
    sbatch_args: tuple[str, ...] = ()  # extra sbatch options, one per item
    workspace: Literal["dispatch", "shared"] = "dispatch"  # shared: workspace.remote is on a shared fs
    endpoints: Literal["ip", "hostname"] = "ip"  # what endpoints use: the node's IP or its Slurm name

    @field_validator("partition", "time", "account", "qos")
    @classmethod
    def _word(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9_.:,+=@/-]+", v):
            raise ValueError(f"expected one word (letters, digits, _.:,+=@/-), got {v!r}")
        return v

    @field_validator("sbatch_args")
    @classmethod
    def _args(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for arg in v:
            if not arg.startswith("-") or any(c in arg for c in "\r\n"):
                raise ValueError(f"each item is one sbatch option on one line, starting with '-': {arg!r}")
        return v

    @field_validator("login")
    @classmethod
    def _login(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.:\[\]-]+", v):
            raise ValueError(f"not a host name, ssh alias or IP address: {v!r}")
        return v


class ClusterSpec(_Model):
    """A whole cluster spec. `source` is the file it came from (for messages and relative paths)."""

    name: str
    backend: Literal["ssh", "slurm"] = "ssh"
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

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError("use 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit")
        return v

    @model_validator(mode="after")
    def _defaults(self) -> "ClusterSpec":
        if not self.workspace.remote:
            ws = self.workspace.model_copy(update={"remote": f"clusterctl/{self.name}"})
            object.__setattr__(self, "workspace", ws)
        if self.backend == "slurm" and self.slurm is not None:
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


_HOSTNAME_RE = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,252})")
_USER_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}\$?")


def check_address(value: str) -> str:
    """A host address as ssh takes it: an IPv4/IPv6 address or a host name / ssh config alias.

    Refuses what ssh would read as an option (a leading '-') or what a shell or a log line would
    misread (spaces, control characters, brackets around a non-IPv6 address)."""
    import ipaddress

    bare = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    if ":" in bare:
        try:
            ipaddress.IPv6Address(bare.split("%", 1)[0])
        except ValueError:
            raise ValueError(f"not a host name or IP address: {value!r}") from None
        return bare
    if bare != value or not _HOSTNAME_RE.fullmatch(value) or ".." in value:
        raise ValueError(f"not a host name or IP address: {value!r}")
    return value


def check_user(value: str) -> str:
    """A login user name: letters, digits, '_', '.', '-' (not first), as useradd allows."""
    if not _USER_RE.fullmatch(value):
        raise ValueError(f"not a valid user name: {value!r}")
    return value


def parse_jump(hop: str) -> tuple[str | None, str, int | None]:
    """`[user@]host[:port]` (IPv6 as `[addr]:port`) -> (user, host, port); ValueError when malformed."""
    user, sep, rest = hop.rpartition("@")
    if sep:
        check_user(user)
    if rest.startswith("["):
        host, close, tail = rest[1:].partition("]")
        if not close or (tail and not tail.startswith(":")):
            raise ValueError(f"cannot parse jump host {hop!r}: expected [user@]host[:port]")
        port_text = tail[1:]
    elif rest.count(":") == 1:
        host, _, port_text = rest.partition(":")
    else:
        host, port_text = rest, ""
    if port_text and not (port_text.isdigit() and 1 <= int(port_text) <= 65535):
        raise ValueError(f"bad port in jump host {hop!r}: expected 1-65535")
    return (user or None), check_address(host), (int(port_text) if port_text else None)


def _jump_chain(v: Any) -> Any:
    """`proxy_jump`: "a,b", [a, b] or "none" -> a tuple of validated hops (first hop first)."""
    if isinstance(v, str):
        v = [] if v.strip().lower() == "none" else [part.strip() for part in v.split(",")]
    if isinstance(v, (list, tuple)):
        for hop in v:
            if not isinstance(hop, str) or not hop:
                raise ValueError("expected jump hosts as [user@]host[:port] strings")
            parse_jump(hop)
        return tuple(v)
    return v


def _slurm_hosts(slurm: SlurmSpec, hosts: tuple[HostSpec, ...]) -> tuple[HostSpec, ...]:
    """Under Slurm, node i of the allocation is planned as host `slurm-node-<i>.invalid` (set at run time)."""
    from .slurmjob import node_token

    if hosts:  # the hosts give the shape (gpus, slots) of node i; Slurm picks the machines
        keep = {"address": None, "port": None, "proxy_jump": None, "train_address": None}  # Slurm places them
        return tuple(h.model_copy(update={**keep, "address": node_token(i)}) for i, h in enumerate(hosts))
    gpus = tuple(range(slurm.gpus_per_node))
    return tuple(HostSpec(address=node_token(i), gpus=gpus) for i in range(slurm.nodes or 0))


def _scalar_str(v: Any) -> Any:
    """YAML scalars become strings (`1` → "1", `true` → "true"); anything else is left for the type check."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    return v


def _placeholder_names(arg: str) -> list[str]:
    """Names inside single braces; `{{` and `}}` are literal braces."""
    stripped = arg.replace("{{", "").replace("}}", "")
    return re.findall(r"\{([^{}]*)\}", stripped)


def _did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def parse_hostfile(text: str) -> list[dict]:
    """Parse the common `host slots=N` hostfile format into host dicts; raise ValueError(lineno, msg)."""
    hosts = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        entry: dict[str, Any] = {"address": parts[0]}
        for opt in parts[1:]:
            key, sep, value = opt.partition("=")
            if key in ("slots", "max_slots", "max-slots") and sep and value.isdigit():
                if key == "slots":
                    entry["slots"] = int(value)
            else:
                raise ValueError(lineno, f"cannot parse {opt!r} (expected slots=N)")
        hosts.append(entry)
    return hosts


# ---------------------------------------------------------------------------------------- loading


MAX_HOSTFILE_BYTES = 1 << 20


def load_spec(path: str | Path) -> ClusterSpec:
    """Read, parse and validate the spec at `path`; raise SpecError with every problem found."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
        if len(raw) > MAX_SPEC_BYTES:
            raise SpecError([SpecProblem(str(path), 1, 1, "", f"spec is larger than {MAX_SPEC_BYTES // 1024} KiB")])
        text = raw.decode("utf-8")
    except OSError as exc:
        raise SpecError([SpecProblem(str(path), 1, 1, "", f"cannot read spec: {exc.strerror or exc}")]) from None
    except UnicodeDecodeError:
        raise SpecError([SpecProblem(str(path), 1, 1, "", "spec is not UTF-8 text")]) from None
    return parse_spec(text, str(path))


def parse_spec(text: str, source: str = "<spec>") -> ClusterSpec:
    """Validate spec `text` (named `source` in messages); raise SpecError with every problem found."""
    try:
        loc = load_located(text)
    except YamlSyntaxError as exc:
        raise SpecError([SpecProblem(source, exc.line, exc.column, "", exc.message)]) from None
    data = loc.data
    if not isinstance(data, dict):
        raise SpecError([SpecProblem(source, 1, 1, "", "a spec is a YAML mapping (name:, hosts:, job:, ...)")])

    problems = [_problem(loc, source, p, "key given twice") for p in loc.duplicates]
    problems += _password_problems(loc, source, data, ())
    if problems:
        raise SpecError(problems)

    data = dict(data)
    problems += _load_hostfile(loc, source, data)
    if problems:
        raise SpecError(problems)
    provision, found = data.pop("provision", None), []
    try:
        spec = ClusterSpec.model_validate({**data, "source": source})
    except pydantic.ValidationError as exc:
        found += exc.errors()
    if provision is not None:
        from .provision.schema import ProvisionSpec

        try:
            provision = ProvisionSpec.model_validate(provision)
        except pydantic.ValidationError as exc:
            found += [{**err, "loc": ("provision", *err["loc"])} for err in exc.errors()]
    if found:
        problems += [_pydantic_problem(loc, source, err) for err in found]
        raise SpecError(sorted(_dedupe(problems), key=lambda p: (p.file != source, p.line, p.column))) from None
    if provision is not None:
        object.__setattr__(spec, "provision", provision)  # frozen model: set once, here
    problems += _semantic_problems(loc, source, spec)
    if problems:
        raise SpecError(problems)
    return spec


def _problem(loc: Located, source: str, path: tuple, message: str) -> SpecProblem:
    line, col = loc.position(path)
    return SpecProblem(source, line, col, _printable(_dotted(path)), _printable(message))


def _printable(text: str) -> str:
    """`text` on one line: control characters (newlines, escapes, NUL) shown as Python escapes."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _dotted(path: tuple) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _password_problems(loc: Located, source: str, node: Any, path: tuple) -> list[SpecProblem]:
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            child = path + (key,)
            if isinstance(key, str) and PASSWORD_KEY_RE.search(key):
                found.append(
                    _problem(loc, source, child, "passwords are not allowed in a spec: use ssh.identity_file or an ssh-agent")
                )
            else:
                found += _password_problems(loc, source, value, child)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _password_problems(loc, source, value, path + (i,))
    return found


def _load_hostfile(loc: Located, source: str, data: dict) -> list[SpecProblem]:
    hostfile = data.get("hostfile")
    if hostfile is None:
        return []
    if "hosts" in data:
        return [_problem(loc, source, ("hostfile",), "give either hosts or hostfile, not both")]
    if not isinstance(hostfile, str):
        return []  # the type check reports it
    base = Path(source).resolve().parent if source != "<spec>" else Path.cwd()
    path = Path(hostfile).expanduser()
    path = path if path.is_absolute() else base / path
    try:
        raw = path.read_bytes()
        if len(raw) > MAX_HOSTFILE_BYTES:
            return [_problem(loc, source, ("hostfile",), f"{path} is larger than {MAX_HOSTFILE_BYTES // 1024} KiB")]
        text = raw.decode("utf-8")
        bad = next((c for c in text if not c.isprintable() and c not in "\n\t\r"), None)
        if bad is not None:
            lineno = text[:text.index(bad)].count("\n") + 1
            return [SpecProblem(str(path), lineno, 1, "hostfile", f"not a text hostfile (control character {bad!r})")]
        data["hosts"] = parse_hostfile(text)
    except OSError as exc:
        return [_problem(loc, source, ("hostfile",), f"cannot read {path}: {exc.strerror or exc}")]
    except UnicodeDecodeError:
        return [_problem(loc, source, ("hostfile",), f"{path} is not UTF-8 text")]
    except ValueError as exc:
        lineno, msg = exc.args
        return [SpecProblem(str(path), lineno, 1, "hostfile", msg)]
    return []


_PYDANTIC_MESSAGES = {
    "missing": "required key is missing",
    "int_type": "expected an integer",
    "int_parsing": "expected an integer",
    "float_type": "expected a number",
    "float_parsing": "expected a number",
    "string_type": "expected a string",
    "bool_type": "expected true or false",
    "bool_parsing": "expected true or false",
    "dict_type": "expected a mapping",
    "list_type": "expected a list",
    "tuple_type": "expected a list",
    "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
}


def _pydantic_problem(loc: Located, source: str, err: dict) -> SpecProblem:
    path = _spec_path(err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden" and path:
        parent = path[:-1]
        allowed = _allowed_keys(parent)
        return _problem(loc, source, path, f"unknown key{_did_you_mean(path[-1], allowed)}")
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than") and path and path[-1] in (
        "port", "pserver", "trainer", "master", "control"
    ):
        return _problem(loc, source, path, f"port out of range (1-65535): {err.get('input')!r}")
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        return _problem(loc, source, path, f"expected one of {expected}, got {err.get('input')!r}")
    if kind == "value_error":
        msg = str(err.get("ctx", {}).get("error", err["msg"]))
        return _problem(loc, source, path, msg)
    if kind == "too_short" and path and path[-1] == "entrypoint":
        return _problem(loc, source, path, "must name a program to run")
    message = _PYDANTIC_MESSAGES.get(kind, err["msg"][0].lower() + err["msg"][1:])
    return _problem(loc, source, path, message)


def _spec_path(err_loc: tuple) -> tuple:
    """The spec path of a pydantic error location: its parts walked against the models' annotations.

    pydantic puts the union member it tried ('int', 'PserversPerHost', "literal['gpu']", ...) into the
    location after a field whose type is a union; those are dropped here because the walk knows where
    a union is, not because of how the tag looks (a user's key `Name` or `int` is kept).
    """
    if err_loc[:1] == ("provision",):
        from .provision.schema import ProvisionSpec

        return ("provision",) + _walk_loc(ProvisionSpec, tuple(err_loc[1:]))
    return _walk_loc(ClusterSpec, tuple(err_loc))


def _unwrap(ann: Any) -> Any:
    """`ann` without Annotated[...] and without the None of an Optional (pydantic adds no tag for it)."""
    while True:
        origin = typing.get_origin(ann)
        if origin is Annotated:
            ann = typing.get_args(ann)[0]
            continue
        if origin in (Union, types.UnionType):
            members = [a for a in typing.get_args(ann) if a is not type(None)]
            if len(members) == 1:
                ann = members[0]
                continue
        return ann


def _walk_loc(model: Any, parts: tuple) -> tuple:
    path: list = []
    ann: Any = model
    i = 0
    while i < len(parts):
        part = parts[i]
        ann = _unwrap(ann) if ann is not None else None
        origin = typing.get_origin(ann)
        if origin in (Union, types.UnionType):  # this part is the tag of the member tried
            members = [a for a in typing.get_args(ann) if a is not type(None)]
            ann = next((m for m in members if getattr(m, "__name__", None) == part), None)
            i += 1
            continue
        path.append(part)
        i += 1
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            f = ann.model_fields.get(part) if isinstance(part, str) else None
            ann = f.annotation if f is not None else None
        elif origin is dict:
            ann = typing.get_args(ann)[1] if typing.get_args(ann) else None
        elif origin in (tuple, list):
            args = typing.get_args(ann)
            if len(args) == 2 and args[1] is Ellipsis or origin is list:
                ann = args[0] if args else None
            elif isinstance(part, int) and 0 <= part < len(args):
                ann = args[part]
            else:
                ann = None
        else:
            ann = None
    return tuple(path)


def _allowed_keys(parent: tuple) -> list[str]:
    """Keys allowed in the mapping at `parent`, found by walking the models' field annotations."""
    model: type[BaseModel] | None = ClusterSpec
    if parent[:1] == ("provision",):
        from .provision.schema import ProvisionSpec

        model, parent = ProvisionSpec, parent[1:]
    for part in parent:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(part)
        model = _model_in(field.annotation) if field else None
    return [k for k in model.model_fields if k != "source"] if model else []


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel inside an annotation like `X | None`, `tuple[X, ...]` or `Union[int, X]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _dedupe(problems: list[SpecProblem]) -> list[SpecProblem]:
    seen, out = set(), []
    for p in problems:
        key = (p.path, p.message)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def _slurm_problems(loc: Located, source: str, spec: ClusterSpec) -> list[SpecProblem]:
    if spec.backend != "slurm":
        return [_problem(loc, source, ("slurm",), "a slurm: section needs backend: slurm")] if spec.slurm else []
    if spec.slurm is None:
        return [_problem(loc, source, ("backend",), "backend: slurm needs a slurm: section (login:, nodes:, ...)")]
    problems = []
    given = loc.data.get("hosts") if isinstance(loc.data, dict) else None
    if spec.slurm.nodes is None and not given:
        problems.append(_problem(loc, source, ("slurm",), "give slurm.nodes (or hosts, for the shape of each node)"))
    if spec.slurm.nodes is not None and given and spec.slurm.nodes != len(given):
        problems.append(_problem(loc, source, ("slurm", "nodes"), f"{spec.slurm.nodes} nodes but {len(given)} hosts"))
    if isinstance(spec.job.pservers, tuple):
        problems.append(_problem(loc, source, ("job", "pservers"),
                                 "under Slurm the nodes are known at run time: give a count or {per_host: N}"))
    if spec.job.launcher == "mpi":
        problems.append(_problem(loc, source, ("job", "launcher"),
                                 "launcher: mpi is not supported with backend: slurm"))
    if spec.data is not None:
        problems.append(_problem(loc, source, ("data",), "data: is not supported with backend: slurm yet; "
                                 "put the files in the workspace"))
    if spec.slurm.workspace == "shared" and not spec.workspace.remote.startswith("/"):
        problems.append(_problem(loc, source, ("workspace", "remote"),
                                 "slurm.workspace: shared needs an absolute path on the shared filesystem"))
    return problems


def _semantic_problems(loc: Located, source: str, spec: ClusterSpec) -> list[SpecProblem]:
    problems = _slurm_problems(loc, source, spec)
    if problems:
        return problems
    if not spec.hosts:
        where = ("hostfile",) if spec.hostfile else ("hosts",)
        problems.append(_problem(loc, source, where, "no hosts: list at least one host"))
    seen: dict[tuple[str, int], int] = {}
    for i, host in enumerate(spec.hosts):
        key = (host.address, host.port or spec.ssh.port)
        if key in seen:
            where = key[0] if key[1] is None else f"{key[0]}:{key[1]}"
            problems.append(_problem(loc, source, ("hosts", i), f"duplicate host {where} (also hosts[{seen[key]}])"))
        else:
            seen[key] = i
        if spec.job.trainers == "gpu" and not host.gpus:
            problems.append(_problem(loc, source, ("hosts", i), "job.trainers is 'gpu' but this host lists no gpus"))
    if isinstance(spec.job.pservers, tuple):
        addresses = {h.address for h in spec.hosts}
        for i, addr in enumerate(spec.job.pservers):
            if addr not in addresses:
                hint = _did_you_mean(addr, sorted(addresses))
                problems.append(_problem(loc, source, ("job", "pservers", i), f"{addr} is not in hosts{hint}"))
    if spec.job.mode == "pserver" and _pserver_count(spec) == 0:
        problems.append(_problem(loc, source, ("job", "pservers"), "pserver mode needs at least one pserver"))
    if spec.job.mode == "collective" and _pserver_count(spec) > 0:
        problems.append(_problem(loc, source, ("job", "pservers"), "collective mode runs no pservers; set mode: pserver"))
    if problems:
        return problems
    # Late import: plan depends on spec, not the other way round at import time.
    from .plan import PlanError, make_plan

    try:
        make_plan(spec)
    except PlanError as exc:
        problems.append(_problem(loc, source, exc.path, exc.message))
    return problems


def _pserver_count(spec: ClusterSpec) -> int:
    p = spec.job.pservers
    if isinstance(p, int):
        return p
    if isinstance(p, PserversPerHost):
        return p.per_host * len(spec.hosts)
    return len(p)
