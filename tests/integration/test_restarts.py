"""Jobs that survive failures, over real SSH on the docker test cluster: restarts, a disposable controller."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from clusterlib import assert_no_orphans, clusterctl, job_ports, job_spec, node_exec, status_json, wait_state

pytestmark = pytest.mark.integration


def pid_of(spec, role, id_):
    st = status_json(spec)
    return next(p for p in st["processes"] if p["role"] == role and p["id"] == id_)


def wait_for_line(spec, needle, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(needle in line for line in clusterctl("logs", spec).stdout.splitlines()):
            return
        time.sleep(0.5)
    raise AssertionError(f"no log line with {needle!r}")


@pytest.mark.timeout(180)
def test_a_trainer_killed_with_sigkill_restarts_the_whole_job_which_then_succeeds(testcluster, tmp_path):
    env = {"STEPS": "50", "STEP_S": "0.2"}
    spec = job_spec(testcluster, tmp_path, "it-restart", hosts=3, env=env, restarts=2, restart_backoff=1)  # the least there is
    ips = [n.ip for n in testcluster.nodes[:3]]
    clusterctl("dispatch", spec, check=True)
    clusterctl("start", spec, check=True)
    wait_for_line(spec, "step=2 trainer=2")
    victim = pid_of(spec, "trainer", 2)
    node_exec(testcluster.nodes[2].container, f"kill -9 {victim['pid']}")
    t0 = time.monotonic()
    st = wait_state(spec, {"restarting", "running"}, timeout=20)
    st = wait_state(spec, {"succeeded", "failed"}, timeout=60)
    assert st["state"] == "succeeded", st
    assert (st["attempt"], st["restarts"]) == (1, 2)
    first, second = st["attempts"]
    assert first["outcome"] == "failed" and first["reason"] == f"trainer.2 on {ips[2]} exited with code -9", first
    assert second["outcome"] == "succeeded"
    assert second["started_at"] - first["ended_at"] >= 1 - 0.05  # the back-off
    assert time.monotonic() - t0 < 60
    logs = clusterctl("logs", spec, check=True).stdout.splitlines()
    for i, ip in enumerate(ips):  # every attempt's log is kept, each line says which attempt
        assert f"[{ip} trainer.{i}] step=0 trainer={i}" in logs
        assert f"[{ip} trainer.{i}#1] attempt=1 torchelastic=1" in logs
        assert f"[{ip} trainer.{i}#1] step=49 trainer={i}" in logs
    assert f"[{ips[0]} pserver.0#1] pserver listening" in logs
    assert not any(line.startswith(f"[{ips[2]} trainer.2] step=49") for line in logs)  # it was killed
    status = clusterctl("status", spec, check=True).stdout
    assert "attempt 1 (restarts allowed: 2)" in status
    assert f"attempt 0: failed: trainer.2 on {ips[2]} exited with code -9" in status
    assert_no_orphans(testcluster, "it-restart", job_ports(spec))


@pytest.mark.timeout(180)
def test_the_controller_is_disposable(testcluster, tmp_path):
    """`start --follow` killed with SIGKILL leaves the job running; a new `logs -f`, `status` and `stop` attach."""
    spec = job_spec(testcluster, tmp_path, "it-detach", hosts=2, env={"STEPS": "30", "STEP_S": "0.2"})
    ips = [n.ip for n in testcluster.nodes[:2]]
    clusterctl("dispatch", spec, check=True)

    def start_follow_then_kill():
        proc = subprocess.Popen([sys.executable, "-m", "clusterctl.cli", "start", str(spec), "--follow"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        for line in proc.stdout:
            if "step=" in line or time.monotonic() > deadline:
                break
        proc.kill()
        proc.wait(timeout=10)
        assert proc.returncode == -9

    start_follow_then_kill()
    assert status_json(spec)["state"] == "running"
    res = clusterctl("logs", spec, "--follow", timeout=90)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert f"[{ips[0]} trainer.0] step=29 trainer=0" in lines and f"[{ips[1]} trainer.1] step=29 trainer=1" in lines
    assert status_json(spec)["state"] == "succeeded"

    start_follow_then_kill()
    assert status_json(spec)["state"] == "running"
    res = clusterctl("stop", spec, check=True)
    assert "job it-detach stopped on 2 host(s)" in res.stdout
    assert_no_orphans(testcluster, "it-detach", job_ports(spec))
    assert status_json(spec)["state"] == "stopped"


@pytest.mark.slow  # the default tier restarts fit_a_line under the local backend (tests/unit/test_backend_local.py)
@pytest.mark.timeout(240)
def test_fit_a_line_resumes_from_the_pservers_checkpoint_after_a_trainer_is_killed(clusterctl_on_nodes, tmp_path):
    """Restarts on, pservers checkpointing every 20 steps: kill -9 a trainer mid-run; the job succeeds and the
    steps before the checkpoint are not trained again."""
    import re
    import uuid

    from clusterlib import ROOT, write_spec

    info = clusterctl_on_nodes
    ckpt = f"/tmp/ckpt-{uuid.uuid4().hex[:8]}"
    spec = write_spec(
        info, tmp_path / "fal.yaml", name="it-fal-resume", hosts=2,
        workspace={"local": str(ROOT / "examples" / "fit_a_line"), "remote": "clusterctl-it/fal-resume"},
        job={"mode": "pserver", "entrypoint": ["/opt/venv/bin/python", "train.py"], "args": ["--step-delay", "0.03"],
             "pservers": 2, "trainers": 1, "grace": 3, "restarts": 1, "restart_backoff": 1,
             "env": {"CLUSTERCTL_PS_CHECKPOINT": ckpt, "CLUSTERCTL_PS_CHECKPOINT_EVERY": "20"},
             "ports": {"control": 7480, "master": 7481, "pserver": 7482, "trainer": 7490}},
    )
    clusterctl("stop", spec)
    ips = [n.ip for n in info.nodes[:2]]
    clusterctl("dispatch", spec, check=True)
    clusterctl("start", spec, check=True)
    wait_for_line(spec, "step=70 ", timeout=60)
    victim = pid_of(spec, "trainer", 1)
    node_exec(info.nodes[1].container, f"kill -9 {victim['pid']}")
    st = wait_state(spec, {"succeeded", "failed"}, timeout=120)
    assert st["state"] == "succeeded" and st["attempt"] == 1, st
    assert st["attempts"][0]["reason"] == f"trainer.1 on {ips[1]} exited with code -9"
    logs = clusterctl("logs", spec, check=True).stdout.splitlines()
    killed_at = max(int(m.group(1)) for line in logs
                    if (m := re.match(rf"\[{re.escape(ips[1])} trainer\.1\] step=(\d+) ", line)))
    for i, ip in enumerate(ips):
        again = [int(m.group(1)) for line in logs if (m := re.match(rf"\[{re.escape(ip)} trainer\.{i}#1\] step=(\d+) ", line))]
        resumed = again[0]
        # resumed at a checkpoint (a multiple of 20 saved before the kill), never from scratch
        assert resumed >= 60 and resumed % 20 == 0 and resumed <= killed_at + 1, (resumed, killed_at)
        assert again == list(range(resumed, again[-1] + 1)) and again[-1] == 259
        done = [line for line in logs if line.startswith(f"[{ip} trainer.{i}#1] done steps=")]
        assert done and f"done steps={260 - resumed} " in done[0], done
    assert any(line.startswith(f"[{ips[0]} pserver.0#1] ") and "loaded 1 block(s) at step" in line for line in logs)
    assert_no_orphans(info, "it-fal-resume", [7480, 7482, 7483], hosts=info.nodes[:2])
    for n in info.nodes[:2]:
        node_exec(n.container, f"rm -rf {ckpt}")
