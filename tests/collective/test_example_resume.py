"""The collective examples resume from their own checkpoint on a restart (the attempt number in the environment)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
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


@pytest.mark.timeout(90)
def test_mlp_collective_resumes_where_it_was_saved_and_ends_like_an_uninterrupted_run(tmp_path):
    if MPIEXEC is None:
        pytest.skip("no mpiexec found")

    def run(steps, attempt, ckpt=None):
        args = [MPIEXEC, "-n", "2", sys.executable, str(MLP), "--steps", str(steps)]
        if ckpt:
            args += ["--checkpoint-dir", str(ckpt)]
        res = subprocess.run(args, env=_env(CLUSTERCTL_RESTART_COUNT=attempt), capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr
        return res.stdout

    straight = run(100, 0)
    ckpt = tmp_path / "ckpt"
    assert "resumed" not in run(60, 0, ckpt)  # the first attempt saves at 20, 40, 60 and never loads
    resumed = run(100, 1, ckpt)
    assert sorted(re.findall(r"resumed step=(\d+) attempt=1 trainer=(\d)", resumed)) == [("60", "0"), ("60", "1")]
    assert not re.search(r"^step=(0|20|40) ", resumed, re.MULTILINE)  # those steps are not trained again
    checksums = set(re.findall(r"checksum=([\d.]+)", straight)) | set(re.findall(r"checksum=([\d.]+)", resumed))
    assert len(checksums) == 1, (straight, resumed)
    assert "resumed" not in run(100, 0, ckpt)  # a new job (attempt 0) ignores an old checkpoint


@pytest.mark.slow  # six torch imports: ~40 s on a small machine
@pytest.mark.timeout(120)
def test_torch_gloo_resumes_from_its_checkpoint_on_a_restart(tmp_path):
    pytest.importorskip("torch")

    def run(steps, attempt, ckpt):
        port = free_port()
        procs = [subprocess.Popen([sys.executable, str(TORCH)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=_env(RANK=r, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                           STEPS=steps, CHECKPOINT_DIR=ckpt, SAVE_EVERY=10,
                                           TORCHELASTIC_RESTART_COUNT=attempt))
                 for r in range(2)]
        outs = [p.communicate(timeout=90)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        return "".join(outs)

    straight = run(40, 0, tmp_path / "other")
    run(25, 0, tmp_path / "ckpt")  # saves at steps 10 and 20
    resumed = run(40, 1, tmp_path / "ckpt")
    assert sorted(re.findall(r"resumed step=(\d+) attempt=1 trainer=(\d)", resumed)) == [("20", "0"), ("20", "1")]
    assert "step=0 " not in resumed and "step=10 " not in resumed
    final = sorted(re.findall(r"done rank=(\d) world=2 allreduce=3 loss=([\d.]+)", straight))
    assert final and sorted(re.findall(r"done rank=(\d) world=2 allreduce=3 loss=([\d.]+)", resumed)) == final
