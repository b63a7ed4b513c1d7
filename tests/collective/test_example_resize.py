"""The collective examples resume from their checkpoint at another world size (an elastic job that lost a host):
4 ranks killed mid-run (SIGKILL, after a checkpoint), then attempt 1 at 3 ranks ends where an undisturbed
4-rank run ends."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import MPIEXEC, free_port

ROOT = Path(__file__).resolve().parents[2]
MLP = ROOT / "examples" / "mlp_collective" / "train.py"
TORCH = ROOT / "examples" / "torch_gloo" / "train.py"


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLUSTERCTL_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["UCX_LOG_LEVEL"] = "error"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _wait_for(path: Path, pattern: str, procs: list[subprocess.Popen], timeout: float) -> None:
    """Wait until `path` (a run's output) matches `pattern`; fail if the run ended first or at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.search(pattern, path.read_text(errors="replace")):
            return
        if all(p.poll() is not None for p in procs):
            pytest.fail(f"the run ended before {pattern!r}:\n{path.read_text(errors='replace')[-3000:]}")
        time.sleep(0.05)
    pytest.fail(f"no {pattern!r} within {timeout}s:\n{path.read_text(errors='replace')[-3000:]}")


def _kill(procs: list[subprocess.Popen]) -> None:
    """SIGKILL each run's process group (started with start_new_session) and reap it."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        assert p.wait(timeout=30) == -signal.SIGKILL


def _resumed_step(out: str, ranks: int, world_key: str) -> int:
    found = sorted(re.findall(rf"resumed step=(\d+) attempt=1 trainer=(\d+) {world_key}=(\d+)", out))
    assert [(int(t), int(w)) for _, t, w in found] == [(r, ranks) for r in range(ranks)], out
    steps = {int(s) for s, _, _ in found}
    assert len(steps) == 1, found
    return steps.pop()


@pytest.mark.timeout(180)
def test_mlp_collective_killed_at_4_ranks_resumes_at_3_and_ends_like_an_undisturbed_run(tmp_path):
    if MPIEXEC is None:
        pytest.skip("no mpiexec found")
    steps, ckpt = 100, tmp_path / "ckpt"

    def mpi(n, attempt, *extra):
        return [MPIEXEC, "-n", str(n), sys.executable, str(MLP), "--steps", str(steps), *extra], \
            _env(CLUSTERCTL_RESTART_COUNT=attempt)

    argv, env = mpi(4, 0)
    straight = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=90)
    assert straight.returncode == 0, straight.stdout + straight.stderr

    argv, env = mpi(4, 0, "--checkpoint-dir", str(ckpt), "--save-every", "20", "--step-delay", "0.05")
    out = tmp_path / "killed.out"
    with open(out, "wb") as fh:
        killed = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # rank 0 prints step=40 after it saved the checkpoint of step 40 (at the end of step 39)
        _wait_for(out, r"step=40 loss=\S+ trainer=0", [killed], timeout=90)
    finally:
        _kill([killed])
    assert "done steps=" not in out.read_text()  # killed mid-run, not at its end

    argv, env = mpi(3, 1, "--checkpoint-dir", str(ckpt))
    resumed = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=90)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    first = _resumed_step(resumed.stdout, 3, "ranks")
    assert first in (40, 60, 80), resumed.stdout
    trained = {int(s) for s in re.findall(r"^step=(\d+) ", resumed.stdout, re.MULTILINE)}
    assert trained and min(trained) >= first, resumed.stdout  # the steps before the checkpoint are not trained again
    ref = {float(c) for c in re.findall(r"trainer=\d checksum=([\d.]+)", straight.stdout)}
    got = {float(c) for c in re.findall(r"trainer=\d checksum=([\d.]+)", resumed.stdout)}
    assert len(ref) == 1 and len(got) == 1, (straight.stdout, resumed.stdout)
    assert got.pop() == pytest.approx(ref.pop(), rel=1e-9)  # only the order of the additions differs


@pytest.mark.slow  # eleven torch imports: a minute or more on a small machine
@pytest.mark.timeout(300)
def test_torch_gloo_killed_at_world_4_resumes_at_world_3_and_ends_like_an_undisturbed_run(tmp_path):
    pytest.importorskip("torch")

    def start(world, attempt, ckpt, out_dir, step_s=""):
        port = free_port()
        out_dir.mkdir()
        procs = []
        for r in range(world):
            with open(out_dir / f"rank{r}.out", "wb") as fh:
                procs.append(subprocess.Popen(
                    [sys.executable, str(TORCH)], stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                    env=_env(RANK=r, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, STEPS=40,
                             CHECKPOINT_DIR=ckpt, SAVE_EVERY=10, TORCHELASTIC_RESTART_COUNT=attempt, STEP_S=step_s)))
        return procs

    def finish(procs, out_dir):
        codes = [p.wait(timeout=150) for p in procs]
        outs = "".join((out_dir / f"rank{r}.out").read_text() for r in range(len(procs)))
        assert codes == [0] * len(procs), outs
        return outs

    straight = finish(start(4, 0, tmp_path / "other", tmp_path / "straight"), tmp_path / "straight")
    killed = start(4, 0, tmp_path / "ckpt", tmp_path / "killed", step_s="0.1")
    try:
        # rank 0 prints step=20 after it saved the checkpoint of step 20 (at the end of step 19)
        _wait_for(tmp_path / "killed" / "rank0.out", r"step=20 loss=", killed, timeout=150)
    finally:
        _kill(killed)
    resumed = finish(start(3, 1, tmp_path / "ckpt", tmp_path / "resumed"), tmp_path / "resumed")
    first = _resumed_step(resumed, 3, "world")
    assert first in (20, 30), resumed
    assert not re.search(r"^step=(0|10) ", resumed, re.MULTILINE)  # not trained again
    assert sorted(re.findall(r"done rank=(\d) world=3 allreduce=6", resumed)) == ["0", "1", "2"], resumed
    ref = {float(c) for c in re.findall(r"checksum=([\d.]+) trainer=\d world=4", straight)}
    got = {float(c) for c in re.findall(r"checksum=([\d.]+) trainer=\d world=3", resumed)}
    assert len(ref) == 1 and len(got) == 1, (straight, resumed)
    assert got.pop() == pytest.approx(ref.pop(), rel=1e-12)  # float64; only the order of the additions differs
