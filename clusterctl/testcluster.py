"""A cluster of real sshd nodes in Docker containers on this machine, for integration tests and demos.

``up`` builds (and caches) a node image, starts N containers on a private docker network, pins every
node's own host key in a generated known_hosts, installs a per-cluster client key and writes a
cluster spec that clusterctl can use as is. ``down`` removes only what carries this cluster's label.
Options shape it like a real fleet: a non-root login user with sudo (root login disabled), a bastion
in front of nodes on a network this machine has no address on, an OpenSSH config with an alias per
node, a node whose sudo wants a password. See docs/testcluster.md.

Why one module of ~1,250 lines: it is a test tool, not part of the controller or the host package, and
its pieces (the debootstrap base image, the node image, the networks, the fleet shapes, the spec and
ssh config it writes) are one recipe whose steps share the cluster's naming and locking; its command line
is in testcluster_cli.py and its Slurm extension in testcluster_slurm.py.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.resources
import io
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import yaml

from . import docker
from .errors import ClusterctlError, UsageError

__all__ = [
    "ClusterInfo",
    "DockerClusterError",
    "DockerClusterUsageError",
    "Shape",
    "Node",
    "NodeStatus",
    "DEFAULT_NAME",
    "LABEL",
    "up",
    "status",
    "down",
    "state_dir",
    "ensure_docker",
    "add_up_arguments",
    "add_down_parser",
]

DEFAULT_NAME = "clusterctl-test"
LABEL = "clusterctl.testcluster"
INDEX_LABEL = "clusterctl.testcluster.index"
IMAGE_LABEL = "clusterctl.testcluster.image"
LAYOUT_LABEL = "clusterctl.testcluster.layout"
# `docker run` options beyond the image; bump LAYOUT when they change so running clusters are recreated.
SMALL_TMPFS = "/mnt/small"  # a 2 MiB tmpfs on every node: lets tests fill a disk for real
LAYOUT = "tmpfs2m-shm1g-v1"
BUILD_LABEL = "clusterctl.testcluster.build"
ROLE_LABEL = "clusterctl.testcluster.role"  # "bastion" on the bastion; nodes carry none (or "node")
# Nodes behind a bastion: this machine gets an `unreachable` route (this metric) to their subnet, so a
# connect from here fails at once ("No route to host") instead of leaving through the default route.
ROUTE_METRIC = 4242
HIDE_OPTION = "com.docker.network.bridge.inhibit_ipv4"  # a bridge on which the host takes no IPv4 address
USER_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}\Z")
NODE_UID = 1000
NODE_IMAGE_REPO = "clusterctl/testcluster-node"
LOCAL_BASE_REPO = "clusterctl/bookworm-base"
REGISTRY_BASE_IMAGE = "debian:bookworm-slim"
DEBIAN_SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
DEBOOTSTRAP_INCLUDE = (
    "openssh-server",
    "python3",
    "python3-venv",
    "python3-pip",
    "procps",
    "iproute2",
    "rsync",
    "ca-certificates",
    "netbase",
    "iputils-ping",
    "sudo",
)
# Local wheel directories searched before any index; a requirement they satisfy is never downloaded
# (torch==2.13.0 must come from the local +cpu wheel, not from an index).
LOCAL_WHEEL_DIRS = ("/opt/wheels",)
# The node's interpreter (Debian bookworm): wheels are downloaded for it, not for the controller.
NODE_PYTHON_VERSION = "3.11"
NODE_GLIBC_MINOR = 36
TEMPLATE_DIR = Path(str(importlib.resources.files(__package__) / "templates" / "testcluster"))  # package data
TEMPLATE_FILES = ("Dockerfile", "sshd_config", "entrypoint.sh", "ensure-packages.sh")

PULL_TIMEOUT = 20.0  # a registry that does not answer in this long is treated as absent
SSH_WAIT_TIMEOUT = 60.0  # per node, for sshd to generate host keys and answer
INTERNAL_PROBE_TIMEOUT = 15.0  # how long an --internal network gets to prove the host reaches nodes
BUILD_TIMEOUT = 1800.0
DEBOOTSTRAP_TIMEOUT = 1800.0
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,40}\Z")

Progress = Callable[[str], None]
T = TypeVar("T")
R = TypeVar("R")


class DockerClusterError(ClusterctlError):
    """The test cluster could not be built, started, inspected or removed as asked."""


class DockerClusterUsageError(DockerClusterError, UsageError):
    """An argument of up/status/down that no cluster can have (a bad name, node count, user, ...): refused
    before docker is touched; exit 2, as argparse's own argument errors."""


class Node(NamedTuple):
    """One node: its container name, its address on the cluster network, and its hostname."""

    container: str
    ip: str
    hostname: str


@dataclass(frozen=True)
class Shape:
    """What the cluster looks like to its users: the login user, a bastion, nodes whose sudo wants a password."""

    user: str = "root"
    bastion: bool = False
    sudo_password_nodes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not USER_RE.match(self.user):
            raise DockerClusterUsageError(
                f"invalid user name {self.user!r}: use lowercase letters, digits, '_' or '-' (at most 32, "
                "not starting with a digit or '-')"
            )
        if self.sudo_password_nodes and self.user == "root":
            raise DockerClusterUsageError("--sudo-password-node needs --user NAME: root does not use sudo")

    @property
    def home(self) -> str:
        """The login user's home directory on the nodes."""
        return "/root" if self.user == "root" else f"/home/{self.user}"

    def layout(self) -> str:
        """The LAYOUT label for this shape: plain LAYOUT for the default (root on one flat network)."""
        if self == Shape():
            return LAYOUT
        parts = [LAYOUT, f"user={self.user}"]
        if self.bastion:
            parts.append("bastion")
        if self.sudo_password_nodes:
            parts.append("sudo-password=" + ",".join(str(i) for i in self.sudo_password_nodes))
        return ";".join(parts)

    def run_args(self, index: int | None) -> list[str]:
        """`docker run` options for node index (None: the bastion) that give it this shape."""
        args: list[str] = []
        if self.user != "root":
            sudo = "password" if index in self.sudo_password_nodes else "nopasswd"
            args += ["--env", f"CLUSTERCTL_USER={self.user}", "--env", f"CLUSTERCTL_SUDO={sudo}"]
        if self.bastion and index is not None:
            # The entrypoint drops the default route: a node behind the bastion routes nowhere but its subnet.
            args += ["--cap-add", "NET_ADMIN", "--env", "CLUSTERCTL_NO_DEFAULT_ROUTE=1"]
        return args


