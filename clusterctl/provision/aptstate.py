"""What offline apt takes from a host, read as untrusted data at one boundary.

A host may be compromised: everything it sends is parsed here, with size and count limits, against an
allow-list, and anything else is refused with one line. A host contributes only

- its apt sources (`/etc/apt/sources.list`, `sources.list.d/*.list|*.sources`), parsed here and written again
  by us as deb822 stanzas: `deb` entries over `http(s)://` to hosts other than loopback or link-local, with
  the options in `SOURCE_OPTIONS` only (`file:`, `cdrom:`, `copy:`, `ssh:`/`rsh:`, `mirror+…`, `tor+…` and
  unknown options are dropped and logged);
- its keyrings (`/etc/apt/trusted.gpg`, `trusted.gpg.d/`, `/etc/apt/keyrings/`, `/usr/share/keyrings/`) and
  preferences (`/etc/apt/preferences`, `preferences.d/`), as data files;
- `/var/lib/dpkg/status`, its architecture (`dpkg --print-architecture`), and the listing of its offline
  repository (`.deb` name, size, SHA256).

Never its `apt.conf` / `apt.conf.d` (hooks such as `APT::Update::Pre-Invoke` would run on the controller),
`auth.conf` (credentials stay on the host), or any other file. The host script sends only the allow-listed
files; the controller checks every record again, since a host's reply may be anything.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
import re
import socket
import urllib.parse
from dataclasses import dataclass, field

from ..errors import ProvisionError

__all__ = ["HOST_STATE_SCRIPT", "numeric_name", "local_host", "STATE_HEADER", "HostAptState", "StateReader", "parse_state", "SourceEntry",
           "parse_sources", "SOURCE_OPTIONS", "LIMITS", "allowed_kind"]

STATE_HEADER = "clusterctl-apt-state 2"

# Bounds on what one host may send (bytes unless said otherwise); past one, the host's state is refused.
LIMITS = {
    "line": 256 << 10,  # one record line (the host sends at most 48 KiB of data per line)
    "file": 4 << 20,  # one sources / preferences / keyring file
    "config": 32 << 20,  # all of them together
    "files": 1024,  # how many of them
    "status": 128 << 20,  # /var/lib/dpkg/status (a large desktop's is ~10 MiB)
    "debs": 100_000,  # entries in the listing of the host's offline repository
    "total": 256 << 20,  # everything the host prints, records and noise
    "sources": 4096,  # source entries across the host's files
}

_NAME = r"[A-Za-z0-9_+-][A-Za-z0-9_.+:-]{0,127}"  # a file name in a parts directory (no leading dot)
_ALLOWED = [
    (re.compile(r"etc/apt/sources\.list"), "sources"),
    (re.compile(rf"etc/apt/sources\.list\.d/{_NAME}\.(?:list|sources)"), "sources"),
    (re.compile(r"etc/apt/preferences"), "preferences"),
    (re.compile(rf"etc/apt/preferences\.d/{_NAME}"), "preferences"),
    (re.compile(r"etc/apt/trusted\.gpg"), "keyring"),
    (re.compile(rf"etc/apt/trusted\.gpg\.d/{_NAME}"), "keyring"),
    (re.compile(rf"etc/apt/keyrings/{_NAME}"), "keyring"),
    (re.compile(rf"usr/share/keyrings/{_NAME}"), "keyring"),
    (re.compile(r"var/lib/dpkg/status"), "status"),
]
_ARCH_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}\Z")
_DEB_RE = re.compile(r"^[A-Za-z0-9+][A-Za-z0-9._+~%-]{0,254}\.deb\Z")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}\Z")


def allowed_kind(path: str) -> str | None:
    """'sources' | 'preferences' | 'keyring' | 'status' for a path offline apt takes from a host; else None."""
    for pattern, kind in _ALLOWED:
        if pattern.fullmatch(path) and ".." not in path.split("/"):
            return kind
    return None


# Read on the host (any user, Python 3.5+): only the allow-listed files, in bounded base64 chunks.
HOST_STATE_SCRIPT = r"""
import base64, hashlib, json, os, re, subprocess, sys
repo = sys.argv[1]
if not repo.startswith("/"):
    repo = os.path.join(os.path.expanduser("~"), repo)
