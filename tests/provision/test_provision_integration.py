"""Provisioning and doctor against real sshd nodes (no internet inside): local apt repositories, a
controller-side wheelhouse, the ssh mesh driving a 2-node mpiexec, dpkg-lock waits and version drift."""

from __future__ import annotations

import re
import subprocess
import time

import pytest
from provision_helpers import NVIDIA_DIR, REPO_DIR, WHEELHOUSE, docker_exec, run_cli

pytestmark = pytest.mark.integration

APT_SOURCE = {"name": "testrepo", "uri": f"file:{REPO_DIR}", "trusted": True}
NVIDIA_SOURCE = {"name": "fake-nvidia", "uri": f"file:{NVIDIA_DIR}", "trusted": True}
# Air-gapped nodes: only our own sources' lists are refreshed (deb.debian.org is unreachable from them).
APT = {"sources": [APT_SOURCE], "update": "sources", "lock_timeout": 3}
MPI4PY = "4.1.2"


def _row(output: str, label: str) -> str:
    """The table row of host `label` (one line at COLUMNS=200)."""
    rows = [ln for ln in output.splitlines() if re.search(rf"[│|] {re.escape(label)}\s", ln)]
    assert rows, f"no row for {label} in:\n{output}"
    return rows[0]


def _change(output: str, step: str, nodes) -> str:
    """What the `changed:` / `would change:` list says `step` did on exactly these nodes."""
    prefix = f"  {step} on {', '.join(n.ip for n in nodes)}: "
    lines = [ln[len(prefix):] for ln in output.splitlines() if ln.startswith(prefix)]
    assert len(lines) == 1, f"no single {prefix!r} line in:\n{output}"
    return lines[0]


def _pkg_version(container: str, name: str) -> str:
    res = docker_exec(container, "dpkg-query", "-W", "-f", "${db:Status-Status} ${Version}", name, check=False)
    return res.stdout.strip()


def _reset(nodes, script: str) -> None:
    """Undo what an earlier test (or a kept cluster's earlier session) left, so each test starts clean."""
    for node in nodes:
        docker_exec(node.container, "sh", "-c", script)


APT_RESET = (
    "apt-mark unhold ctl-hello ctl-lockprobe >/dev/null 2>&1; dpkg --purge ctl-hello ctl-lockprobe >/dev/null 2>&1; "
    "rm -f /etc/apt/sources.list.d/clusterctl-*.list; true"
)
GPU_PKGS = "cuda-toolkit-12-4 libcudnn9-cuda-12 libcudnn9-dev-cuda-12 libnccl2 libnccl-dev"
GPU_RESET = f"apt-mark unhold {GPU_PKGS} >/dev/null 2>&1; dpkg --purge {GPU_PKGS} >/dev/null 2>&1; " + APT_RESET
MPI_RESET = (
    "rm -rf /opt/jobvenv /root/.clusterctl/wheelhouse /root/.ssh/clusterctl-* /root/.ssh/config; "
    "sed -i '/clusterctl-mesh-/d' /root/.ssh/authorized_keys"
)


def _fs_state(container: str) -> tuple[str, str]:
    """(sorted `docker diff`, hash of name/size/mtime of everything under the paths provisioning touches)."""
    diff = subprocess.run(["docker", "diff", container], capture_output=True, text=True, check=True).stdout
    listing = docker_exec(
        container, "sh", "-c",
        "find /etc /root /opt /usr /var/lib/dpkg /var/lib/apt -xdev -printf '%p %s %T@\\n' 2>/dev/null | sort | sha256sum",
    ).stdout
    return "\n".join(sorted(diff.splitlines())), listing


