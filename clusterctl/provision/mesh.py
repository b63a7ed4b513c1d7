"""The intra-cluster SSH mesh: one ed25519 key made on the controller, every peer's host key pinned."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from ..cache import cache_root, makedirs
from ..errors import ProvisionError
from .steps import HostFacts

__all__ = ["mesh_key", "mesh_context", "own_names", "cache_root"]


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


def own_names(hosts, facts: dict) -> tuple[dict, list[tuple[object, str]]]:
    """({host: the hostname it reported, or ""}, [(host, why its hostname is left out)]): a host may add a name for
    itself to the mesh (its known_hosts line and the ssh config's Host line) only when no other host has it, as an
    address of the spec or a hostname it reported too, when it is no IP address (a compromised host could
    otherwise have its key pinned for a peer), and when it is a single label or a name in a DNS domain of the spec's
    hosts (not github.com: the peers' ssh there would be refused, or expect this host's key)."""
    others: dict[str, set] = {}  # lower-cased name -> hosts it names
    for host in hosts:
        for name in (host.address, host.endpoint_address, host.hostname, facts[host].hostname):
            if name:
                others.setdefault(name.lower(), set()).add(host)
    # the DNS domains of the spec's own names for its hosts (never of a name a host reported)
    domains = {_parent(n) for h in hosts for n in (h.address, h.endpoint_address, h.hostname) if n and not _is_address(n)}
    domains.discard("")
    names, dropped = {}, []
    for host in hosts:
        name = facts[host].hostname
        names[host] = ""
        if not name or name.lower() == host.endpoint_address.lower():
            continue  # its address is pinned already
        clash = sorted(h.label for h in others.get(name.lower(), set()) - {host})
        if clash:
            dropped.append((host, f"its hostname {name} names {', '.join(clash)} too"))
        elif _is_address(name):
            dropped.append((host, f"its hostname {name} is an IP address"))
        elif _parent(name) and _parent(name) not in domains:  # e.g. github.com: every peer's ssh there would be ours
            dropped.append((host, f"its hostname {name} is a domain name outside the spec hosts' domains"))
        else:
            names[host] = name
    return names, dropped


def _parent(name: str) -> str:
    """The DNS domain a dotted name is in (lower-cased; "" for a single label): node1.corp.example -> corp.example."""
    return name.lower().rstrip(".").partition(".")[2]


def _is_address(name: str) -> bool:
    """An IP address, or a name ending in a number (which resolvers read as one: 127.1, 2130706433)."""
    from .aptstate import numeric_name

    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return numeric_name(name)


def known_hosts_text(hosts, facts: dict) -> str:
    """known_hosts lines pinning every host's own key under its spec address and its own hostname (own_names)."""
    own, _ = own_names(hosts, facts)
    lines = []
    for host in hosts:
        f: HostFacts = facts[host]
        if not f.host_key:
            raise ProvisionError(f"{host.label}: no /etc/ssh/ssh_host_ed25519_key.pub to pin for the ssh mesh")
        addr = host.endpoint_address  # how the other hosts name it (an alias of ours means nothing there)
        names = [addr if host.port == 22 else f"[{addr}]:{host.port}"]
        if own[host]:
            names.append(own[host] if host.port == 22 else f"[{own[host]}]:{host.port}")
        lines.append(f"{','.join(names)} {f.host_key}")
    return "\n".join(lines)


def mesh_context(job: str, public_line: str, hosts, facts: dict) -> dict:
    """Template context of the ssh_mesh step (all public data; the private key goes on stdin). `dropped`: the
    hostnames left out, for the hosts' logs."""
    own, dropped = own_names(hosts, facts)
    names = []
    for host in hosts:
        for name in (host.endpoint_address, own[host]):
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
        "dropped": dropped,
    }
