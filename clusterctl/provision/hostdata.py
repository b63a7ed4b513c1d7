"""Replies of the provisioning fact scripts (probe, doctor), read as untrusted data: bounded in size while they
arrive, the last JSON object found, every field checked before anything uses it.

A host may be compromised. Its facts travel on: its hostname and host key into the other hosts' ssh
config and known_hosts (ssh_mesh), its Python and platform tags into `pip download` on the controller, its
home into `sudo env`. Each one is checked against what such a fact looks like; anything else fails that host
with one line, never a traceback, and never reaches another host.
"""

from __future__ import annotations

import json
import math
import re
import threading

from ..errors import BadReply

__all__ = ["Collector", "last_object", "shown", "BadReply"]


def shown(text: object, limit: int = 80) -> str:
    """`text` for a message or a table: one line, control characters escaped, cut to `limit`."""
    s = str(text)
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in s[: limit + 1])
    return out[:limit] + ("..." if len(s) > limit else "")


class Collector:
    """An on_line callback keeping each host's stdout lines up to `max_bytes` (a line that arrives in pieces,
    being over the transport's 4 MiB, counts as over); past it the host is marked and nothing more is kept."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._lines: dict = {}
        self._size: dict = {}
        self._over: set = set()
        self._lock = threading.Lock()

    def __call__(self, host, stream: str, line: str) -> None:
        """Take one line of a host's output (stderr stays in the Result's tail)."""
        if stream != "out":
            return
        with self._lock:
            if host in self._over:
                return
            size = self._size.get(host, 0) + len(line) + 1
            if size > self.max_bytes or len(line) >= 4 << 20:
                self._over.add(host)
                self._lines.pop(host, None)
                return
            self._size[host] = size
            self._lines.setdefault(host, []).append(line)

    def reply(self, host) -> dict:
        """The last JSON object the host printed; BadReply (one line) when there is none or it sent too much."""
        if host in self._over:
            raise BadReply(f"the reply is larger than {self.max_bytes >> 20} MiB")
        return last_object(self._lines.get(host, []))


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def last_object(lines: list[str]) -> dict:
    """The last line that holds a JSON object (after whatever a shell's start-up files printed before it)."""
    for line in reversed(lines):
        line = line.strip()
        start = line.find("{")
        if start < 0:
            continue
        try:  # NaN, Infinity and 1e999 are no JSON (RFC 8259): `doctor --json` would pass them on
            obj = json.loads(line[start:], parse_constant=_no_constant, parse_float=_finite)
        except (ValueError, RecursionError):
            raise BadReply(f"not JSON: {shown(line)}") from None
        if not isinstance(obj, dict):
            raise BadReply(f"not a JSON object: {shown(line)}")
        return obj
    tail = next((ln for ln in reversed(lines) if ln.strip()), "")
    raise BadReply(f"no JSON reply (last line: {shown(tail) or 'nothing'})")


_HOSTNAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}\Z")
_HOST_KEY_RE = re.compile(r"^(ssh-ed25519 [A-Za-z0-9+/]{16,200}={0,2})?\Z")
_PYTHON_RE = re.compile(r"^\d{1,2}\.\d{1,3}\Z")
_IMPL_RE = re.compile(r"^[a-z]{1,16}\Z")
_MACHINE_RE = re.compile(r"^[A-Za-z0-9_]{1,32}\Z")
_GLIBC_RE = re.compile(r"^(\d{1,3}\.\d{1,4})?\Z")
_SUDO_RE = re.compile(r"^(|root|ok|password|missing|error: .{0,500})\Z", re.S)


def _string(data: dict, key: str, pattern: re.Pattern | None = None, *, limit: int = 4096, default: str | None = None) -> str:
    value = data.get(key, default)
    if not isinstance(value, str) or len(value) > limit:
        raise BadReply(f"{key}: not a string of at most {limit} characters: {shown(value)}")
    if pattern is not None and not pattern.match(value):
        raise BadReply(f"{key}: not a {key}: {shown(value)}")
    return value


