"""Offline apt: the controller resolves, downloads and uploads the .debs an air-gapped host lacks.

For each host: read what offline apt takes from it (aptstate.py: an allow-list of sources, keyrings,
preferences, dpkg status and architecture; never its apt.conf) in one round trip; run apt's own solver on the
controller against exactly that, in a private apt root whose configuration is ours alone (`APT_CONFIG`:
`Dir` set to the root, no configuration parts or main file read, every hook list cleared), plus the spec's
`apt.sources`; `apt-get install --print-uris` then names every .deb the host lacks for the requested
packages. The .debs are downloaded once into a controller-side cache (checked against the index's digest),
only the ones the host does not already have are uploaded (a tar on the SSH channel), with a `Packages`
index, and the host's apt step installs from that local repository (`file:`), with no route out.

Everything runs under one deadline (`apt.offline.timeout`) for all hosts together: hosts with different
configurations are resolved in parallel, `apt-get` is killed with its methods when the deadline passes, and
each download also has its own deadline (60 s plus one second per MiB), so a mirror that drips bytes cannot
hold the controller. `file:` URIs are read only inside the spec's `apt.offline.file_roots`.

The controller needs apt-get and dpkg-deb (a Debian or Ubuntu machine) and a route to the host
distribution's archive (as the wheelhouse needs PyPI).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..cache import prune_lru
from ..errors import ProvisionError
from ..quoting import redact
from .aptproxy import Pinned, env_proxies, proxy
from .aptstate import HOST_STATE_SCRIPT, HostAptState, StateReader, allowed_kind, parse_sources, parse_state
from .schema import AptSource
from .steps import source_line

__all__ = ["HOST_STATE_SCRIPT", "source_hosts", "HostAptState", "StateReader", "Deb", "Deadline", "parse_state", "missing_packages",
           "prepare_root", "resolve", "download", "check_file_sources", "packages_index", "release_file",
           "upload_plan", "manifest", "local_root", "HOOK_LISTS", "DOWNLOAD_BASE_S"]

LAYOUT = "3"  # part of every apt root's name: a root made by an older layout is never reused
# Each host configuration seen makes a private apt root holding its sources' indexes (~120 MB for Debian's main), and
# each dpkg status a copy: the RECENT most recently used of each are kept, and the others once unused for IDLE_S
# (longer than apt.offline.timeout may be, so never one that a run in progress uses).
RECENT = 8
IDLE_S = 2 * 86400
DEB_IDLE_S = 30 * 86400  # a cached .deb (`debs/ALGO-DIGEST/NAME`, shared by all) unused this long is removed
DOWNLOAD_BASE_S = 60.0  # each .deb: this many seconds, plus one per MiB of its size (and never past the deadline)
DOWNLOAD_RATE = 1 << 20
# apt's lists of commands to run; none may come from a host. Cleared in our configuration (which is the only
# one apt reads), and checked absent with `apt-config dump` by tests/security/test_apt_untrusted.py.
HOOK_LISTS = ("APT::Update::Pre-Invoke", "APT::Update::Post-Invoke", "APT::Update::Post-Invoke-Success",
              "DPkg::Pre-Invoke", "DPkg::Post-Invoke", "DPkg::Pre-Install-Pkgs", "DPkg::Post-Invoke-Success",
              "APT::Install::Pre-Invoke", "APT::Install::Post-Invoke", "APT::Install::Post-Invoke-Success")


class Deadline:
    """A point in time (time.monotonic) that work must finish by; `what` names it in messages."""

    def __init__(self, seconds: float, what: str):
        self.at = time.monotonic() + seconds
        self.seconds, self.what = seconds, what

    def left(self) -> float:
        """Seconds left (0 when passed)."""
        return max(0.0, self.at - time.monotonic())

    def sooner(self, seconds: float, what: str) -> Deadline:
        """This deadline or one `seconds` from now, whichever comes first."""
        if time.monotonic() + seconds < self.at:
            return Deadline(seconds, what)
        return self


@dataclass(frozen=True)
class Deb:
    """One .deb apt wants: where it comes from, its file name, size and checksum."""

    uri: str
    filename: str
    size: int
    digest: str  # "sha256:HEX" (or md5/sha1/sha512: the strongest the index gives apt-get --print-uris)


def installed_versions(status: bytes) -> dict[str, str]:
    """Package -> version of every installed package in a dpkg status file."""
    out = {}
    for stanza in status.decode("utf-8", "replace").split("\n\n"):
        fields = dict(re.findall(r"^([A-Za-z-]+): ?(.*)$", stanza, re.M))
        if fields.get("Status", "").endswith(" installed") and "Package" in fields:
            out[fields["Package"]] = fields.get("Version", "")
    return out


def missing_packages(packages: list[str], status: bytes, *, force: bool = False) -> list[str]:
    """The requested `name[=version]`s that are not installed (at that version) according to `status`."""
    have = installed_versions(status)
    out = []
    for spec in packages:
        name, _, version = spec.partition("=")
        if force or name not in have or (version and have[name] != version):
            out.append(spec)
    return out


def local_root(spec) -> Path:
    """The controller-side cache of offline apt (package indexes per host configuration, and the .debs)."""
    return spec.local_path(spec.provision.apt.offline.local)


def file_roots(spec) -> list[Path]:
    """The controller directories offline apt may read `file:` repositories from (apt.offline.file_roots)."""
    return [Path(os.path.realpath(spec.local_path(d))) for d in spec.provision.apt.offline.file_roots]


def _inside(path: str, roots: list[Path]) -> bool:
    real = Path(os.path.realpath(path))
    return any(real == r or r in real.parents for r in roots)


def check_file_sources(sources: list[AptSource], roots: list[Path], where: str = "apt.sources") -> None:
    """ProvisionError (one line) for a `file:` source of the spec outside apt.offline.file_roots."""
    for src in sources:
        if src.uri.startswith("file:"):
            path = urllib.request.url2pathname(urllib.parse.urlsplit(src.uri).path)
            if not _inside(path, roots):
                allowed = ", ".join(map(str, roots)) or "none given"
                raise ProvisionError(f"offline apt: {where} {src.name}: {src.uri} is outside apt.offline.file_roots "
                                     f"({allowed}); add its directory there to let the controller read it")


def _conf_value(text: str) -> str:
    if any(c in text for c in '"\n\r{};\\') or not text.isprintable():
        raise ProvisionError(f"offline apt: {text!r} cannot be written into apt's configuration")
    return text


def _root_key(state: HostAptState, sources: list[tuple[AptSource, bytes]]) -> str:
    h = hashlib.sha256(f"{LAYOUT}\0{state.arch}\0".encode())
    for path, data in state.config.items():
        h.update(path.encode() + b"\0" + hashlib.sha256(data).digest())
    for src, key in sources:
        h.update(b"\1" + source_line(src).encode() + b"\0" + hashlib.sha256(key).digest())
    return h.hexdigest()[:16]


def prepare_root(cache: Path, state: HostAptState, sources: list[tuple[AptSource, bytes]], *, log=lambda line: None) -> Path:
    """A private apt root for this host configuration: the host's allow-listed files, its sources as we
    re-wrote them, the spec's sources, and a configuration of ours alone (shared by hosts that look alike)."""
    root = cache / "roots" / _root_key(state, sources)
    entries, notes = parse_sources(state)
    for note in notes:
        log(f"controller: host source {note}")
    if (root / "apt.conf").is_file():
        os.utime(root)  # used: see prune_lru
        return root
    tmp = root.with_name(root.name + f".tmp{threading.get_ident()}")
    shutil.rmtree(tmp, ignore_errors=True)
    rootdir = _conf_value(str(root))
    for path, data in state.config.items():
        if allowed_kind(path) not in ("preferences", "keyring"):
            continue  # sources are re-written below from the parsed entries; nothing else is taken from a host
        dest = tmp / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
    parts = tmp / "etc" / "apt" / "sources.list.d"
    parts.mkdir(parents=True, exist_ok=True)
    (parts / "host.sources").write_text("\n".join(e.deb822(rootdir) for e in entries))
    for src, key in sources:
        line = source_line(src)
        if key:
            keyring = tmp / "etc" / "apt" / "keyrings" / f"clusterctl-{src.name}.gpg"
            keyring.parent.mkdir(parents=True, exist_ok=True)
            keyring.write_bytes(key)
            line = line.replace(f"signed-by=/etc/apt/keyrings/clusterctl-{src.name}.gpg", f"signed-by={rootdir}/etc/apt/keyrings/clusterctl-{src.name}.gpg")
        (parts / f"clusterctl-{src.name}.list").write_text(line + "\n")
    for sub in ("etc/apt/preferences.d", "etc/apt/trusted.gpg.d", "no-parts", "var/lib/apt/lists/partial",
                "var/cache/apt/archives/partial", "var/log/apt", "var/lib/dpkg"):
        (tmp / sub).mkdir(parents=True, exist_ok=True)
    conf = [
        f'Dir "{rootdir}/";',
        # read nothing else: no configuration parts, no main file, no credentials (neither the host's nor ours)
        f'Dir::Etc::parts "{rootdir}/no-parts/";',
        f'Dir::Etc::main "{rootdir}/no-parts/apt.conf";',
        f'Dir::Etc::netrc "{rootdir}/no-parts/auth.conf";',
        f'Dir::Etc::netrcparts "{rootdir}/no-parts/";',
        *(f"#clear {name};" for name in HOOK_LISTS),
        'Dir::Bin::methods "/usr/lib/apt/methods/";',  # the controller's own apt methods and solver
        '#clear Dir::Bin::solvers;', 'Dir::Bin::solvers:: "/usr/lib/apt/solvers/";',
        '#clear Dir::Bin::planners;', 'Dir::Bin::planners:: "/usr/lib/apt/planners/";',
        'APT::Solver "internal";',
        f'APT::Architecture "{_conf_value(state.arch)}";',
        f'#clear APT::Architectures; APT::Architectures {{ "{state.arch}"; }};',
        '#clear Acquire::Languages; Acquire::Languages { "none"; };',
        'Debug::NoLocking "true";',
        'APT::Sandbox::User "root";' if os.geteuid() == 0 else "",
        'Acquire::Retries "1";',
        'Acquire::http::Timeout "30";',
        'Acquire::https::Timeout "30";',
        # a host's source is checked for where it points (aptstate._check_uri); a redirect would move the request
        # anywhere, the controller's own loopback and the cloud metadata address included
        'Acquire::http::AllowRedirect "false";',
        'Acquire::https::AllowRedirect "false";',
        'APT::Get::List-Cleanup "false";',
    ]
    (tmp / "apt.conf").write_text("\n".join(c for c in conf if c) + "\n")
    try:
        tmp.rename(root)
    except OSError:  # another thread made the same root meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    prune_lru(root.parent, RECENT, IDLE_S)
    return root