NAME = re.compile(r"^[A-Za-z0-9_+-][A-Za-z0-9_.+:-]{0,127}\Z")
print("HEADER")
def emit(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
def send(path, limit):
    try:
        with open("/" + path, "rb") as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        emit({"note": "cannot read /%s: %s" % (path, exc.strerror)})
        return
    if len(data) > limit:
        emit({"note": "/%s is larger than %d bytes: not sent" % (path, limit)})
        return
    emit({"path": path, "data": ""})
    for i in range(0, len(data), 49152):
        emit({"path": path, "data": base64.b64encode(data[i:i + 49152]).decode()})
out = subprocess.run(["dpkg", "--print-architecture"], stdout=subprocess.PIPE, check=True)
emit({"arch": out.stdout.decode().strip()})
for path in ("etc/apt/sources.list", "etc/apt/preferences", "etc/apt/trusted.gpg"):
    if os.path.isfile("/" + path):
        send(path, FILE_LIMIT)
for folder, suffixes in (("etc/apt/sources.list.d", (".list", ".sources")), ("etc/apt/preferences.d", None),
                         ("etc/apt/trusted.gpg.d", None), ("etc/apt/keyrings", None), ("usr/share/keyrings", None)):
    try:
        names = sorted(os.listdir("/" + folder))
    except OSError:
        continue
    for name in names:
        if NAME.match(name) and (suffixes is None or name.endswith(suffixes)) and os.path.isfile("/%s/%s" % (folder, name)):
            send("%s/%s" % (folder, name), FILE_LIMIT)
send("var/lib/dpkg/status", STATUS_LIMIT)
try:  # what the controller uploaded earlier: name -> [size, sha256] (written by it, beside the files)
    with open(os.path.join(repo, "clusterctl-manifest.json")) as fh:
        manifest = json.load(fh)
except (OSError, ValueError):
    manifest = {}
if os.path.isdir(repo) and isinstance(manifest, dict):
    for name in sorted(os.listdir(repo)):
        entry = manifest.get(name)
        path = os.path.join(repo, name)
        if name.endswith(".deb") and isinstance(entry, list) and len(entry) == 2 and os.path.isfile(path):
            if entry[0] == os.path.getsize(path):
                emit({"deb": [name, entry[0], entry[1]]})
emit({"end": True})
""".replace("HEADER", STATE_HEADER).replace("FILE_LIMIT", str(LIMITS["file"])).replace(
    "STATUS_LIMIT", str(LIMITS["status"]))


@dataclass(frozen=True)
class HostAptState:
    """What offline apt takes from one host (see the module's docstring), checked."""

    arch: str
    config: dict[str, bytes]  # allow-listed path (no leading '/') -> content: sources, preferences, keyrings
    status: bytes  # /var/lib/dpkg/status
    files: dict[str, tuple[int, str]] = field(default_factory=dict)  # the host's repository: .deb -> (size, sha256)
    notes: tuple[str, ...] = ()  # what the host skipped (unreadable or too large files)


class StateReader:
    """An on_line callback for one host's state script: records parsed as they arrive, within LIMITS."""

    def __init__(self, label: str):
        self.label = label
        self.error = ""
        self.arch = ""
        self.config: dict[str, bytearray] = {}
        self.status = bytearray()
        self.files: dict[str, tuple[int, str]] = {}
        self.notes: list[str] = []
        self.started = self.ended = False
        self._seen = 0
        self._lineno = 0
        self._config_bytes = 0

    def __call__(self, _host, stream: str, line: str) -> None:
        """Take one line of the host's output (stderr is left to the Result's tail)."""
        if stream != "out":
            return
        self.feed(line)

    def _fail(self, why: str) -> None:
        if not self.error:
            self.error = why

    def feed(self, line: str) -> None:
        """Take one line of stdout."""
        self._seen += len(line) + 1
        self._lineno += 1
        if self.error:
            return
        if self._seen > LIMITS["total"]:
            return self._fail(f"it sent more than {LIMITS['total'] >> 20} MiB")
        if not self.started:  # what a shell's start-up files print before the script is not ours to read
            self.started = line.strip() == STATE_HEADER
            return
        if self.ended:
            return self._fail(f"line {self._lineno}: output after the end record")
        if len(line) > LIMITS["line"]:
            return self._fail(f"line {self._lineno}: longer than {LIMITS['line'] >> 10} KiB")
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            return self._fail(f"line {self._lineno}: not a JSON record: {_shown(line)}")
        if not isinstance(rec, dict) or len(rec) not in (1, 2):
            return self._fail(f"line {self._lineno}: not a record: {_shown(line)}")
        try:
            self._record(rec)
        except (ValueError, TypeError, binascii.Error) as exc:
            self._fail(f"line {self._lineno}: {exc}")

    def _record(self, rec: dict) -> None:
        if set(rec) == {"arch"}:
            arch = rec["arch"]
            if not isinstance(arch, str) or not _ARCH_RE.match(arch):
                raise ValueError(f"not a dpkg architecture: {_shown(str(arch))}")
            self.arch = arch
        elif set(rec) == {"path", "data"}:
            path, data = rec["path"], rec["data"]
            if not isinstance(path, str) or not isinstance(data, str):
                raise ValueError("a file record's path and data are strings")
            kind = allowed_kind(path)
            if kind is None:
                raise ValueError(f"the host sent /{_shown(path)}, which offline apt never takes from a host")
            chunk = base64.b64decode(data, validate=True)
            if kind == "status":
                if len(self.status) + len(chunk) > LIMITS["status"]:
                    raise ValueError(f"/var/lib/dpkg/status is larger than {LIMITS['status'] >> 20} MiB")
                self.status += chunk
                return
            buf = self.config.get(path)
            if buf is None:
                if len(self.config) >= LIMITS["files"]:
                    raise ValueError(f"more than {LIMITS['files']} apt files")
                buf = self.config[path] = bytearray()
            self._config_bytes += len(chunk)
            if len(buf) + len(chunk) > LIMITS["file"]:
                raise ValueError(f"/{path} is larger than {LIMITS['file'] >> 20} MiB")
            if self._config_bytes > LIMITS["config"]:
                raise ValueError(f"the apt files are larger than {LIMITS['config'] >> 20} MiB together")
            buf += chunk
        elif set(rec) == {"deb"}:
            entry = rec["deb"]
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                    and isinstance(entry[1], int) and not isinstance(entry[1], bool) and isinstance(entry[2], str)):
                raise ValueError("a deb record is [name, size, sha256]")
            name, size, digest = entry
            if not _DEB_RE.match(name) or not _SHA256_RE.match(digest) or not 0 <= size < 1 << 40:
                raise ValueError(f"not a .deb listing: {_shown(json.dumps(entry))}")
            if len(self.files) >= LIMITS["debs"]:
                raise ValueError(f"more than {LIMITS['debs']} .debs in the host's repository")
            self.files[name] = (size, digest)
        elif set(rec) == {"note"} and isinstance(rec["note"], str):
            if len(self.notes) < 100:
                self.notes.append(_shown(rec["note"]))
        elif set(rec) == {"end"}:
            self.ended = True
        else:
            raise ValueError(f"unknown record {_shown(json.dumps(sorted(rec)))}")

    def state(self) -> HostAptState:
        """The host's state; ProvisionError (one line) when what it sent is not usable."""
        why = self.error
        if not why and not self.started:
            why = "no state header (is python3 on the host?)"
        elif not why and not self.ended:
            why = "cut short (no end record)"
        elif not why and not self.arch:
            why = "no architecture"
        if why:
            raise ProvisionError(f"offline apt: the state {self.label} sent is not usable: {why}")
        return HostAptState(self.arch, {k: bytes(v) for k, v in sorted(self.config.items())}, bytes(self.status),
                            dict(self.files), tuple(self.notes))


def parse_state(stdout: str, label: str = "the host") -> HostAptState:
    """The host-state script's whole stdout, checked (see StateReader); ProvisionError on anything else."""
    reader = StateReader(label)
    for line in stdout.splitlines():
        reader.feed(line)
    return reader.state()


def _shown(text: str, limit: int = 80) -> str:
    """`text` for a message: one line, control characters escaped, cut to `limit`."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[: limit + 1])
    return out[:limit] + ("..." if len(text) > limit else "")


# ------------------------------------------------------------------------------------------- sources

# deb822 field -> one-line option, for the options a host's source may carry onto the controller.
SOURCE_OPTIONS = {
    "Architectures": "arch", "Languages": "lang", "Trusted": "trusted", "Signed-By": "signed-by",
    "Check-Valid-Until": "check-valid-until", "Valid-Until-Min": "valid-until-min",
    "Valid-Until-Max": "valid-until-max", "Check-Date": "check-date", "Date-Max-Future": "date-max-future",
    "By-Hash": "by-hash", "PDiffs": "pdiffs", "Allow-Insecure": "allow-insecure", "Allow-Weak": "allow-weak",
    "Allow-Downgrade-To-Insecure": "allow-downgrade-to-insecure",
}
_ONE_LINE = {v: k for k, v in SOURCE_OPTIONS.items()}
_FIELD_CANON = {k.lower(): k for k in (*SOURCE_OPTIONS, "Types", "URIs", "Suites", "Components", "Enabled")}
_VALUE_RE = re.compile(r"^[A-Za-z0-9_.,:+-]{1,128}\Z")
_SUITE_RE = re.compile(r"^[A-Za-z0-9_.~+/$()-]{1,128}\Z")
_COMPONENT_RE = re.compile(r"^[A-Za-z0-9_.~+/-]{1,64}\Z")
_URI_RE = re.compile(r"^https?://[A-Za-z0-9._~:/?#@!$&'()*+,;=%\[\]-]{1,1024}\Z")
_KEYPATH_RE = re.compile(r"^/[A-Za-z0-9_.+/-]{1,255}\Z")
_FINGERPRINT_RE = re.compile(r"^[0-9A-Fa-f]{16,40}!?\Z")
_ARMOR_LINE_RE = re.compile(r"^[A-Za-z0-9+/=:. ,()@<>_-]{0,128}\Z")


@dataclass(frozen=True)
class SourceEntry:
    """One checked `deb` source of a host: what we write into the controller's apt root for it."""

    uris: tuple[str, ...]
    suites: tuple[str, ...]
    components: tuple[str, ...]
    options: tuple[tuple[str, str], ...] = ()  # (deb822 field, value) from SOURCE_OPTIONS, Signed-By last
    key_paths: tuple[str, ...] = ()  # absolute keyring paths Signed-By names (re-rooted when written)
    armored_key: str = ""  # a Signed-By that embeds the key itself (deb822)

    def deb822(self, root: str) -> str:
        """This entry as a deb822 stanza, keyring paths under `root` (the controller's copy of the host)."""
        lines = ["Types: deb", f"URIs: {' '.join(self.uris)}", f"Suites: {' '.join(self.suites)}"]
        if self.components:
            lines.append(f"Components: {' '.join(self.components)}")
        lines += [f"{k}: {v}" for k, v in self.options]
        if self.key_paths:
            lines.append("Signed-By: " + " ".join(root.rstrip("/") + p if p.startswith("/") else p for p in self.key_paths))
        elif self.armored_key:
            lines.append("Signed-By:")
            lines += [" " + (ln if ln else ".") for ln in self.armored_key.splitlines()]
        return "\n".join(lines) + "\n"


_NUMERIC_LABEL_RE = re.compile(r"(0[xX][0-9a-fA-F]*|[0-9]+)\Z")


def numeric_name(host: str) -> bool:
    """Whether `host`'s last label is a number: resolvers (inet_aton) and URL parsers read such a name as an
    IPv4 address in one of its forms (127.1, 2130706433, 0x7f000001), never as a name."""
    return bool(_NUMERIC_LABEL_RE.match(host.rstrip(".").rpartition(".")[2]))


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address `host` names as the controller's resolver reads it, or None for a name. Besides the canonical
    forms, the resolver (inet_aton) takes 127.1, 2130706433, 0x7f000001 and 0177.0.0.1; a name whose last label is
    a number is such an address (as URL parsers read it) or nothing: ValueError."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if not numeric_name(host):
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        raise ValueError(f"{host} is neither a host name nor an address") from None


def local_host(host: str) -> bool:
    """True for names and addresses that mean 'this machine' or its link: on the controller they are not the host.
    Also such an address in another form (127.1, 0x7f000001, ::ffff:127.0.0.1, 6to4), unspecified and multicast
    addresses, and a number that is no address."""
    host = host.strip("[]").lower()
    name = host.rstrip(".")
    if name in ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback") or name.endswith(".localhost"):
        return True
    try:
        addr = _address(host)
    except ValueError:
        return True
    if addr is None:
        return False  # a name: not resolved here (DNS may say anything); redirects are not followed (aptoffline)
    if isinstance(addr, ipaddress.IPv6Address):
        inner = addr.ipv4_mapped or addr.sixtofour
        if inner is None and addr.packed[:12] == bytes(12) and int(addr) > 1:  # IPv4-compatible ::a.b.c.d
            inner = ipaddress.IPv4Address(addr.packed[12:])
        if inner is not None and _local_addr(inner):
            return True
    return _local_addr(addr)


def _local_addr(addr) -> bool:
    return addr.is_loopback or addr.is_link_local or addr.is_unspecified or addr.is_multicast


def _check_uri(uri: str) -> str:
    """'' when a host's source URI may be fetched by the controller; else why not."""
    if not _URI_RE.match(uri):
        scheme = uri.split(":", 1)[0] if ":" in uri else uri
        return f"scheme {_shown(scheme, 24)}: the controller fetches only http(s) sources of a host"
    try:
        parts = urllib.parse.urlsplit(uri)
        hostname = parts.hostname or ""
        _ = parts.port
    except ValueError:
        return "not a URI"
    if not hostname:
        return "no host in the URI"
    try:
        _address(hostname.strip("[]"))
    except ValueError as exc:
        return _shown(str(exc), 120)
    if local_host(hostname):
        return f"{hostname} is the host itself (loopback or link-local), not a place the controller may fetch from"
    if parts.username or parts.password:
        return "credentials in the URI"
    return ""


def _signed_by(value: str, keyrings: set[str]) -> tuple[tuple[str, ...], str, str]:
    """(key paths, armored key, why refused) of a Signed-By value."""
    text = value.strip()
    if text.startswith("-----BEGIN PGP PUBLIC KEY BLOCK-----"):
        lines = [ln.strip() for ln in text.splitlines()]
        if len(lines) > 4096 or not lines[-1] == "-----END PGP PUBLIC KEY BLOCK-----":
            return (), "", "an embedded Signed-By key that is not one armored block"
        if not all(_ARMOR_LINE_RE.match(ln) for ln in lines):
            return (), "", "an embedded Signed-By key with characters an armored key has not"
        return (), "\n".join("" if ln == "." else ln for ln in lines), ""
    items = [x for x in re.split(r"[\s,]+", text) if x]
    if not items or len(items) > 16:
        return (), "", "an empty or over-long Signed-By"
    for item in items:
        if item.startswith("/"):
            if not _KEYPATH_RE.match(item) or ".." in item.split("/"):
                return (), "", f"Signed-By {_shown(item)}: not a keyring path"
            if item.lstrip("/") not in keyrings:
                return (), "", f"Signed-By {_shown(item)}: a keyring offline apt does not take from the host"
        elif not _FINGERPRINT_RE.match(item):
            return (), "", f"Signed-By {_shown(item)}: neither a keyring path nor a fingerprint"
    return tuple(items), "", ""


def _entry(where: str, types: list[str], uris: list[str], suites: list[str], components: list[str],
           options: list[tuple[str, str]], keyrings: set[str], notes: list[str]) -> SourceEntry | None:
    """A checked entry, or None (with a note saying why) for one the controller does not use."""
    if "deb" not in types:
        return None  # deb-src only: not needed to install binaries
    kept_uris = []
    for uri in uris:
        why = _check_uri(uri)
        if why:
            notes.append(f"{where}: dropped {_shown(uri)}: {why}")
        else:
            kept_uris.append(uri)
    if not kept_uris:
        return None
    bad = [s for s in suites if not _SUITE_RE.match(s)] + [c for c in components if not _COMPONENT_RE.match(c)]
    if bad or not suites or (any(s.endswith("/") for s in suites) and components):
        notes.append(f"{where}: dropped: not a suite and components apt reads: {_shown(' '.join(bad or suites))}")
        return None
    kept: list[tuple[str, str]] = []
    keys, armored = (), ""
    for name, value in options:
        if name not in SOURCE_OPTIONS:
            notes.append(f"{where}: option {_shown(name, 40)} ignored (not one offline apt takes from a host)")
        elif name == "Signed-By":
            keys, armored, why = _signed_by(value, keyrings)
            if why:
                notes.append(f"{where}: dropped: {why}")
                return None
        elif not _VALUE_RE.match(value.strip()):
            notes.append(f"{where}: option {name} ignored: value {_shown(value, 40)} is not a plain word list")
        else:
            kept.append((name, " ".join(value.strip().split(","))))
    return SourceEntry(tuple(kept_uris), tuple(suites), tuple(components), tuple(kept), keys, armored)


def _one_line(name: str, text: str, keyrings: set[str], notes: list[str]) -> list[SourceEntry]:
    out = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"/{name}:{lineno}"
        m = re.match(r"^(deb|deb-src)\s+(?:\[([^\]]*)\]\s*)?(\S+)\s+(\S+)((?:\s+\S+)*)\s*\Z", line)
        if not m:
            notes.append(f"{where}: not a source line: {_shown(line)}")
            continue
        options = []
        for opt in (m.group(2) or "").split():
            key, sep, value = opt.partition("=")
            if not sep or key.endswith(("+", "-")):
                notes.append(f"{where}: option {_shown(opt, 40)} ignored (only key=value)")
                continue
            field_name = _ONE_LINE.get(key.lower())
            if field_name is None:
                notes.append(f"{where}: option {_shown(key, 40)} ignored (not one offline apt takes from a host)")
                continue
            options.append((field_name, value))
        entry = _entry(where, [m.group(1)], [m.group(3)], [m.group(4)], m.group(5).split(), options, keyrings, notes)
        if entry is not None:
            out.append(entry)
    return out


def _deb822(name: str, text: str, keyrings: set[str], notes: list[str]) -> list[SourceEntry]:
    out = []
    stanzas: list[list[tuple[int, str]]] = [[]]
    for lineno, raw in enumerate(text.splitlines(), 1):
        if raw.startswith("#"):
            continue
        if not raw.strip():
            if stanzas[-1]:
                stanzas.append([])
            continue
        stanzas[-1].append((lineno, raw))
    for stanza in stanzas:
        if not stanza:
            continue
        where = f"/{name}:{stanza[0][0]}"
        # Each field's lines, joined once at the end: adding a host's continuation lines to a string one by one
        # copied the value each time (a 4 MiB file of them took half a minute).
        lines: dict[str, list[str]] = {}
        current = None
        ok = True
        for lineno, raw in stanza:
            if raw[0] in " \t":
                if current is None:
                    ok = False
                    break
                lines[current].append(raw.strip())
                continue
            key, sep, value = raw.partition(":")
            if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9-]{0,63}", key):
                ok = False
                break
            current = _FIELD_CANON.get(key.lower(), key)
            lines[current] = [value.strip()]
        if not ok:
            notes.append(f"{where}: dropped: not a deb822 stanza")
            continue
        fields = {key: "\n".join(parts) for key, parts in lines.items()}
        if fields.get("Enabled", "yes").lower() in ("no", "false", "0"):
            continue
        options = [(k, v) for k, v in fields.items() if k not in ("Types", "URIs", "Suites", "Components", "Enabled")]
        entry = _entry(where, fields.get("Types", "").split(), fields.get("URIs", "").split(),
                       fields.get("Suites", "").split(), fields.get("Components", "").split(), options, keyrings, notes)
        if entry is not None:
            out.append(entry)
    return out


def parse_sources(state: HostAptState) -> tuple[list[SourceEntry], list[str]]:
    """The host's sources that the controller may fetch, checked; and a note for everything left out."""
    keyrings = {p for p in state.config if allowed_kind(p) == "keyring"}
    entries: list[SourceEntry] = []
    notes: list[str] = []
    for path, data in state.config.items():
        if allowed_kind(path) != "sources":
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            notes.append(f"/{path}: not UTF-8 text: left out")
            continue
        parse = _deb822 if path.endswith(".sources") else _one_line
        entries += parse(path, text, keyrings, notes)
        if len(entries) > LIMITS["sources"]:
            raise ProvisionError(f"offline apt: the host has more than {LIMITS['sources']} apt sources")
    return entries, notes
