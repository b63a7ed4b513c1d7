"""The intra-cluster SSH mesh: one ed25519 key made on the controller, every peer's host key pinned."""

from __future__ import annotations

import os
from pathlib import Path

from ..cache import cache_root, makedirs
from ..errors import ProvisionError
from .steps import HostFacts

__all__ = ["mesh_key", "mesh_context", "cache_root"]


def default_key_path(job: str) -> Path:
    """Where the mesh key of `job` lives when ssh_mesh.key is not given."""
    return cache_root() / "mesh" / job / "id_ed25519"


def mesh_key(path: Path, job: str) -> tuple[bytes, str]:
    """(private key bytes, public key line) of the mesh key at `path`, generated on first use (mode 0600)."""
    try:
        return _mesh_key(path, job)
    except OSError as exc:  # an unreadable key, a folder named as the key, an unwritable cache
        raise ProvisionError(f"ssh_mesh key {path}: {exc.strerror or exc}") from None


def _mesh_key(path: Path, job: str) -> tuple[bytes, str]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    pub_path = path.with_name(path.name + ".pub")
    if path.is_file():
        private = path.read_bytes()
        try:
            key = serialization.load_ssh_private_key(private, password=None)
        except (ValueError, TypeError) as exc:
            raise ProvisionError(f"ssh_mesh key {path} is not an unencrypted OpenSSH private key: {exc}") from None
        public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        return private, f"{public.decode()} clusterctl-mesh-{job}"
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    line = f"{public.decode()} clusterctl-mesh-{job}"
    makedirs(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(private)
    pub_path.write_text(line + "\n")
    return private, line


def known_hosts_text(hosts, facts: dict) -> str:
    """known_hosts lines pinning every host's own key under its spec address and its hostname."""
    lines = []
    for host in hosts:
        f: HostFacts = facts[host]
        if not f.host_key:
            raise ProvisionError(f"{host.label}: no /etc/ssh/ssh_host_ed25519_key.pub to pin for the ssh mesh")
        addr = host.endpoint_address  # how the other hosts name it (an alias of ours means nothing there)
        names = [addr if host.port == 22 else f"[{addr}]:{host.port}"]
        if f.hostname and f.hostname not in names:
            names.append(f.hostname if host.port == 22 else f"[{f.hostname}]:{host.port}")
        lines.append(f"{','.join(names)} {f.host_key}")
    return "\n".join(lines)


def mesh_context(job: str, public_line: str, hosts, facts: dict) -> dict:
    """Template context of the ssh_mesh step (all public data; the private key goes on stdin)."""
    names = []
    for host in hosts:
        for name in (host.endpoint_address, facts[host].hostname):
            if name and name not in names:
                names.append(name)
    key_name = f"clusterctl-{job}_ed25519"
    known_name = f"clusterctl-{job}.known_hosts"
    begin, end = f"# BEGIN clusterctl ssh_mesh {job}", f"# END clusterctl ssh_mesh {job}"
    block = "\n".join(
        [
            begin,
            "Host " + " ".join(names),
            f"    IdentityFile ~/.ssh/{key_name}",
            f"    UserKnownHostsFile ~/.ssh/{known_name}",
            "    StrictHostKeyChecking yes",  # peers are pinned; an unknown or changed key is refused
            "    BatchMode yes",  # never prompt (mpiexec has no terminal)
            end,
        ]
    )
    return {
        "key_name": key_name,
        "known_name": known_name,
        "public_key": public_line,
        "known_hosts": known_hosts_text(hosts, facts),
        "config_block": block,
        "begin_marker": begin,
        "end_marker": end,
    }
