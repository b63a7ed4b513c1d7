"""Pservers that checkpoint on their own (checkpoint_every) and resume from the latest step they all hold."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from ps_jobs import CKPT_TRAINERS as T
from ps_jobs import ckpt_job

from clusterctl.ps import checkpoint as ckpt

pytestmark = pytest.mark.timeout(30)


def test_pservers_save_every_n_steps_and_a_restart_resumes_from_the_latest(servers, tmp_path):
    root = tmp_path / "ckpt"
    g = servers(2, num_trainers=T, mode="sync", barrier_timeout=20, checkpoint_dir=str(root), checkpoint_every=3)
    straight = ckpt_job(g.endpoints, 8)
    assert g.join(5) and not g.errors
    assert [ckpt.saved_steps(root, i) for i in (0, 1)] == [[6, 3], [6, 3]]  # the latest and the one before
    assert not (root / "checkpoint.json").exists()  # no trainer asked: nothing to commit

    g2 = servers(2, num_trainers=T, mode="sync", barrier_timeout=20, checkpoint_dir=str(root), checkpoint_every=3)
    assert [s.loaded_step for s in g2.servers] == [6, 6]
    resumed = ckpt_job(g2.endpoints, 8)
    for tid in range(T):  # steps 0..5 are not done again, and the result is the same as without the restart
        assert resumed[tid][0] == 6
        for k in ("W", "b"):
            np.testing.assert_array_equal(resumed[tid][1][k], straight[tid][1][k])


def test_pservers_stopped_between_two_saves_settle_on_a_step_they_all_hold(servers, tmp_path):
    root = tmp_path / "ckpt"
    g = servers(2, num_trainers=T, mode="sync", barrier_timeout=20, checkpoint_dir=str(root), checkpoint_every=3)
    straight = ckpt_job(g.endpoints, 8)
    assert g.join(5) and not g.errors
    # pserver 1 was killed after pserver 0 saved step 6 but before it did
    shutil.rmtree(root / "pserver-1")
    (root / "pserver-1.prev").rename(root / "pserver-1")
    assert [ckpt.saved_steps(root, i) for i in (0, 1)] == [[6, 3], [3]]
    g2 = servers(2, num_trainers=T, mode="sync", barrier_timeout=20, checkpoint_dir=str(root), checkpoint_every=3)
    assert [s.loaded_step for s in g2.servers] == [6, 3]
    resumed = ckpt_job(g2.endpoints, 8)
    for tid in range(T):
        assert resumed[tid][0] == 3
        for k in ("W", "b"):
            np.testing.assert_array_equal(resumed[tid][1][k], straight[tid][1][k])
    assert json.loads((root / "pserver-0" / "manifest.json").read_text())["step"] == 6  # saved again on the way


def test_checkpoint_every_needs_a_directory():
    from clusterctl.ps import PsConfigError
    from clusterctl.ps.server import ParameterServer

    with pytest.raises(PsConfigError, match="checkpoint_every needs a checkpoint directory"):
        ParameterServer("127.0.0.1:0", checkpoint_every=5)
