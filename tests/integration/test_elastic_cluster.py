"""Elastic jobs on a docker test cluster of five nodes (issue 24): a host stopped hard (`docker kill`) mid-run,
and the job goes on, on a spare in its place or on fewer hosts, from its checkpoint, to the result an
undisturbed run gives; the coordinator's own host lost; a pserver whose checkpoint shard was on the lost host;
a host that comes back waits as a spare.

The cluster is its own (`<session cluster>-elastic`, five nodes, login `ubuntu`, no bastion): nodes are killed
here, and brought back (`testcluster up` wakes them) before each test. The job is examples/torch_gloo (stock
torch, gloo, env://), which saves a checkpoint every SAVE_EVERY steps on rank 0's host and resumes from it at
any world size; its final weights' checksum is compared with a run of the same steps on this machine (one
process: float64, the same up to the order of the additions)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from clusterctl import testcluster as tc
from clusterlib import ROOT, clusterctl, docker, node_exec, status_json, tagged_pids, wait_state
from helpers import free_port

pytestmark = pytest.mark.integration

NAME = os.environ.get("CLUSTERCTL_TESTCLUSTER_NAME", "clusterctl-pytest") + "-elastic"
PACKAGES = ["numpy", "mpi4py", "mpich", "pyzmq", "torch==2.13.0"]  # the session cluster's: its image is cached
TORCH = ROOT / "examples" / "torch_gloo"
STEPS = 60
# The documented deadlines (docs/lifecycle.md): a lost host is noticed within peer_timeout (5 s; the
# coordinator's host: + reconnect_timeout, 3 s), the attempt's stop takes up to grace (3 s) + 5 s, the back-off
# 1 s; then torch starts on every host. A loaded 2-core machine may take minutes for the rest.
DEADLINE = 240


@pytest.fixture(scope="module")
def cluster5():
    info = tc.up(5, name=NAME, packages=PACKAGES, user="ubuntu")
    yield info
    if os.environ.get("CLUSTERCTL_KEEP_TESTCLUSTER", "") != "1":
        tc.down(NAME)


@pytest.fixture
def nodes(cluster5):
    """The five nodes, every one of them up (an earlier test killed one: `up` starts it again)."""
    return tc.up(5, name=NAME, packages=PACKAGES, user="ubuntu")


def reference_checksum(tmp_path, steps=STEPS) -> float:
    """The final weights' checksum of an undisturbed run of `steps` steps (one process on this machine)."""
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLUSTERCTL_", "TORCHELASTIC_"))}
    env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), STEPS=str(steps))
    out = subprocess.run([sys.executable, str(TORCH / "train.py")], env=env, capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    return float(re.search(r"checksum=([\d.]+) trainer=0 world=1", out.stdout).group(1))



def elastic_spec(info, tmp_path, name, *, members=4, spares=1, base=7700, steps=STEPS, step_s=0.5,
                 **job) -> tuple[Path, str]:
    """torch_gloo on the first `members` nodes and `spares` spares; (spec path, rank 0's checkpoint dir)."""
    ckpt = f"{info.home}/ckpt-{name}-{uuid.uuid4().hex[:6]}"
    spec_dict = yaml.safe_load(Path(info.spec_path).read_text())
    hosts = spec_dict["hosts"][: members + spares]
    for h in hosts[members:]:
        h["spare"] = True
    spec = {"name": name, "ssh": dict(spec_dict["ssh"], command_timeout=30), "hosts": hosts,
            "workspace": {"local": str(TORCH), "remote": f"clusterctl-it/{name}"},
            "job": {"mode": "collective", "entrypoint": ["/opt/venv/bin/python", "train.py"], "trainers": 1,
                    "restarts": 3, "restart_backoff": 1, "grace": 3,
                    "env": {"STEPS": str(steps), "STEP_S": str(step_s), "SAVE_EVERY": "10", "CHECKPOINT_DIR": ckpt},
                    "ports": {"control": base, "master": base + 1, "trainer": base + 10}, **job}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    clusterctl("stop", path)  # a kept cluster may hold a crashed earlier run
    return path, ckpt


def wait_log(spec, pattern, timeout=DEADLINE) -> str:
    """The first log line of the job matching `pattern` (regex), polling `clusterctl logs`."""
    deadline = time.monotonic() + timeout
    while True:
        for line in clusterctl("logs", spec, timeout=120).stdout.splitlines():
            if re.search(pattern, line):
                return line
        if time.monotonic() > deadline:
            raise AssertionError(f"no log line matching {pattern!r} within {timeout}s")
        time.sleep(1)


def logs_without(spec, lost_ip) -> str:
    """Every log line the job's hosts still have: the lost host's went with it (`logs` names it, exit 1)."""
    res = clusterctl("logs", spec, timeout=180)
    assert res.returncode == 1 and f"logs incomplete:\nclusterctl: error: {lost_ip}: " in res.stderr, res.stderr
    return res.stdout


def checksums(logs: str, world: int) -> set[float]:
    return {float(c) for c in re.findall(rf"checksum=([\d.]+) trainer=\d world={world}", logs)}


def no_orphans(info, job, alive):
    """GUIDE section 3 on the nodes still up: no process of the job."""
    deadline = time.monotonic() + 20
    while (left := {n.container: tagged_pids(n.container, job) for n in alive}) and any(left.values()):
        assert time.monotonic() < deadline, f"orphans of {job}: {left}"
        time.sleep(0.5)


@pytest.mark.timeout(600)
def test_a_host_stopped_hard_is_replaced_by_the_spare_and_the_job_ends_as_an_undisturbed_run(nodes, tmp_path):
    # the default tier's elastic test: 40 steps of a quarter second, the loss after the checkpoint of step 20
    ref = reference_checksum(tmp_path, 40)
    spec, ckpt = elastic_spec(nodes, tmp_path, "it-el-spare", steps=40, step_s=0.25)
    ips = [n.ip for n in nodes.nodes]
    clusterctl("dispatch", spec, check=True)
    res = clusterctl("start", spec, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    try:
        # rank 0 prints step=20 after it saved the checkpoint of step 20
        wait_log(spec, rf"\[{re.escape(ips[0])} trainer\.0\] step=20 ")
        docker("kill", nodes.nodes[2].container)  # stopped hard: no goodbye from its supervisor
        t_lost = time.monotonic()
        st = wait_state(spec, {"succeeded", "failed"}, timeout=DEADLINE)
        assert st["state"] == "succeeded", st
        took = time.monotonic() - t_lost
        assert st["attempt"] == 1 and st["attempts"][0]["reason"].startswith(f"lost host {ips[2]}: "), st
        assert st["elastic"]["members"] == [ips[0], ips[1], ips[4], ips[3]]
        assert st["elastic"]["lines"][-1] == (
            f"host {ips[2]} lost at attempt 0; {ips[4]} (spare) in its place at attempt 1")
        logs = logs_without(spec, ips[2])
        # attempt 1 resumed from the checkpoint at the same world size, rank 2 on the spare
        resumed = re.findall(r"\[(\S+) trainer\.(\d)#1\] resumed step=(\d+) attempt=1 trainer=\d world=4", logs)
        assert len(resumed) == 4 and {int(r): h for h, r, _ in resumed} == {0: ips[0], 1: ips[1], 2: ips[4],
                                                                         3: ips[3]}, logs
        assert len({int(s) for _, _, s in resumed}) == 1 and int(resumed[0][2]) >= 20
        got = checksums(logs, 4)
        assert len(got) == 1 and got.pop() == pytest.approx(ref, rel=1e-9)  # an undisturbed run's result
        # exit 1: the lost host does not answer, and is named; once attempt 1's hosts answered it is not waited for
        # (a connect to a stopped container's address may fail first: "No route to host")
        shown = clusterctl("status", spec)
        assert shown.returncode == 1 and re.search(
            rf"^{re.escape(ips[2])}: (cannot connect to {re.escape(ips[2])}|no answer in [\d.]+s, not waited for: "
            r"attempt 1 runs without it and its hosts all answered$)", shown.stdout, re.M), shown.stdout
        assert f"host {ips[2]} lost at attempt 0; {ips[4]} (spare) in its place at attempt 1" in shown.stdout
        print(f"the job ended {took:.1f}s after the loss")
        no_orphans(nodes, "it-el-spare", [n for i, n in enumerate(nodes.nodes) if i != 2])
    finally:
        tc.up(5, name=NAME, packages=PACKAGES, user="ubuntu")  # the killed node back, for `stop` and the next test
        clusterctl("stop", spec, timeout=120)
        node_exec(nodes.nodes[0].container, f"rm -rf {ckpt}", check=False)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_without_a_spare_the_job_goes_on_on_the_min_hosts(nodes, tmp_path):
    ref = reference_checksum(tmp_path)
    spec, ckpt = elastic_spec(nodes, tmp_path, "it-el-min", spares=0, min_hosts=3, base=7720)
    ips = [n.ip for n in nodes.nodes]
    clusterctl("dispatch", spec, check=True)
    clusterctl("start", spec, check=True, timeout=180)
    try:
        wait_log(spec, rf"\[{re.escape(ips[0])} trainer\.0\] step=20 ")
        docker("kill", nodes.nodes[3].container)
        st = wait_state(spec, {"succeeded", "failed"}, timeout=DEADLINE)
        assert st["state"] == "succeeded" and st["attempt"] == 1, st
        assert st["elastic"]["members"] == ips[:3]
        assert st["elastic"]["lines"][-1] == f"host {ips[3]} lost at attempt 0; left out from attempt 1"
        logs = logs_without(spec, ips[3])
        resumed = re.findall(r"trainer\.(\d)#1\] resumed step=(\d+) attempt=1 trainer=\d world=3", logs)
        assert sorted(int(r) for r, _ in resumed) == [0, 1, 2], logs
        got = checksums(logs, 3)
        assert len(got) == 1 and got.pop() == pytest.approx(ref, rel=1e-9)
        no_orphans(nodes, "it-el-min", nodes.nodes[:3])
    finally:
        tc.up(5, name=NAME, packages=PACKAGES, user="ubuntu")
        clusterctl("stop", spec, timeout=120)
        node_exec(nodes.nodes[0].container, f"rm -rf {ckpt}", check=False)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_coordinators_host_stopped_hard_the_next_host_takes_over_and_the_job_finishes(nodes, tmp_path):
    """Rank 0's checkpoint lived on the lost first host: the job starts again from step 0 (docs/lifecycle.md:
    what a lost host costs) and still ends where an undisturbed run ends."""
    ref = reference_checksum(tmp_path)
    spec, ckpt = elastic_spec(nodes, tmp_path, "it-el-coord", base=7740)
    ips = [n.ip for n in nodes.nodes]
    clusterctl("dispatch", spec, check=True)
    clusterctl("start", spec, check=True, timeout=180)
    try:
        wait_log(spec, rf"\[{re.escape(ips[0])} trainer\.0\] step=10 ")
        docker("kill", nodes.nodes[0].container)
        st = wait_state(spec, {"succeeded", "failed"}, timeout=DEADLINE)
        assert st["state"] == "succeeded" and st["attempt"] == 1, st
        assert st["elastic"]["members"] == [ips[4], ips[1], ips[2], ips[3]]
        assert st["elastic"]["lines"][0].endswith(f"; coordinator {ips[1]}")
        assert st["elastic"]["lines"][-1] == (f"host {ips[0]} lost at attempt 0 (the coordinator; {ips[1]} took over); "
                                              f"{ips[4]} (spare) in its place at attempt 1")
        logs = logs_without(spec, ips[0])
        assert f"[{ips[4]} trainer.0#1] done rank=0 world=4" in logs
        got = checksums(logs, 4)
        assert len(got) == 1 and got.pop() == pytest.approx(ref, rel=1e-9)
        no_orphans(nodes, "it-el-coord", nodes.nodes[1:])
    finally:
        tc.up(5, name=NAME, packages=PACKAGES, user="ubuntu")
        clusterctl("stop", spec, timeout=120)
        node_exec(nodes.nodes[0].container, f"rm -rf {ckpt}", check=False)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_host_that_comes_back_waits_as_a_spare_and_status_says_so(nodes, tmp_path):
    """A node frozen past peer_timeout (`docker pause`) is lost; the spare takes its place; once thawed, its
    supervisor rejoins and is never let into the running attempt: it waits, idle, and status says so."""
    spec, ckpt = elastic_spec(nodes, tmp_path, "it-el-back", base=7760, env={
        "STEPS": "200", "STEP_S": "0.5", "SAVE_EVERY": "10"})
    ips = [n.ip for n in nodes.nodes]
    clusterctl("dispatch", spec, check=True)
    clusterctl("start", spec, check=True, timeout=180)
    try:
        wait_log(spec, rf"\[{re.escape(ips[0])} trainer\.0\] step=10 ")
        docker("pause", nodes.nodes[2].container)
        try:
            st = wait_state(spec, {"running"}, timeout=DEADLINE)
            deadline = time.monotonic() + DEADLINE
            while not (st["attempt"] == 1 and st["state"] == "running"):
                assert time.monotonic() < deadline, st
                time.sleep(1)
                st = status_json(spec)
        finally:
            docker("unpause", nodes.nodes[2].container)
        want = f"{ips[2]}: came back after it was lost at attempt 0: a spare for the next attempt, not in this one"
        deadline = time.monotonic() + 60
        while not any(line.startswith(want) for line in (st.get("elastic") or {}).get("lines", [])):
            assert time.monotonic() < deadline, st
            time.sleep(1)
            st = status_json(spec)
        assert st["elastic"]["members"] == [ips[0], ips[1], ips[4], ips[3]] and st["attempt"] == 1
        assert [p for p in st["processes"] if p["host"] == ips[2] and p["state"] == "running"] == []
        assert want in clusterctl("status", spec, check=True).stdout
    finally:
        clusterctl("stop", spec, timeout=120)
        node_exec(nodes.nodes[0].container, f"rm -rf {ckpt}", check=False)
    no_orphans(nodes, "it-el-back", nodes.nodes)


# -- a parameter-server job (examples/fit_a_line, clusterctl.ps: the wheel on the nodes) ------------------------------


@pytest.fixture(scope="module")
def ps_nodes(cluster5, clusterctl_wheel):
    """The five nodes with this checkout of clusterctl in /opt/venv (the pservers' runtime)."""
    from clusterctl.ops import open_session

    info = tc.up(5, name=NAME, packages=PACKAGES, user="ubuntu")
    with open_session(str(info.spec_path)) as session:
        session.remote.run(
            f"cat > /tmp/{clusterctl_wheel.name} && sudo -n /opt/venv/bin/pip install -q --no-deps --no-index "
            f"--force-reinstall /tmp/{clusterctl_wheel.name}", stdin=clusterctl_wheel.read_bytes(),
            what="installing clusterctl on the nodes")
    return info


def ps_spec(info, tmp_path, name, base) -> tuple[Path, str]:
    """fit_a_line on 3 nodes and a spare, 2 pservers (on the first two nodes), checkpoints every 50 steps on each
    host's own disk."""
    ckpt = f"/tmp/ckpt-{name}-{uuid.uuid4().hex[:6]}"
    spec_dict = yaml.safe_load(Path(info.spec_path).read_text())
    hosts = spec_dict["hosts"][:4]
    hosts[3]["spare"] = True
    spec = {"name": name, "ssh": dict(spec_dict["ssh"], command_timeout=30), "hosts": hosts,
            "workspace": {"local": str(ROOT / "examples" / "fit_a_line"), "remote": f"clusterctl-it/{name}"},
            "job": {"mode": "pserver", "entrypoint": ["/opt/venv/bin/python", "train.py"],
                    "args": ["--step-delay", "0.05"], "pservers": 2, "trainers": 1, "grace": 3, "restarts": 2,
                    "restart_backoff": 1, "min_hosts": 2,
                    "env": {"CLUSTERCTL_PS_CHECKPOINT": ckpt, "CLUSTERCTL_PS_CHECKPOINT_EVERY": "50"},
                    "ports": {"control": base, "master": base + 1, "pserver": base + 2, "trainer": base + 10}}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    clusterctl("stop", path)
    return path, ckpt


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_pserver_whose_shard_was_only_on_the_lost_host_refuses_to_resume_in_one_line(ps_nodes, tmp_path):
    spec, ckpt = ps_spec(ps_nodes, tmp_path, "it-el-ps-gone", 7780)
    ips = [n.ip for n in ps_nodes.nodes]
    clusterctl("dispatch", spec, check=True)
    clusterctl("start", spec, check=True, timeout=180)
    try:
        wait_log(spec, rf"\[{re.escape(ips[0])} trainer\.0\] step=60 ")
        docker("kill", ps_nodes.nodes[1].container)  # pserver.1's host, with its shard on its own disk
        st = wait_state(spec, {"succeeded", "failed"}, timeout=DEADLINE)
        assert st["state"] == "failed", st
        line = (f"cannot resume the parameters: pserver.1's checkpoint shard (pserver-1 in {ckpt}) was on {ips[1]}, "
                f"which is gone, and {ips[3]} does not hold it; put CLUSTERCTL_PS_CHECKPOINT on storage every host "
                "shares (docs/lifecycle.md)")
        assert line in st["reason"], st
        assert st["attempt"] == 0 and st["attempts"][0]["reason"].startswith(f"lost host {ips[1]}: "), st
        # refused before attempt 1 started: nothing of it ran anywhere
        no_orphans(ps_nodes, "it-el-ps-gone", [n for i, n in enumerate(ps_nodes.nodes[:4]) if i != 1])
    finally:
        tc.up(5, name=NAME, packages=PACKAGES, user="ubuntu")
        clusterctl("stop", spec, timeout=120)
        for n in ps_nodes.nodes[:4]:
            node_exec(n.container, f"rm -rf {ckpt}", check=False)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_pserver_job_resumes_from_its_checkpoint_on_the_new_placement(ps_nodes, tmp_path):
    """The lost host's shard is also on the spare (as on storage every host shares: copied here before the loss):
    pserver.1 moves to the spare, every pserver loads the common step, the trainers go on from it."""
    spec, ckpt = ps_spec(ps_nodes, tmp_path, "it-el-ps-moved", 7800)
    ips = [n.ip for n in ps_nodes.nodes]
    lost, spare = ps_nodes.nodes[1], ps_nodes.nodes[3]
    clusterctl("dispatch", spec, check=True)
    clusterctl("start", spec, check=True, timeout=180)
    try:
        wait_log(spec, rf"\[{re.escape(ips[0])} trainer\.0\] step=60 ")  # the checkpoint of step 50 is saved
        shard = node_exec(lost.container, f"cd {ckpt} && tar cf - pserver-1 | base64 -w0", user="ubuntu")
        node_exec(spare.container, f"mkdir -p {ckpt} && cd {ckpt} && echo {shard} | base64 -d | tar xf -",
                  user="ubuntu")
        docker("kill", lost.container)
        st = wait_state(spec, {"succeeded", "failed"}, timeout=DEADLINE)
        assert st["state"] == "succeeded" and st["attempt"] == 1, st
        assert st["elastic"]["members"] == [ips[0], ips[3], ips[2]]
        logs = logs_without(spec, ips[1])
        assert re.search(rf"\[{re.escape(ips[3])} pserver\.1#1\] .*loaded 1 block\(s\) at step 50", logs), logs[-3000:]
        again = [int(m.group(1)) for m in re.finditer(rf"\[{re.escape(ips[0])} trainer\.0#1\] step=(\d+) ", logs)]
        assert again and again[0] == 50, again  # from the checkpoint, not from scratch
        no_orphans(ps_nodes, "it-el-ps-moved", [n for i, n in enumerate(ps_nodes.nodes[:4]) if i != 1])
    finally:
        tc.up(5, name=NAME, packages=PACKAGES, user="ubuntu")
        clusterctl("stop", spec, timeout=120)
        for n in ps_nodes.nodes[:4]:
            node_exec(n.container, f"rm -rf {ckpt}", check=False)
