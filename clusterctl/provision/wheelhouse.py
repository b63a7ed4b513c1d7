"""Wheelhouse for air-gapped hosts: `pip download` once on the controller for the hosts' Python and
platform, upload only the wheels a host lacks (a tar stream on the SSH channel's stdin), install offline.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

from ..cache import prune_lru
from ..errors import ProvisionError
from ..quoting import join, redact
from .steps import HostFacts

__all__ = ["platform_args", "download", "missing_wheels", "tar_stream", "upload_command"]

_STAMP = ".clusterctl-complete"
DOWNLOAD_TIMEOUT = 1800
# A group (one folder per requirements, platform, index and offered wheels) is never used again once its key changes,
# and every clusterctl version offers its own wheel: the RECENT most recently used groups are kept, the others once
# unused for IDLE_S (31 MB a group for clusterctl's own requirements; 1.1 GB after a day of provisioning tests).
RECENT = 8
IDLE_S = 30 * 86400
_HELP_LINK = "ERROR: ResolutionImpossible: for help visit"  # pip's last line after conflicting requirements


def platform_args(facts: HostFacts) -> list[str]:
    """`pip download` flags selecting wheels a host with these facts can install."""
    if not facts.python or not facts.machine:
        raise ProvisionError("cannot pick wheels: the host's Python version or machine is unknown")
    impl = facts.implementation or "cp"
    nodot = facts.python.replace(".", "")
    args = ["--python-version", facts.python, "--implementation", impl]
    for abi in (f"{impl}{nodot}", "abi3", "none"):
        args += ["--abi", abi]
    arch = facts.machine
    if facts.glibc:
        major, minor = (int(x) for x in facts.glibc.split(".")[:2])
        for m in range(minor, 4, -1):
            args += ["--platform", f"manylinux_{major}_{m}_{arch}"]
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        args += [a for m, tag in legacy.items() if m <= minor for a in ("--platform", f"{tag}_{arch}")]
    args += ["--platform", f"linux_{arch}"]
    return args


def _group_key(reqs: list[str], plat: list[str], index_url: str | None, find_links: list[str] = ()) -> str:
    offered = sorted(p.name for d in find_links for p in Path(d).glob("*.whl"))  # a new wheel there: download again
    blob = json.dumps({"reqs": reqs, "platform": plat, "index": index_url, "links": list(find_links), "offered": offered},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def download(
    reqs: list[str], facts: HostFacts, local_root: Path, *, index_url: str | None, force: bool, log,
    find_links: list[str] = (),
) -> Path:
    """Directory of wheels for `reqs` on hosts like `facts`; downloaded once, then reused (unless force)."""
    plat = platform_args(facts)
    folder = local_root / _group_key(reqs, plat, index_url, find_links)
    stamp = folder / _STAMP
    if stamp.is_file() and not force:
        _used(folder, local_root)
        return folder
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise ProvisionError(f"cannot write the wheelhouse in {folder} (wheelhouse.local): {exc.strerror or exc}") from None
    argv = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-input",
            "--only-binary=:all:", "--dest", str(folder), *plat]
    if index_url:
        argv += ["--index-url", index_url]
    for link in find_links:
        argv += ["--find-links", str(link)]
    argv += reqs
    log(f"$ {redact(join(argv))}")  # an index URL may carry credentials: never logged
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        raise ProvisionError(f"pip download timed out after {DOWNLOAD_TIMEOUT}s") from None
    for line in (proc.stdout + proc.stderr).splitlines():
        log(redact(line))
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        # pip's own cause: its last ERROR line, not the help link it ends a conflict with
        causes = [ln for ln in lines if ln.startswith("ERROR: ") and not ln.startswith(_HELP_LINK)]
        tail = (causes or lines)[-1:] or ["no output"]
        raise ProvisionError(f"pip download for Python {facts.python} {facts.machine} failed: {redact(tail[0])}")
    stamp.write_text(json.dumps(sorted(p.name for p in folder.glob("*.whl"))) + "\n")
    _used(folder, local_root)
    return folder


def _is_group(name: str) -> bool:
    """Whether a name in the wheelhouse root is one of download()'s groups (16 hex digits), not a user's own file."""
    return len(name) == 16 and all(c in "0123456789abcdef" for c in name)


def _used(folder: Path, local_root: Path) -> None:
    """Mark `folder` used now and prune the groups past the RECENT most recent that nobody used for IDLE_S (best
    effort: a wheelhouse it cannot prune is used as it is)."""
    try:
        os.utime(folder)
    except OSError:
        return
    prune_lru(local_root, RECENT, IDLE_S, match=_is_group)


def missing_wheels(folder: Path, facts: HostFacts) -> list[Path]:
    """Wheels in `folder` the host does not have yet (same name and size counts as present)."""
    have = set(facts.wheels)
    return [p for p in sorted(folder.glob("*.whl")) if (p.name, p.stat().st_size) not in have]


class _Chunks:
    """A write-only file object whose writes are collected for a generator to hand out."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> list[bytes]:
        parts, self.parts = self.parts, []
        return parts


def tar_stream(files: list[Path]) -> Iterator[bytes]:
    """A tar archive of `files` (flat names), produced chunk by chunk so big wheels are never all in memory."""
    sink = _Chunks()
    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for path in files:
            info = tarfile.TarInfo(path.name)
            info.size, info.mode, info.mtime = path.stat().st_size, 0o644, int(path.stat().st_mtime)
            with open(path, "rb") as fh:
                tar.addfile(info, fh)
            yield from sink.take()
    yield from sink.take()


def upload_command(remote_dir: str) -> str:
    """The host command unpacking a tar from stdin into `remote_dir` (relative paths: under $HOME)."""
    return f"mkdir -p -- {join([remote_dir])} && tar -x -f - -C {join([remote_dir])} --no-same-owner"


def local_root(spec) -> Path:
    """Controller-side wheelhouse root for `spec` (wheelhouse.local: `~` expanded, relative to the spec file, as every
    controller path of the spec is)."""
    return spec.local_path(spec.provision.wheelhouse.local)
