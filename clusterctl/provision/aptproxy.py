"""Where offline apt's fetches on the controller may connect: a host's sources are resolved here, and pinned.

A host may be compromised, and the sources it sends name where the controller fetches from. aptstate checks
each URI's host as written (no loopback or link-local address, no `localhost`); a *name* in it is resolved
later, by whoever connects, and DNS may answer with the controller's own loopback or the cloud metadata
address. So every connection that a host's source causes is made here: the name is resolved once, refused when
any of its addresses is this machine's or its link's (aptstate.local_host: loopback, link-local, unspecified,
multicast, in any spelling), and the socket is connected to an address from that same answer (no second lookup
that could answer differently).

- `Pinned.connect` is that connection; the .deb downloads (aptoffline._fetch, redirects included) use it.
- `proxy` serves apt-get's own fetches (`apt-get update`: indexes, Release files) as a proxy on the loopback
  (`Acquire::http(s)::Proxy`): `GET http://...` in absolute form, one request per connection, and `CONNECT` for
  https; each target through `Pinned.connect`.

The spec's own `apt.sources` are the user's: their hosts are trusted (a mirror on the controller's loopback is
theirs to name). Where the controller's environment names a proxy for a scheme (`http_proxy`, `https_proxy`), that
proxy resolves the names and is used as before: what it may reach is its own configuration's business.
"""

from __future__ import annotations

import contextlib
import ipaddress
import selectors
import socket
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterator

from .aptstate import local_host

__all__ = ["Pinned", "RefusedAddress", "proxy", "env_proxies"]

HEAD_LIMIT = 64 << 10  # bytes of one request's line and headers
HEAD_TIMEOUT_S = 30.0  # for apt to send a request's head
IDLE_TIMEOUT_S = 120.0  # a relayed connection with no byte either way for this long is closed
_HOP = ("connection", "proxy-connection", "keep-alive", "proxy-authorization", "te", "trailer", "upgrade")


class RefusedAddress(OSError):
    """A host's source names this machine (or its link) once resolved: no connection is made."""


def env_proxies() -> dict[str, tuple[str, int]]:
    """{scheme: (host, port)} of the proxies the controller's environment names (urllib's reading of it)."""
    out = {}
    for scheme, url in urllib.request.getproxies().items():
        if scheme == "no":  # no_proxy: a list of hosts, not a proxy
            continue
        try:
            parts = urllib.parse.urlsplit(url if "//" in url else "//" + url)
            if parts.hostname:
                out[scheme] = (parts.hostname.lower(), parts.port or (443 if parts.scheme == "https" else 80))
        except ValueError:
            continue
    return out


class Pinned:
    """Connections for offline apt's fetches: to the hosts of the spec's sources as asked, to any other host only at
    an address its name resolved to that is not this machine's (see the module's docstring)."""

    def __init__(self, trusted: set[str] | frozenset[str] = frozenset(), timeout: float = 30.0):
        self.trusted = frozenset(h.strip("[]").lower().rstrip(".") for h in trusted)
        self.timeout = timeout

    def addresses(self, host: str, port: int) -> list[tuple]:
        """getaddrinfo's answer for host:port, refused (RefusedAddress) when any address is this machine's."""
        name = host.strip("[]")
        if local_host(name):
            raise RefusedAddress(f"{name} is the controller itself (loopback or link-local), not a place it may fetch from")
        try:
            infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise OSError(f"cannot resolve {name}: {exc.strerror or exc}") from None
        for info in infos:
            addr = str(info[4][0]).split("%", 1)[0]  # an IPv6 link-local address's scope
            try:
                ipaddress.ip_address(addr)
            except ValueError:
                raise RefusedAddress(f"{name} resolves to {addr!r}, which is no address") from None
            if local_host(addr):
                raise RefusedAddress(f"{name} resolves to {addr}: the controller itself (loopback or link-local), "
                                     "not a place it may fetch from")
        if not infos:
            raise OSError(f"cannot resolve {name}: no address")
        return infos

    def connect(self, host: str, port: int, timeout: float | None = None) -> socket.socket:
        """A connected socket to host:port (see the class); OSError (RefusedAddress) when it may not or cannot be."""
        timeout = self.timeout if timeout is None else timeout
        if host.strip("[]").lower().rstrip(".") in self.trusted:
            return socket.create_connection((host.strip("[]"), port), timeout=timeout)
        last: OSError | None = None
        for family, kind, proto, _, sockaddr in self.addresses(host, port):
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(timeout)
                sock.connect(sockaddr)
                return sock
            except OSError as exc:
                sock.close()
                last = exc
        assert last is not None
        raise last


def _split_target(target: str, default_port: int) -> tuple[str, int]:
    """HOST and PORT of `host:port` / `[v6]:port` (CONNECT) or of a URL's netloc; ValueError."""
    parts = urllib.parse.urlsplit("//" + target)
    if not parts.hostname:
        raise ValueError("no host")
    return parts.hostname, parts.port or default_port


