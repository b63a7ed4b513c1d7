"""Offline apt: the controller resolves, downloads and uploads the .debs an air-gapped host lacks.

For each host: read its apt configuration (/etc/apt, /usr/share/keyrings), architecture and dpkg status in
one round trip; run apt's own solver on the controller against exactly that (`APT_CONFIG` with `Dir` set to a
private copy of the host's /etc/apt, `Dir::State::status` = the host's status file, the host's architecture),
plus the spec's `apt.sources`; `apt-get install --print-uris` then names every .deb the host lacks for the
requested packages. The .debs are downloaded once into a controller-side cache (checked against their
SHA256), only the ones the host does not already have are uploaded (a tar on the SSH channel), with a
`Packages` index, and the host's apt step installs from that local repository (`file:`), with no route out.

The controller needs apt-get and dpkg-deb (a Debian or Ubuntu machine) and a route to the host
distribution's archive (as the wheelhouse needs PyPI).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ProvisionError
from ..quoting import join
from .schema import AptSource
from .steps import source_line

__all__ = ["HOST_STATE_SCRIPT", "HostAptState", "Deb", "parse_state", "missing_packages", "resolve", "download",
           "packages_index", "release_file", "upload_plan", "manifest", "upload_command", "local_root"]

# Read on the host (any user): apt's configuration, keyrings, architecture, dpkg status, the local repo's files.
HOST_STATE_SCRIPT = r"""
import base64, io, json, os, subprocess, sys, tarfile
repo = sys.argv[1]
if not repo.startswith("/"):
    repo = os.path.join(os.path.expanduser("~"), repo)
buf = io.BytesIO()
skipped = []
with tarfile.open(fileobj=buf, mode="w:gz") as tar:
    for top in ("/etc/apt", "/usr/share/keyrings"):
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames.sort()
            for name in sorted(filenames):
                path = os.path.join(dirpath, name)
                # our own lists are controller-side in offline mode; credentials never leave the host
                if name.startswith("clusterctl-") or "auth.conf" in path or not os.path.isfile(path):
                    continue
                try:
                    tar.add(path, arcname=path.lstrip("/"), recursive=False)
                except OSError:
                    skipped.append(path)
with open("/var/lib/dpkg/status", "rb") as fh:
    status = fh.read()
arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True).stdout.strip()
files = {}
try:  # what the controller uploaded earlier: name -> sha256 (written by it, beside the files)
    with open(os.path.join(repo, "clusterctl-manifest.json")) as fh:
        manifest = json.load(fh)
except (OSError, ValueError):
    manifest = {}
if os.path.isdir(repo):
    for name in os.listdir(repo):
        path = os.path.join(repo, name)
        if name.endswith(".deb") and os.path.isfile(path) and isinstance(manifest.get(name), list):
            if manifest[name][0] == os.path.getsize(path):
                files[name] = manifest[name]
print(json.dumps({"arch": arch, "etc": base64.b64encode(buf.getvalue()).decode(), "skipped": skipped,
                  "status": base64.b64encode(status).decode(), "files": files}))
"""


@dataclass(frozen=True)
class HostAptState:
    """What offline apt needs to know about one host."""

    arch: str
    etc: bytes  # tar.gz of /etc/apt and /usr/share/keyrings
    status: bytes  # /var/lib/dpkg/status
    files: dict[str, tuple[int, str]] = field(default_factory=dict)  # the host's repository: .deb -> (size, sha256)


@dataclass(frozen=True)
class Deb:
    """One .deb apt wants: where it comes from, its file name, size and checksum."""

    uri: str
    filename: str
    size: int
    digest: str  # "sha256:HEX" (or md5/sha1/sha512: the strongest the index gives apt-get --print-uris)


def parse_state(stdout: str) -> HostAptState:
    """The host-state script's JSON line, decoded; ProvisionError on garbage."""
    try:
        data = json.loads(stdout.strip().splitlines()[-1])
        return HostAptState(data["arch"], base64.b64decode(data["etc"]), base64.b64decode(data["status"]),
                            {str(k): (int(v[0]), str(v[1])) for k, v in data.get("files", {}).items()})
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise ProvisionError(f"offline apt: the host's state is not readable ({exc.__class__.__name__}): {stdout[:200]!r}") from None


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


