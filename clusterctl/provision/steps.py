"""The provisioning steps: which run, in what order, and each host's template context. Pure."""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ProvisionError
from . import versions
from .schema import AptSource, ProvisionSpec

__all__ = ["STEP_ORDER", "HostFacts", "gpu_apt_packages", "needs_root", "pip_as_login", "sudo_problem", "selected_steps", "requirements", "step_context", "source_line", "read_requirements", "read_keyring"]

# The order steps run in; each later step may rely on the earlier ones (gpu/mpi need the venv).
STEP_ORDER = ("wheelhouse", "apt", "python", "gpu", "mpi", "ssh_mesh", "commands")


@dataclass(frozen=True)
class HostFacts:
    """What the probe learnt about one host (see probe.py)."""

    python: str = ""  # "3.11"
    implementation: str = "cp"
    machine: str = ""  # "x86_64"
    glibc: str = ""  # "2.36"
    hostname: str = ""
    host_key: str = ""  # "ssh-ed25519 AAAA..."
    wheels: tuple[tuple[str, int], ...] = ()  # files in the remote wheelhouse (name, size)
    user: str = ""  # the login user
    uid: int = -1
    home: str = ""
    sudo: str = ""  # root | ok | password | missing | error: ... (provision_host.login_facts)


def selected_steps(prov: ProvisionSpec, only: list[str] | None = None) -> list[str]:
    """The steps the spec asks for, in STEP_ORDER, narrowed to `only`; ProvisionError on unknown names."""
    present = {
        "wheelhouse": bool(prov.wheelhouse and prov.wheelhouse.enabled),
        "apt": bool(prov.apt and (prov.apt.packages or prov.apt.sources)),
        "python": prov.python is not None,
        "gpu": prov.cuda is not None,
        "mpi": prov.mpi is not None,
        "ssh_mesh": bool(prov.ssh_mesh and prov.ssh_mesh.enabled),
        "commands": bool(prov.commands),
    }
    if only:
        unknown = [s for s in only if s not in STEP_ORDER]
        if unknown:
            raise ProvisionError(f"unknown step {unknown[0]!r} for --only (steps: {', '.join(STEP_ORDER)})")
        absent = [s for s in only if not present[s]]
        if absent:
            raise ProvisionError(f"--only {absent[0]}: the spec's provision section has no {absent[0]} step")
        return [s for s in STEP_ORDER if s in only]
    return [s for s in STEP_ORDER if present[s]]


def _outside_home(path: str, home: str) -> bool:
    if not path.startswith("/"):
        return False  # relative paths are under the login user's home
    home = home.rstrip("/")
    return not (home and (path == home or path.startswith(home + "/")))


def needs_root(step: str, prov: ProvisionSpec, facts: HostFacts) -> bool:
    """Whether `step` needs root on this host: apt, the GPU stack's apt part, a venv outside the home, root commands."""
    if facts.uid == 0:
        return False
    venv_outside = bool(prov.python) and _outside_home(prov.python.venv, facts.home)
    if step == "apt":
        return True
    if step == "gpu":
        return bool(_gpu_apt(prov)) or venv_outside
    if step in ("python", "mpi"):
        return venv_outside
    if step == "commands":
        return any(c.root for c in prov.commands)
    return False


def pip_as_login(step: str, prov: ProvisionSpec, facts: HostFacts) -> bool:
    """Whether `step` runs as root (needs_root) while the venv its pip part installs into is the login user's (under the
    home): the gpu step with apt packages. Its pip part then runs as the login user, so the venv's files stay theirs."""
    if not (prov.python and needs_root(step, prov, facts)):
        return False
    return step in ("python", "gpu", "mpi") and not _outside_home(prov.python.venv, facts.home)


def sudo_problem(host_label: str, facts: HostFacts) -> str:
    """Why this host cannot run root steps through `sudo -n` ("" when it can, or when the login user is root)."""
    if facts.uid == 0 or facts.sudo in ("root", "ok"):
        return ""
    who = f"{facts.user or 'the login user'} on {host_label}"
    if facts.sudo == "password":
        return f"sudo needs a password for {who}: allow NOPASSWD sudo or log in as root"
    if facts.sudo == "missing":
        return f"sudo is not installed for {who}: install sudo (NOPASSWD) or log in as root"
    return f"sudo -n does not work for {who} ({facts.sudo.removeprefix('error: ') or 'unknown'}): allow NOPASSWD sudo or log in as root"