class AptTimeout(ProvisionError):
    """apt-get ran past its deadline and was killed with its methods; carries what it printed."""

    def __init__(self, deadline: Deadline, output: str):
        super().__init__(f"apt-get ran past {deadline.what}")
        self.deadline, self.output = deadline, output


def source_hosts(sources: list[tuple[AptSource, bytes]]) -> frozenset[str]:
    """The hosts of the spec's own apt sources: the user's, fetched from as named (aptproxy.Pinned's `trusted`)."""
    out = set()
    for src, _ in sources:
        try:
            host = urllib.parse.urlsplit(src.uri).hostname
        except ValueError:
            continue
        if host:
            out.add(host)
    return frozenset(out)


def _apt(root: Path, status: Path, *args: str, deadline: Deadline, tool: str = "apt-get",
         via: str | None = None) -> subprocess.CompletedProcess:
    """apt-get (or apt-cache) with our configuration only, killed (with the methods it started) at the deadline.
    `via`: the aptproxy.proxy URL its http(s) fetches go through (not for a scheme the environment names a proxy for)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("APT_")}
    env.update(APT_CONFIG=str(root / "apt.conf"), LC_ALL="C")
    argv = [tool, "-q", "-o", f"Dir::State::status={status}"]
    if via:
        mine = [s for s in ("http", "https") if s not in env_proxies()]
        argv += [o for s in mine for o in ("-o", f"Acquire::{s}::Proxy={via}")]
        argv += ["-o", "Acquire::http::Pipeline-Depth=0"]  # the proxy serves one request per connection
    argv += args
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", env=env, start_new_session=True)
    except FileNotFoundError:
        raise ProvisionError("apt.offline needs apt-get and dpkg-deb on the controller (a Debian or Ubuntu machine)") from None
    try:
        out, _ = proc.communicate(timeout=deadline.left())
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
        raise AptTimeout(deadline, out or "") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")


def _cause(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stdout.splitlines()
    errors = [ln for ln in lines if ln.startswith("E: ")]
    return (errors or [ln for ln in lines if ln.strip()][-1:] or [f"exit {proc.returncode}"])[0]


def _in_flight(output: str, root: Path) -> str:
    """The URLs apt was fetching when it was killed (from its Get/Ign lines), else every source of the root."""
    got = re.findall(r"^(?:Get|Ign|Err):\d+ (.+?)(?: \[[^\]]*\])?$", output, re.M)
    done = set(re.findall(r"^(?:Hit|Get):\d+ (.+?) \[[^\]]*\]$", output, re.M))  # "[size]": fetched whole
    urls = [u for u in dict.fromkeys(got) if u not in done]
    if not urls:
        for path in sorted((root / "etc" / "apt" / "sources.list.d").glob("*")):
            urls += re.findall(r"(?:^URIs:|^deb(?: \[[^\]]*\])?) *(\S+)", path.read_text(), re.M)
    return ", ".join(redact(u) for u in urls[:3]) + (f" (+{len(urls) - 3} more)" if len(urls) > 3 else "")


def resolve(cache: Path, state: HostAptState, packages: list[str], sources: list[tuple[AptSource, bytes]], *,
            deadline: Deadline, refresh: bool = False, reinstall: bool = False, label: str = "the host",
            log=lambda line: None) -> list[Deb]:
    """The .debs the host lacks for `packages`, resolved by apt on the controller against the host's own state."""
    if not packages:
        return []  # everything requested is installed: no index to read
    root = prepare_root(cache, state, sources, log=log)
    status = cache / "status" / (hashlib.sha256(state.status).hexdigest()[:16])
    status.parent.mkdir(parents=True, exist_ok=True)
    status.write_bytes(state.status)
    prune_lru(status.parent, RECENT, IDLE_S)
    lists = root / "var" / "lib" / "apt" / "lists"
    if refresh or not any(p.name.endswith(("Packages", "Packages.gz", "Packages.xz", "Packages.lz4")) for p in lists.iterdir()):
        try:
            with proxy(Pinned(source_hosts(sources))) as (via, refused):
                proc = _apt(root, status, "update", deadline=deadline, via=via)
        except AptTimeout as exc:
            for line in exc.output.splitlines():
                log(f"controller: {line}")
            raise ProvisionError(f"offline apt for {label}: apt-get update did not finish within {deadline.seconds:g}s "
                                 f"({deadline.what}); still fetching {_in_flight(exc.output, root)}") from None
        for line in proc.stdout.splitlines():
            log(f"controller: {line}")
        failed = [ln for ln in proc.stdout.splitlines() if ln.startswith(("E: ", "W: Failed to fetch", "Err:"))]
        if refused:
            raise ProvisionError(f"offline apt for {label}: a source of the host refused: {refused[0]} (a mirror of "
                                 "yours there: name it in apt.sources)")
        if proc.returncode != 0 or failed:
            raise ProvisionError(
                f"offline apt: the controller cannot read this host's package archive: {_cause(proc) if proc.returncode else failed[0]}"
                " (the controller needs a route to the host distribution's archive, or a mirror in apt.sources)"
            )
    try:
        proc = _apt(root, status, "-qq", "-y", "--print-uris", "--no-install-recommends", "--allow-downgrades",
                    "--allow-change-held-packages", *(["--reinstall"] if reinstall else []), "install", *packages,
                    deadline=deadline)
    except AptTimeout:
        raise ProvisionError(f"offline apt for {label}: apt-get install --print-uris did not finish within "
                             f"{deadline.seconds:g}s ({deadline.what})") from None
    if proc.returncode != 0:
        raise ProvisionError(f"offline apt: apt-get install {' '.join(packages)}: {_cause(proc)}")
    debs = []
    for line in proc.stdout.splitlines():
        m = re.match(r"^'([^']+)' (\S+) (\d+)", line)
        if m:
            if not _DEB_NAME.fullmatch(m.group(2)):
                raise ProvisionError(f"offline apt for {label}: {redact(m.group(1))} has no usable file name: refused")
            debs.append(Deb(m.group(1), m.group(2), int(m.group(3)), ""))
    return _with_digests(root, status, debs, deadline=deadline, label=label)