def _reason(text: str) -> str:
    """A status line's reason phrase: printable ASCII, one line, short (apt prints it)."""
    return "".join(c if " " <= c <= "~" else "?" for c in text)[:300]


class _Handler(threading.Thread):
    """One connection from apt: one request (GET/HEAD in absolute form, or CONNECT), relayed to its checked target."""

    def __init__(self, client: socket.socket, pinned: Pinned, refused: list[str]):
        super().__init__(daemon=True)
        self.client, self.pinned, self.refused = client, pinned, refused

    def _answer(self, code: int, why: str) -> None:
        """An error status, then a lingering close: what the client still sends is read (a little while) so that the
        close is no reset that could reach it before the answer."""
        with contextlib.suppress(OSError):
            self.client.sendall(f"HTTP/1.1 {code} {_reason(why)}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
            self.client.shutdown(socket.SHUT_WR)
            self.client.settimeout(1.0)
            left = 4 * HEAD_LIMIT
            while left > 0 and (chunk := self.client.recv(16384)):
                left -= len(chunk)

    def _head(self) -> bytes | None:
        self.client.settimeout(HEAD_TIMEOUT_S)
        data = b""
        while b"\r\n\r\n" not in data:
            if len(data) > HEAD_LIMIT:
                return None
            chunk = self.client.recv(16384)
            if not chunk:
                return None
            data += chunk
        return data

    def run(self) -> None:
        try:
            self._serve()
        except OSError:
            pass
        finally:
            self.client.close()

    def _serve(self) -> None:
        data = self._head()
        if data is None:
            return self._answer(400, "bad request")
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        try:
            method, target, version = lines[0].split(" ")
        except ValueError:
            return self._answer(400, "bad request line")
        headers = [ln for ln in lines[1:] if ln]
        if method == "CONNECT":
            try:
                host, port = _split_target(target, 443)
            except ValueError:
                return self._answer(400, "bad CONNECT target")
            upstream = self._connect(host, port)
            if upstream is None:
                return
            self.client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            return _relay(self.client, upstream, rest)
        if method not in ("GET", "HEAD") or not target.lower().startswith("http://"):
            return self._answer(405, "only GET and HEAD of http:// URLs, and CONNECT")
        if any(h.split(":", 1)[0].strip().lower() in ("content-length", "transfer-encoding") for h in headers) or rest:
            return self._answer(400, "a request with a body")
        try:
            url = urllib.parse.urlsplit(target)
            host, port = _split_target(url.netloc.rpartition("@")[2], 80)
        except ValueError:
            return self._answer(400, "bad URL")
        upstream = self._connect(host, port)
        if upstream is None:
            return
        path = url.path or "/"
        kept = [h for h in headers if h.split(":", 1)[0].strip().lower() not in _HOP]
        upstream.sendall((f"{method} {path}{'?' + url.query if url.query else ''} {version}\r\n"
                          + "".join(h + "\r\n" for h in kept) + "Connection: close\r\n\r\n").encode("latin-1"))
        _relay(self.client, upstream, b"")

    def _connect(self, host: str, port: int) -> socket.socket | None:
        try:
            return self.pinned.connect(host, port)
        except RefusedAddress as exc:
            self.refused.append(str(exc))
            self._answer(403, f"refused by clusterctl: {exc}")
        except OSError as exc:
            self._answer(502, f"clusterctl cannot connect to {host}: {exc.strerror or exc}")
        return None


def _relay(client: socket.socket, upstream: socket.socket, first: bytes) -> None:
    """Bytes both ways until both ends closed (or IDLE_TIMEOUT_S with none); closes `upstream`."""
    try:
        if first:
            upstream.sendall(first)
        client.setblocking(False)
        upstream.setblocking(False)
        sel = selectors.DefaultSelector()
        peer = {client: upstream, upstream: client}
        for s in peer:
            sel.register(s, selectors.EVENT_READ)
        open_ends = 2
        while open_ends:
            ready = sel.select(IDLE_TIMEOUT_S)
            if not ready:
                return
            for key, _ in ready:
                src = key.fileobj
                try:
                    chunk = src.recv(1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(src)
                    open_ends -= 1
                    with contextlib.suppress(OSError):
                        peer[src].shutdown(socket.SHUT_WR)
                    continue
                dst = peer[src]
                dst.setblocking(True)
                dst.settimeout(IDLE_TIMEOUT_S)
                try:
                    dst.sendall(chunk)
                finally:
                    dst.setblocking(False)
    except OSError:
        return
    finally:
        upstream.close()


@contextlib.contextmanager
def proxy(pinned: Pinned) -> Iterator[tuple[str, list[str]]]:
    """A proxy on 127.0.0.1 for the duration: (its URL, the refusals it made, one line each)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    refused: list[str] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return
            if stop.is_set():
                client.close()
                return
            _Handler(client, pinned, refused).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/", refused
    finally:
        stop.set()
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(5)
