"""Fixtures for provisioning tests: a 3-node sshd cluster of our own (provisioning mutates nodes: apt
packages, holds, venvs, ssh config), local apt repositories copied into the nodes, and spec writers.

The cluster is brought up after collection, outside every test's timeout (see tests/integration/conftest.py
for the same pattern). CLUSTERCTL_KEEP_TESTCLUSTER=1 keeps it for the next session.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from clusterctl import testcluster as tc
from clusterctl.errors import ClusterctlError

sys.path.insert(0, str(Path(__file__).parent))
from provision_helpers import APT_OFFLINE_CACHE, NVIDIA_DIR, REPO_DIR, build_repo, copy_into, remove_roots_naming

# CLUSTERCTL_TESTCLUSTER_NAME (several sessions on one machine): our cluster is "<that name>-prov"
CLUSTER = (os.environ["CLUSTERCTL_TESTCLUSTER_NAME"] + "-prov") if os.environ.get("CLUSTERCTL_TESTCLUSTER_NAME") else "clusterctl-provtest"
NODES = 3
TEST_PACKAGES = [("ctl-hello", "1.0-1"), ("ctl-hello", "1.1-1"), ("ctl-lockprobe", "1.0-1")]
# Named and versioned like NVIDIA's packages; empty payloads.
NVIDIA_PACKAGES = [
    ("cuda-toolkit-12-4", "12.4.1-1"),
    ("cuda-toolkit-12-6", "12.6.3-1"),
    ("libcudnn9-cuda-12", "9.1.0.70-1"),
    ("libcudnn9-dev-cuda-12", "9.1.0.70-1", "libcudnn9-cuda-12 (= 9.1.0.70-1)"),
    ("libnccl2", "2.21.5-1+cuda12.4"),
    ("libnccl-dev", "2.21.5-1+cuda12.4", "libnccl2 (= 2.21.5-1+cuda12.4)"),
    ("libnccl2", "2.20.5-1+cuda12.4"),
    ("libnccl-dev", "2.20.5-1+cuda12.4", "libnccl2 (= 2.20.5-1+cuda12.4)"),
    ("libnccl2", "2.21.5-1+cuda11.8"),
]

_SESSION: dict[str, tuple[str, object]] = {}
# The controller-side copies of the local repositories (offline apt reads them on the controller).
LOCAL_REPOS: dict[str, Path] = {}


def _bring_up(tmp: Path) -> tuple[str, object]:
    try:
        tc.ensure_docker()
    except ClusterctlError as exc:
        ci = os.environ.get("CI", "").lower() in {"true", "1", "yes"}
        return ("fail" if ci else "skip"), f"docker cannot be used: {exc}"
    try:
        info = tc.up(NODES, name=CLUSTER, packages=[])
    except ClusterctlError as exc:
        return "fail", f"could not bring up {CLUSTER}: {exc}"
    repo = build_repo(tmp / "apt", TEST_PACKAGES)
    nvidia = build_repo(tmp / "nvidia", NVIDIA_PACKAGES)
    LOCAL_REPOS.update(test=repo, nvidia=nvidia)
    for node in info.nodes:
        # testcluster gives nodes its own node-to-node key; remove it so only ssh_mesh can make mpiexec work.
        subprocess.run(
            ["docker", "exec", node.container, "rm", "-f", "/root/.ssh/id_ed25519", "/root/.ssh/id_ed25519.pub",
             "/root/.ssh/known_hosts"], check=True, capture_output=True,
        )
        copy_into(node.container, repo, REPO_DIR)
        copy_into(node.container, nvidia, NVIDIA_DIR)
    return "ok", info


@pytest.hookimpl(trylast=True)  # after -k/-m deselected theirs: `items` is what will run
def pytest_collection_modifyitems(session, config, items) -> None:
    """Bring our cluster up once, before any test's timeout starts, if a selected test needs it."""
    if config.option.collectonly or "outcome" in _SESSION:
        return
    if any("provcluster" in getattr(item, "fixturenames", ()) for item in items):
        _SESSION["repos"] = Path(tempfile.mkdtemp(prefix="clusterctl-provision-repos-"))
        _SESSION["outcome"] = _bring_up(_SESSION["repos"])


def pytest_unconfigure(config) -> None:
    """The session's repositories go with it (they were made before its tmp_path existed), and so do the offline apt
    roots that name them; the cluster too when no test used it (the fixture's teardown did not run)."""
    outcome = _SESSION.get("outcome")
    if outcome and outcome[0] == "ok" and not _SESSION.get("used") and os.environ.get("CLUSTERCTL_KEEP_TESTCLUSTER") != "1":
        tc.down(CLUSTER)
    if "repos" in _SESSION:
        repos = _SESSION.pop("repos")
        remove_roots_naming(APT_OFFLINE_CACHE, repos)
        shutil.rmtree(repos, ignore_errors=True)


@pytest.fixture(scope="session")
def provcluster(tmp_path_factory) -> Iterator[tc.ClusterInfo]:
    """Our 3-node cluster with the local apt repositories in place; removed at the end unless kept."""
    if "outcome" not in _SESSION:  # requested dynamically
        _SESSION["repos"] = tmp_path_factory.mktemp("provision-repos")
        _SESSION["outcome"] = _bring_up(_SESSION["repos"])
    verdict, payload = _SESSION["outcome"]
    if verdict == "skip":
        pytest.skip(str(payload))
    if verdict == "fail":
        pytest.fail(str(payload), pytrace=False)
    _SESSION["used"] = True
    yield payload
    if os.environ.get("CLUSTERCTL_KEEP_TESTCLUSTER") != "1":
        tc.down(CLUSTER)


@pytest.fixture
def local_repos(provcluster) -> dict[str, Path]:
    """{"test": ..., "nvidia": ...}: the controller-side directories of the nodes' local apt repositories."""
    return LOCAL_REPOS


@pytest.fixture
def cache_home(tmp_path, monkeypatch) -> Path:
    """A private XDG_CACHE_HOME: provisioning logs and the mesh key land under it."""
    path = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(path))
    return path


@pytest.fixture
def prov_spec(provcluster, tmp_path):
    """Write a spec for (some of) the cluster's nodes with the given provision section; return its path."""

    def write(provision: dict, nodes: list[int] | None = None, name: str = "provjob", user: str = "root") -> Path:
        base = yaml.safe_load(Path(provcluster.spec_path).read_text())
        base["ssh"]["user"] = user
        if nodes is not None:
            base["hosts"] = [base["hosts"][i] for i in nodes]
        base["name"] = name
        base["job"] = {"entrypoint": ["python3", "train.py"], "trainers": 1}
        base["workspace"] = {"local": str(tmp_path), "remote": "/root/work" if user == "root" else "work"}
        base["provision"] = provision
        path = tmp_path / f"{name}-{len(list(tmp_path.glob('*.yaml')))}.yaml"
        path.write_text(yaml.safe_dump(base, sort_keys=False))
        return path

    return write