@pytest.mark.timeout(240)
def test_apt_install_pin_hold_idempotent_and_check(provcluster, prov_spec, cache_home):
    nodes = provcluster.nodes
    _reset(nodes, APT_RESET)
    spec = prov_spec({"apt": {**APT, "packages": ["ctl-hello=1.0-1"], "hold": True}})

    first = run_cli("provision", str(spec))
    assert first.returncode == 0, first.stdout + first.stderr
    assert _change(first.stdout, "apt", nodes) == "source testrepo; install ctl-hello=1.0-1; hold ctl-hello"
    for node in nodes:
        assert re.search(r"│ changed\s+│$", _row(first.stdout, node.ip))
        assert _pkg_version(node.container, "ctl-hello") == "installed 1.0-1"
        assert "ctl-hello" in docker_exec(node.container, "apt-mark", "showhold").stdout.split()
    assert f"{len(nodes)} changed, 0 failed, 0 ok" in first.stdout
    log = cache_home / "clusterctl" / "provision" / "provjob" / f"{nodes[0].ip}.log"
    assert "[apt] Setting up ctl-hello (1.0-1) ..." in log.read_text().splitlines()
    assert f"per-host logs: {log.parent}/<host>.log" in first.stdout

    second = run_cli("provision", str(spec))
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"0 changed, 0 failed, {len(nodes)} ok" in second.stdout  # its time vs the first's: benchmarks/provision.py

    # --check against a newer pin: reports the change, changes nothing on any node.
    newer = prov_spec({"apt": {**APT, "packages": ["ctl-hello=1.1-1", "ctl-lockprobe"], "hold": True}})
    before = {n.container: _fs_state(n.container) for n in nodes}
    check = run_cli("provision", str(newer), "--check")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "\nwould change:\n" in check.stdout
    assert _change(check.stdout, "apt", nodes) == "install ctl-hello=1.1-1 ctl-lockprobe"
    for node in nodes:
        assert "│ would change " in _row(check.stdout, node.ip)
        assert _pkg_version(node.container, "ctl-hello") == "installed 1.0-1"
    assert "--check (nothing was changed)" in check.stdout
    assert {n.container: _fs_state(n.container) for n in nodes} == before


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_dpkg_lock_bounded_wait_then_rerun_succeeds(provcluster, prov_spec, cache_home):
    nodes = provcluster.nodes
    locked = nodes[1]
    _reset(nodes, APT_RESET)
    spec = prov_spec({"apt": {**APT, "packages": ["ctl-lockprobe=1.0-1"], "lock_timeout": 2}})
    # Hold dpkg's frontend lock the way apt does (fcntl/lockf, not flock(1)) for 8 seconds.
    holder = subprocess.Popen(
        ["docker", "exec", locked.container, "python3", "-c",
         "import fcntl, os, time\n"
         "fd = os.open('/var/lib/dpkg/lock-frontend', os.O_RDWR | os.O_CREAT)\n"
         "fcntl.lockf(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(8)"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        start = time.monotonic()
        res = run_cli("provision", str(spec))
        elapsed = time.monotonic() - start
    finally:
        holder.wait(timeout=30)
    assert res.returncode == 1, res.stdout + res.stderr
    row = _row(res.stdout, locked.ip)
    assert re.search(r"failed: dpkg lock /var/lib/dpkg/lock-frontend is held by pid \d+ \(python3\); gave up after 2s "
                     r"\(apt.lock_timeout\)", row), row
    others = [n for n in nodes if n != locked]
    assert _change(res.stdout, "apt", others) == "source testrepo; install ctl-lockprobe=1.0-1"
    assert elapsed < 30
    rerun = run_cli("provision", str(spec))
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert _change(rerun.stdout, "apt", [locked]) == "install ctl-lockprobe=1.0-1"
    assert f"1 changed, 0 failed, {len(nodes) - 1} ok" in rerun.stdout


GPU = {
    "apt": {"sources": [], "update": "sources", "lock_timeout": 5},
    "cuda": {"version": "12.4", "method": "apt", "repository": NVIDIA_SOURCE},
    "cudnn": "9.1.0.70",
    "nccl": "2.21.5",
}


@pytest.mark.slow  # the GPU apt method offline: tests/provision/test_provision_offline.py
@pytest.mark.timeout(240)
def test_cuda_apt_method_pins_holds_and_detects_drift(provcluster, prov_spec, cache_home):
    nodes = provcluster.nodes
    _reset(nodes, GPU_RESET)
    spec = prov_spec(GPU)
    first = run_cli("provision", str(spec), "--only", "gpu")
    assert first.returncode == 0, first.stdout + first.stderr
    assert _change(first.stdout, "gpu", nodes) == (
        "source fake-nvidia; install cuda-toolkit-12-4 libcudnn9-cuda-12=9.1.0.70-1 libcudnn9-dev-cuda-12=9.1.0.70-1 "
        "libnccl2=2.21.5-1+cuda12.4 libnccl-dev=2.21.5-1+cuda12.4; "
        "hold cuda-toolkit-12-4 libcudnn9-cuda-12 libcudnn9-dev-cuda-12 libnccl2 libnccl-dev"
    )
    for node in nodes:
        assert _pkg_version(node.container, "libnccl2") == "installed 2.21.5-1+cuda12.4"
        held = set(docker_exec(node.container, "apt-mark", "showhold").stdout.split())
        assert {"cuda-toolkit-12-4", "libcudnn9-cuda-12", "libcudnn9-dev-cuda-12", "libnccl2", "libnccl-dev"} <= held
    again = run_cli("provision", str(spec), "--only", "gpu")
    assert f"0 changed, 0 failed, {len(nodes)} ok" in again.stdout, again.stdout

    # One node drifts to another NCCL: doctor names it, provisioning puts it back.
    odd = nodes[2]
    docker_exec(odd.container, "apt-get", "install", "-y", "-q", "--allow-downgrades", "--allow-change-held-packages",
                "libnccl2=2.20.5-1+cuda12.4", "libnccl-dev=2.20.5-1+cuda12.4")
    doc = run_cli("doctor", str(spec))
    assert doc.returncode == 1, doc.stdout + doc.stderr
    others = ", ".join(n.ip for n in nodes if n != odd)
    assert f"NCCL differs: {odd.ip} has 2.20.5-1+cuda12.4; {others} have 2.21.5-1+cuda12.4" in doc.stdout
    fix = run_cli("provision", str(spec), "--only", "gpu")
    assert fix.returncode == 0, fix.stdout + fix.stderr
    assert _change(fix.stdout, "gpu", [odd]).startswith("install libnccl2=2.21.5-1+cuda12.4 libnccl-dev=2.21.5-1+cuda12.4")
    assert f"1 changed, 0 failed, {len(nodes) - 1} ok" in fix.stdout
    assert "NCCL differs" not in run_cli("doctor", str(spec)).stdout

    # A GPU whose driver is older than the toolkit needs (a fake nvidia-smi on one node): refused, both versions named.
    fake = nodes[1]
    docker_exec(fake.container, "sh", "-c",
                "printf '#!/bin/sh\\necho 535.104.05\\n' > /usr/local/bin/nvidia-smi && chmod 755 /usr/local/bin/nvidia-smi")
    try:
        res = run_cli("provision", str(spec), "--only", "gpu")
    finally:
        docker_exec(fake.container, "rm", "-f", "/usr/local/bin/nvidia-smi")
    assert res.returncode == 1
    assert "failed: CUDA 12.4 needs NVIDIA driver >= 550.54.14 but this host's driver is 535.104.05" in _row(
        res.stdout, fake.ip
    )


def _mpi_spec(prov_spec, nodes=None, mpi4py=MPI4PY, name="provjob"):
    return prov_spec(
        {
            "python": {"venv": "/opt/jobvenv", "requirements": ["numpy"]},
            "mpi": {"implementation": "mpich", "mpi4py": mpi4py},
            "wheelhouse": {"local": str(WHEELHOUSE)},
            "ssh_mesh": True,
        },
        nodes=nodes,
        name=name,
    )


ALLREDUCE = (
    "from mpi4py import MPI\n"
    "import numpy as np\n"
    "c = MPI.COMM_WORLD\n"
    "out = np.zeros(1)\n"
    "c.Allreduce(np.array([c.rank + 1.0]), out)\n"
    "print('rank', c.rank, 'of', c.size, 'on', MPI.Get_processor_name(), 'sum', out[0])\n"
)


@pytest.mark.timeout(420)
def test_wheelhouse_mpi_and_ssh_mesh_run_allreduce_across_nodes(provcluster, prov_spec, cache_home):
    nodes = provcluster.nodes
    _reset(nodes, MPI_RESET)
    spec = _mpi_spec(prov_spec)
    first = run_cli("provision", str(spec))
    assert first.returncode == 0, first.stdout + first.stderr
    for node in nodes:
        row = _row(first.stdout, node.ip)
        assert "failed" not in row, row
    a, b = nodes[0], nodes[1]
    res = docker_exec(
        a.container, "timeout", "60", "/opt/jobvenv/bin/mpiexec", "-launcher", "ssh", "-hosts", f"{a.ip},{b.ip}",
        "-n", "2", "/opt/jobvenv/bin/python", "-c", ALLREDUCE, check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    lines = sorted(ln for ln in res.stdout.splitlines() if ln.startswith("rank"))
    assert lines == [f"rank 0 of 2 on {a.hostname} sum 3.0", f"rank 1 of 2 on {b.hostname} sum 3.0"]

    second = run_cli("provision", str(spec))
    assert second.returncode == 0
    steps = ("wheelhouse", "python", "mpi", "ssh_mesh")
    # --check with another mpi4py pin: every step is evaluated, nothing on any node changes.
    other = _mpi_spec(prov_spec, mpi4py="4.1.1")
    before = {n.container: _fs_state(n.container) for n in nodes}
    check = run_cli("provision", str(other), "--check")
    assert check.returncode == 0, check.stdout + check.stderr
    assert _change(check.stdout, "wheelhouse", nodes) == "upload 1 wheel(s)"
    assert _change(check.stdout, "mpi", nodes) == "pip install mpich + mpi4py (mpi4py 4.1.2 does not match ==4.1.1)"
    assert {n.container: _fs_state(n.container) for n in nodes} == before
    assert f"0 changed, 0 failed, {len(steps) * len(nodes)} ok" in second.stdout, second.stdout
    # how much faster the converged run is than the first: benchmarks/provision.py (wall-clock ratios live there)


@pytest.mark.timeout(300)
def test_doctor_names_the_node_with_another_mpi4py(provcluster, prov_spec, cache_home):
    nodes = provcluster.nodes
    spec = _mpi_spec(prov_spec)
    assert run_cli("provision", str(spec)).returncode == 0
    ok = run_cli("doctor", str(spec))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "all hosts agree" in ok.stdout
    assert re.search(r"GPUs\s*│ none\s*│ none\s*│ none", ok.stdout), ok.stdout  # no GPU here: reported, not a problem

    odd = nodes[2]
    single = _mpi_spec(prov_spec, nodes=[2], mpi4py="4.1.1", name="provjob-odd")
    res = run_cli("provision", str(single), "--only", "wheelhouse", "python", "mpi")
    assert res.returncode == 0, res.stdout + res.stderr
    bad = run_cli("doctor", str(spec))
    assert bad.returncode == 1, bad.stdout
    others = ", ".join(n.ip for n in nodes if n != odd)
    assert f"problem: mpi4py differs: {odd.ip} has 4.1.1; {others} have {MPI4PY}" in bad.stdout
    data = run_cli("doctor", str(spec), "--json")
    assert data.returncode == 1 and '"ok": false' in data.stdout

    fix = run_cli("provision", str(spec))
    assert fix.returncode == 0
    assert run_cli("doctor", str(spec)).returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pip_method_installs_real_nccl_wheel_from_the_wheelhouse(provcluster, prov_spec, cache_home):
    """cuda/nccl with method: pip put NVIDIA's real wheels (~200 MB) into the venv, offline via the wheelhouse."""
    nodes = provcluster.nodes[:2]
    _reset(provcluster.nodes, "rm -rf /opt/ncclvenv; " + GPU_RESET)
    spec = prov_spec(
        {
            "python": {"venv": "/opt/ncclvenv"},
            "cuda": {"version": "12.4", "method": "pip"},
            "nccl": "2.21.5",
            "wheelhouse": {"local": str(WHEELHOUSE)},
        },
        nodes=[0, 1],
        name="provjob-nccl",
    )
    first = run_cli("provision", str(spec))
    assert first.returncode == 0, first.stdout + first.stderr
    assert _change(first.stdout, "gpu", nodes).startswith("pip install CUDA wheels (nvidia-cuda-runtime-cu12 missing; ")
    for node in nodes:
        got = docker_exec(node.container, "/opt/ncclvenv/bin/python", "-c",
                          "from importlib.metadata import version as v; print(v('nvidia-nccl-cu12'), v('nvidia-cuda-runtime-cu12'))")
        nccl, runtime = got.stdout.split()
        assert nccl == "2.21.5" and runtime.startswith("12.4.")
        lib = docker_exec(node.container, "sh", "-c", "ls /opt/ncclvenv/lib/python3*/site-packages/nvidia/nccl/lib/")
        assert "libnccl.so.2" in lib.stdout.split()
    again = run_cli("provision", str(spec))
    assert "0 changed, 0 failed" in again.stdout, again.stdout
    doc = run_cli("doctor", str(spec), "--json")
    assert '"nccl": "2.21.5 (pip nvidia-nccl-cu12)"' in doc.stdout, doc.stdout
