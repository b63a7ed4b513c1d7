"""Checkpoints: save/load of every shard, consistency checks, and a restarted job that continues."""

from __future__ import annotations

import json

import numpy as np
import pytest
from ps_jobs import CKPT_TRAINERS as T
from ps_jobs import TOKEN, ckpt_init, ckpt_job

from clusterctl.ps import Adam, CheckpointError, PSClient, RemoteOpError
from clusterctl.ps import checkpoint as ckpt

pytestmark = pytest.mark.timeout(30)

def test_restart_from_checkpoint_continues_exactly(servers, tmp_path):
    root = tmp_path / "ckpt"
    g = servers(2, num_trainers=T, mode="sync", barrier_timeout=20, checkpoint_root=str(tmp_path))
    straight = ckpt_job(g.endpoints, 8, save_at=4, root=str(root))
    assert g.join(5) and not g.errors
    commit = ckpt.read_commit(root)
    assert (commit["step"], commit["num_servers"]) == (4, 2)
    manifests = [json.loads((root / f"pserver-{i}" / "manifest.json").read_text()) for i in (0, 1)]
    assert [m["step"] for m in manifests] == [4, 4]
    assert [[b["key"] for b in m["blocks"]] for m in manifests] == [["W.block0", "b.block0"], ["W.block1"]]
    assert manifests[0]["optimizer"]["kind"] == "adam" and manifests[0]["blocks"][0]["state"] == ["m", "t", "v"]

    # a new job whose pservers start from the checkpoint: trainers resume at step 4
    g2 = servers(2, num_trainers=T, mode="sync", barrier_timeout=20, checkpoint_dir=str(root))
    assert [s.loaded_step for s in g2.servers] == [4, 4]
    resumed = ckpt_job(g2.endpoints, 8)
    for tid in range(T):
        assert resumed[tid][0] == 4
        for k in ("W", "b"):
            np.testing.assert_array_equal(resumed[tid][1][k], straight[tid][1][k])


def test_load_on_request_from_a_trainer(servers, tmp_path):
    root = tmp_path / "ckpt"
    g = servers(1, num_trainers=T, mode="sync", barrier_timeout=20, checkpoint_root=str(tmp_path))
    straight = ckpt_job(g.endpoints, 5, save_at=2, root=str(root))
    # fresh (nothing to resume from), but save/load allowed under tmp_path
    g2 = servers(1, num_trainers=T, mode="sync", barrier_timeout=20, checkpoint_root=str(tmp_path))
    # trainer 0 asks the running pservers to load; trainers that init afterwards resume at its step
    with PSClient(g2.endpoints, trainer_id=0, num_trainers=T, mode="sync", optimizer=Adam(0.01), timeout=5) as c:
        c.init(ckpt_init())
        assert c.load(str(root)) == 2
    resumed = ckpt_job(g2.endpoints, 5)
    assert all(resumed[t][0] == 2 for t in range(T))
    np.testing.assert_array_equal(resumed[0][1]["W"], straight[0][1]["W"])


def test_a_relative_save_path_puts_the_commit_record_beside_the_shards(servers, tmp_path, monkeypatch):
    """The record went to the trainer's working directory, the shards under the pservers' checkpoint root."""
    root, cwd = tmp_path / "root", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    g = servers(2, num_trainers=1, mode="sync", checkpoint_root=str(root))
    with PSClient(g.endpoints, trainer_id=0, num_trainers=1, mode="sync", timeout=5, min_block_size=4) as c:
        c.init({"w": np.arange(8, dtype=np.float32)})
        assert c.save("run", 1) == 1
        assert c.load("run") == 1  # the pservers check their shards against the record beside them
        c.complete()
    assert sorted(p.name for p in (root / "run").iterdir()) == ["checkpoint.json", "pserver-0", "pserver-1"]
    assert ckpt.read_commit(root / "run")["step"] == 1
    assert list(cwd.iterdir()) == []  # nothing in the trainer's working directory


