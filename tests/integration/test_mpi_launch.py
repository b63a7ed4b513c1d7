"""launcher: mpi across test-cluster nodes: one mpiexec over the nodes' SSH mesh; stop cleans every node."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import yaml

from clusterlib import ROOT, assert_mlp_ranks_match_single, clusterctl, mlp_single, status_json, tagged_pids, write_spec

pytestmark = pytest.mark.integration

# Inside containers MPICH's intra-node shared-memory transport fails to connect; TCP between all ranks works.
CONTAINER_MPI_ENV = {"MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "tcp,self", "UCX_WARN_UNUSED_ENV_VARS": "n"}


def mpi_spec(info, tmp_path, name, *, hosts, slots, entrypoint, args=(), workspace):
    base = yaml.safe_load(Path(info.spec_path).read_text())
    spec = write_spec(
        info, tmp_path / f"{name}.yaml", name=name, hosts=hosts,
        workspace={"local": str(workspace), "remote": f"clusterctl-it/{name}"},
        job={"mode": "collective", "launcher": "mpi", "mpiexec": "/opt/venv/bin/mpiexec", "entrypoint": entrypoint,
             "args": list(args), "env": CONTAINER_MPI_ENV, "grace": 3},
    )
    data = yaml.safe_load(spec.read_text())
    data["hosts"] = [dict(h, slots=slots) for h in base["hosts"][:hosts]]
    spec.write_text(yaml.safe_dump(data))
    clusterctl("stop", spec)
    return spec


@pytest.mark.timeout(240)
def test_mlp_trains_over_mpi_launch_and_matches_single_process(clusterctl_on_nodes, tmp_path):
    info = clusterctl_on_nodes
    spec = mpi_spec(info, tmp_path, "it-mpi-mlp", hosts=3, slots=1, workspace=ROOT / "examples" / "mlp_collective",
                    entrypoint=["/opt/venv/bin/python", "train.py"], args=["--steps", "300", "--batch", "96"])
    plan = clusterctl("plan", spec, check=True).stdout
    assert "launcher: mpi" in plan and "-n 3" in plan and "-launcher ssh" in plan
    clusterctl("dispatch", spec, check=True)
    res = clusterctl("start", spec, "--follow", timeout=200)
    assert res.returncode == 0, res.stdout + res.stderr
    done = re.findall(r"done steps=300 loss=([\d.]+) .* trainer=(\d) checksum=([\d.]+)", res.stdout)
    assert sorted(t for _, t, _ in done) == ["0", "1", "2"], res.stdout
    ref_loss, ref_sum = mlp_single(300, 96)
    for loss, _, checksum in done:
        assert float(checksum) == pytest.approx(float(ref_sum), rel=1e-9)
        assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
    assert float(ref_loss) < 0.1  # it did converge


@pytest.mark.timeout(240)
def test_stop_of_an_mpi_job_leaves_no_rank_on_any_node(testcluster, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "spin.py").write_text(
        "import time\nfrom mpi4py import MPI\nc = MPI.COMM_WORLD\nc.Barrier()\n"
        "print(f'rank={c.Get_rank()} up', flush=True)\ntime.sleep(600)\n"
    )
    spec = mpi_spec(testcluster, tmp_path, "it-mpi-stop", hosts=2, slots=2, workspace=ws,
                    entrypoint=["/opt/venv/bin/python", "spin.py"])
    clusterctl("dispatch", spec, check=True)
    clusterctl("start", spec, check=True)
    nodes = testcluster.nodes[:2]
    deadline = time.monotonic() + 60
    while sum(len(tagged_pids(n.container, "it-mpi-stop")) for n in nodes) < 5 and time.monotonic() < deadline:
        time.sleep(0.5)  # mpiexec plus 4 ranks, 2 on each node
    counts = {n.container: len(tagged_pids(n.container, "it-mpi-stop")) for n in nodes}
    assert counts[nodes[1].container] == 2, counts  # ranks on the second node carry the job's tag too
    assert status_json(spec)["state"] == "running"
    res = clusterctl("stop", spec, check=True)
    assert "job it-mpi-stop stopped" in res.stdout
    deadline = time.monotonic() + 15
    while any(tagged_pids(n.container, "it-mpi-stop") for n in nodes) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(tagged_pids(n.container, "it-mpi-stop") for n in nodes)


@pytest.mark.timeout(240)
def test_same_training_without_mpiexec_under_the_ssh_launcher(clusterctl_on_nodes, tmp_path):
    """launcher: ssh — clusterctl starts each rank with the env contract; the backend joins them via its PMI server."""
    info = clusterctl_on_nodes
    base = 7600
    spec = write_spec(
        info, tmp_path / "ssh.yaml", name="it-ssh-mlp", hosts=3,
        workspace={"local": str(ROOT / "examples" / "mlp_collective"), "remote": "clusterctl-it/ssh-mlp"},
        job={"mode": "collective", "launcher": "ssh", "entrypoint": ["/opt/venv/bin/python", "train.py"],
             "args": ["--steps", "300", "--batch", "96"], "trainers": 1, "env": {"UCX_TLS": "tcp,self"}, "grace": 3,
             "ports": {"control": base, "master": base + 1, "trainer": base + 10}},
    )
    clusterctl("stop", spec)
    clusterctl("dispatch", spec, check=True)
    res = clusterctl("start", spec, "--follow", timeout=200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr
    assert_mlp_ranks_match_single(res.stdout, ranks=3, steps=300, batch=96)