def read_requirements(path: Path) -> list[str]:
    """Requirement lines of a requirements file (comments and blank lines dropped); options are refused."""
    from ..files import read_limited

    try:  # bounded, and a FIFO refused rather than waited on
        text = read_limited(path, 4 << 20).decode("utf-8")
    except OSError as exc:
        raise ProvisionError(f"cannot read python.requirements file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ProvisionError(f"python.requirements file {path} is not UTF-8 text") from None
    reqs = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = re.sub(r"(^|\s)#.*$", "", raw).strip()
        if not line:
            continue
        if line.startswith("-"):
            raise ProvisionError(
                f"{path}:{lineno}: option lines ({line.split()[0]}) are not supported; list requirements only"
            )
        reqs.append(line)
    return reqs


def _python_requirements(spec, prov: ProvisionSpec) -> list[str]:
    reqs = prov.python.requirements if prov.python else ()
    if isinstance(reqs, str):
        return read_requirements(spec.local_path(spec.workspace.local) / reqs)
    return list(reqs)


def _gpu_pip(prov: ProvisionSpec) -> list[str]:
    cuda = prov.cuda.version if prov.cuda else ""
    out = []
    if prov.gpu_method("cuda") == "pip":
        out += versions.cuda_pip_requirements(cuda)
    if prov.gpu_method("cudnn") == "pip":
        out.append(versions.cudnn_pip_requirement(prov.cudnn.version, cuda))
    if prov.gpu_method("nccl") == "pip":
        out.append(versions.nccl_pip_requirement(prov.nccl.version, cuda))
    return out


def gpu_apt_packages(prov: ProvisionSpec) -> list[str]:
    """The `name=version` apt packages the gpu step installs (cuda/cudnn/nccl with method apt)."""
    return _gpu_apt(prov)


def _gpu_apt(prov: ProvisionSpec) -> list[str]:
    cuda = prov.cuda.version if prov.cuda else ""
    out = []
    if prov.gpu_method("cuda") == "apt":
        out.append(versions.cuda_apt_package(cuda))
    if prov.gpu_method("cudnn") == "apt":
        out += [f"{name}={ver}" for name, ver in versions.cudnn_apt_packages(prov.cudnn.version, cuda)]
    if prov.gpu_method("nccl") == "apt":
        ver = versions.nccl_apt_version(prov.nccl.version, cuda)
        out += [f"libnccl2={ver}", f"libnccl-dev={ver}"]
    return out


def _mpi_requirements(prov: ProvisionSpec) -> list[str]:
    mpi = prov.mpi
    if mpi is None:
        return []

    def pin(name: str, ver: str | None) -> str:
        return f"{name}=={ver}" if ver else name

    return [pin(mpi.implementation, mpi.version), pin("mpi4py", mpi.mpi4py)]


def requirements(spec, steps: list[str] | None = None) -> list[str]:
    """Every pip requirement the (selected) steps install: what the wheelhouse must hold."""
    prov: ProvisionSpec = spec.provision
    steps = steps or list(STEP_ORDER)
    out: list[str] = []
    if "python" in steps:
        out += _python_requirements(spec, prov)
    if "gpu" in steps:
        out += _gpu_pip(prov)
    if "mpi" in steps:
        out += _mpi_requirements(prov)
    return out


def source_line(src: AptSource, name: str | None = None) -> str:
    """The one-line apt source for `src` (signed-by our uploaded keyring, or trusted=yes)."""
    opts = []
    if src.trusted:
        opts.append("trusted=yes")
    if src.signed_by:
        opts.append(f"signed-by=/etc/apt/keyrings/clusterctl-{name or src.name}.gpg")
    head = f"deb [{' '.join(opts)}]" if opts else "deb"
    return " ".join([head, src.uri, src.suite, *src.components])


def read_keyring(spec, src: AptSource) -> bytes:
    """The controller-side keyring of `src` (signed_by; b"" without one), for the host or for offline apt."""
    if not src.signed_by:
        return b""
    from ..files import read_limited

    path = spec.local_path(src.signed_by)
    try:  # a keyring is kilobytes: bounded, and a FIFO refused rather than waited on
        return read_limited(path, 1 << 20)
    except OSError as exc:
        raise ProvisionError(f"cannot read apt keyring {path}: {exc.strerror or exc}") from None


def _source_ctx(spec, src: AptSource) -> dict:
    key = base64.b64encode(read_keyring(spec, src)).decode()
    return {"name": src.name, "line": source_line(src), "key_b64": key}


def step_context(step: str, spec, *, check: bool, force: bool, wheelhouse_remote: str | None, mesh: dict | None) -> dict:
    """The template context of `step` (the same for every host; host-specific data travels on stdin)."""
    prov: ProvisionSpec = spec.provision
    ctx: dict = {"step": step, "check": check, "force": force}
    venv = prov.python.venv if prov.python else ""
    pip = {"venv": venv, "wheelhouse": wheelhouse_remote or ""}
    if step == "apt":
        apt = prov.apt
        offline = bool(apt.offline and apt.offline.enabled)  # apt.sources are the controller's, then
        ctx.update(
            lock_timeout=int(apt.lock_timeout),
            update=apt.update,
            hold=apt.hold,
            sources=[] if offline else [_source_ctx(spec, s) for s in apt.sources],
            packages=list(apt.packages),
            offline=apt.offline.remote if offline else "",
        )
    elif step == "python":
        py = prov.python
        ctx.update(pip, interpreter=py.interpreter, requirements=_python_requirements(spec, prov))
        ctx["venv_flags"] = ["--system-site-packages"] if py.system_site_packages else []
        ctx["system_site"] = "true" if py.system_site_packages else "false"  # pyvenv.cfg's include-system-site-packages
    elif step == "gpu":
        cuda = prov.cuda
        apt = prov.apt
        ctx.update(
            pip,
            cuda=cuda.version,
            min_driver=versions.min_driver(cuda.version),
            driver_check=cuda.driver_check,
            apt_packages=_gpu_apt(prov),
            pip_requirements=_gpu_pip(prov),
            lock_timeout=int(apt.lock_timeout) if apt else 120,
            update=apt.update if apt else "all",
            repository=_source_ctx(spec, cuda.repository) if cuda.repository else None,
            offline=apt.offline.remote if apt and apt.offline and apt.offline.enabled else "",
        )
    elif step == "mpi":
        ctx.update(pip, implementation=prov.mpi.implementation, requirements=_mpi_requirements(prov))
    elif step == "ssh_mesh":
        ctx.update(mesh or {})
    elif step == "commands":
        ctx["commands"] = [c.model_dump() for c in prov.commands]
    else:
        raise ProvisionError(f"step {step} has no template")
    return ctx
