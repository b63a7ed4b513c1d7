"""Dispatch end to end without SSH: the controller's plans and archives applied by hostws.py to a local
directory standing in for a host (the same bytes the SSH channel carries)."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterctl.host import hostws as _hostws
from clusterctl.ops import dispatch as d
from clusterctl.ops.dispatch import plan as dplan
from clusterctl.ops.dispatch import records as drecords
from clusterctl.ops.dispatch import scan as dscan

HOSTWS = Path(_hostws.__file__).resolve()
_gens = itertools.count()


@pytest.fixture(autouse=True)
def own_hash_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(dscan, "HASH_CACHE_DIR", tmp_path / "hash-cache")


@pytest.fixture(autouse=True, params=["inline", "archive"])
def transport(request, monkeypatch):
    """Every test twice: small updates inside the header (the default), and everything as a tar archive."""
    if request.param == "archive":
        monkeypatch.setattr(dplan, "INLINE", -1)
    return request.param


PATH = os.environ.get("PATH", "")


@pytest.fixture()
def sites(tmp_path):
    """(the local workspace, the host's workspace root), the latter's parent directory made."""
    ws, root = tmp_path / "ws", tmp_path / "host" / "ws"
    root.parent.mkdir()
    return ws, root


def host(cmd: str, root: Path, stdin: bytes = b"") -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": PATH}
    return subprocess.run([sys.executable, str(HOSTWS), cmd, str(root)], input=stdin, capture_output=True, timeout=60, env=env)


def state(root: Path) -> d.HostView:
    res = host("state", root)
    assert res.returncode == 0, res.stderr
    return d.view_of(json.loads(res.stdout))


def push(ws: Path, root: Path, view: d.HostView | None = None, *, deltas: bool = True):
    """Plan against `view` (default: the host's state, as for a host this controller does not know),
    stream header + archive into `hostws.py apply`; returns (plan, reply, bytes sent)."""
    files = d.scan_workspace(ws, ())
    plan = d.plan_host(f"gen{next(_gens):04d}", view or state(root), files, deltas=deltas)
    header = d.update_bytes(plan, files)
    if plan.inline:
        data = header
    else:
        archive = d.Archive(files, plan.whole, plan.patches)
        data = b"".join(archive.stream(header))
        archive.close()
    res = host("apply", root, data)
    assert res.returncode == 0, res.stderr.decode()
    return plan, json.loads(res.stdout), len(data)


def tree(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def live_gen(root: Path) -> Path:
    return root.parent / os.readlink(root)


def make_ws(ws: Path, n: int = 12, size: int = 100_000) -> None:
    rng = random.Random(1)
    for i in range(n):
        p = ws / f"d{i % 3}" / f"f{i}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rng.randbytes(size))
    (ws / "train.py").write_text("print('hi')\n")


def edit(path: Path, offset: int, data: bytes) -> None:
    buf = bytearray(path.read_bytes())
    buf[offset : offset + len(data)] = data
    path.write_bytes(bytes(buf))


def assert_no_drift(root: Path) -> None:
    res = host("verify", root)
    assert json.loads(res.stdout)["drift"] == [], res.stdout


def test_small_edits_travel_as_changed_blocks(sites):
    ws, root = sites
    make_ws(ws)
    plan, reply, first = push(ws, root)
    assert len(plan.whole) == 13 and not plan.patches and first > 12 * 100_000
    edit(ws / "d0/f0.bin", 50_000, b"sixteen bytes!!!")  # one block
    edit(ws / "d1/f1.bin", 4090, b"straddles two blocks")  # two blocks
    with open(ws / "d2/f2.bin", "ab") as fh:  # grows by 10 KB: the old, partial last block plus two new ones
        fh.write(os.urandom(10_000))
    with open(ws / "d0/f3.bin", "r+b") as fh:  # shrinks to 60 KiB: no block changed, only the size
        fh.truncate(60 * 1024)
    (ws / "train.py").write_text("print('bye')\n")  # one block only: sent whole
    plan, reply, second = push(ws, root)
    assert plan.whole == ["train.py"]
    assert {rel: p.ranges for rel, p in plan.patches.items()} == {
        "d0/f0.bin": ((12, 1),), "d1/f1.bin": ((0, 2),), "d2/f2.bin": ((24, 3),), "d0/f3.bin": (),
    }
    assert second < 40_000, second  # vs ~330 KB for the four files whole
    assert reply["written"] == 5
    assert tree(root) == tree(ws)
    assert_no_drift(root)


def test_previous_generations_are_never_modified_and_the_spare_is_recycled(sites):
    ws, root = sites
    make_ws(ws)
    push(ws, root)
    v1_dir, v1 = live_gen(root), tree(ws)
    edit(ws / "d0/f0.bin", 0, b"v2")
    push(ws, root)
    v2_dir, v2 = live_gen(root), tree(ws)
    assert tree(v1_dir) == v1  # the old generation still holds the old bytes (patched into new files)
    (v1_dir / "left-by-a-job.txt").write_text("x")  # a job that ran in v1 wrote into its workspace
    (v1_dir / "d1" / "f1.bin").unlink()
    (v1_dir / "job-out" / "deep").mkdir(parents=True)  # and a directory tree of its own
    (v1_dir / "job-out" / "deep" / "ckpt").write_text("x")
    (v1_dir / "d0" / "f0.bin").unlink()  # a file replaced by another inode, and one by a symlink
    (v1_dir / "d0" / "f0.bin").write_text("job's own")
    (v1_dir / "d0" / "f3.bin").unlink()
    (v1_dir / "d0" / "f3.bin").symlink_to(v1_dir / "job-out" / "deep" / "ckpt")
    edit(ws / "d0/f0.bin", 0, b"v3")
    (ws / "d2" / "f2.bin").unlink()
    push(ws, root)  # builds v3 out of v1's directory
    assert not v1_dir.exists()
    assert not (root / "job-out").exists() and not (root / "d0" / "f3.bin").is_symlink()
    assert tree(root) == tree(ws)
    assert tree(v2_dir) == v2
    unchanged = "d0/f3.bin"
    assert os.stat(root / unchanged).st_ino == os.stat(v2_dir / unchanged).st_ino  # hard links, not copies
    assert_no_drift(root)


def test_a_directory_may_become_a_file_and_back(sites):
    ws, root = sites
    (ws / "a").mkdir(parents=True)
    (ws / "a" / "b.txt").write_text("b")
    (ws / "c").write_text("c")
    push(ws, root)
    (ws / "a" / "b.txt").unlink()
    (ws / "a").rmdir()
    (ws / "a").write_text("now a file")
    (ws / "c").unlink()
    (ws / "c").mkdir()
    (ws / "c" / "d.txt").write_text("now a directory")
    push(ws, root)
    assert tree(root) == tree(ws)
    (ws / "a").unlink()
    (ws / "a").mkdir()
    (ws / "a" / "e.txt").write_text("a directory again")
    push(ws, root)
    assert tree(root) == tree(ws)
    assert_no_drift(root)


def test_a_stale_record_changes_nothing_and_returns_the_hosts_state(sites):
    ws, root = sites
    make_ws(ws, n=3)
    push(ws, root)
    remembered = state(root)
    (ws / "train.py").write_text("v2\n")
    push(ws, root)  # another controller moved the host on
    before = tree(root)
    (ws / "train.py").write_text("v3\n")
    view = d.HostView(remembered.gen, remembered.manifest, check=True)
    plan, reply, _ = push(ws, root, view)
    assert reply["stale"].startswith("generation is ") and reply["gen"] != remembered.gen
    assert tree(root) == before
    _, reply, _ = push(ws, root, d.view_of(reply))  # planned again from what the host said
    assert "stale" not in reply and tree(root) == tree(ws)


def test_drift_is_found_before_anything_changes(sites):
    ws, root = sites
    make_ws(ws, n=3)
    push(ws, root)
    view = d.HostView(state(root).gen, state(root).manifest, check=True)
    with open(root / "d1" / "f1.bin", "ab") as fh:
        fh.write(b"edited by hand")
    _, reply, _ = push(ws, root, view)
    assert reply["stale"] == "drift" and reply["drift"] == [{"path": "d1/f1.bin", "problem": "modified"}]
    _, reply, _ = push(ws, root, d.view_of(reply))
    assert tree(root) == tree(ws)
    view = d.HostView(reply["gen"], state(root).manifest, check=True)
    _, reply, sent = push(ws, root, view)  # nothing changed anywhere: a header, and no new generation
    assert reply["unchanged"] is True and sent < 200


def test_a_patch_whose_base_differs_is_refused_then_sent_whole(sites):
    ws, root = sites
    make_ws(ws, n=3)
    push(ws, root)
    target = root / "d0" / "f0.bin"
    st = target.stat()
    data = bytearray(target.read_bytes())
    data[70_000:70_005] = b"XXXXX"
    target.unlink()  # replaced behind our back with the same size and mtime: not visible as drift
    target.write_bytes(bytes(data))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    edit(ws / "d0/f0.bin", 0, b"local edit")
    view = state(root)
    assert view.drift == frozenset()
    before = tree(root)
    plan, reply, _ = push(ws, root, view)
    assert list(plan.patches) == ["d0/f0.bin"]
    assert reply["stale"] == "patch" and reply["drift"] == [{"path": "d0/f0.bin", "problem": "modified"}]
    assert tree(root) == before
    plan, reply, _ = push(ws, root, d.view_of(reply))
    assert plan.whole == ["d0/f0.bin"] and not plan.patches
    assert tree(root) == tree(ws)


def test_block_digests_follow_the_file_size():
    assert d.block_size(0) == d.block_size(4 << 20) == 4096
    assert d.block_size((4 << 20) + 1) == 8192
    assert d.block_size(1 << 30) == 1 << 20  # at most 1024 blocks per file


def test_records_round_trip_and_ignore_damage(tmp_path, monkeypatch):
    from clusterctl.plan import Host

    monkeypatch.setattr(drecords, "RECORDS_DIR", tmp_path / "dispatched")
    a, b = Host("10.0.0.1", 22, "root", 0), Host("10.0.0.2", 22, "root", 1)
    manifest = {"x.py": {"s": 1, "h": "00", "m": 420, "t": 5}}
    records = d.Records("ws")
    records.save({a: ("g1", manifest), b: ("g1", manifest)})
    assert len(list((tmp_path / "dispatched" / "manifests").glob("*.json"))) == 1  # stored once
    view = d.Records("ws").load(a)
    assert (view.gen, view.manifest, view.check) == ("g1", manifest, True)
    assert d.Records("other-root").load(a) is None
    records._path(b).write_text("{not json")
    assert d.Records("ws").load(b) is None


def test_hosts_without_tar_cp_or_rm_get_the_same_result(sites, tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "PATH", str(tmp_path / "empty-bin"))
    ws, root = sites
    make_ws(ws, n=4)
    push(ws, root)  # Python's tarfile, hashing while it writes
    for round_ in range(3):  # patches; a plain hard-linked copy; then the spare recycled
        edit(ws / "d1/f1.bin", 8192 * round_, b"round %d" % round_)
        (ws / f"new{round_}.txt").write_text("new")
        plan, reply, _ = push(ws, root)
        assert list(plan.patches) == ["d1/f1.bin"] and "stale" not in reply
        assert tree(root) == tree(ws)
    assert_no_drift(root)


def test_an_apply_started_ahead_and_given_nothing_changes_nothing(sites):
    """The controller starts `apply` before it knows the update; a host that needs none gets an empty stdin."""
    ws, root = sites
    make_ws(ws, n=2)
    push(ws, root)
    before, gens = tree(root), sorted(os.listdir(root.parent / "ws.d"))
    res = host("apply", root, b"")
    assert (res.returncode, res.stdout, res.stderr) == (0, b"", b"")
    assert tree(root) == before and sorted(os.listdir(root.parent / "ws.d")) == gens
    res = host("apply", root, b"00000000")  # a header cut short is an error, not nothing
    assert res.returncode == 1 and b"header incomplete" in res.stderr


def test_paths_that_are_not_normal_are_refused(tmp_path):
    import marshal

    root = tmp_path / "host" / "ws"
    root.parent.mkdir()
    for bad in ("../escape", "/abs", "a/../b", "a//b"):
        blob = marshal.dumps({"gen": "g1", "base": None, "changes": {bad: {"s": 0, "h": "", "m": 420, "t": 0}},
                              "delete": [], "archive": False, "inline": {bad: b""}})
        res = host("apply", root, b"%016d" % len(blob) + blob)
        assert res.returncode == 1 and b"refusing" in res.stderr, (bad, res.stderr)
        assert not (tmp_path / "escape").exists() and not root.exists()


def test_a_first_dispatch_leaves_a_spare_that_the_next_one_recycles(sites):
    """So that the first change after a first dispatch recycles too, instead of copying the tree."""
    ws, root = sites
    make_ws(ws, n=6)
    push(ws, root)
    gens, v1 = root.parent / "ws.d", live_gen(root)
    spare = gens / (v1.name + "~spare")
    assert sorted(os.listdir(gens)) == sorted([v1.name, v1.name + ".manifest", spare.name, spare.name + ".manifest"])
    assert tree(spare) == tree(v1) and os.stat(spare / "d0/f3.bin").st_ino == os.stat(v1 / "d0/f3.bin").st_ino
    (root / "train.py").write_text("edited on the host\n")  # drift: the hard-linked spare sees it too
    edit(ws / "d0/f0.bin", 0, b"v2")
    _, reply, _ = push(ws, root)
    assert reply["previous"] == v1.name
    assert sorted(os.listdir(gens)) == sorted([v1.name, v1.name + ".manifest", live_gen(root).name,
                                               live_gen(root).name + ".manifest"])  # the spare became the new one
    assert tree(root) == tree(ws)
    assert_no_drift(root)


def test_a_generation_a_job_runs_in_is_neither_recycled_nor_removed_while_it_runs(sites):
    """Two dispatches while a job ran recycled its generation (its own files deleted, its code replaced) and a third
    removed it: found by fuzzing `fab start`, which ships the workspace before the host refuses a second start. The
    job's supervisor holds its generation (LocalProcesses.pin): a dispatch goes around it until the job ends."""
    from clusterctl.host.processes import LocalProcesses

    ws, root = sites
    make_ws(ws, n=6)
    push(ws, root)
    v1, v1_tree = live_gen(root), tree(ws)
    entry = {"role": "trainer", "id": 0, "argv": ["python3", "train.py"], "cwd": str(root), "log": "/dev/null",
             "ports": [], "env": {}}
    job = LocalProcesses("j", str(root.parent / "jobdir"), [entry])
    assert job.rows[0].cwd == str(v1)  # resolved once: every attempt runs in the generation the job started in
    (v1 / "ckpt.bin").write_text("the job's own output")
    for i in range(4):
        edit(ws / "d0/f0.bin", 0, b"v%d" % i)
        _, reply, _ = push(ws, root)
        assert tree(root) == tree(ws)
        assert (v1 / "ckpt.bin").read_text() == "the job's own output"
        assert {k: v for k, v in tree(v1).items() if k != "ckpt.bin"} == v1_tree
    assert live_gen(root) != v1
    for fd in job._fds:  # the job ended (its supervisor exits)
        os.close(fd)
    edit(ws / "d0/f0.bin", 0, b"v9")
    push(ws, root)
    push(ws, root)
    deadline = time.monotonic() + 30  # removed by the detached pruner
    while v1.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not v1.exists()


def test_an_empty_directory_anyone_may_write_to_is_never_adopted(sites):
    """An empty workspace directory is adopted (replaced by the workspace's symlink), but not /tmp: `fab dispatch
    --remote-dir /tmp` made a host's /tmp a symlink, mode 0755."""
    ws, root = sites
    make_ws(ws, n=2)
    root.mkdir()
    os.chmod(root, 0o1777)
    files = d.scan_workspace(ws, ())
    plan = d.plan_host("gen-shared", d.HostView(None, {}), files)
    for res in (host("state", root), host("apply", root, d.update_bytes(plan, files))):
        assert res.returncode == 1 and b"is a directory anyone may write to (mode 1777)" in res.stderr
    assert root.is_dir() and not root.is_symlink() and os.stat(root).st_mode & 0o7777 == 0o1777
    os.chmod(root, 0o775)  # a user's own (group-writable, as umask 002 makes it): adopted
    push(ws, root)
    assert root.is_symlink() and tree(root) == tree(ws)
