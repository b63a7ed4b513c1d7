"""Parsing ``ip:port`` endpoints into ZeroMQ addresses, refusing wildcard binds."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence

from .errors import PsConfigError

__all__ = ["duplicate_endpoints", "endpoint_key", "parse_endpoint_list", "split_endpoint", "zmq_address"]

_WILDCARDS = {"", "*", "0.0.0.0", "::", "[::]"}


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``"10.0.0.2:6170"`` (optionally ``tcp://``-prefixed) -> ``("10.0.0.2", 6170)``."""
    text = endpoint.strip()
    text = text.removeprefix("tcp://")
    host, sep, port = text.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise PsConfigError(f"endpoint {endpoint!r} is not HOST:PORT")
    host = host.strip("[]")
    if host in _WILDCARDS:
        raise PsConfigError(f"endpoint {endpoint!r}: a pserver binds its planned address, not a wildcard")
    return host, int(port)


def _resolve(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise PsConfigError(f"cannot resolve pserver host {host!r}: {exc}") from None


def zmq_address(endpoint: str) -> str:
    """The ``tcp://IP:PORT`` ZeroMQ address of ``endpoint``, with the host resolved to an IP."""
    host, port = split_endpoint(endpoint)
    ip = _resolve(host)
    if ip in _WILDCARDS:
        raise PsConfigError(f"endpoint {endpoint!r} resolves to a wildcard address")
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


def endpoint_key(endpoint: str) -> tuple[str, int]:
    """What ``endpoint`` names, whatever its spelling: ``tcp://localhost:06170`` and ``127.0.0.1:6170`` give
    ``("127.0.0.1", 6170)``. IP literals in their normal form, ``localhost`` as 127.0.0.1, other host names in
    lower case: nothing is looked up (names that resolve to one address are not seen as one)."""
    host, port = split_endpoint(endpoint)
    host = host.lower().rstrip(".")
    try:
        host = str(ipaddress.ip_address(host))
    except ValueError:
        if host == "localhost":
            host = "127.0.0.1"
    return host, port


def duplicate_endpoints(endpoints: Sequence[str]) -> list[str]:
    """The endpoints named more than once, each with its spellings when they differ: ``["127.0.0.1:6170 (as
    'localhost:6170', '127.0.0.1:6170')"]``; empty when every endpoint is another pserver."""
    groups: dict[tuple[str, int], list[str]] = {}
    for ep in endpoints:
        groups.setdefault(endpoint_key(ep), []).append(ep)
    out = []
    for (host, port), spellings in groups.items():
        if len(spellings) > 1:
            name = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            same = len(set(spellings)) == 1
            out.append(name if same else f"{name} (as {', '.join(map(repr, spellings))})")
    return out


def parse_endpoint_list(text: str) -> tuple[str, ...]:
    """Split a comma-separated ``ip:port`` list (PADDLE_PSERVERS_IP_PORT_LIST), validating each."""
    eps = tuple(e.strip() for e in text.split(",") if e.strip())
    if not eps:
        raise PsConfigError("the pserver endpoint list is empty")
    for ep in eps:
        split_endpoint(ep)
    return eps
