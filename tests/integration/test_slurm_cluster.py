"""backend: slurm against a real Slurm cluster (Debian's slurm-wlm and munge in containers, testcluster_slurm).

fit_a_line in pserver sync mode (workspace dispatched to every node), mlp_collective (workspace on the
cluster's shared filesystem), a failed trainer (the job fails, nothing is left) and a stop (no process
carrying the job's CLUSTERCTL_JOB on any node, ports free).
"""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from clusterlib import ROOT, assert_mlp_ranks_match_single, clusterctl, docker, status_json, tagged_pids

pytestmark = pytest.mark.integration

NODES = 3
CLUSTER_NAME = os.environ.get("CLUSTERCTL_TESTCLUSTER_NAME", "clusterctl-pytest") + "-slurm"

# Every trainer leaves a child behind that setsid()s, ignores SIGTERM and sleeps: it escapes its srun
# step (proctrack/linuxproc tracks the process tree), so only our sweep by CLUSTERCTL_JOB can end it.
ORPHANING = """\
import os, signal, sys, time
if os.fork() == 0:
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
    os._exit(0)
tid = int(os.environ["PADDLE_TRAINER_ID"])
print(f"trainer={tid} rank={os.environ['RANK']} world={os.environ['WORLD_SIZE']} "
      f"endpoint={os.environ['PADDLE_CURRENT_ENDPOINT']} master={os.environ['MASTER_ADDR']}", flush=True)
fail = os.environ.get("FAIL_TRAINER")
if fail is not None and int(fail) == tid:
    time.sleep(1)
    sys.exit(3)
time.sleep(600)
"""


def _session_packages(config) -> list[str]:
    """The session cluster's pip packages (tests/integration/conftest.py), so that both share a node image."""
    for plugin in config.pluginmanager.get_plugins():
        packages = getattr(plugin, "TESTCLUSTER_PACKAGES", None)
        if packages is not None:
            return list(packages)
    return ["numpy", "mpi4py", "mpich", "pyzmq"]  # what these tests need


@pytest.fixture(scope="module")
def slurm_cluster(pytestconfig, clusterctl_wheel):
    """A 3-node Slurm cluster with this checkout of clusterctl (the session's wheel) in every node's /opt/venv."""
    from clusterctl import testcluster as tc
    from clusterctl import testcluster_slurm as tsl
    from clusterctl.errors import ClusterctlError

    try:
        tc.ensure_docker()
    except ClusterctlError as exc:
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail(f"docker cannot be used: {exc}")
        pytest.skip(f"docker cannot be used: {exc}")
    t0 = time.monotonic()
    packages = _session_packages(pytestconfig)
    info = tsl.up(NODES, name=CLUSTER_NAME, packages=packages)
    wheel = clusterctl_wheel

    def install(container: str) -> None:
        docker("cp", str(wheel), f"{container}:/tmp/{wheel.name}")
        docker("exec", container, "/opt/venv/bin/pip", "install", "-q", "--no-deps", "--no-index",
               "--force-reinstall", f"/tmp/{wheel.name}", timeout=120)

    with ThreadPoolExecutor(len(info.nodes)) as pool:
        list(pool.map(install, [n.container for n in info.nodes]))
    print(f"slurm cluster {info.name} up in {time.monotonic() - t0:.1f}s ({info.timings}), packages {packages}")
    yield info
    if os.environ.get("CLUSTERCTL_KEEP_TESTCLUSTER") != "1":
        tsl.down(CLUSTER_NAME)


def slurm_spec(info, path: Path, name: str, workspace: Path, remote: str, job: dict, *, shared: bool = False) -> Path:
    """A backend: slurm spec for the test Slurm cluster (its own written spec's ssh and slurm sections)."""
    base = yaml.safe_load(Path(info.spec_path).read_text())
    slurm = dict(base["slurm"], workspace="shared" if shared else "dispatch")
    spec = {"name": name, "backend": "slurm", "slurm": slurm, "ssh": base["ssh"],
            "workspace": {"local": str(workspace), "remote": remote}, "job": job}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def no_tagged(info, job: str, timeout: float = 15) -> dict[str, list[int]]:
    """Wait until no node has a process tagged with job; return what is still there."""
    deadline = time.monotonic() + timeout
    while True:
        left = {n.container: tagged_pids(n.container, job) for n in info.nodes}
        if not any(left.values()) or time.monotonic() > deadline:
            return {c: p for c, p in left.items() if p}
        time.sleep(0.5)


@pytest.mark.timeout(600)  # the first test also brings the cluster up (an image build when not cached)
def test_fit_a_line_pserver_sync_through_slurm(slurm_cluster, tmp_path):
    info = slurm_cluster
    spec = slurm_spec(info, tmp_path / "fal.yaml", "it-slurm-fal", ROOT / "examples" / "fit_a_line",
                      "clusterctl-it/slurm-fal",
                      {"mode": "pserver", "entrypoint": ["/opt/venv/bin/python", "train.py"], "pservers": 2,
                       "trainers": 1, "sync": "sync", "grace": 3, "ports": {"pserver": 7470, "trainer": 7480}})
    clusterctl("stop", spec, check=True)
    plan = clusterctl("plan", spec, "--json", check=True).stdout
    assert '"PADDLE_PSERVERS_IP_PORT_LIST": "slurm-node-0.invalid:7470,slurm-node-1.invalid:7470"' in plan
    res = clusterctl("start", spec, "--dispatch", "--follow", timeout=150)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr
    done = re.findall(r"\[(\S+) trainer\.(\d)\] done steps=\d+ loss=([\d.]+) .* mode=(\w+)", res.stdout)
    assert sorted(t for _, t, _, _ in done) == ["0", "1", "2"], res.stdout[-3000:]
    assert all(m == "sync" and float(loss) < 10 for _, _, loss, m in done), done
    # trainer i on node i of the allocation, pservers on nodes 0 and 1, each listening on its node's own IP
    assert {(node, t) for node, t, _, _ in done} == {(n.hostname, str(i)) for i, n in enumerate(info.nodes)}
    pserver_log = clusterctl("logs", spec, "--role", "pserver", "--id", "1", check=True).stdout
    assert f"[{info.nodes[1].hostname} pserver.1]" in pserver_log
    assert f"listening on tcp://{info.nodes[1].ip}:7470" in pserver_log
    final = status_json(spec)
    assert final["state"] == "succeeded", final
    assert re.search(r"Slurm job \d+ COMPLETED", final["reason"])
    assert {(p["role"], p["id"], p["state"]) for p in final["processes"]} == {
        ("pserver", 0, "exited"), ("pserver", 1, "exited"),
        ("trainer", 0, "exited"), ("trainer", 1, "exited"), ("trainer", 2, "exited")}
    assert not no_tagged(info, "it-slurm-fal")


