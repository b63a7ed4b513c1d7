"""Integration fixtures: one dockerized sshd cluster per test session (see docs/testcluster.md).

The cluster is brought up once, right after collection and before any test's timeout starts (the
first build downloads wheels and builds an image: minutes), then handed to tests by the session
fixture ``testcluster`` (name: CLUSTERCTL_TESTCLUSTER_NAME, default clusterctl-pytest).
Set CLUSTERCTL_KEEP_TESTCLUSTER=1 to keep it after the session (the next
session then reuses it in about a second). Concurrent sessions share the cluster and only the last
one to finish removes it. Without docker the tests skip, except under CI=true,
where they fail.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from clusterctl import testcluster as tc
from clusterctl.errors import ClusterctlError

# Override when several people share one docker daemon, so that sessions do not tear down each other's.
PYTEST_CLUSTER_NAME = os.environ.get("CLUSTERCTL_TESTCLUSTER_NAME", "clusterctl-pytest")
PYTEST_CLUSTER_NODES = 4
# GUIDE §3 / issue 11 part 5: the shared cluster is shaped like real fleets: login `ubuntu` (root login
# off, passwordless sudo), nodes on a network this machine has no address on, reached through a bastion,
# and an ssh config with an alias per node. Tests reach root on a node through `docker exec` or `sudo -n`.
PYTEST_CLUSTER_USER = "ubuntu"
# Installed into /opt/venv on every node; other test modules may read this list.
TESTCLUSTER_PACKAGES: list[str] = ["numpy", "mpi4py", "mpich", "pyzmq", "torch==2.13.0"]

# Outcome of the bring-up done after collection: ("ok", ClusterInfo, seconds) | ("skip"|"fail", reason, 0).
_SESSION: dict[str, tuple[str, object, float]] = {}


def pytest_configure(config: pytest.Config) -> None:
    """Register the `integration` marker (the lead owns pyproject.toml)."""
    config.addinivalue_line("markers", "integration: needs docker; runs against the real sshd test cluster")


def pytest_unconfigure(config: pytest.Config) -> None:
    """Release the cluster if the fixture never ran its teardown (setup failed, or no test asked for it)."""
    if "outcome" in _SESSION and "released" not in _SESSION:
        _release()


def _release() -> None:
    """Drop this session's lease; the last session out takes the cluster down (unless CLUSTERCTL_KEEP_TESTCLUSTER)."""
    _SESSION["released"] = ("done", None, 0.0)
    others = _update_leases(take=False)
    if not _keep() and others == 0 and _SESSION["outcome"][0] == "ok":
        tc.down(PYTEST_CLUSTER_NAME)


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"true", "1", "yes"}


def _keep() -> bool:
    return os.environ.get("CLUSTERCTL_KEEP_TESTCLUSTER", "") == "1"


def _bring_up() -> tuple[str, object, float]:
    """Start the session cluster; docker missing is 'skip' (or 'fail' in CI), any other error 'fail'."""
    try:
        tc.ensure_docker()
    except ClusterctlError as exc:
        verdict = "fail" if _in_ci() else "skip"
        return verdict, f"docker cannot be used: {exc}", 0.0
    _update_leases(take=True)  # before `up`: a finishing session must not tear the cluster down under us
    start = time.monotonic()
    try:
        info = tc.up(PYTEST_CLUSTER_NODES, name=PYTEST_CLUSTER_NAME, packages=list(TESTCLUSTER_PACKAGES),
                     user=PYTEST_CLUSTER_USER, bastion=True, ssh_config=True)
    except ClusterctlError as exc:
        return "fail", f"could not bring up test cluster {PYTEST_CLUSTER_NAME}: {exc}", 0.0
    return "ok", info, time.monotonic() - start


@pytest.hookimpl(trylast=True)  # after -k/-m deselected theirs: `items` is what will run
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Bring the cluster up once, outside every test's timeout, if a selected test needs it."""
    if config.option.collectonly or "outcome" in _SESSION:
        return
    if any("testcluster" in getattr(item, "fixturenames", ()) for item in items):
        _SESSION["outcome"] = _bring_up()


