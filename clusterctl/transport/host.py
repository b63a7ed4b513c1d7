"""A host as every transport sees it: where to connect, as whom, through which bastions.

Defined here, below the plan, so that the transports need nothing above them (clusterctl.plan re-exports
`Host`; the plan builds hosts from the spec and `ssh -G`). Also the one parser of a jump hop's
`[user@]host[:port]` form, which the spec checks (clusterctl.spec.fields.parse_jump) and the transports
use to reach bastions.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Host", "split_jump"]


@dataclass(frozen=True)
class Host:
    """A host as the remote layer needs it: where to connect, as whom, through which bastions.

    `address` is what the spec names (an IP, a host name or an ssh-config alias) and what `ssh` is
    given; `hostname`, `user` and `port` are what OpenSSH resolves it to (`ssh -G`); `jump` the
    bastions in between, first hop first; `train_address` what the other hosts use for its endpoints."""

    address: str
    port: int
    user: str
    index: int
    hostname: str = ""  # "" = address
    jump: tuple[str, ...] = ()
    train_address: str = ""  # "" = hostname
    jump_none: bool = False  # the spec said `proxy_jump: none` over a ProxyJump in the ssh config
    hop_command: str = ""  # the first bastion's own ProxyCommand in the ssh config: ssh runs it to reach that bastion

    @property
    def label(self) -> str:
        """Short name used to prefix output lines: the address, plus the port when it is not 22 (an IPv6 address
        then in brackets, as ssh writes it: `[fd00::1]:2222`, not `fd00::1:2222`)."""
        if self.port == 22:
            return self.address
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"

    @property
    def connect_name(self) -> str:
        """The name or address the SSH connection finally goes to (the config's HostName)."""
        return self.hostname or self.address

    @property
    def endpoint_address(self) -> str:
        """The address in this host's endpoints: train_address, else the resolved HostName."""
        return self.train_address or self.hostname or self.address

    def to_json(self) -> dict:
        """What clusterctl connects to for this host, as `clusterctl plan --json` shows it."""
        return {"address": self.address, "user": self.user, "hostname": self.connect_name, "port": self.port,
                "jump": list(self.jump), "train_address": self.endpoint_address}


def split_jump(hop: str) -> tuple[str | None, str, int | None]:
    """`[user@]host[:port]` (IPv6 as `[addr]:port`), or the same as an `ssh://` URI as `ssh -J` and ProxyJump take
    it, -> (user, host, port), unchecked beyond its form; ValueError when the brackets or the port are malformed."""
    if hop[:6].lower() == "ssh://":
        hop = hop[6:].removesuffix("/")
    user, sep, rest = hop.rpartition("@")
    port_text = None  # no ':' after the host; "" (`host:`) is a port left out: refused, as OpenSSH does
    if rest.startswith("["):
        host, close, tail = rest[1:].partition("]")
        if not close or (tail and not tail.startswith(":")):
            raise ValueError(f"cannot parse {hop!r}: expected [user@]host[:port]")
        if tail:
            port_text = tail[1:]
    elif rest.count(":") == 1:
        host, _, port_text = rest.partition(":")
    else:
        host = rest
    if port_text is not None and not (port_text.isascii() and port_text.isdigit() and 1 <= int(port_text) <= 65535):
        raise ValueError(f"bad port in {hop!r}: expected 1-65535")
    return (user if sep else None) or None, host, (int(port_text) if port_text else None)