@pytest.mark.timeout(240)
def test_mlp_collective_from_the_shared_filesystem(slurm_cluster, tmp_path):
    info = slurm_cluster
    spec = slurm_spec(info, tmp_path / "mlp.yaml", "it-slurm-mlp", ROOT / "examples" / "mlp_collective",
                      "/shared/it-slurm-mlp",
                      {"mode": "collective", "entrypoint": ["/opt/venv/bin/python", "train.py"],
                       "args": ["--steps", "300", "--batch", "96"], "trainers": 1, "env": {"UCX_TLS": "tcp,self"},
                       "grace": 3, "ports": {"master": 7501, "trainer": 7510}}, shared=True)
    clusterctl("stop", spec, check=True)
    res = clusterctl("dispatch", spec, check=True)
    assert "dispatch to 1 host(s)" in res.stdout  # the login node only: /shared is the same on every node
    res = clusterctl("start", spec, "--follow", timeout=200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr
    assert_mlp_ranks_match_single(res.stdout, ranks=3, steps=300, batch=96)
    assert status_json(spec)["state"] == "succeeded"


def _orphaning_job(info, tmp_path, name: str, env: dict, base: int) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "job.py").write_text(ORPHANING)
    return slurm_spec(info, tmp_path / f"{name}.yaml", name, ws, f"clusterctl-it/{name}",
                      {"mode": "collective", "entrypoint": ["/opt/venv/bin/python", "job.py"], "trainers": 1,
                       "env": env, "grace": 2, "ports": {"master": base, "trainer": base + 10}})


@pytest.mark.timeout(180)
def test_a_failed_trainer_fails_the_job_and_leaves_nothing(slurm_cluster, tmp_path):
    info = slurm_cluster
    spec = _orphaning_job(info, tmp_path, "it-slurm-fail", {"FAIL_TRAINER": "1"}, 7520)
    clusterctl("stop", spec, check=True)
    res = clusterctl("start", spec, "--dispatch", "--follow", timeout=120)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr
    ranks = re.findall(r"\[(\S+) trainer\.(\d)\] trainer=\d rank=(\d) world=3 endpoint=([\d.]+):(\d+) master=([\d.]+)",
                       res.stdout)
    assert sorted(r[1] for r in ranks) == ["0", "1", "2"], res.stdout
    by_node = {n.hostname: n.ip for n in info.nodes}
    assert all(by_node[node] == ip and port == "7530" and master == info.nodes[0].ip
               for node, _, _, ip, port, master in ranks), ranks
    st = status_json(spec)
    assert st["state"] == "failed", st
    assert "FAILED" in st["reason"] and "trainer.1 failed (exit 3)" in st["reason"], st["reason"]
    by = {(p["role"], p["id"]): (p["state"], p["exit_code"]) for p in st["processes"]}
    assert by[("trainer", 1)] == ("failed", 3), by
    assert by[("trainer", 0)][0] == by[("trainer", 2)][0] == "stopped", by
    assert not no_tagged(info, "it-slurm-fail")  # the setsid children that ignored SIGTERM included


@pytest.mark.timeout(180)
def test_stop_scancels_and_leaves_no_orphan(slurm_cluster, tmp_path):
    info = slurm_cluster
    spec = _orphaning_job(info, tmp_path, "it-slurm-stop", {}, 7540)
    clusterctl("stop", spec, check=True)
    clusterctl("dispatch", spec, check=True)
    res = clusterctl("start", spec, check=True)
    assert re.search(r"submitted in [\d.]+s", res.stdout), res.stdout
    again = clusterctl("start", spec)
    assert again.returncode != 0 and "already" in again.stderr + again.stdout, again.stdout + again.stderr
    deadline = time.monotonic() + 60
    while sum(len(tagged_pids(n.container, "it-slurm-stop")) for n in info.nodes) < 6 and time.monotonic() < deadline:
        time.sleep(0.5)  # 3 trainers, each with its setsid child
    counts = {n.container: len(tagged_pids(n.container, "it-slurm-stop")) for n in info.nodes}
    assert all(c == 2 for c in counts.values()), counts
    assert status_json(spec)["state"] == "running"
    res = clusterctl("stop", spec, check=True)
    assert "job it-slurm-stop stopped (Slurm job" in res.stdout, res.stdout
    assert not no_tagged(info, "it-slurm-stop", timeout=2)
    st = status_json(spec)
    assert st["state"] == "stopped" and "CANCELLED" in st["reason"], st
    assert "is not running" in clusterctl("stop", spec, check=True).stdout