def probe_facts(data: dict) -> dict:
    """The probe's reply, checked field by field: the keyword arguments of steps.HostFacts."""
    uid = data.get("uid", -1)
    if not isinstance(uid, int) or isinstance(uid, bool) or not -1 <= uid < 1 << 32:
        raise BadReply(f"uid: not a user id: {shown(uid)}")
    home = _string(data, "home", default="")
    if home and (not home.startswith("/") or not home.isprintable()):
        raise BadReply(f"home: not an absolute path: {shown(home)}")
    user = _string(data, "user", limit=256, default="")
    if not user.isprintable():
        raise BadReply(f"user: not a user name: {shown(user)}")
    sudo = _string(data, "sudo", _SUDO_RE, limit=520, default="")
    wheels = data.get("wheels", [])
    if not isinstance(wheels, list) or len(wheels) > 100_000:
        raise BadReply("wheels: not a list of at most 100000 [name, size]")
    listed = []
    for entry in wheels:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and isinstance(entry[1], int)
                and not isinstance(entry[1], bool) and 0 < len(entry[0]) <= 255 and "/" not in entry[0]):
            raise BadReply(f"wheels: not a [name, size]: {shown(entry)}")
        listed.append((entry[0], entry[1]))
    return {
        "python": _string(data, "python", _PYTHON_RE),
        "implementation": _string(data, "implementation", _IMPL_RE, default="cp"),
        "machine": _string(data, "machine", _MACHINE_RE),
        "glibc": _string(data, "glibc", _GLIBC_RE, default=""),
        "hostname": _string(data, "hostname", _HOSTNAME_RE, limit=253),
        "host_key": _string(data, "host_key", _HOST_KEY_RE, limit=200, default=""),
        "wheels": tuple(listed),
        "user": user,
        "uid": uid,
        "home": home,
        "sudo": "".join(c if c.isprintable() else " " for c in sudo),
    }


def _clean(value, depth: int = 0):
    """A doctor reply's value with every string one printable line (control characters escaped)."""
    if depth > 8:
        raise BadReply("nested too deep")
    if isinstance(value, str):
        return shown(value, 2000)
    if isinstance(value, float) and not math.isfinite(value):
        raise BadReply(f"not a finite number: {value}")
    if isinstance(value, list):
        return [_clean(v, depth + 1) for v in value[:1000]]
    if isinstance(value, dict):
        return {shown(k, 200): _clean(v, depth + 1) for k, v in list(value.items())[:5000]}
    return value


def _need(f: dict, path: str, kind) -> None:
    obj = f
    for part in path.split("."):
        if not isinstance(obj, dict) or part not in obj:
            raise BadReply(f"{path}: missing")
        obj = obj[part]
    if not isinstance(obj, kind) or (kind is int and isinstance(obj, bool)):
        raise BadReply(f"{path}: not a {getattr(kind, '__name__', kind)}: {shown(obj)}")


def doctor_facts(data: dict) -> dict:
    """The doctor facts script's reply, checked for the shape the report reads, every string made printable."""
    f = _clean(data)
    for path, kind in (("hostname", str), ("os", str), ("python3", str), ("venv", dict), ("venv.path", str),
                       ("venv.exists", bool), ("gpu", dict), ("gpu.gpus", list), ("ports", dict), ("reach", dict)):
        _need(f, path, kind)
    for key in ("python", "mpi4py", "mpi_library", "mpiexec", "mpi4py_error"):
        if not isinstance(f["venv"].get(key, ""), str):
            raise BadReply(f"venv.{key}: not a string")
    if not isinstance(f["venv"].get("packages", {}), dict) or not all(isinstance(v, str) for v in f["venv"].get("packages", {}).values()):
        raise BadReply("venv.packages: not a name -> version mapping")
    for key in ("toolkit", "cudnn", "nccl", "driver"):
        if not isinstance(f["gpu"].get(key, ""), (str, type(None))):
            raise BadReply(f"gpu.{key}: not a string")
        if f["gpu"].get(key) is None:
            f["gpu"][key] = ""  # null is "not found", which the facts script writes as "": the report reads strings
    for gpu in f["gpu"]["gpus"]:
        if not (isinstance(gpu, dict) and isinstance(gpu.get("index"), (int, str)) and isinstance(gpu.get("name"), str)):
            raise BadReply(f"gpu.gpus: not an {{index, name}}: {shown(gpu)}")
    if not all(isinstance(v, str) for v in f["ports"].values()):
        raise BadReply("ports: not a port -> state mapping")
    for peer, r in f["reach"].items():
        if not isinstance(r, dict) or not all(isinstance(v, str) for v in r.values()):
            raise BadReply(f"reach.{peer}: not a kind -> state mapping")
    login = f.get("login", {})
    if not isinstance(login, dict) or not all(isinstance(v, (str, int)) for v in login.values()):
        raise BadReply("login: not a mapping")
    return f
