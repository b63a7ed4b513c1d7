"""What runs: the `job:` section (layout, ports, env, placeholders), the workspace and the data shards."""

from __future__ import annotations

import posixpath
import re
import shlex
import unicodedata
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, Field, ValidationInfo, field_validator

from ..host.common import script_arg
from ..host.policy import DEFAULT_POLICY, GRACE_MAX, ON_FAILURE, RESTART_BACKOFF_MAX, RESTART_BACKOFF_MIN, RESTARTS_MAX
from .fields import Port, _did_you_mean, _Model, _placeholder_names, _scalar_str, nonempty_path
from ..host.elastic import MAX_HOST_CHANGES, MAX_HOST_CHANGES_MAX  # elastic jobs' bound (hosts[].spare, min_hosts)

__all__ = ["JobSpec", "PortsSpec", "PserversPerHost", "WorkspaceSpec", "DataSpec", "PLACEHOLDERS", "CONTRACT_ENV",
           "RESTART_ENV", "one_line", "OneLine"]


ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")

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


# ... and the names each host's supervisor gives its processes: the job's token (the pservers and the PMI server
# authenticate with it), whether it is used, the job's directory (its stop finds the processes by them).
SUPERVISOR_ENV = frozenset({"CLUSTERCTL_AUTH", "CLUSTERCTL_JOB_TOKEN", "CLUSTERCTL_JOBDIR"})


def one_line(value: str) -> str:
    """A path (or an #SBATCH value) as one line of printable characters: a control or line-separator character
    would end a line of the sbatch script, of a shell command or of a log, so it is refused (ValueError)."""
    for i, c in enumerate(value):
        if unicodedata.category(c) in ("Cc", "Zl", "Zp"):
            raise ValueError(f"control character {c!r} at character {i + 1} of {value!r}: "
                             "paths and #SBATCH values must be one line of printable characters")
    return value


OneLine = Annotated[str, AfterValidator(one_line)]  # an item of a list, refused at its own index


def no_nul(value: str) -> str:
    """An argument or an environment value: anything but NUL, which no argv or environ can hold (execve would
    refuse it on the host, after the job had been dispatched and launched)."""
    at = value.find("\0")
    if at >= 0:
        raise ValueError(f"NUL character at character {at + 1} of {value!r}: "
                         "a process's arguments and environment cannot hold one")
    return value


Arg = Annotated[str, AfterValidator(no_nul)]  # an argv item, refused at its own index


# The top-level directories of a Linux system (the FHS's, and the usual mount points): a workspace's path becomes a
# symlink to its generations, so an empty one of these (a container's /tmp, a fresh /srv) would be replaced.
SYSTEM_DIRS = frozenset("/" + d for d in (
    "bin", "boot", "dev", "dev/shm", "etc", "home", "lib", "lib32", "lib64", "libx32", "media", "mnt", "opt", "proc",
    "root", "run", "sbin", "srv", "sys", "tmp", "usr", "var", "var/tmp"))


class WorkspaceSpec(_Model):
    """What to ship: a local directory, where it lands on every host, and what to leave out."""

    local: str = "."
    remote: str = ""
    exclude: tuple[OneLine, ...] = (".git/", "__pycache__/", "*.pyc", ".venv/")

    @field_validator("local")
    @classmethod
    def _local(cls, v: str) -> str:
        return one_line(nonempty_path(v))  # '' was '.', the default: the key left out

    @field_validator("remote")
    @classmethod
    def _remote(cls, v: str) -> str:
        one_line(nonempty_path(v))  # '' was clusterctl/<name>, the default
        written = v
        if v == "~" or v.startswith("~/"):
            v = v[2:]  # ssh sessions start in $HOME: relative paths are relative to it
        if ".." in Path(v).parts:
            raise ValueError("must not contain '..'")
        # the workspace's path becomes a symlink to its generations: never the home directory or / itself
        if posixpath.normpath(v or ".") == ".":
            raise ValueError(f"{written!r} is the home directory itself: give a directory under it, or leave the key out")
        if posixpath.normpath(v).strip("/") == "":
            raise ValueError(f"{written!r} is the root directory: give a directory under it, or leave the key out")
        if "/" + posixpath.normpath(v).strip("/") in SYSTEM_DIRS:  # an empty /tmp became a symlink, mode 0755
            raise ValueError(f"{written!r} is a system directory, which the workspace's symlink would replace: give a "
                             "directory under it")
        return v