def _safe_extract(etc: bytes, dest: Path) -> None:
    with tarfile.open(fileobj=io.BytesIO(etc), mode="r:gz") as tar:
        members = [m for m in tar.getmembers() if m.isfile() and not m.name.startswith("/") and ".." not in m.name.split("/")]
        tar.extractall(dest, members=members, filter="data")


def _reroot_signed_by(tmp: Path, root: Path) -> None:
    """Point every absolute Signed-By / signed-by= path of the sources copied to `tmp` at `root` (tmp's final name)."""
    folder = tmp / "etc" / "apt"
    files = [folder / "sources.list", *sorted((folder / "sources.list.d").glob("*"))]
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        text = re.sub(r"(signed-by=)(/[^\s\],]+)", lambda m: m.group(1) + str(root) + m.group(2), text)
        text = re.sub(r"^(Signed-By:\s*)(/\S+)\s*$", lambda m: m.group(1) + str(root) + m.group(2), text, flags=re.M)
        path.write_text(text)


def _prepare_root(cache: Path, state: HostAptState, sources: list[tuple[AptSource, bytes]]) -> Path:
    """A private apt root with the host's configuration plus the spec's sources (one per distinct configuration)."""
    h = hashlib.sha256(state.arch.encode() + b"\0" + state.etc)
    for src, key in sources:
        h.update(source_line(src).encode() + b"\0" + key)
    root = cache / "roots" / h.hexdigest()[:16]
    if (root / "apt.conf").is_file():
        return root
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    _safe_extract(state.etc, tmp)
    _reroot_signed_by(tmp, root)  # the host's own sources (ours, added below, point into root already)
    parts = tmp / "etc" / "apt" / "sources.list.d"
    parts.mkdir(parents=True, exist_ok=True)
    for src, key in sources:
        line = source_line(src)
        if key:
            keyring = tmp / "etc" / "apt" / "keyrings" / f"clusterctl-{src.name}.gpg"
            keyring.parent.mkdir(parents=True, exist_ok=True)
            keyring.write_bytes(key)
            line = line.replace(f"signed-by=/etc/apt/keyrings/clusterctl-{src.name}.gpg", f"signed-by={root}/etc/apt/keyrings/clusterctl-{src.name}.gpg")
        (parts / f"clusterctl-{src.name}.list").write_text(line + "\n")
    for sub in ("etc/apt/preferences.d", "etc/apt/apt.conf.d", "var/lib/apt/lists/partial", "var/cache/apt/archives/partial", "var/log/apt", "var/lib/dpkg"):
        (tmp / sub).mkdir(parents=True, exist_ok=True)
    conf = [
        f'Dir "{root}/";',
        'Dir::Bin::methods "/usr/lib/apt/methods/";',  # the controller's own apt methods and solver
        'Dir::Bin::solvers "/usr/lib/apt/solvers/";',
        f'APT::Architecture "{state.arch}";',
        f'APT::Architectures {{ "{state.arch}"; }};',
        'Debug::NoLocking "true";',
        'APT::Sandbox::User "root";' if os.geteuid() == 0 else "",
        'Acquire::Retries "1";',
        'APT::Get::List-Cleanup "false";',
    ]
    (tmp / "apt.conf").write_text("\n".join(c for c in conf if c) + "\n")
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return root


def _apt(root: Path, status: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, APT_CONFIG=str(root / "apt.conf"), LC_ALL="C")
    argv = ["apt-get", "-q", "-o", f"Dir::State::status={status}", *args]
    try:
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    except FileNotFoundError:
        raise ProvisionError("apt.offline needs apt-get and dpkg-deb on the controller (a Debian or Ubuntu machine)") from None
    except subprocess.TimeoutExpired:
        raise ProvisionError(f"apt-get {' '.join(args[:1])} on the controller took over {timeout:g}s") from None


def _cause(proc: subprocess.CompletedProcess) -> str:
    lines = (proc.stdout + "\n" + proc.stderr).splitlines()
    errors = [ln for ln in lines if ln.startswith("E: ")]
    return (errors or [ln for ln in lines if ln.strip()][-1:] or [f"exit {proc.returncode}"])[0]