_DEB_NAME = re.compile(r"[A-Za-z0-9+][A-Za-z0-9._+~%-]{0,254}\.deb")


def _with_digests(root: Path, status: Path, debs: list[Deb], *, deadline: Deadline, label: str) -> list[Deb]:
    """`debs` with the SHA256 (or SHA512) their index gives (`--print-uris` shows MD5 at most, and none at all
    for archives that dropped MD5); a .deb without one is refused."""
    if not debs:
        return debs
    names = sorted({d.filename.split("_", 1)[0] for d in debs})
    try:
        proc = _apt(root, status, "show", *names, deadline=deadline, tool="apt-cache")
    except AptTimeout:
        raise ProvisionError(f"offline apt for {label}: apt-cache show did not finish within {deadline.seconds:g}s "
                             f"({deadline.what})") from None
    known: dict[tuple[str, int], str] = {}
    for stanza in proc.stdout.split("\n\n"):
        fields = dict(re.findall(r"^(Filename|Size|SHA256|SHA512): (\S+)$", stanza, re.M))
        if "Filename" in fields and fields.get("Size", "").isdigit():
            digest = f"sha512:{fields['SHA512']}" if "SHA512" in fields else (f"sha256:{fields['SHA256']}" if "SHA256" in fields else "")
            if digest:
                known[(fields["Filename"].rsplit("/", 1)[-1], int(fields["Size"]))] = digest
    out = []
    for deb in debs:
        digest = known.get((deb.filename, deb.size)) or known.get((urllib.parse.unquote(deb.uri.rsplit("/", 1)[-1]), deb.size))
        if not digest or not re.fullmatch(r"sha(256:[0-9a-f]{64}|512:[0-9a-f]{128})", digest):
            raise ProvisionError(f"offline apt for {label}: the index gives {redact(deb.uri)} no SHA256: refused")
        out.append(Deb(deb.uri, deb.filename, deb.size, digest))
    return out