def test_a_relative_save_path_resolved_apart_writes_no_commit_record(servers, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    g = servers(2, num_trainers=1, mode="sync", checkpoint_root=str(tmp_path / "a"))
    g.servers[1].checkpoint_root = str((tmp_path / "b").resolve())  # pservers whose roots differ
    with PSClient(g.endpoints, trainer_id=0, num_trainers=1, mode="sync", timeout=5, min_block_size=4) as c:
        c.init({"w": np.arange(8, dtype=np.float32)})
        with pytest.raises(CheckpointError, match=r"^pservers saved 'run' in different directories .*; no commit "
                                                  r"record written \(give save an absolute path\)$"):
            c.save("run", 1)
        c.complete()
    assert not list(tmp_path.glob("**/checkpoint.json"))


def _save_two(tmp_path, steps=(7, 7), commit=7):
    root = tmp_path / "c"
    for i, s in enumerate(steps):
        ckpt.save_server(root, ckpt.ServerCheckpoint(i, 2, s, "sync", {"kind": "sgd", "lr": 0.1, "momentum": 0.9,
                         "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8}, {f"k{i}": np.arange(3, dtype=np.float32)},
                         {f"k{i}": {}}))
    if commit is not None:
        ckpt.write_commit(root, commit, ["a:1", "b:2"])
    return root


def test_load_round_trip(tmp_path):
    root = _save_two(tmp_path)
    got = ckpt.load_server(root, 1, 2)
    assert got.step == 7 and list(got.blocks) == ["k1"]
    np.testing.assert_array_equal(got.blocks["k1"], np.arange(3, dtype=np.float32))


def test_inconsistent_steps_across_pservers_are_refused(tmp_path):
    root = _save_two(tmp_path, steps=(7, 9), commit=None)
    with pytest.raises(CheckpointError, match="inconsistent checkpoint: pserver-1 is at step 9, expected 7"):
        ckpt.load_server(root, 0, 2)


def test_shard_newer_than_commit_record_is_refused(tmp_path):
    root = _save_two(tmp_path, steps=(9, 9), commit=7)
    with pytest.raises(CheckpointError) as err:
        ckpt.load_server(root, 0, 2)
    assert str(err.value) == f"{root}: the commit record says step 7, but pserver 0 holds step 9 (pserver-0)"


def test_wrong_server_count_is_refused(tmp_path):
    root = _save_two(tmp_path)
    with pytest.raises(CheckpointError, match="saved by pserver 0 of 2, cannot load into pserver 0 of 3"):
        ckpt.load_server(root, 0, 3)


def test_missing_shard_reported_through_the_client(servers, tmp_path):
    g = servers(1, num_trainers=1, mode="sync", checkpoint_root=str(tmp_path))
    with PSClient(g.endpoints, trainer_id=0, num_trainers=1, mode="sync", timeout=5) as c:
        c.init({"w": np.zeros(3, np.float32)})
        with pytest.raises(RemoteOpError) as err:
            c.load(str(tmp_path / "nowhere"))
        c.complete()
    assert err.value.code == "CheckpointError"
    assert "pserver-0/manifest.json: missing" in str(err.value)


def test_a_pserver_that_cannot_load_its_checkpoint_says_why_in_one_line(tmp_path):
    """A damaged checkpoint to start from: exit 1 and one error line naming the file, not a traceback."""
    import subprocess
    import sys

    (tmp_path / "pserver-0").mkdir()
    (tmp_path / "pserver-0" / "manifest.json").write_text("{not json")
    env = {"PATH": "/usr/bin:/bin", "TRAINING_ROLE": "PSERVER", "PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:1",
           "PADDLE_CURRENT_ENDPOINT": "127.0.0.1:1", "PADDLE_TRAINERS_NUM": "1",
           "CLUSTERCTL_PS_CHECKPOINT": str(tmp_path), "CLUSTERCTL_JOB_TOKEN": TOKEN}
    proc = subprocess.run([sys.executable, "-m", "clusterctl.ps", "server"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pserver could not start" in lines[0] and "manifest.json" in lines[0], lines