class DataSpec(_Model):
    """Optional data shards: files matching `pattern` are dealt to trainers by index % trainers."""

    local: str
    pattern: str = "*"
    remote: str = "data"

    @field_validator("local", "pattern", "remote")
    @classmethod
    def _paths(cls, v: str, info: ValidationInfo) -> str:
        if info.field_name == "local":
            nonempty_path(v, "leave the data: section out")  # '' was '.', the spec's own directory
        elif info.field_name == "pattern" and not v.strip():
            raise ValueError("empty: it would match no file; give a pattern, or leave the key out ('*')")
        else:
            nonempty_path(v)  # '' was the workspace's own directory, not `data`, the default
        return one_line(v)


class PortsSpec(_Model):
    """Base ports. A process's port is its base plus its local index on the host."""

    pserver: Port = 6170
    trainer: Port = 6180
    master: Port = 6169
    control: Port = 6168


class PserversPerHost(_Model):
    per_host: int = Field(ge=0, le=256)


RESTART_ENV = ("CLUSTERCTL_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")  # the attempt number, set by the agent


def _tilde_refused(items) -> None:
    for item in items:
        if item is not None and item.startswith("~"):
            raise ValueError(f"{item!r}: ~ is not expanded (processes start without a shell): give an absolute path, "
                             "or one relative to the workspace (workspace.remote)")


class JobSpec(_Model):
    """What to run and how processes are laid out."""

    mode: Literal["pserver", "collective"] = "collective"
    launcher: Literal["ssh", "mpi"] = "ssh"
    mpi: Literal["mpich", "openmpi"] = "mpich"
    mpiexec: str = "mpiexec"
    mpi_args: tuple[Arg, ...] = ()
    entrypoint: tuple[Arg, ...] = Field(min_length=1)
    args: tuple[Arg, ...] = ()
    env: dict[str, Arg] = {}
    pservers: Union[int, PserversPerHost, tuple[str, ...]] = 0
    trainers: Union[int, Literal["gpu"]] = 1
    ports: PortsSpec = PortsSpec()
    log_dir: str = "."  # relative to <workspace.remote>.logs/
    # the job's Policy (clusterctl/host/policy.py): its defaults and bounds, written once there
    on_failure: Literal[ON_FAILURE] = DEFAULT_POLICY.on_failure
    grace: float = Field(DEFAULT_POLICY.grace, ge=0, le=GRACE_MAX, allow_inf_nan=False)
    restarts: int = Field(DEFAULT_POLICY.restarts, ge=0, le=RESTARTS_MAX)  # a failed job starts again, up to this many times
    # seconds before the first restart (at least 1), doubled for each next
    restart_backoff: float = Field(DEFAULT_POLICY.restart_backoff, ge=RESTART_BACKOFF_MIN, le=RESTART_BACKOFF_MAX,
                                   allow_inf_nan=False)
    # token: every server of the job (pserver, PMI) authenticates with the job's token; none: they serve
    # anyone who can reach them (a trusted, isolated network only; said in so many words)
    auth: Literal["token", "none"] = "token"
    sync: Literal["sync", "async", "geo"] = "sync"
    k_steps: int = Field(100, ge=1)
    # elastic jobs (docs/lifecycle.md#elastic-jobs): the fewest hosts the job runs on (None: every host that is
    # not a spare), and how many changes of its hosts (a spare in a lost host's place, a lost host left out)
    # any hour may see
    min_hosts: int | None = Field(None, ge=1, le=100_000)
    max_host_changes: int = Field(MAX_HOST_CHANGES, ge=0, le=MAX_HOST_CHANGES_MAX)

    @field_validator("log_dir", "mpiexec")
    @classmethod
    def _paths(cls, v: str) -> str:
        return one_line(nonempty_path(v))  # '' was the logs' own directory ('.'), or no mpiexec at all

    @field_validator("entrypoint", "mpiexec")
    @classmethod
    def _no_tilde(cls, v: Any) -> Any:
        """`~/venv/bin/python` was run as <workspace>/~/venv/bin/python (not found, after the dispatch): processes
        start without a shell, on every backend, so nothing expands a `~` in the program (or mpiexec), nor in the
        script an interpreter is given (`python3 ~/train.py`). Other arguments are the program's to read (a script
        may expand `--data ~/d` itself)."""
        _tilde_refused((v,) if isinstance(v, str) else (v[0], script_arg(v)))
        return v

    @field_validator("args")
    @classmethod
    def _no_tilde_script(cls, v: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        entrypoint = info.data.get("entrypoint")  # absent where it was refused
        if entrypoint and script_arg(entrypoint) is None:
            _tilde_refused((script_arg(entrypoint + v),))  # `entrypoint: [python3]`, `args: [~/train.py]`
        return v

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
            if k in SUPERVISOR_ENV:
                raise ValueError(f"{k} is clusterctl's, set by each host's supervisor; remove it from job.env"
                                 + (" (job.auth: none turns the job token off)" if k == "CLUSTERCTL_AUTH" else ""))
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