@dataclass(frozen=True)
class ClusterInfo:
    """What `up` made: nodes in index order, and where the key, pins and spec live."""

    name: str
    nodes: list[Node]
    spec_path: Path
    key_path: Path
    known_hosts_path: Path
    state_dir: Path
    image: str = ""
    network: str = ""  # the nodes' network
    packages: list[str] = field(default_factory=list)  # pip requirements installed in /opt/venv
    image_built: bool = False  # True if this call built the node image (False: cache hit)
    reused: bool = False  # True if this call kept already running containers
    timings: dict[str, float] = field(default_factory=dict)
    user: str = "root"  # the login user on nodes and bastion
    home: str = "/root"  # that user's home on the nodes
    bastion: Node | None = None  # ip: its address on front_network, the one this machine reaches
    front_network: str = ""  # the bastion's network towards this machine ("" without a bastion)
    ssh_config_path: Path | None = None  # the OpenSSH config written beside the spec (ssh_config=True)
    sudo_password_nodes: tuple[int, ...] = ()  # indexes of nodes whose sudo wants a password

    @property
    def proxy_jump(self) -> str | None:
        """`user@bastion-ip` for `ssh -J` / `ssh.proxy_jump`, or None without a bastion."""
        return f"{self.user}@{self.bastion.ip}" if self.bastion else None

    @property
    def aliases(self) -> list[str]:
        """The ssh_config alias of each node, in index order (node0, node1, ...)."""
        return [f"node{i}" for i in range(len(self.nodes))]


@dataclass(frozen=True)
class NodeStatus:
    """One container of a cluster as docker and a TCP probe of port 22 see it."""

    container: str
    hostname: str
    ip: str
    state: str
    ssh: bool


def _noop(_: str) -> None:
    return None


# --------------------------------------------------------------------------------------------- paths


def state_root() -> Path:
    """Directory holding every test cluster's state (override with CLUSTERCTL_TESTCLUSTER_HOME)."""
    env = os.environ.get("CLUSTERCTL_TESTCLUSTER_HOME")
    # absolute: the spec and ssh config name the key and known_hosts in it, read from any directory
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "clusterctl" / "testcluster").absolute()


def state_dir(name: str) -> Path:
    """Directory holding one cluster's client key, known_hosts and default spec."""
    return state_root() / _checked_name(name)


def _checked_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise DockerClusterUsageError(
            f"invalid test cluster name {name!r}: use lowercase letters, digits, '.', '_' or '-' "
            "(at most 41 characters, starting with a letter or digit)"
        )
    return name


