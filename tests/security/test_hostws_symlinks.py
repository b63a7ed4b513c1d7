"""Workspace apply never follows a symlink it did not create, and drift detection sees replaced
directories (issue 12, finding 11): real hostws.py on a local directory standing in for a host."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from clusterctl.ops import dispatch as d
from clusterctl.ops.dispatch import plan as dplan
from clusterctl.ops.dispatch import scan as dscan
from test_hostws_apply import host, live_gen, make_ws, push, state, tree  # noqa: E402  (helpers only)


@pytest.fixture(autouse=True)
def own_hash_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(dscan, "HASH_CACHE_DIR", tmp_path / "hash-cache")


@pytest.fixture(params=["inline", "archive"])
def sites(request, tmp_path, monkeypatch):
    if request.param == "archive":
        monkeypatch.setattr(dplan, "INLINE", -1)
    ws, root, outside = tmp_path / "ws", tmp_path / "host" / "ws", tmp_path / "outside"
    root.parent.mkdir()
    outside.mkdir()
    return ws, root, outside


def digests(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def drift(root: Path) -> list[dict]:
    res = host("verify", root)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["drift"]


def test_a_directory_replaced_by_a_symlink_is_drift_and_the_next_dispatch_stays_inside(sites):
    ws, root, outside = sites
    make_ws(ws, n=6)
    push(ws, root)
    live = live_gen(root)
    # the attack: d1/ replaced by a link to a directory outside holding identical copies (same mtimes)
    shutil.copytree(live / "d1", outside / "d1", copy_function=shutil.copy2)
    shutil.rmtree(live / "d1")
    os.symlink(outside / "d1", live / "d1")
    before = digests(outside)
    assert drift(root) == [{"path": "d1/f1.bin", "problem": "replaced"}, {"path": "d1/f4.bin", "problem": "replaced"}]
    (ws / "d1" / "f1.bin").write_bytes(b"new content")
    (ws / "d1" / "new.txt").write_text("new file\n")
    view = d.HostView(state(root).gen, state(root).manifest, check=True)  # a controller trusting its cache
    _, reply, _ = push(ws, root, view)
    assert reply["stale"] == "drift"
    push(ws, root, d.view_of(reply))
    assert digests(outside) == before  # nothing written outside
    assert not (live_gen(root) / "d1").is_symlink() and tree(root) == tree(ws)
    assert drift(root) == []


def test_a_symlink_at_a_new_directory_is_not_written_through(sites):
    ws, root, outside = sites
    make_ws(ws, n=3)
    push(ws, root)
    os.symlink(outside, live_gen(root) / "newdir")  # not in the manifest: drift cannot see it
    (ws / "newdir").mkdir()
    (ws / "newdir" / "x.py").write_text("print(1)\n")
    push(ws, root)
    assert list(outside.iterdir()) == []
    assert (live_gen(root) / "newdir").is_dir() and not (live_gen(root) / "newdir").is_symlink()
    assert tree(root) == tree(ws)


def test_a_file_replaced_by_a_symlink_is_drift_and_replaced(sites):
    ws, root, outside = sites
    make_ws(ws, n=3)
    push(ws, root)
    live = live_gen(root)
    target = outside / "secret"
    shutil.copy2(live / "train.py", target)
    os.unlink(live / "train.py")
    os.symlink(target, live / "train.py")
    assert drift(root) == [{"path": "train.py", "problem": "replaced"}]
    (ws / "train.py").write_text("print('changed')\n")
    _, reply, _ = push(ws, root)
    assert target.read_text() == "print('hi')\n"  # the link's target is untouched
    assert not (live_gen(root) / "train.py").is_symlink() and tree(root) == tree(ws)
