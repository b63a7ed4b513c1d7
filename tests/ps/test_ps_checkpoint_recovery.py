"""Checkpoints after a crash: a save killed between its renames, and a save that failed on one pserver."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

from clusterctl.ps import SGD, CheckpointError, ParameterServer, PSClient, RemoteOpError
from clusterctl.ps import checkpoint as ckpt

pytestmark = pytest.mark.timeout(30)

OPT = SGD(0.1).to_dict()


def _shard(step: int, server_id: int = 0, num_servers: int = 1) -> ckpt.ServerCheckpoint:
    """Pserver ``server_id``'s shard at ``step``: one block holding ``step`` in every element."""
    return ckpt.ServerCheckpoint(server_id, num_servers, step, "sync", OPT,
                                 {"w.block0": np.full(4, step, np.float32)}, {"w.block0": {}},
                                 {"w": ((4,), "float32")})


class Killed(BaseException):
    """The pserver dies here (SIGKILL, OOM, power loss): nothing after it runs."""


def _save_killed_at_rename(root, monkeypatch, k: int) -> bool:
    """Save step 3 over steps 2 and 1, the process dying before its ``k``-th rename; True if it was."""
    renames = []
    real = pathlib.Path.rename

    def rename(self, target):
        if len(renames) == k:
            raise Killed
        renames.append((self.name, pathlib.Path(target).name))
        return real(self, target)

    with monkeypatch.context() as m:
        m.setattr(pathlib.Path, "rename", rename)
        try:
            ckpt.save_server(root, _shard(3))
        except Killed:
            return True
    return False


def test_a_pserver_killed_at_any_rename_of_a_save_restarts_from_the_newest_complete_shard(tmp_path, monkeypatch):
    """Killed between 'pserver-0 -> .prev' and the new shard's rename, it forgot its checkpoint and deleted it."""
    without_latest = []
    for k in range(10):
        root = tmp_path / str(k)
        ckpt.save_server(root, _shard(1))
        ckpt.save_server(root, _shard(2))
        if not _save_killed_at_rename(root, monkeypatch, k):
            break
        if not (root / "pserver-0").exists():
            without_latest.append(k)
        server = ParameterServer("127.0.0.1:0", checkpoint_dir=str(root), checkpoint_every=1)
        want = 2 if k == 0 else 3  # before the new shard had its stable name: the save never happened
        assert (k, server.loaded_step) == (k, want)
        np.testing.assert_array_equal(server.blocks["w.block0"], np.full(4, want, np.float32))
        assert ckpt.saved_steps(root, 0) == [want, want - 1]
        assert sorted(os.listdir(root)) == ["pserver-0", "pserver-0.prev"]  # nothing half-done left behind
        server.close()
    assert k == 4 and without_latest == [3]  # each of the 4 renames was a crash point once
    ckpt.save_server(root, _shard(4))  # and a save after all that rotates as usual
    assert ckpt.saved_steps(root, 0) == [4, 3]


def test_a_crash_between_the_renames_of_an_older_version_leaves_prev_only_and_it_is_used(servers, tmp_path):
    root = tmp_path / "ckpt"
    ckpt.save_server(root, _shard(100))
    (root / "pserver-0").rename(root / "pserver-0.prev")  # killed after 'pserver-0 -> .prev', before the new one
    (root / ".pserver-0.tmp-4242").mkdir()  # the interrupted save's temporary directory
    g = servers(1, num_trainers=1, mode="sync", checkpoint_dir=str(root), checkpoint_every=1)
    assert g.servers[0].loaded_step == 100
    with PSClient(g.endpoints, trainer_id=0, num_trainers=1, mode="sync", optimizer=SGD(0.1), timeout=10) as c:
        np.testing.assert_array_equal(c.init({"w": np.zeros(4, np.float32)})["w"], np.full(4, 100, np.float32))
        assert c.start_step == 100
        c.push_pull({"w": np.ones(4, np.float32)}, step=100)
        c.complete()
    assert g.join(5) and not g.errors
    assert ckpt.saved_steps(root, 0) == [101, 100]
    assert sorted(os.listdir(root)) == ["pserver-0", "pserver-0.prev"]


def _two_pservers(root, steps0, steps1, commit):
    for step in steps0:
        ckpt.save_server(root, _shard(step, 0, 2))
    for step in steps1:
        ckpt.save_server(root, _shard(step, 1, 2))
    if commit is not None:
        ckpt.write_commit(root, commit, ["a:1", "b:2"])


