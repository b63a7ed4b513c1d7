"""The examples as real local processes with the plan's environment: 2 pservers + 3 trainers."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from helpers import free_ports
from ps_jobs import REPO, LocalJob, job_env

FIT = "examples/fit_a_line/train.py"
STEP = re.compile(r"^step=(\d+) loss=([0-9.]+) trainer=(\d+) pass=(\d+) mode=(\w+)$")
DONE = re.compile(r"^done steps=(\d+) loss=([0-9.]+) steps_per_s=([0-9.]+) wall_s=([0-9.]+) trainer=(\d+) mode=(\w+)$")


def _lines(text: str, pattern: re.Pattern) -> list[re.Match]:
    return [m for m in map(pattern.match, text.splitlines()) if m]


@pytest.mark.timeout(40)
@pytest.mark.parametrize("mode", ["sync", "async", "geo"])
def test_fit_a_line_converges(mode):
    job = LocalJob([FIT], extra_env={"CLUSTERCTL_PS_MODE": mode, "CLUSTERCTL_PS_K_STEPS": "4"}).start()
    res = job.wait(35)
    for name, (rc, out) in res.items():
        assert rc == 0, f"{name} exited {rc}:\n{out[-3000:]}"
    first_losses = []
    for tid in range(3):
        out = res[f"trainer{tid}"][1]
        steps = _lines(out, STEP)
        first_losses.append(float(steps[0][2]))
        done = _lines(out, DONE)
        assert len(steps) == 180 and [int(m[1]) for m in steps] == list(range(180))
        assert {(m[3], m[5]) for m in steps} == {(str(tid), mode)}
        assert len(done) == 1 and done[0][1] == "180" and done[0][6] == mode
        assert float(done[0][2]) < 10.0, out[-500:]  # the seed's bar
    # it did start far away (in async/geo a late trainer may begin from already-trained parameters,
    # but whoever pulled first saw the initial ones)
    assert max(first_losses) > 100.0, first_losses
    for p in range(2):
        assert "all 3 trainer(s) completed" in res[f"pserver{p}"][1]


@pytest.mark.timeout(40)
def test_fit_a_line_restart_from_checkpoint(tmp_path):
    env = {"CLUSTERCTL_PS_MODE": "sync", "CLUSTERCTL_PS_CHECKPOINT": str(tmp_path / "ckpt")}
    first = LocalJob([FIT], extra_env=env, trainer_argv=["--save-every", "9", "--stop-after", "18"]).start()
    trainers = {k: p for k, p in first.procs.items() if k.startswith("trainer")}
    outs = {k: p.communicate(timeout=30)[0] for k, p in trainers.items()}
    assert {k: p.returncode for k, p in trainers.items()} == {"trainer0": 3, "trainer1": 3, "trainer2": 3}
    assert "checkpoint step=18" in outs["trainer0"]
    first.kill()  # the job is stopped: the pservers never saw the trainers complete

    second = LocalJob([FIT], extra_env=env).start()
    res = second.wait(30)
    for name, (rc, out) in res.items():
        assert rc == 0, f"{name} exited {rc}:\n{out[-3000:]}"
    for tid in range(3):
        steps = _lines(res[f"trainer{tid}"][1], STEP)
        assert int(steps[0][1]) == 18 and int(steps[-1][1]) == 179
        assert float(steps[0][2]) < 50  # continued from trained parameters, not from scratch
        assert _lines(res[f"trainer{tid}"][1], DONE)[0][1] == "162"
    assert "loaded 2 block(s)" not in res["pserver0"][1]  # one block per pserver for fit-a-line
    assert "loaded 1 block(s) at step 18" in res["pserver0"][1]


@pytest.mark.timeout(30)
def test_fit_a_line_reads_only_clusterctl_data_files():
    files = f"{REPO}/examples/fit_a_line/data/housing-1.csv"
    job = LocalJob([FIT], pservers=1, trainers=1, extra_env={"CLUSTERCTL_DATA_FILES": files}).start()
    res = job.wait(25)
    assert res["trainer0"][0] == 0, res["trainer0"][1][-2000:]
    # 128 rows / batch 20 = 7 batches per pass, 20 passes
    assert _lines(res["trainer0"][1], DONE)[0][1] == "140"


@pytest.mark.timeout(30)
def test_seed_positional_script():
    ports = free_ports(4)
    eps = ",".join(f"127.0.0.1:{p}" for p in ports[:2])
    script = f"{REPO}/examples/seed_positional/train.py"
    env = job_env("trainer", 0, eps.split(","), ["127.0.0.1:1"])  # only for PYTHONPATH & a clean env
    procs = []
    for i, ep in enumerate(eps.split(",")):
        procs.append(subprocess.Popen([sys.executable, script, "pserver", eps, ep, str(i), "2"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for tid in range(2):
        procs.append(subprocess.Popen([sys.executable, script, "trainer", eps, f"127.0.0.1:{ports[2 + tid]}",
                                       str(tid), "2"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=25)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0, 0, 0], outs
    assert re.search(r"^done steps=130 loss=0\.\d+ wall_s=[0-9.]+ trainer=1$", outs[3], re.MULTILINE)


def test_seed_positional_usage():
    out = subprocess.run([sys.executable, f"{REPO}/examples/seed_positional/train.py", "pserver"],
                         check=False, capture_output=True, text=True, timeout=20,
                         env=job_env("trainer", 0, ["127.0.0.1:1"], ["127.0.0.1:2"]))
    assert out.returncode == 2
    assert out.stderr.strip() == "usage: train.py pserver|trainer ENDPOINTS CURRENT_ENDPOINT TRAINER_ID TRAINERS"


@pytest.mark.timeout(40)
def test_killed_trainer_fails_the_sync_job_loudly_instead_of_hanging():
    env = {"CLUSTERCTL_PS_MODE": "sync", "CLUSTERCTL_PS_BARRIER_TIMEOUT": "2"}
    job = LocalJob([FIT], extra_env=env, trainer_argv=["--step-delay", "0.03"]).start()
    time.sleep(1.5)  # well inside the ~5.4 s the trainers need
    victim = job.procs["trainer1"]
    assert victim.poll() is None
    os.killpg(victim.pid, signal.SIGKILL)
    t0 = time.monotonic()
    res = job.wait(25)
    assert time.monotonic() - t0 < 15
    assert res["trainer1"][0] == -signal.SIGKILL
    why = r"sync barrier for step \d+ timed out after 2s; missing trainer id\(s\): 1$"
    for p in ("pserver0", "pserver1"):
        rc, out = res[p]
        assert rc == 1, out[-2000:]
        assert re.search(why, out, re.MULTILINE), out
    for t in ("trainer0", "trainer2"):
        rc, out = res[t]
        assert rc == 1
        assert re.search(rf"^failed trainer={t[-1]} error={why}", out, re.MULTILINE), out
