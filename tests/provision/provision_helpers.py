"""Build a tiny local apt repository (flat, `deb [trusted=yes] file:DIR ./`) of empty packages, for tests."""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["build_repo", "copy_into", "run_cli", "docker_exec", "REPO_DIR", "NVIDIA_DIR", "WHEELHOUSE", "APT_OFFLINE_CACHE",
           "remove_roots_naming"]

REPO_DIR = "/srv/clusterctl-test-repo"
NVIDIA_DIR = "/srv/fake-nvidia"
# Persistent across sessions: the wheelhouse download is done once per requirement set.
WHEELHOUSE = Path(os.environ.get("CLUSTERCTL_TEST_WHEELHOUSE", Path.home() / ".cache" / "clusterctl" / "test-wheelhouse"))
# Persistent across sessions: the controller's copy of bookworm's package index and the .debs.
APT_OFFLINE_CACHE = Path(
    os.environ.get("CLUSTERCTL_TEST_APT_OFFLINE", Path.home() / ".cache" / "clusterctl" / "test-apt-offline")
)


def remove_roots_naming(cache: Path, directory: Path) -> list[str]:
    """Remove the offline apt roots in `cache` whose sources name `directory` (a session's local repositories, under a
    fresh temporary name: no later session makes the same root, ~120 MB each with bookworm's index); their names."""
    gone = []
    for root in sorted((cache / "roots").glob("*")):
        lists = root / "etc" / "apt" / "sources.list.d"
        if any(str(directory) in p.read_text(errors="replace") for p in lists.glob("clusterctl-*.list")):
            shutil.rmtree(root, ignore_errors=True)
            gone.append(root.name)
    return gone


def _package(workdir: Path, name: str, version: str, depends: str = "") -> Path:
    root = workdir / f"{name}_{version}".replace(":", "_").replace("+", "_")
    (root / "DEBIAN").mkdir(parents=True)
    doc = root / "usr" / "share" / "doc" / name
    doc.mkdir(parents=True)
    (doc / "clusterctl-test").write_text(f"{name} {version}\n")
    control = [
        f"Package: {name}",
        f"Version: {version}",
        "Architecture: all",
        "Maintainer: clusterctl tests <tests@example.invalid>",
        "Section: misc",
        "Priority: optional",
    ]
    if depends:
        control.append(f"Depends: {depends}")
    control.append(f"Description: empty test package {name}")
    (root / "DEBIAN" / "control").write_text("\n".join(control) + "\n")
    out = workdir / "repo" / f"{root.name}_all.deb"
    out.parent.mkdir(exist_ok=True)
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(root), str(out)], check=True, capture_output=True)
    return out


def build_repo(workdir: Path, packages: list[tuple[str, str] | tuple[str, str, str]]) -> Path:
    """Build (name, version[, depends]) packages into workdir/repo with Packages(.gz) and Release; return it."""
    for spec in packages:
        _package(workdir, *spec)
    repo = workdir / "repo"
    proc = subprocess.run(
        ["dpkg-scanpackages", "--multiversion", "."], cwd=repo, check=True, capture_output=True
    )
    (repo / "Packages").write_bytes(proc.stdout)
    (repo / "Packages.gz").write_bytes(gzip.compress(proc.stdout))
    lines = [
        "Origin: clusterctl-tests",
        "Label: clusterctl-tests",
        f"Date: {time.strftime('%a, %d %b %Y %H:%M:%S UTC', time.gmtime())}",
        "SHA256:",
    ]
    for name in ("Packages", "Packages.gz"):
        data = (repo / name).read_bytes()
        lines.append(f" {hashlib.sha256(data).hexdigest()} {len(data)} {name}")
    (repo / "Release").write_text("\n".join(lines) + "\n")
    return repo


def copy_into(container: str, repo: Path, dest: str) -> None:
    """Copy the repository directory into a container at dest (replacing it)."""
    subprocess.run(["docker", "exec", container, "rm", "-rf", dest], check=True, capture_output=True)
    subprocess.run(["docker", "cp", str(repo), f"{container}:{dest}"], check=True, capture_output=True)


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `clusterctl ARGS` in a subprocess (the real CLI, real exit code); output captured as text."""
    env = dict(os.environ, COLUMNS="200")
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "clusterctl.cli", *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    proc.seconds = time.monotonic() - start  # type: ignore[attr-defined]
    return proc


def docker_exec(container: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """`docker exec CONTAINER ARGV...` with text output."""
    return subprocess.run(["docker", "exec", container, *argv], capture_output=True, text=True, check=check, timeout=120)