@contextlib.contextmanager
def _locked(what: str) -> Iterator[None]:
    """Hold an exclusive flock on state_root()/locks/<what> (serialises concurrent up/down/builds)."""
    locks = _made(state_root() / "locks")
    with open(locks / f"{what}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _made(path: Path, mode: int | None = None) -> Path:
    """path, a directory made (with its parents) if absent, chmod'ed to mode; one DockerClusterError line if it
    cannot be (was an OSError naming only the file: `Not a directory: .../locks`)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        if mode is not None:
            path.chmod(mode)
    except OSError as exc:
        raise DockerClusterError(f"cannot make the test cluster state directory {path}: {exc.strerror or exc} "
                                 "(CLUSTERCTL_TESTCLUSTER_HOME chooses where they are)") from exc
    return path


def _network_name(name: str) -> str:
    return f"{name}-net"


def _front_network_name(name: str) -> str:
    return f"{name}-front"


def _bastion_name(name: str) -> str:
    return f"{name}-bastion"


def _container_name(name: str, index: int) -> str:
    return f"{name}-node{index}"


# ---------------------------------------------------------------------------------------- parallel


def _parallel(fn: Callable[[T], R], items: Sequence[T], what: str) -> list[R]:
    """Run fn over items in threads; return results in order or raise one error naming every failure."""
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(items))) as pool:
        futures = [pool.submit(fn, item) for item in items]
    results: list[R] = []
    failures: list[str] = []
    for item, fut in zip(items, futures, strict=True):
        exc = fut.exception()
        if exc is None:
            results.append(fut.result())
        elif isinstance(exc, ClusterctlError):
            failures.append(f"  {item}: {exc}")
        else:
            raise exc
    if failures:
        raise DockerClusterError(f"{what} failed for {len(failures)} of {len(items)}:\n" + "\n".join(failures))
    return results


# -------------------------------------------------------------------------------------- base image


def _apt_mirror() -> str:
    """The Debian mirror apt uses on this machine (CLUSTERCTL_DEBIAN_MIRROR overrides it)."""
    override = os.environ.get("CLUSTERCTL_DEBIAN_MIRROR")
    if override:
        return override
    for text in _apt_source_texts():
        mirror = _mirror_from_sources(text)
        if mirror:
            return mirror
    return DEFAULT_MIRROR


def _apt_source_texts() -> Iterable[str]:
    candidates = [Path("/etc/apt/sources.list")]
    parts = Path("/etc/apt/sources.list.d")
    if parts.is_dir():
        candidates += sorted(parts.glob("*.sources")) + sorted(parts.glob("*.list"))
    for path in candidates:
        if path.is_file():
            yield path.read_text(errors="replace")


def _mirror_from_sources(text: str) -> str | None:
    """The first URI serving the plain Debian suite, in one-line (.list) or deb822 (.sources) format."""
    for stanza in re.split(r"\n\s*\n", text):
        fields = dict(re.findall(r"^(URIs|Suites):\s*(.+)$", stanza, re.MULTILINE))
        if fields and DEBIAN_SUITE in fields.get("Suites", "").split():
            uri = fields.get("URIs", "").split()
            if uri and not uri[0].rstrip("/").endswith("-security"):
                return uri[0].rstrip("/")
    for line in text.splitlines():
        words = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()
        if len(words) >= 3 and words[0] == "deb" and words[2] == DEBIAN_SUITE:
            return words[1].rstrip("/")
    return None


def _local_base_tag() -> str:
    digest = hashlib.sha256(" ".join((DEBIAN_SUITE, *DEBOOTSTRAP_INCLUDE)).encode()).hexdigest()[:12]
    return f"{LOCAL_BASE_REPO}:{DEBIAN_SUITE}-{digest}"


def _resolve_base_image(requested: str | None, progress: Progress) -> str:
    """The base image to build nodes FROM: requested, else local debootstrap build, else registry."""
    if requested:
        if docker.image_exists(requested):
            return requested
        progress(f"pulling {requested} (at most {PULL_TIMEOUT:g}s)")
        if docker.pull(requested, timeout=PULL_TIMEOUT):
            return requested
        raise DockerClusterError(
            f"base image {requested!r} is not present locally and could not be pulled; "
            "leave out --base-image to build a Debian base locally with debootstrap"
        )
    local = _local_base_tag()
    if docker.image_exists(local):
        return local
    if docker.image_exists(REGISTRY_BASE_IMAGE):
        return REGISTRY_BASE_IMAGE
    progress(f"trying to pull {REGISTRY_BASE_IMAGE} (at most {PULL_TIMEOUT:g}s)")
    if docker.pull(REGISTRY_BASE_IMAGE, timeout=PULL_TIMEOUT):
        return REGISTRY_BASE_IMAGE
    progress("no registry reachable: building the base image with debootstrap (about a minute)")
    _build_local_base(local)
    return local


def _build_local_base(tag: str) -> None:
    """debootstrap a minimal bookworm with the node's packages and `docker import` it as tag."""
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None:
        raise DockerClusterError("no registry is reachable and debootstrap is missing: apt-get install debootstrap")
    if os.geteuid() != 0:
        raise DockerClusterError("building the base image with debootstrap needs root")
    work = state_root() / "base-build"
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        rootfs = Path(tmp) / "rootfs"
        argv = [
            debootstrap,
            "--variant=minbase",
            "--include=" + ",".join(DEBOOTSTRAP_INCLUDE),
            DEBIAN_SUITE,
            str(rootfs),
            _apt_mirror(),
        ]
        _checked_run(argv, timeout=DEBOOTSTRAP_TIMEOUT, what="debootstrap")
        _scrub_rootfs(rootfs)
        _import_rootfs(rootfs, tag)


def _scrub_rootfs(rootfs: Path) -> None:
    """Remove what must not be shared by every node (host keys) and what only costs space."""
    for key in (rootfs / "etc" / "ssh").glob("ssh_host_*"):
        key.unlink()
    for cache in (rootfs / "var" / "cache" / "apt" / "archives").glob("*.deb"):
        cache.unlink()
    lists = rootfs / "var" / "lib" / "apt" / "lists"
    for entry in lists.glob("*"):
        if entry.is_file():
            entry.unlink()


def _import_rootfs(rootfs: Path, tag: str) -> None:
    """`tar -C rootfs -c . | docker import - tag`, as two argv processes joined by a pipe."""
    tar = subprocess.Popen(
        ["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert tar.stdout is not None  # for the type checker: stdout=PIPE above
    imp = subprocess.run(
        [
            docker.docker_binary(),
            "import",
            "--change",
            f"LABEL {LABEL}.base={DEBIAN_SUITE}",
            "--change",
            'CMD ["/bin/bash"]',
            "-",
            tag,
        ],
        stdin=tar.stdout,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
        check=False,
    )
    tar.stdout.close()
    tar_err = tar.stderr.read().decode(errors="replace") if tar.stderr else ""
    tar_rc = tar.wait(timeout=60)
    if tar_rc != 0:
        raise DockerClusterError(f"tar of {rootfs} exited {tar_rc}: {tar_err.strip()[-500:]}")
    if imp.returncode != 0:
        raise docker.DockerError(["docker", "import", "-", tag], imp.returncode, imp.stderr)


def _checked_run(
    argv: list[str], *, timeout: float, what: str, shown: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run argv (no shell); raise DockerClusterError naming `shown` (default: argv) with the output's tail."""
    command = shown or " ".join(argv)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise DockerClusterError(f"{what} timed out after {timeout:g}s: {command}") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-10:]
        raise DockerClusterError(f"{what} exited {proc.returncode}: {command}\n" + "\n".join(tail))
    return proc


# -------------------------------------------------------------------------------------- node image


def _node_image_tag(base: str, packages: Sequence[str]) -> str:
    """Content-addressed tag: templates + base image ID + package list decide it."""
    digest = hashlib.sha256()
    for name in TEMPLATE_FILES:
        digest.update(name.encode() + b"\0" + (TEMPLATE_DIR / name).read_bytes() + b"\0")
    digest.update((docker.image_id(base) or base).encode() + b"\0")
    digest.update("\n".join(packages).encode())
    return f"{NODE_IMAGE_REPO}:{digest.hexdigest()[:16]}"


def _ensure_node_image(base: str, packages: Sequence[str], progress: Progress) -> tuple[str, bool]:
    """The node image tag, building it if absent; the flag says whether a build happened."""
    tag = _node_image_tag(base, packages)
    if docker.image_exists(tag):
        return tag, False
    with tempfile.TemporaryDirectory(prefix="clusterctl-node-") as tmp:
        context = Path(tmp)
        for name in TEMPLATE_FILES:
            shutil.copy2(TEMPLATE_DIR / name, context / name)
        (context / "requirements.txt").write_text("".join(f"{p}\n" for p in packages))
        wheels = context / "wheels"
        wheels.mkdir()
        (wheels / "README").write_text("wheels for /opt/venv, downloaded on the controller\n")
        if packages:
            progress(f"downloading wheels for {', '.join(packages)}")
            _download_wheels(packages, wheels)
        progress(f"building node image {tag} FROM {base}")
        _build_image(context, tag, base)
    return tag, True


def _download_wheels(packages: Sequence[str], dest: Path) -> None:
    """`pip download --only-binary=:all:` for the node's Python; local wheels win over any index."""
    local_dirs = [d for d in _local_wheel_dirs() if d.is_dir()]
    wanted = [_local_wheel(req, local_dirs) or req for req in packages]
    argv = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--dest", str(dest)]
    argv += ["--python-version", NODE_PYTHON_VERSION, "--implementation", "cp"]
    argv += ["--abi", "cp" + NODE_PYTHON_VERSION.replace(".", "")]
    argv += _node_platform_args()
    for d in local_dirs:
        argv += ["--find-links", str(d)]
    argv += ["--", *wanted]
    shown = f"pip download --only-binary=:all: (for the nodes' cp311 manylinux) -- {' '.join(wanted)}"
    _checked_run(argv, timeout=BUILD_TIMEOUT, what="pip download", shown=shown)


def _local_wheel_dirs() -> list[Path]:
    extra = os.environ.get("CLUSTERCTL_WHEEL_DIRS", "")
    return [Path(d) for d in (*LOCAL_WHEEL_DIRS, *extra.split(os.pathsep)) if d]


def _node_platform_args() -> list[str]:
    """--platform for every manylinux tag a bookworm node (glibc 2.36, x86_64) accepts."""
    tags = [f"manylinux_2_{minor}_x86_64" for minor in range(NODE_GLIBC_MINOR, 4, -1)]
    tags += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    return [arg for tag in tags for arg in ("--platform", tag)]


def _local_wheel(requirement: str, dirs: Sequence[Path]) -> str | None:
    """Path of a local wheel that satisfies requirement, preferring the highest version, or None."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

    try:
        req = Requirement(requirement)
    except InvalidRequirement as exc:
        raise DockerClusterError(_bad_requirement(requirement, exc)) from exc
    best: tuple[Any, Path] | None = None
    for wheel in (w for d in dirs for w in d.glob("*.whl")):
        try:
            name, version, _build, _tags = parse_wheel_filename(wheel.name)
        except InvalidWheelFilename:
            continue
        if name != canonicalize_name(req.name) or not req.specifier.contains(version, prereleases=True):
            continue
        if best is None or version > best[0]:
            best = (version, wheel)
    return str(best[1]) if best else None


def _build_image(context: Path, tag: str, base: str) -> None:
    """docker build the node image, then drop the wheels stage's image (a GB with torch) it leaves."""
    env = {} if docker.buildkit_available() else {"DOCKER_BUILDKIT": "0"}
    build_id = tag.rsplit(":", 1)[1]
    args = ["build", "--tag", tag, "--label", f"{IMAGE_LABEL}=1"]
    args += ["--build-arg", f"BASE_IMAGE={base}", "--build-arg", f"BUILD_ID={build_id}"]
    docker.run([*args, str(context)], env=env, timeout=BUILD_TIMEOUT)
    docker.run(["image", "prune", "--force", "--filter", f"label={BUILD_LABEL}={build_id}"], timeout=120)


# --------------------------------------------------------------------------------- containers, net


def _labelled_containers(name: str) -> list[dict[str, Any]]:
    return docker.inspect("container", docker.ids_with_label("container", f"{LABEL}={name}"))


def _is_bastion(info: dict[str, Any]) -> bool:
    return bool(info["Config"]["Labels"].get(ROLE_LABEL) == "bastion")


def _cluster_containers(name: str) -> list[dict[str, Any]]:
    """Inspect data of this cluster's nodes (not its bastion), in node-index order."""
    found = [c for c in _labelled_containers(name) if not _is_bastion(c)]
    return sorted(found, key=lambda c: int(c["Config"]["Labels"].get(INDEX_LABEL, "0")))


def _bastion_info(name: str) -> dict[str, Any] | None:
    """Inspect data of this cluster's bastion, or None if it has none."""
    found = [c for c in _labelled_containers(name) if _is_bastion(c)]
    return found[0] if found else None


def _ensure_network(name: str, internal: bool = True, *, net: str | None = None, hidden: bool = False) -> str:
    """Create a network of the cluster if absent (internal: no route out of the host).

    hidden: the host takes no address on it (nodes behind a bastion); see _hide_from_host.
    """
    net = net or _network_name(name)
    if docker.inspect("network", [net]):
        return net
    args = ["network", "create", "--driver", "bridge", "--label", f"{LABEL}={name}"]
    if internal:
        args.append("--internal")
    if hidden:
        args += ["--opt", f"{HIDE_OPTION}=true"]
    docker.run([*args, net])
    return net


def _ip_argv() -> list[str]:
    ip = shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip") if os.access(p, os.X_OK)), None)
    if ip is None:
        raise DockerClusterError("a bastion cluster needs the `ip` command on this machine: apt-get install iproute2")
    return [ip]


def _bridge_of(info: dict[str, Any]) -> str:
    """The host-side Linux bridge of a docker bridge network."""
    options = info.get("Options") or {}
    return str(options.get("com.docker.network.bridge.name") or "br-" + str(info["Id"])[:12])


def _subnets(info: dict[str, Any]) -> list[str]:
    return [str(c["Subnet"]) for c in (info.get("IPAM") or {}).get("Config") or [] if ":" not in c.get("Subnet", ":")]


def _host_addresses(bridge: str) -> list[str]:
    proc = _checked_run([*_ip_argv(), "-4", "-o", "addr", "show", "dev", bridge], timeout=30, what="ip addr show")
    return [line.split()[3] for line in proc.stdout.splitlines() if len(line.split()) > 3]


def _unreachable_routes() -> str:
    argv = [*_ip_argv(), "-4", "route", "show", "type", "unreachable"]
    return _checked_run(argv, timeout=30, what="ip route show").stdout


def _hide_from_host(net: str, progress: Progress) -> None:
    """Make sure this machine has no address on net, and (as root) an `unreachable` route to its subnet.

    docker's --internal alone still gives the host the gateway address; the network is created with
    inhibit_ipv4, and if this docker ignored that, the bridge's address is flushed here (root only).
    """
    found = docker.inspect("network", [net])
    if not found:
        raise DockerClusterError(f"network {net} vanished")
    info = found[0]
    bridge = _bridge_of(info)
    if _host_addresses(bridge):
        if os.geteuid() != 0:
            raise DockerClusterError(f"this machine has an address on {net} ({bridge}); only root can remove it")
        _checked_run([*_ip_argv(), "-4", "addr", "flush", "dev", bridge], timeout=30, what="ip addr flush")
        left = _host_addresses(bridge)
        if left:
            raise DockerClusterError(f"this machine still has {', '.join(left)} on {net} ({bridge})")
    if os.geteuid() != 0:
        progress(f"not root: no `unreachable` route to {net}; a connect to a node leaves by the default route")
        return
    for subnet in _subnets(info):
        argv = [*_ip_argv(), "-4", "route", "replace", "unreachable", subnet, "metric", str(ROUTE_METRIC)]
        _checked_run(argv, timeout=30, what="ip route replace")


def _drop_routes(info: dict[str, Any]) -> None:
    """Remove the `unreachable` routes _hide_from_host added for a network (if any, and if root)."""
    if (info.get("Options") or {}).get(HIDE_OPTION) != "true" or os.geteuid() != 0:
        return
    table = _unreachable_routes()
    for subnet in _subnets(info):
        if re.search(rf"^unreachable {re.escape(subnet)} .*metric {ROUTE_METRIC}\b", table, re.MULTILINE):
            argv = [*_ip_argv(), "-4", "route", "del", "unreachable", subnet, "metric", str(ROUTE_METRIC)]
            _checked_run(argv, timeout=30, what="ip route del")


def _network_is_internal(net: str) -> bool:
    found = docker.inspect("network", [net])
    return bool(found and found[0].get("Internal"))


def _start_node(name: str, index: int, image: str, net: str, shape: Shape | None = None) -> str:
    """`docker run` one node detached, with docker's init as PID 1 so zombies are reaped."""
    shape = shape or Shape()
    container = _container_name(name, index)
    docker.run(
        [
            "run",
            "--detach",
            "--init",  # tini as PID 1: reaps orphans that tests' kill -9 leave behind
            "--name", container,
            "--hostname", container,
            "--network", net,
            "--label", f"{LABEL}={name}",
            "--label", f"{INDEX_LABEL}={index}",
            "--label", f"{IMAGE_LABEL}={image}",
            "--label", f"{LAYOUT_LABEL}={shape.layout()}",
            "--tmpfs", f"{SMALL_TMPFS}:rw,size=2m,mode=1777",
            "--shm-size", "1g",  # MPI's intra-node shared memory; Docker's default 64 MiB is too small
            *shape.run_args(index),
            image,
        ]
    )  # fmt: skip
    return container


def _start_bastion(name: str, image: str, front: str, net: str, shape: Shape) -> str:
    """`docker run` the bastion on the front network, then attach it to the nodes' network too."""
    container = _bastion_name(name)
    docker.run(
        [
            "run",
            "--detach",
            "--init",
            "--name", container,
            "--hostname", container,
            "--network", front,
            "--label", f"{LABEL}={name}",
            "--label", f"{ROLE_LABEL}=bastion",
            "--label", f"{IMAGE_LABEL}={image}",
            "--label", f"{LAYOUT_LABEL}={shape.layout()}",
            *shape.run_args(None),
            image,
        ]
    )  # fmt: skip
    docker.run(["network", "connect", net, container])
    return container


def _node_ip(info: dict[str, Any], net: str) -> str:
    networks = info.get("NetworkSettings", {}).get("Networks") or {}
    ip = (networks.get(net) or {}).get("IPAddress", "")
    if not ip:
        raise DockerClusterError(f"container {info['Name'].lstrip('/')} has no address on network {net}")
    return str(ip)


def _ssh_banner(ip: str, port: int = 22, timeout: float = 1.0) -> bool:
    """True if something at ip:port answers with an SSH banner."""
    try:
        with socket.create_connection((ip, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            return sock.recv(8).startswith(b"SSH-")
    except OSError:
        return False


def _wait_ssh(ip: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _ssh_banner(ip):
            return True
        time.sleep(0.2)
    return False


def _sshd_listening_inside(container: str) -> bool:
    """True if sshd answers on the container's own loopback (the host may still not reach it)."""
    proc = docker.run(
        ["exec", container, "/usr/bin/timeout", "2", "/usr/bin/ssh-keyscan", "-T", "1", "127.0.0.1"],
        check=False,
        timeout=30,
    )
    return "ssh-ed25519" in proc.stdout


def _switch_to_bridge(name: str, containers: Sequence[str], net: str | None = None) -> str:
    """Replace an --internal network the host cannot reach by a plain bridge network."""
    net = net or _network_name(name)
    for container in containers:
        docker.run(["network", "disconnect", "--force", net, container], check=False)
    docker.run(["network", "rm", net])
    _ensure_network(name, internal=False, net=net)
    for container in containers:
        docker.run(["network", "connect", net, container])
    return net


def _wait_nodes(name: str, containers: Sequence[str], net: str, progress: Progress) -> list[Node]:
    """Addresses of the nodes once each one's sshd answers from the host (bridge fallback if needed)."""
    nodes = _nodes_of(containers, net)
    if _network_is_internal(net) and not _wait_ssh(nodes[0].ip, INTERNAL_PROBE_TIMEOUT):
        # Not yet listening (a loaded machine: entrypoint still busy) is not "unreachable": wait for sshd
        # inside for the rest of SSH_WAIT_TIMEOUT, then give the host one more look before switching.
        if not _wait_inside(containers[0], SSH_WAIT_TIMEOUT - INTERNAL_PROBE_TIMEOUT):
            raise DockerClusterError(_not_answering(containers[0], nodes[0].ip))
        if _wait_ssh(nodes[0].ip, 3.0):
            return _parallel(lambda n: _waited(n, SSH_WAIT_TIMEOUT), nodes, "waiting for sshd")
        progress(f"host cannot reach containers on --internal network {net}: using a plain bridge")
        net = _switch_to_bridge(name, containers, net)
        nodes = _nodes_of(containers, net)

    return _parallel(lambda n: _waited(n, SSH_WAIT_TIMEOUT), nodes, "waiting for sshd")


def _waited(node: Node, timeout: float) -> Node:
    """node, once its sshd answers from the host; an error with its log after timeout seconds."""
    if not _wait_ssh(node.ip, timeout):
        raise DockerClusterError(_not_answering(node.container, node.ip))
    return node


def _wait_inside(container: str, timeout: float) -> bool:
    """True once sshd answers on the container's own loopback, False after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if _sshd_listening_inside(container):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


# Runs with the bastion's python3: argv = timeout ip...; prints the addresses whose sshd did not answer.
# Every address is tried at least once, so a timeout of 0 is a single probe.
_PROBE_BEHIND = """
import socket, sys, time
deadline = time.monotonic() + float(sys.argv[1])
pending = sys.argv[2:]
while True:
    left = []
    for ip in pending:
        try:
            with socket.create_connection((ip, 22), timeout=1) as sock:
                sock.settimeout(1)
                ok = sock.recv(8).startswith(b"SSH-")
        except OSError:
            ok = False
        if not ok:
            left.append(ip)
    pending = left
    if not pending or time.monotonic() >= deadline:
        break
    time.sleep(0.2)
print(" ".join(pending))
"""


def _probe_behind(bastion: str, ips: Sequence[str], timeout: float, *, check: bool = False) -> set[str]:
    """The addresses among ips whose sshd does not answer from inside the bastion within timeout.

    If the probe cannot run in the bastion (stopped, paused): all of them, or (check) an error naming the bastion.
    """
    if not ips:
        return set()
    argv = ["exec", bastion, "python3", "-c", _PROBE_BEHIND, f"{timeout:g}", *ips]
    proc = docker.run(argv, timeout=timeout + 10 + 2 * len(ips), check=False)
    if proc.returncode != 0:
        if check:
            tail = (proc.stderr or proc.stdout).strip()[-500:]
            why = f"exit {proc.returncode}: {tail}"
            raise DockerClusterError(f"cannot probe the nodes from the bastion {bastion} ({why})")
        return set(ips)
    return set(proc.stdout.split())


def _wait_behind(bastion: str, nodes: Sequence[Node]) -> list[Node]:
    """The nodes, once each one's sshd answers from the bastion (this machine cannot reach them)."""
    silent = _probe_behind(bastion, [n.ip for n in nodes], SSH_WAIT_TIMEOUT, check=True)
    failures = [_not_answering(n.container, n.ip) + " (probed from the bastion)" for n in nodes if n.ip in silent]
    if failures:
        raise DockerClusterError("\n".join(failures))
    return list(nodes)


def _nodes_of(containers: Sequence[str], net: str) -> list[Node]:
    infos = {c["Name"].lstrip("/"): c for c in docker.inspect("container", list(containers))}
    missing = [c for c in containers if c not in infos]
    if missing:
        raise DockerClusterError(f"containers vanished while starting: {', '.join(missing)}")
    return [Node(c, _node_ip(infos[c], net), infos[c]["Config"]["Hostname"]) for c in containers]


def _not_answering(container: str, ip: str) -> str:
    logs = docker.run(["logs", "--tail", "20", container], check=False, timeout=30)
    tail = (logs.stdout + logs.stderr).strip()
    return f"sshd in {container} ({ip}) did not answer within {SSH_WAIT_TIMEOUT:g}s; its log:\n{tail}"


# ------------------------------------------------------------------------------------ keys & pins


def _ensure_client_key(state: Path) -> tuple[Path, str]:
    """The cluster's ed25519 client key (made on first use, mode 0600) and its public line."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key_path = state / "id_ed25519"
    pub_path = state / "id_ed25519.pub"
    if key_path.is_file() and pub_path.is_file():
        key_path.chmod(0o600)
        return key_path, pub_path.read_text().strip()
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    pub_line = f"{public.decode()} clusterctl-testcluster-{state.name}"
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(private)
    key_path.chmod(0o600)
    pub_path.write_text(pub_line + "\n")
    return key_path, pub_line


def _host_key(container: str) -> str:
    """`TYPE BASE64` of the node's own ed25519 host key, read through docker exec."""
    proc = docker.run(["exec", container, "cat", "/etc/ssh/ssh_host_ed25519_key.pub"], timeout=30)
    fields = proc.stdout.split()
    if len(fields) < 2 or fields[0] != "ssh-ed25519":
        raise DockerClusterError(f"{container}: unexpected host key {proc.stdout.strip()!r}")
    return f"{fields[0]} {fields[1]}"


def _known_hosts(nodes: Sequence[Node], keys: Sequence[str], with_names: bool) -> str:
    """known_hosts text pinning each node's key to its address (and hostname, for use inside)."""
    lines = []
    for node, key in zip(nodes, keys, strict=True):
        host = f"{node.ip},{node.hostname}" if with_names else node.ip
        lines.append(f"{host} {key}\n")
    return "".join(lines)


def _ssh_tar(files: dict[str, tuple[str, int]], owner: int = 0) -> bytes:
    """A tar holding .ssh/ (0700) and the given files (name -> (text, mode)), all owned by uid/gid owner."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        folder = tarfile.TarInfo(".ssh")
        folder.type, folder.mode, folder.mtime = tarfile.DIRTYPE, 0o700, int(time.time())
        folder.uid = folder.gid = owner
        tar.addfile(folder)
        for name, (text, mode) in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f".ssh/{name}")
            info.size, info.mode, info.mtime = len(data), mode, int(time.time())
            info.uid = info.gid = owner
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _install_ssh_files(container: str, tar_bytes: bytes, home: str = "/root") -> None:
    """Unpack the .ssh tar into home on the node with `docker cp --archive -` (owners kept; no shell)."""
    argv = [docker.docker_binary(), "cp", "--archive", "-", f"{container}:{home}"]
    proc = subprocess.run(argv, input=tar_bytes, capture_output=True, timeout=60, check=False)
    if proc.returncode != 0:
        raise docker.DockerError(argv, proc.returncode, proc.stderr.decode(errors="replace"))


def _pin_and_authorize(
    nodes: Sequence[Node], state: Path, shape: Shape | None = None, bastion: Node | None = None
) -> tuple[Path, Path]:
    """Pin host keys in state/known_hosts and give every node the cluster key (node-to-node ssh too).

    With a login user, root and the user both get the files (root's key only shows that sshd, not a
    missing key, refuses root). The bastion is pinned after the nodes and gets authorized_keys only.
    """
    shape = shape or Shape()
    key_path, pub_line = _ensure_client_key(state)
    hosts = [*nodes, *([bastion] if bastion else [])]
    keys = _parallel(_host_key, [n.container for n in hosts], "reading host keys")
    known_hosts = state / "known_hosts"
    known_hosts.write_text(_known_hosts(hosts, keys, with_names=False))
    files = {
        "authorized_keys": (pub_line + "\n", 0o600),
        # mpiexec and friends ssh from node to node: same key, same pins, names included.
        "id_ed25519": (key_path.read_text(), 0o600),
        "id_ed25519.pub": (pub_line + "\n", 0o644),
        "known_hosts": (_known_hosts(nodes, keys[: len(nodes)], with_names=True), 0o644),
    }
    homes = [("/root", _ssh_tar(files))]
    if shape.user != "root":
        homes.append((shape.home, _ssh_tar(files, owner=NODE_UID)))
    targets = [(n.container, tar, home) for n in nodes for home, tar in homes]
    if bastion:
        login = {"authorized_keys": files["authorized_keys"]}
        targets += [(bastion.container, _ssh_tar(login), "/root")]
        if shape.user != "root":
            targets += [(bastion.container, _ssh_tar(login, owner=NODE_UID), shape.home)]
    _parallel(lambda t: _install_ssh_files(*t), targets, "installing keys")
    return key_path, known_hosts


def _spec_dict(
    name: str,
    nodes: Sequence[Node],
    key_path: Path,
    known_hosts: Path,
    *,
    user: str = "root",
    bastion: Node | None = None,
) -> dict[str, Any]:
    ssh: dict[str, Any] = {
        "user": user,
        "port": 22,
        "identity_file": str(key_path),
        "known_hosts": str(known_hosts),
        "host_key_policy": "strict",
        "connect_timeout": 5,
    }
    if bastion is not None:
        ssh["proxy_jump"] = f"{user}@{bastion.ip}"
    return {
        "name": name,
        "ssh": ssh,
        "hosts": [{"address": n.ip} for n in nodes],
        # relative to the login user's home: a non-root user cannot write /root
        "workspace": {"local": ".", "remote": "/root/work" if user == "root" else "work"},
        "job": {
            "mode": "pserver",
            "entrypoint": ["/opt/venv/bin/python", "train.py"],
            "pservers": 1,
            "trainers": 1,
        },
    }


# A file name ssh_config takes as it is: no blank, quote, backslash, %, $, # or anything a shell reads
_PLAIN_PATH = re.compile(r"[A-Za-z0-9_./+:-]+")


def _ssh_config_file(path: Path) -> str:
    """A file name as the value of IdentityFile or UserKnownHostsFile, which ssh_config(5) splits at blanks and
    %-expands (TOKENS) and ${}-expands (ENVIRONMENT VARIABLES): written plain when it needs nothing of that,
    else as clusterctl.transport.openssh.config_path quotes it (double quotes, `%%` for a `%`). A `${` cannot be
    escaped there, nor a line break written: a name holding either is refused."""
    from .transport.openssh import config_path

    text = _one_line(path)
    if "${" in text:
        raise DockerClusterUsageError(f"cannot write {text!r} into an ssh config: it holds '${{' (ssh expands an "
                                      "environment variable there, with no way to escape it)")
    return text if _PLAIN_PATH.fullmatch(text) else config_path(text)


def _one_line(path: Path) -> str:
    """str(path), refused (a usage error) if it holds a line break: no ssh_config line can hold one."""
    text = str(path)
    if any(ch in text for ch in "\n\r"):
        raise DockerClusterUsageError(f"cannot write {text!r} into an ssh config: it holds a line break")
    return text


def _jump_line(config: Path) -> str:
    """How a node's entry reaches `Host bastion`. ProxyJump makes ssh run `ssh -F <the -F it was given> -W
    '[%h]:%p' bastion` through the shell with that name neither quoted nor %-escaped (`ssh -F '/a b/ssh_config'`
    ran `ssh -F /a b/ssh_config`; a `%b` was "unknown key"): a config whose name needs either writes that
    command out, its own name quoted for the shell and %-escaped (ProxyCommand is %-expanded, not ${}-expanded)."""
    text = _one_line(config)
    if _PLAIN_PATH.fullmatch(text):
        return "ProxyJump bastion"
    return f"ProxyCommand ssh -F {shlex.quote(text).replace('%', '%%')} -W '[%h]:%p' bastion"


def _ssh_config_header(name: str) -> str:
    return f"# Written by `clusterctl testcluster up` for test cluster {name}: ssh -F, fab -S or ssh.config.\n"


def _remove_our_ssh_config(path: Path, name: str) -> None:
    """An `up` without --ssh-config: the ssh config an earlier `up --ssh-config` of this cluster wrote beside the spec
    names the nodes as they were then (a recreated node has another address and host key), so it goes; a file of
    that name we did not write for this cluster (the user's own) is left alone."""
    try:
        with open(path, "rb") as f:
            ours = f.readline() == _ssh_config_header(name).encode()
        if ours:
            path.unlink()
    except OSError:
        pass


def _ssh_config_text(
    name: str,
    nodes: Sequence[Node],
    user: str,
    key_path: Path,
    known_hosts: Path,
    bastion: Node | None,
    config: Path | None = None,
) -> str:
    """OpenSSH config: `Host bastion` (if any) and `Host node<i>` per node, pinned to the cluster's known_hosts.

    config: where it is written (the nodes' jump to the bastion may name it; see _jump_line)."""
    common = [
        f"User {user}",
        "Port 22",
        f"IdentityFile {_ssh_config_file(key_path)}",
        "IdentitiesOnly yes",
        f"UserKnownHostsFile {_ssh_config_file(known_hosts)}",
        "StrictHostKeyChecking yes",
    ]
    entries = [("bastion", bastion.ip, [])] if bastion else []
    jump = [_jump_line(config) if config is not None else "ProxyJump bastion"] if bastion else []
    entries += [(f"node{i}", n.ip, jump) for i, n in enumerate(nodes)]
    out = [_ssh_config_header(name)]
    for alias, ip, extra in entries:
        out.append(f"\nHost {alias}\n")
        out.extend(f"    {line}\n" for line in [f"HostName {ip}", *common, *extra])
    return "".join(out)


def _write_spec(path: Path, spec: dict[str, Any]) -> None:
    header = "# Written by `clusterctl testcluster up`; workspace.local is relative to this file.\n"
    _write_text(path, header + yaml.safe_dump(spec, sort_keys=False, default_flow_style=False), "the spec")


def _write_text(path: Path, text: str, what: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as exc:
        raise DockerClusterError(f"cannot write {what} {path}: {exc.strerror or exc}") from exc


def _checked_spec_out(spec_out: Path | None) -> Path | None:
    """--spec-out, checked before anything is built: a file whose directory exists or can be made."""
    if spec_out is None:
        return None
    path = Path(spec_out).resolve()
    if path.is_dir():
        raise DockerClusterUsageError(f"--spec-out {path} is a directory: give the spec file's path "
                                      f"(e.g. {path / 'cluster.yaml'})")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DockerClusterError(f"--spec-out {path}: cannot make its directory: {exc.strerror or exc}") from exc
    return path


def _checked_packages(packages: Sequence[str] | None) -> list[str]:
    """--packages as pip requirements, each checked before anything is built (one line for a bad one)."""
    from packaging.requirements import InvalidRequirement, Requirement

    pkgs = [p.strip() for p in (packages or []) if p.strip()]
    for requirement in pkgs:
        try:
            Requirement(requirement)
        except InvalidRequirement as exc:
            raise DockerClusterUsageError(_bad_requirement(requirement, exc)) from exc
    return pkgs


# A docker image reference (distribution/reference's grammar): [host[:port]/]path[:tag][@digest]; an image ID
# passes as a name. Checked before docker sees it: `--base-image=--help` was read as docker's own option.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]+)?"
IMAGE_RE = re.compile(
    rf"(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?"
)


def _checked_base_image(base_image: str | None) -> str | None:
    """--base-image, checked before docker is touched: None (the default base), or a docker image reference."""
    if base_image is not None and (len(base_image) > 255 or not IMAGE_RE.fullmatch(base_image)):
        raise DockerClusterUsageError(f"invalid --base-image {base_image!r}: give a docker image reference such as "
                                      f"{REGISTRY_BASE_IMAGE}, or leave it out to build a Debian base locally")
    return base_image


def _checked_nodes(nodes: int) -> int:
    """--nodes, checked before anything is built: 1..64."""
    if not 1 <= nodes <= 64:
        raise DockerClusterUsageError(f"--nodes must be between 1 and 64, not {nodes}")
    return nodes


def _bad_requirement(requirement: str, exc: Exception) -> str:
    # packaging's message goes on with the requirement and a caret under the fault: the first line says it
    return f"invalid package requirement {requirement!r}: {str(exc).splitlines()[0]}"


# -------------------------------------------------------------------------------------- public API


def ensure_docker() -> None:
    """Make sure docker answers (starting dockerd if installed); raise DockerUnavailable if it cannot."""
    log = state_root() / "dockerd.log"
    try:
        docker.ensure_daemon(log)
    except docker.DockerError as exc:
        raise docker.DockerUnavailable(f"docker is not usable: {exc}") from exc


def _networks_of(info: dict[str, Any]) -> dict[str, Any]:
    return dict(info.get("NetworkSettings", {}).get("Networks") or {})


def _reusable(
    existing: Sequence[dict[str, Any]],
    nodes: int,
    image: str,
    name: str,
    shape: Shape | None = None,
    bastion: dict[str, Any] | None = None,
) -> bool:
    """True if the existing containers are exactly this cluster's nodes 0..N-1 on this image, in this shape."""
    shape = shape or Shape()
    if len(existing) != nodes or not docker.inspect("network", [_network_name(name)]):
        return False
    for index, info in enumerate(existing):
        labels = info["Config"]["Labels"]
        if labels.get(INDEX_LABEL) != str(index) or labels.get(IMAGE_LABEL) != image:
            return False
        if labels.get(LAYOUT_LABEL) != shape.layout():
            return False
        if info["Name"].lstrip("/") != _container_name(name, index):
            return False
        if _network_name(name) not in _networks_of(info):
            return False
    if not shape.bastion:
        return bastion is None and not docker.inspect("network", [_front_network_name(name)])
    if bastion is None or bastion["Name"].lstrip("/") != _bastion_name(name):
        return False
    labels = bastion["Config"]["Labels"]
    if labels.get(IMAGE_LABEL) != image or labels.get(LAYOUT_LABEL) != shape.layout():
        return False
    return {_network_name(name), _front_network_name(name)} <= set(_networks_of(bastion))


def _wake(info: dict[str, Any]) -> str:
    """Start or unpause a node that a test stopped or paused; return its name."""
    container = str(info["Name"]).lstrip("/")
    state = info["State"]
    if state.get("Paused"):
        docker.run(["unpause", container])
    elif not state.get("Running"):
        docker.run(["start", container])
    return container


def up(
    nodes: int,
    name: str = DEFAULT_NAME,
    spec_out: Path | None = None,
    base_image: str | None = None,
    packages: list[str] | None = None,
    *,
    progress: Progress | None = None,
    user: str | None = None,
    bastion: bool = False,
    ssh_config: bool = False,
    sudo_password_nodes: Iterable[int] = (),
) -> ClusterInfo:
    """Bring up (or reuse) an N-node sshd cluster named name and write its spec; see module docs.

    user: a non-root login user (uid 1000, passwordless sudo; root login disabled). bastion: nodes
    only behind `<name>-bastion`, on a network this machine has no address on. ssh_config: write
    `<spec dir>/ssh_config` (aliases node0.., bastion). sudo_password_nodes: node indexes whose sudo
    wants a password.
    """
    say = progress or _noop
    _checked_name(name)
    _checked_nodes(nodes)
    password_nodes = tuple(sorted(set(sudo_password_nodes)))
    bad = [i for i in password_nodes if not 0 <= i < nodes]
    if bad:
        raise DockerClusterUsageError(f"--sudo-password-node {bad[0]}: nodes are numbered 0..{nodes - 1}")
    # None: root; "" is a user name like any other, and refused by Shape (it used to be taken as root)
    shape = Shape(user="root" if user is None else user, bastion=bastion, sudo_password_nodes=password_nodes)
    pkgs = _checked_packages(packages)
    base_image = _checked_base_image(base_image)
    spec_out = _checked_spec_out(spec_out)
    state = state_dir(name)
    spec_path = spec_out or (state / "cluster.yaml").resolve()
    config_path = spec_path.parent / "ssh_config" if ssh_config else None
    if config_path is not None:  # a file name it cannot hold is refused now, not once the cluster is up
        _ssh_config_text(name, [], shape.user, state / "id_ed25519", state / "known_hosts", None)
        _jump_line(config_path)
    started = time.monotonic()
    ensure_docker()
    _made(state, 0o700)
    with _locked("images"):  # two sessions must not debootstrap or build the same image at once
        base = _resolve_base_image(base_image, say)
        image, built = _ensure_node_image(base, pkgs, say)
    images_done = time.monotonic()
    with _locked(f"cluster-{name}"):
        fresh = not docker.ids_with_label("container", f"{LABEL}={name}")  # no node of it, running or not
        try:
            node_list, front, reused = _start_or_reuse(name, nodes, image, shape, say)
            key_path, known_hosts = _pin_and_authorize(node_list, state, shape, front)
        except KeyboardInterrupt:  # Ctrl+C: what this `up` started goes again (a cluster it found is left as it is)
            if fresh:
                say(f"interrupted: removing the containers and networks of {name} this `up` started")
                _remove(name)
            raise
        _write_spec(spec_path, _spec_dict(name, node_list, key_path, known_hosts, user=shape.user, bastion=front))
        if config_path is not None:
            text = _ssh_config_text(name, node_list, shape.user, key_path, known_hosts, front, config_path)
            _write_text(config_path, text, "the ssh config")
        else:
            _remove_our_ssh_config(spec_path.parent / "ssh_config", name)
    done = time.monotonic()
    return ClusterInfo(
        name=name,
        nodes=node_list,
        spec_path=spec_path,
        key_path=key_path,
        known_hosts_path=known_hosts,
        state_dir=state,
        image=image,
        network=_network_name(name),
        packages=pkgs,
        image_built=built,
        reused=reused,
        timings={"images": images_done - started, "containers": done - images_done, "total": done - started},
        user=shape.user,
        home=shape.home,
        bastion=front,
        front_network=_front_network_name(name) if front else "",
        ssh_config_path=config_path,
        sudo_password_nodes=password_nodes,
    )


def _start_or_reuse(
    name: str, nodes: int, image: str, shape: Shape, say: Progress
) -> tuple[list[Node], Node | None, bool]:
    """Reuse the cluster's containers if they match (waking stopped ones), else recreate them.

    Returns the nodes, the bastion (None without one; its ip is the one on the front network), reused.
    """
    existing = _cluster_containers(name)
    bastion_info = _bastion_info(name)
    reused = _reusable(existing, nodes, image, name, shape, bastion_info)
    net, front = _network_name(name), _front_network_name(name)
    if reused:
        say(f"reusing the {nodes} node(s) of {name}")
        containers = _parallel(_wake, existing, "waking nodes")
        bastion = _wake(bastion_info) if bastion_info else None
    else:
        if existing or bastion_info or docker.ids_with_label("network", f"{LABEL}={name}"):
            say(f"recreating {name}: it has {len(existing)} node(s), another image or another shape")
            _remove(name)
        _ensure_network(name, hidden=shape.bastion)
        if shape.bastion:
            _hide_from_host(net, say)
            _ensure_network(name, net=front)
        say(f"starting {nodes} node(s) on network {net}" + (f", a bastion on {front}" if shape.bastion else ""))
        containers = _parallel(
            lambda i: _start_node(name, i, image, net, shape), list(range(nodes)), "starting nodes"
        )
        bastion = _start_bastion(name, image, front, net, shape) if shape.bastion else None
    if bastion is None:
        return _wait_nodes(name, containers, net, say), None, reused
    _hide_from_host(net, say)  # again on reuse: a restarted daemon may have given the bridge an address
    jump = _wait_nodes(name, [bastion], front, say)[0]
    return _wait_behind(bastion, _nodes_of(containers, net)), jump, reused


def status(name: str = DEFAULT_NAME) -> list[NodeStatus]:
    """The cluster's nodes (then its bastion) with state, address and whether sshd answers (via the bastion)."""
    _checked_name(name)
    ensure_docker()

    def row(info: dict[str, Any], net: str) -> NodeStatus:
        ip = (_networks_of(info).get(net) or {}).get("IPAddress", "")
        state = "paused" if info["State"].get("Paused") else str(info["State"].get("Status", "unknown"))
        return NodeStatus(info["Name"].lstrip("/"), info["Config"]["Hostname"], ip, state, False)

    nodes = [row(info, _network_name(name)) for info in _cluster_containers(name)]
    bastion_info = _bastion_info(name)
    bastion = [row(bastion_info, _front_network_name(name))] if bastion_info else []
    running = [s.ip for s in nodes if s.ip and s.state == "running"]
    if bastion:  # the nodes are behind it: probe them from there (this machine has no route to them)
        silent = _probe_behind(bastion[0].container, running, 0) if bastion[0].state == "running" else set(running)
        answered = set(running) - silent
    else:
        answered = {ip for ip, ok in zip(running, _parallel(_ssh_banner, running, "probing"), strict=True) if ok}
    result = [replace(s, ssh=s.ip in answered) for s in nodes]
    result += [replace(b, ssh=bool(b.ip) and b.state == "running" and _ssh_banner(b.ip)) for b in bastion]
    return result


def down(name: str = DEFAULT_NAME, *, keep_state: bool = False) -> int:
    """Remove this cluster's containers and network (found by label only); idempotent. Returns count."""
    _checked_name(name)
    ensure_docker()
    with _locked(f"cluster-{name}"):
        removed = _remove(name)
        state = state_dir(name)
        if not keep_state and state.is_dir():
            shutil.rmtree(state)
    return removed


def _remove(name: str) -> int:
    """Remove the containers and networks labelled with this cluster's name; return how many."""
    label = f"{LABEL}={name}"
    containers = docker.ids_with_label("container", label)
    if containers:
        docker.run(["rm", "--force", "--volumes", *containers], timeout=120)
    networks = docker.ids_with_label("network", label)
    for info in docker.inspect("network", networks):
        _drop_routes(info)
    for net in networks:
        docker.run(["network", "rm", net], timeout=60)
    return len(containers) + len(networks)


# --------------------------------------------------------------------------------------------- CLI


def add_up_arguments(p_up: argparse.ArgumentParser, default_name: str, *, base_image: bool = True) -> None:
    """The options every test cluster's `up` takes (this one's, testcluster_slurm's): --nodes, --name, --spec-out,
    --base-image (unless base_image=False), --packages."""
    p_up.add_argument("--nodes", type=int, required=True, help="number of nodes")
    p_up.add_argument("--name", default=default_name, help=f"cluster name (default {default_name})")
    p_up.add_argument("--spec-out", help="where to write the spec (default: <state dir>/cluster.yaml)")
    if base_image:
        p_up.add_argument("--base-image", help="base image to build nodes FROM (default: local debootstrap build)")
    p_up.add_argument("--packages", help="comma-separated pip requirements to put in /opt/venv")


def add_down_parser(sub: Any, default_name: str, func: Any, help: str) -> None:
    """A test cluster's `down` subcommand (--name, default `default_name`), handled by `func`."""
    p_down = sub.add_parser("down", help=help)
    p_down.add_argument("--name", default=default_name)
    p_down.set_defaults(func=func)