def _lease_dir() -> Path:
    return tc.state_root() / "leases" / PYTEST_CLUSTER_NAME


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _update_leases(take: bool) -> int:
    """Take or drop this session's lease on the shared cluster; return how many other live sessions hold one.

    Concurrent pytest sessions on one docker daemon share the cluster (``up`` reuses it); only the
    last one to finish tears it down.
    """
    leases = _lease_dir()
    leases.mkdir(parents=True, exist_ok=True)
    mine = leases / str(os.getpid())
    with open(leases / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if take:
            mine.write_text("")
        else:
            mine.unlink(missing_ok=True)
        others = 0
        for lease in leases.iterdir():
            if not lease.name.isdigit() or lease == mine:
                continue
            if _pid_alive(int(lease.name)):
                others += 1
            else:
                lease.unlink(missing_ok=True)  # a crashed session's lease
        return others


@pytest.fixture(scope="session")
def testcluster() -> Iterator[tc.ClusterInfo]:
    """The session's 4-node cluster (ClusterInfo): login `ubuntu` with passwordless sudo, behind a bastion,
    with an ssh config; removed at the end unless CLUSTERCTL_KEEP_TESTCLUSTER=1."""
    if "outcome" not in _SESSION:  # e.g. requested dynamically: bring it up now
        _SESSION["outcome"] = _bring_up()
    verdict, payload, _seconds = _SESSION["outcome"]
    if verdict == "skip":
        pytest.skip(str(payload))
    if verdict == "fail":
        pytest.fail(str(payload), pytrace=False)
    assert isinstance(payload, tc.ClusterInfo)
    yield payload
    _release()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say how the session's cluster came up (a cold image build explains a slow session)."""
    outcome = _SESSION.get("outcome")
    if outcome and outcome[0] == "ok" and isinstance(outcome[1], tc.ClusterInfo):
        info, seconds = outcome[1], outcome[2]
        how = "reused" if info.reused else "started"
        built = "built" if info.image_built else "cached"
        terminalreporter.write_line(
            f"testcluster {info.name}: {len(info.nodes)} nodes {how} in {seconds:.1f}s, image {info.image} ({built})"
        )


@pytest.fixture(scope="session")
def testcluster_packages() -> list[str]:
    """The session cluster's pip packages: the clusters of other modules (Slurm, the pods' image) install the same,
    so that they share its node image."""
    return list(TESTCLUSTER_PACKAGES)


@pytest.fixture(scope="session")
def testcluster_bringup_seconds(testcluster: tc.ClusterInfo) -> float:
    """Wall time the session's first `up` took (image build included when it happened)."""
    return _SESSION["outcome"][2]


@pytest.fixture(scope="session")
def clusterctl_wheel(tmp_path_factory: pytest.TempPathFactory):
    """A wheel of this checkout of clusterctl (built once per session)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(root)],
        check=True, capture_output=True, timeout=300,
    )
    return next(out.glob("clusterctl-*.whl"))


def _install_wheel(spec_path, wheel, *, sudo: str = "") -> None:
    from clusterctl.ops import open_session

    with open_session(str(spec_path)) as session:
        session.remote.run(
            f"cat > /tmp/{wheel.name} && {sudo}/opt/venv/bin/pip install -q --no-deps --no-index --force-reinstall "
            f"/tmp/{wheel.name}",
            stdin=wheel.read_bytes(),
            what="installing clusterctl on the nodes",
        )


@pytest.fixture(scope="session")
def clusterctl_on_nodes(testcluster: tc.ClusterInfo, clusterctl_wheel) -> tc.ClusterInfo:
    """The session cluster with this checkout of clusterctl installed into every node's /opt/venv (as a wheel)."""
    _install_wheel(testcluster.spec_path, clusterctl_wheel, sudo="" if testcluster.user == "root" else "sudo -n ")
    return testcluster


FLEET_USER = "ubuntu"
FLEET_PASSWORD_NODE = 2  # this node's sudo wants a password; nodes 0 and 1 have passwordless sudo


@pytest.fixture(scope="session")
def fleet(testcluster: tc.ClusterInfo, clusterctl_wheel) -> Iterator[tc.ClusterInfo]:
    """A cluster shaped like real fleets: login `ubuntu` (root login off, passwordless sudo), 3 nodes on a
    network this machine has no address on, reached only through a bastion, an ssh config with an alias
    per node; node2's sudo wants a password. clusterctl is installed in /opt/venv of nodes 0 and 1."""
    name = f"{testcluster.name}-fleet"
    info = tc.up(3, name=name, packages=testcluster.packages, user=FLEET_USER, bastion=True, ssh_config=True,
                 sudo_password_nodes=[FLEET_PASSWORD_NODE])
    good = info.spec_path.parent / "good-nodes.yaml"
    import yaml

    spec = yaml.safe_load(info.spec_path.read_text())
    spec["hosts"] = spec["hosts"][:2]
    good.write_text(yaml.safe_dump(spec))
    _install_wheel(good, clusterctl_wheel, sudo="sudo -n ")
    yield info
    if not _keep():
        tc.down(name)