def resolve(cache: Path, state: HostAptState, packages: list[str], sources: list[tuple[AptSource, bytes]], *,
            refresh: bool = False, reinstall: bool = False, log=lambda line: None) -> list[Deb]:
    """The .debs the host lacks for `packages`, resolved by apt on the controller against the host's own state."""
    if not packages:
        return []  # everything requested is installed: no index to read
    root = _prepare_root(cache, state, sources)
    status = cache / "status" / (hashlib.sha256(state.status).hexdigest()[:16])
    status.parent.mkdir(parents=True, exist_ok=True)
    status.write_bytes(state.status)
    lists = root / "var" / "lib" / "apt" / "lists"
    if refresh or not any(p.name.endswith(("Packages", "Packages.gz", "Packages.xz", "Packages.lz4")) for p in lists.iterdir()):
        proc = _apt(root, status, "update")
        for line in (proc.stdout + proc.stderr).splitlines():
            log(f"controller: {line}")
        failed = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith(("E: ", "W: Failed to fetch", "Err:"))]
        if proc.returncode != 0 or failed:
            raise ProvisionError(
                f"offline apt: the controller cannot read this host's package archive: {_cause(proc) if proc.returncode else failed[0]}"
                " (the controller needs a route to the host distribution's archive, or a mirror in apt.sources)"
            )
    proc = _apt(root, status, "-qq", "-y", "--print-uris", "--no-install-recommends", "--allow-downgrades",
                "--allow-change-held-packages", *(["--reinstall"] if reinstall else []), "install", *packages)
    if proc.returncode != 0:
        raise ProvisionError(f"offline apt: apt-get install {' '.join(packages)}: {_cause(proc)}")
    debs = []
    for line in proc.stdout.splitlines():
        m = re.match(r"^'([^']+)' (\S+) (\d+) ?(?:(MD5Sum|SHA1|SHA256|SHA512):([0-9a-f]+))?", line)
        if m:
            algo = {"MD5Sum": "md5", "SHA1": "sha1", "SHA256": "sha256", "SHA512": "sha512"}.get(m.group(4) or "", "")
            debs.append(Deb(m.group(1), m.group(2), int(m.group(3)), f"{algo}:{m.group(5)}" if algo else ""))
    return debs


def _sha256(path: Path, algo: str = "sha256") -> str:
    h = hashlib.new(algo)
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download(cache: Path, debs: list[Deb], *, log=lambda line: None) -> list[Path]:
    """Every deb in the controller's cache (fetched once, checked against its SHA256); their paths."""
    folder = cache / "debs"
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for deb in debs:
        path = folder / deb.filename
        algo, _, want = deb.digest.partition(":")
        if not (path.is_file() and path.stat().st_size == deb.size and (not want or _sha256(path, algo) == want)):
            tmp = path.with_name(path.name + ".part")
            log(f"controller: download {deb.uri}")
            try:
                if deb.uri.startswith("file:"):
                    shutil.copyfile(urllib.request.url2pathname(urllib.parse.urlsplit(deb.uri).path), tmp)
                else:
                    with urllib.request.urlopen(deb.uri, timeout=60) as resp, open(tmp, "wb") as fh:
                        shutil.copyfileobj(resp, fh)
            except OSError as exc:
                raise ProvisionError(f"offline apt: cannot download {deb.uri} on the controller: {exc}") from None
            if want and _sha256(tmp, algo) != want:
                tmp.unlink()
                raise ProvisionError(f"offline apt: {deb.uri} does not match its {algo} in the archive's index")
            tmp.replace(path)
        out.append(path)
    return out


def packages_index(paths: list[Path]) -> bytes:
    """A flat repository's `Packages` for these .debs (control fields + Filename, Size, SHA256), as dpkg-scanpackages writes."""
    stanzas = []
    for path in sorted(paths, key=lambda p: p.name):
        try:
            control = subprocess.run(["dpkg-deb", "-f", str(path)], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError) as exc:
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


def upload_command(remote_dir: str) -> str:
    """Unpack a tar from stdin into the host's local repository (relative: under the login user's home)."""
    return f"mkdir -p -- {join([remote_dir])} && tar -x -f - -C {join([remote_dir])} --no-same-owner"