def _digest(path: Path, algo: str = "sha256") -> str:
    h = hashlib.new(algo)
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


_sha256 = _digest


class _Sockets:
    """The sockets of one download (redirects open more); shut down all at once when the deadline passes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: list[socket.socket] = []
        self.fired = False

    def add(self, sock: socket.socket) -> socket.socket:
        with self.lock:
            self.open.append(sock)
            if self.fired:
                sock.shutdown(socket.SHUT_RDWR)
        return sock

    def fire(self) -> None:
        with self.lock:
            self.fired = True
            for sock in self.open:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # a blocked recv returns at once
                except OSError:
                    pass


def _opener(sockets: _Sockets, pinned: Pinned) -> urllib.request.OpenerDirector:
    """urllib with its usual proxy and redirect handling, every connection's socket registered in `sockets`; every
    connection but one to the environment's proxy made by `pinned` (a redirect's target is checked as the first)."""
    proxies = set(env_proxies().values())

    def connect(address, timeout=socket._GLOBAL_DEFAULT_TIMEOUT, source_address=None):
        host, port = address[0], address[1]
        if (str(host).lower(), port) in proxies:
            return socket.create_connection(address, timeout, source_address)
        return pinned.connect(host, port, None if timeout is socket._GLOBAL_DEFAULT_TIMEOUT else timeout)

    def tracked(base):
        class Conn(base):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                # registered as soon as it is open: before a proxy's CONNECT or a TLS handshake, which may drip too
                self._create_connection = lambda *a, **k: sockets.add(connect(*a, **k))
        return Conn

    http_conn, https_conn = tracked(http.client.HTTPConnection), tracked(http.client.HTTPSConnection)

    class Http(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(http_conn, req)

    class Https(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(https_conn, req, context=self._context)

    return urllib.request.build_opener(Http, Https)


def _fetch(deb: Deb, dest: Path, deadline: Deadline, pinned: Pinned) -> None:
    """Download deb.uri into dest: at most deb.size bytes, within the deadline (shutting the socket at it)."""
    scheme = urllib.parse.urlsplit(deb.uri).scheme
    if scheme not in ("http", "https"):
        raise ProvisionError(f"scheme {scheme!r} is not fetched")
    sockets = _Sockets()
    timer = threading.Timer(deadline.left(), sockets.fire)
    timer.daemon = True
    timer.start()
    got = 0
    try:
        with _opener(sockets, pinned).open(deb.uri, timeout=min(30.0, max(deadline.left(), 0.1))) as resp, open(dest, "wb") as fh:
            while True:
                chunk = resp.read1(1 << 16) if hasattr(resp, "read1") else resp.read(1 << 16)
                if not chunk:
                    break
                got += len(chunk)
                if got > deb.size:
                    raise ProvisionError(f"the server sent more than the {deb.size} bytes the index gives")
                fh.write(chunk)
                if sockets.fired:
                    break
    except (OSError, ValueError, urllib.error.URLError, http.client.HTTPException) as exc:
        if not sockets.fired and deadline.left() > 0:
            raise ProvisionError(str(getattr(exc, "reason", None) or exc)) from None
    finally:
        timer.cancel()
    if sockets.fired or (got < deb.size and deadline.left() <= 0):
        raise _Late(got)
    if got != deb.size:
        raise ProvisionError(f"got {got} of {deb.size} bytes")


class _Late(Exception):
    def __init__(self, got: int):
        super().__init__(got)
        self.got = got


def _copy_file(deb: Deb, dest: Path, roots: list[Path]) -> None:
    """Copy a `file:` .deb from inside apt.offline.file_roots (after resolving symlinks), at most deb.size bytes."""
    path = urllib.request.url2pathname(urllib.parse.urlsplit(deb.uri).path)
    if not _inside(path, roots):
        allowed = ", ".join(map(str, roots)) or "none given"
        raise ProvisionError(f"refused: {os.path.realpath(path)} is outside apt.offline.file_roots ({allowed})")
    real = os.path.realpath(path)
    if not os.path.isfile(real) or os.path.getsize(real) != deb.size:
        raise ProvisionError(f"{real} is not a file of the {deb.size} bytes the index gives")
    shutil.copyfile(real, dest)


def download(cache: Path, debs: list[Deb], *, deadline: Deadline, file_roots: list[Path] | None = None,
             label: str = "the host", log=lambda line: None, trusted: frozenset[str] = frozenset()) -> list[Path]:
    """Every deb in the controller's cache (fetched once, checked against its digest); their paths.

    Each download has its own deadline (DOWNLOAD_BASE_S plus a second per MiB) within `deadline`;
    `file:` URIs are read only inside `file_roots`; an http(s) one is fetched from a host of `trusted` (the spec's
    sources: source_hosts) as named, from any other only at an address that is not the controller's (aptproxy).
    ProvisionError names the host and the URL."""
    pinned = Pinned(trusted)
    folder = cache / "debs"
    out = []
    for deb in debs:
        algo, _, want = deb.digest.partition(":")
        path = folder / f"{algo}-{want[:32]}" / deb.filename  # one cache entry per content, not per name
        with contextlib.suppress(OSError):
            os.utime(path.parent)  # used now (before it is checked: a concurrent prune leaves it alone)
        if not (path.is_file() and path.stat().st_size == deb.size and _digest(path, algo) == want):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + f".part{threading.get_ident()}")
            shown = redact(deb.uri)
            mine = deadline.sooner(DOWNLOAD_BASE_S + deb.size / DOWNLOAD_RATE,
                                   f"{DOWNLOAD_BASE_S:g} s + 1 s/MiB for one .deb")
            log(f"controller: download {shown} ({deb.size} bytes, within {mine.left():.0f} s)")
            try:
                if deb.uri.startswith("file:"):
                    _copy_file(deb, tmp, file_roots or [])
                else:
                    _fetch(deb, tmp, mine, pinned)
            except _Late as late:
                tmp.unlink(missing_ok=True)
                raise ProvisionError(f"offline apt for {label}: downloading {shown} did not finish within "
                                     f"{mine.seconds:.0f}s ({mine.what}; {late.got} of {deb.size} bytes)") from None
            except (ProvisionError, OSError) as exc:
                tmp.unlink(missing_ok=True)
                why = str(exc) if isinstance(exc, ProvisionError) else (exc.strerror or str(exc))
                raise ProvisionError(f"offline apt for {label}: cannot download {shown} on the controller: {why}") from None
            if _digest(tmp, algo) != want:
                tmp.unlink()
                raise ProvisionError(f"offline apt for {label}: {shown} does not match its {algo} in the archive's index")
            tmp.replace(path)
        out.append(path)
    prune_lru(folder, 0, DEB_IDLE_S, match=lambda name: re.fullmatch(r"sha(256|512)-[0-9a-f]{32}", name) is not None)
    return out


def packages_index(paths: list[Path]) -> bytes:
    """A flat repository's `Packages` for these .debs (control fields + Filename, Size, SHA256), as dpkg-scanpackages writes."""
    stanzas = []
    for path in sorted(paths, key=lambda p: p.name):
        try:
            control = subprocess.run(["dpkg-deb", "-f", str(path)], capture_output=True, text=True, check=True,
                                     timeout=60).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            raise ProvisionError(f"offline apt: dpkg-deb cannot read {path}: {exc}") from None
        stanzas.append(control.rstrip("\n") + f"\nFilename: ./{path.name}\nSize: {path.stat().st_size}\nSHA256: {_sha256(path)}\n")
    return "\n".join(stanzas).encode()


