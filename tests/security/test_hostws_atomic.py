"""`hostws.py apply` removes a deleted file only inside the workspace, never makes live an update whose stream
ended early (even between two members), and a failed apply leaves nothing behind: real hostws.py on a local
directory standing in for a host.

Before: a deletion was joined to the staging copy and unlinked without looking at the directories on the way.
Where the staging copy is made with `cp -al` (no spare generation to recycle: the first change after the
spare was removed, or lost to a concurrent dispatch), a directory that the job (or anyone with the login)
had replaced by a symlink was followed, and the file of that name in the link's target, outside the
workspace, was deleted. A stream that ended at a member's boundary (an interrupted controller's, or one
cut when a local file vanished) was taken by GNU tar for the whole archive: files whose members never came
kept the previous generation's content (the spare's, or the copy's) under the new manifest, and that
generation went live. And on a host without GNU tar, an archive cut short (the controller's stream ended
early) was a tarfile traceback that left the staging directory behind."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from clusterctl.ops import dispatch as d
from clusterctl.ops.dispatch import plan as dplan
import test_hostws_apply as helpers  # noqa: E402  (helpers only)
from test_hostws_apply import host, live_gen, make_ws, push, state, tree  # noqa: E402
from test_hostws_symlinks import own_hash_cache, sites  # noqa: E402, F401  (the same fixtures)


def drop_other_generations(root: Path) -> None:
    """Remove every generation but the live one (the spare included), as a disk clean-up on the host may."""
    gens, live = root.parent / "ws.d", live_gen(root).name
    for name in os.listdir(gens):
        if name not in (live, live + ".manifest"):
            p = gens / name
            shutil.rmtree(p) if p.is_dir() else p.unlink()


@pytest.mark.parametrize("spare", [True, False], ids=["recycled", "copied"])
def test_a_deletion_under_a_directory_replaced_by_a_symlink_stays_inside(sites, spare):  # noqa: F811 (the fixture)
    ws, root, outside = sites
    make_ws(ws, n=6)
    push(ws, root)
    if not spare:
        drop_other_generations(root)
    live = live_gen(root)
    # the job made d1/ a link to a directory of its own outside the workspace, holding files of the same names
    shutil.copytree(live / "d1", outside / "d1", copy_function=shutil.copy2)
    shutil.rmtree(live / "d1")
    os.symlink(outside / "d1", live / "d1")
    before = sorted(os.listdir(outside / "d1"))
    assert before == ["f1.bin", "f4.bin"]
    (ws / "d1" / "f1.bin").unlink()  # deleted locally: the next dispatch deletes it on the host
    plan, reply, _ = push(ws, root)
    assert plan.delete == ["d1/f1.bin"] and "stale" not in reply, reply
    assert sorted(os.listdir(outside / "d1")) == before  # nothing deleted outside
    assert not (live_gen(root) / "d1").is_symlink() and tree(root) == tree(ws)
    assert json.loads(host("verify", root).stdout)["drift"] == []


def test_an_archive_cut_short_on_a_host_without_tar_fails_in_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(helpers, "PATH", str(tmp_path / "empty-bin"))  # no tar, cp or rm: Python's tarfile
    monkeypatch.setattr(dplan, "INLINE", -1)
    ws, root = tmp_path / "ws", tmp_path / "host" / "ws"
    root.parent.mkdir()
    make_ws(ws, n=3)
    push(ws, root)
    gens, before, live = root.parent / "ws.d", tree(root), live_gen(root)
    (ws / "d0" / "f0.bin").write_bytes(os.urandom(300_000))
    files = d.scan_workspace(ws, ())
    plan = d.plan_host("gen-cut", state(root), files)
    archive = d.Archive(files, plan.whole, plan.patches)
    data = b"".join(archive.stream(d.update_bytes(plan, files)))
    archive.close()
    res = host("apply", root, data[: len(data) // 2])
    err = res.stderr.decode()
    assert res.returncode == 1 and "Traceback" not in err, err
    assert err.startswith("dispatch failed, previous workspace kept: ") and err.count("\n") == 1, err
    assert live_gen(root) == live and tree(root) == before
    assert [n for n in os.listdir(gens) if n.endswith(".tmp")] == []  # no staging left behind


@pytest.mark.parametrize("spare", [True, False], ids=["recycled", "copied"])
def test_an_archive_that_ends_at_a_members_boundary_never_goes_live(tmp_path, monkeypatch, spare):
    monkeypatch.setattr(dplan, "INLINE", -1)
    ws, root = tmp_path / "ws", tmp_path / "host" / "ws"
    root.parent.mkdir()
    make_ws(ws, n=3)
    push(ws, root)
    if not spare:
        drop_other_generations(root)
    live, before = live_gen(root), tree(root)
    for rel in ("d0/f0.bin", "d1/f1.bin", "d2/f2.bin"):  # changed, each keeping its size
        (ws / rel).write_bytes(os.urandom(100_000))
    files = d.scan_workspace(ws, ())
    plan = d.plan_host("gen-cut", state(root), files, deltas=False)
    header = d.update_bytes(plan, files)
    archive = d.Archive(files, plan.whole, plan.patches)
    data = b"".join(archive.stream(header))
    archive.close()
    with tarfile.open(fileobj=io.BytesIO(data[len(header):])) as tar:
        second = tar.getmembers()[1].offset  # where the second member's headers start
    res = host("apply", root, data[: len(header) + second])
    assert res.returncode == 1, res
    assert res.stderr.decode() == ("dispatch failed, previous workspace kept: content check failed after transfer: "
                                   "d1/f1.bin, d2/f2.bin\n")
    assert live_gen(root) == live and tree(root) == before
    assert json.loads(host("verify", root).stdout)["drift"] == []