def test_a_save_that_failed_on_one_pserver_resumes_at_the_committed_step(tmp_path):
    """pserver 0 saved step 10, pserver 1 failed to: both refused to start, though both hold step 5."""
    _two_pservers(tmp_path, [5, 10], [5], commit=5)
    for sid in (0, 1):
        got = ckpt.load_server(tmp_path, sid, 2)
        assert got.step == 5
        np.testing.assert_array_equal(got.blocks["w.block0"], np.full(4, 5, np.float32))


def test_a_second_failed_save_keeps_the_committed_step(tmp_path):
    """pserver 1 failed to save steps 10 and 15: pserver 0's save of 15 rotated the committed step 5 out of its
    .prev (10 became .prev), and no pserver held step 5 any more."""
    _two_pservers(tmp_path, [5, 10], [5], commit=5)
    ckpt.save_server(tmp_path, _shard(15, 0, 2))  # pserver 1's save of 15 fails again: no new commit record
    assert ckpt.saved_steps(tmp_path, 0) == [15, 5]
    for sid in (0, 1):
        assert ckpt.load_server(tmp_path, sid, 2).step == 5
    ckpt.save_server(tmp_path, _shard(20, 1, 2))  # both saved 20, and the trainer committed it: rotation as usual
    ckpt.save_server(tmp_path, _shard(20, 0, 2))
    ckpt.write_commit(tmp_path, 20, ["a:1", "b:2"])
    ckpt.save_server(tmp_path, _shard(25, 0, 2))
    assert ckpt.saved_steps(tmp_path, 0) == [25, 20]


@pytest.mark.parametrize(("steps0", "steps1", "loader", "message"), [
    ([5, 10], [3], 0, "the commit record says step 5, but pserver 1 holds step 3 (pserver-1)"),
    ([5, 10], [3], 1, "the commit record says step 5, but pserver 1 holds step 3 (pserver-1)"),
    ([2, 3, 10], [5], 0, "the commit record says step 5, but pserver 0 holds step 10 (pserver-0) and step 3 "
                         "(pserver-0.prev)"),
    ([2, 3, 10], [5], 1, "the commit record says step 5, but pserver 0 holds step 10 (pserver-0) and step 3 "
                         "(pserver-0.prev)"),
])
def test_a_pserver_that_lacks_the_committed_step_is_named(tmp_path, steps0, steps1, loader, message):
    _two_pservers(tmp_path, steps0, steps1, commit=5)
    with pytest.raises(CheckpointError) as err:
        ckpt.load_server(tmp_path, loader, 2)
    assert str(err.value) == f"{tmp_path}: {message}"


def test_a_job_whose_last_save_failed_on_one_pserver_restarts_and_keeps_the_committed_step(servers, tmp_path):
    root = tmp_path / "ckpt"

    def client(g):
        return PSClient(g.endpoints, trainer_id=0, num_trainers=1, mode="sync", optimizer=SGD(0.1), timeout=10,
                        min_block_size=2)

    g = servers(2, num_trainers=1, mode="sync", checkpoint_root=str(tmp_path))
    with client(g) as c:
        c.init({"w": np.zeros(8, np.float32)})
        for step in range(10):
            w = c.push_pull({"w": np.ones(8, np.float32)}, step=step)["w"]
            if step == 4:
                assert c.save(str(root)) == 5
                at5 = w
        (root / "pserver-1.prev").symlink_to("/nonexistent")  # pserver 1's save of step 10 fails
        with pytest.raises(RemoteOpError, match="pserver-1.prev is a symlink"):
            c.save(str(root))
        (root / "pserver-1.prev").unlink()
        c.complete()
    assert [ckpt.saved_steps(root, i) for i in (0, 1)] == [[10, 5], [5]] and ckpt.read_commit(root)["step"] == 5

    g2 = servers(2, num_trainers=1, mode="sync", checkpoint_dir=str(root))
    assert [s.loaded_step for s in g2.servers] == [5, 5]
    with client(g2) as c:
        np.testing.assert_array_equal(c.init({"w": np.zeros(8, np.float32)})["w"], at5)
        assert c.start_step == 5
        c.push_pull({"w": np.ones(8, np.float32)}, step=5)
        assert c.save(str(root)) == 6
        c.complete()
    # pserver 0's step 10 (saved after the committed step, in a branch given up) goes; step 5 stays
    assert [ckpt.saved_steps(root, i) for i in (0, 1)] == [[6, 5], [6, 5]]