def release_file(packages: bytes) -> bytes:
    """A flat repository's `Release` listing the `Packages` index's SHA256 (apt wants one even with trusted=yes)."""
    return (
        "Origin: clusterctl-offline\nLabel: clusterctl-offline\nSHA256:\n"
        f" {hashlib.sha256(packages).hexdigest()} {len(packages)} Packages\n"
    ).encode()


def upload_plan(paths: list[Path], state: HostAptState) -> list[Path]:
    """The .debs the host's local repository does not already hold (the same bytes: size and SHA256)."""
    return [p for p in paths if state.files.get(p.name) != (p.stat().st_size, _sha256(p))]


def manifest(paths: list[Path], state: HostAptState) -> bytes:
    """The host repository's manifest after uploading `paths`: every .deb it holds -> [size, sha256]."""
    out = {name: list(entry) for name, entry in state.files.items()}
    out.update({p.name: [p.stat().st_size, _sha256(p)] for p in paths})
    return json.dumps(dict(sorted(out.items()))).encode()


def resolve_all(cache: Path, states: dict, packages: dict, sources: list[tuple[AptSource, bytes]], *,
                deadline: Deadline, refresh: bool, reinstall: bool, log) -> dict:
    """Resolve every host (key -> HostAptState) in parallel, one thread per distinct configuration: key ->
    list[Deb] or the ProvisionError it failed with. `log(key, line)`."""
    groups: dict[str, list] = {}
    for key, state in states.items():
        groups.setdefault(_root_key(state, sources), []).append(key)
    out: dict = {}

    def work(members: list) -> None:
        fresh = not refresh  # one root per group: refreshed (--force) once, by the first host that needs an index
        for key in members:
            label = getattr(key, "label", str(key))
            try:
                out[key] = resolve(cache, states[key], packages[key], sources, deadline=deadline, refresh=not fresh,
                                   reinstall=reinstall, label=label, log=lambda line, key=key: log(key, line))
            except ProvisionError as exc:
                out[key] = exc
            fresh = fresh or bool(packages[key])

    if groups:
        with ThreadPoolExecutor(max_workers=min(8, len(groups)), thread_name_prefix="aptoffline") as pool:
            list(pool.map(work, groups.values()))
    return out
