"""Dispatch (clusterctl.ops.dispatch: dispatch, verify) over fake hosts: the real host tool (hostws) applies the
updates in each host's directory (tests/unit/fakehosts.py)."""

import os
import re
import shutil
import sys

import pytest

from clusterctl.errors import JobError, RemoteError
from clusterctl.ops.dispatch import dispatch, verify

sys.path.insert(0, os.path.dirname(__file__))
from fakehosts import FakeCluster, FaultyTransport, refused  # noqa: E402


def tree(path):
    """{relative path: content} of every file under `path` (following the workspace symlink)."""
    out = {}
    for dirpath, _, names in os.walk(path):
        for name in names:
            full = os.path.join(dirpath, name)
            out[os.path.relpath(full, path)] = open(full, "rb").read()
    return out


def sent(results):
    """{host label: (files sent, deleted)} of a dispatch."""
    return {r.host.label: (r.files_sent, r.deleted) for r in results}


def test_first_and_incremental_dispatches_send_only_what_changed(tmp_path):
    c = FakeCluster(tmp_path, files={"train.py": "print(1)\n", "lib/util.py": "X = 1\n", "old.txt": "old\n",
                                     "skip.pyc": "compiled", ".git/HEAD": "ref"})
    with c.session() as s:
        first = dispatch(s)
        assert sent(first) == {"n0": (3, 0), "n1": (3, 0)}
        assert len({r.generation for r in first}) == 1
        assert all(r.bytes_sent > 0 for r in first)
        want = {"train.py": b"print(1)\n", "lib/util.py": b"X = 1\n", "old.txt": b"old\n"}
        assert tree(c.workspace(0)) == tree(c.workspace(1)) == want  # excludes left out
        assert os.path.islink(c.workspace(0))

        again = dispatch(s)  # nothing changed: nothing travels, the generation stays
        assert sent(again) == {"n0": (0, 0), "n1": (0, 0)}
        assert [r.generation for r in again] == [r.generation for r in first]

        c.write("train.py", "print(2)\n")
        c.write("new/data.txt", "new\n")
        (c.local / "old.txt").unlink()
        third = dispatch(s)
        assert sent(third) == {"n0": (2, 1), "n1": (2, 1)}
        assert third[0].generation != first[0].generation
        want = {"train.py": b"print(2)\n", "lib/util.py": b"X = 1\n", "new/data.txt": b"new\n"}
        assert tree(c.workspace(0)) == tree(c.workspace(1)) == want
        assert verify(s) == {h: [] for h in s.plan.hosts}


def test_drift_on_a_host_is_found_by_verify_and_repaired_by_the_next_dispatch(tmp_path):
    c = FakeCluster(tmp_path, files={"train.py": "print(1)\n", "cfg.txt": "a\n"})
    with c.session() as s:
        dispatch(s)
        (c.workspace(1) / "cfg.txt").write_text("edited on the host\n")
        (c.workspace(1) / "train.py").unlink()
        drift = {h.label: sorted(d["path"] for d in items) for h, items in verify(s).items()}
        assert drift == {"n0": [], "n1": ["cfg.txt", "train.py"]}
        res = dispatch(s)
        assert sent(res) == {"n0": (0, 0), "n1": (2, 0)}
        assert tree(c.workspace(1)) == {"train.py": b"print(1)\n", "cfg.txt": b"a\n"}
        assert verify(s) == {h: [] for h in s.plan.hosts}


def test_a_host_at_another_generation_or_without_the_host_tool_is_brought_up_to_date(tmp_path):
    c = FakeCluster(tmp_path, files={"train.py": "print(1)\n", "b.txt": "b\n"})
    with c.session() as s:
        dispatch(s)
        shutil.rmtree(c.home(1))  # n1 was reinstalled: this controller's record of it is stale
        shutil.rmtree(c.home(0) / ".clusterctl" / "bin")  # n0 lost the host tool, not its workspace
        res = dispatch(s)
        assert sent(res) == {"n0": (0, 0), "n1": (2, 0)}
        assert tree(c.workspace(1)) == {"train.py": b"print(1)\n", "b.txt": b"b\n"}
        c.write("b.txt", "b2\n")
        assert sent(dispatch(s)) == {"n0": (1, 0), "n1": (1, 0)}
        assert (c.workspace(0) / "b.txt").read_text() == (c.workspace(1) / "b.txt").read_text() == "b2\n"


def test_big_files_stream_as_an_archive_and_a_small_change_as_its_blocks(tmp_path):
    big = os.urandom(9 << 20)  # over the bulk threshold: an archive through Remote.push
    c = FakeCluster(tmp_path, hosts=1, files={"big.bin": big, "small.txt": "s\n"})
    with c.session() as s:
        (first,) = dispatch(s)
        assert (first.files_sent, first.bytes_sent > len(big)) == (2, True)
        assert (c.workspace(0) / "big.bin").read_bytes() == big
        changed = bytearray(big)
        changed[5_000_000:5_000_010] = b"0123456789"  # one block of the file
        c.write("big.bin", bytes(changed))
        (second,) = dispatch(s)
        assert second.files_sent == 1 and second.bytes_sent < 100_000  # the changed block, not 9 MiB
        assert (c.workspace(0) / "big.bin").read_bytes() == bytes(changed)


def test_each_host_gets_its_trainers_data_shards(tmp_path):
    c = FakeCluster(tmp_path, files={"train.py": "print(1)\n"},
                    extra={"data": {"local": "shards", "pattern": "part-*", "remote": "data"}})
    for i in range(4):
        (tmp_path / "shards").mkdir(exist_ok=True)
        (tmp_path / "shards" / f"part-{i}").write_text(f"shard {i}\n")
    (tmp_path / "shards" / "README").write_text("not a shard")
    with c.session() as s:
        assert [p.env["CLUSTERCTL_DATA_FILES"] for p in s.plan.trainers] == ["data/part-0:data/part-2",
                                                                            "data/part-1:data/part-3"]
        assert sent(dispatch(s)) == {"n0": (3, 0), "n1": (3, 0)}
    assert tree(c.workspace(0)) == {"train.py": b"print(1)\n", "data/part-0": b"shard 0\n", "data/part-2": b"shard 2\n"}
    assert tree(c.workspace(1)) == {"train.py": b"print(1)\n", "data/part-1": b"shard 1\n", "data/part-3": b"shard 3\n"}


def test_a_host_that_cannot_be_reached_fails_the_dispatch_by_name_and_the_others_get_theirs(tmp_path):
    c = FakeCluster(tmp_path, files={"train.py": "print(1)\n"})
    with c.session(transport=FaultyTransport(c.transport, down={"n1"})) as s:
        with pytest.raises(RemoteError) as info:
            dispatch(s)
    assert "dispatch failed on 1 host(s): n1" in str(info.value)
    assert re.search(refused("n1"), str(info.value))
    assert tree(c.workspace(0)) == {"train.py": b"print(1)\n"}
    assert not c.workspace(1).exists()
    # lost later, while its update travels (this controller has a record of it now): named the same way
    c.write("train.py", "print(2)\n")
    with c.session() as s:
        dispatch(s)
    c.write("train.py", "print(3)\n")
    with c.session(transport=FaultyTransport(c.transport, down={"n0"}, only="apply")) as s:
        with pytest.raises(RemoteError, match=r"(?s)dispatch failed on 1 host.*n0: " + refused("n0")):
            dispatch(s)
    assert (c.workspace(1) / "train.py").read_text() == "print(3)\n"
    assert (c.workspace(0) / "train.py").read_text() == "print(2)\n"


def test_a_workspace_that_is_not_a_directory_is_a_clear_error(tmp_path):
    c = FakeCluster(tmp_path)
    shutil.rmtree(c.local)
    with c.session() as s, pytest.raises(JobError, match=r"workspace.local .*/ws is not a directory"):
        dispatch(s)


def test_an_empty_workspace_is_a_generation_of_its_own_and_start_finds_it_dispatched(tmp_path, monkeypatch, capsys):
    """A job whose program is already on the hosts (`python3 -c ...`, an installed package) may ship an empty
    workspace: it was left as no generation at all, so the command line's table failed on it (AttributeError)
    and `start` said "workspace not dispatched since the last dispatch" after every dispatch."""
    from clusterctl import cli

    c = FakeCluster(tmp_path, files={}, job={"entrypoint": ["python3", "-c", "pass"]}).everywhere(monkeypatch)
    gens = []
    for _ in range(2):  # the first makes an empty generation on every host; the second finds it as it was
        assert cli.main(["dispatch", str(c.spec_path)]) == 0
        out, err = capsys.readouterr()
        cells = [[cell.strip() for cell in line.strip("│|").split("│" if "│" in line else "|")]
                 for line in out.splitlines() if line.lstrip("│| ").startswith("n")]
        assert [row[0] for row in cells] == ["n0", "n1"] and all(re.fullmatch(r"\d{8}-\d{6}-\w+", row[-1])
                                                               for row in cells), out
        gens.append([row[-1] for row in cells])
    assert gens[0] == gens[1] and all(c.workspace(i).is_symlink() and tree(c.workspace(i)) == {} for i in range(2))
    with c.session() as s:
        assert verify(s) == {h: [] for h in s.plan.hosts}
    assert cli.main(["start", str(c.spec_path)]) == 0, capsys.readouterr().err
    assert cli.main(["stop", str(c.spec_path)]) == 0


def test_dispatch_on_a_cached_plan_loads_no_spec(tmp_path, monkeypatch):
    """`clusterctl dispatch` on a plan from the cache takes the workspace, its excludes and the data shards'
    directory from the cache entry: the spec models are never loaded (issue 23 part 4), and the hosts get
    exactly what a dispatch from the loaded spec gives them."""
    import time

    from clusterctl.ops import open_session

    c = FakeCluster(tmp_path, files={"train.py": "print(1)\n", "skip.pyc": "compiled", "d/a.txt": "a\n"},
                    extra={"data": {"local": "shards", "pattern": "*.bin", "remote": "in"}})
    (tmp_path / "shards").mkdir()
    for i in range(4):
        (tmp_path / "shards" / f"s{i}.bin").write_bytes(bytes([i]) * 10)
    old = time.time() - 60
    for p in (c.spec_path, tmp_path / "shards", *(tmp_path / "shards").iterdir()):
        os.utime(p, (old, old))  # the plan cache keeps nothing made from files changed as it planned
    c.everywhere(monkeypatch)
    with open_session(str(c.spec_path)) as miss:
        assert miss.spec_loaded  # planned from the spec: the entry is written
    with open_session(str(c.spec_path)) as s:
        assert not s.spec_loaded
        results = dispatch(s)
        assert not s.spec_loaded  # the workspace and data directories came from the entry
    assert sent(results) == {"n0": (4, 0), "n1": (4, 0)}  # train.py, d/a.txt and two shards each (skip.pyc excluded)
    for i in range(2):
        got = tree(c.workspace(i))
        assert sorted(got) == ["d/a.txt", f"in/s{i}.bin", f"in/s{i + 2}.bin", "train.py"]
        assert got[f"in/s{i}.bin"] == bytes([i]) * 10


def test_records_are_private_and_ones_readable_by_others_are_not_used(tmp_path, monkeypatch):
    """The controller's records of what each host has (and the hash cache) are 0600 files in private
    directories; a record or manifest others could have written is not trusted (the host is asked), and is
    written again privately."""
    import stat

    from clusterctl.ops.dispatch import records as drecords
    from clusterctl.ops.dispatch import scan as dscan

    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setattr(drecords, "RECORDS_DIR", cache / "dispatched")
    monkeypatch.setattr(dscan, "HASH_CACHE_DIR", cache / "hashes")
    c = FakeCluster(tmp_path, files={"train.py": "print(1)\n"})
    first_mtime = (c.local / "train.py").stat().st_mtime_ns
    with c.session() as s:
        dispatch(s)
        files = [p for p in cache.rglob("*") if p.is_file()]
        assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
        assert all(drecords.Records(s.plan.workdir).load(h) is not None for h in s.plan.hosts)
        for p in files:
            p.chmod(0o644)  # as an older version left them, or someone else wrote them
        assert all(drecords.Records(s.plan.workdir).load(h) is None for h in s.plan.hosts)
        c.write("train.py", "print(2)\n")
        assert sent(dispatch(s)) == {"n0": (1, 0), "n1": (1, 0)}  # the hosts were asked, then updated
        left = [p for p in cache.rglob("*") if p.is_file() and stat.S_IMODE(p.stat().st_mode) != 0o600]
        # only the old generation's manifest (the sweep's stamp, which others could have written, is written again)
        assert left == [p for p in files if p.parent.name == "manifests" and p.name != ".swept"]
        assert all(drecords.Records(s.plan.workdir).load(h) is not None for h in s.plan.hosts)
        # back to the first content and mtime (a manifest records both, mtime in whole seconds, so a run that
        # crossed a second made another manifest): its manifest, left 0644, is used again
        os.utime(c.write("train.py", "print(1)\n"), ns=(first_mtime, first_mtime))
        dispatch(s)
        bad = [(str(p.relative_to(cache)), oct(p.stat().st_mode)) for p in cache.rglob("*") if p.is_file() and stat.S_IMODE(p.stat().st_mode) != 0o600]
        assert not bad, bad
        assert all(drecords.Records(s.plan.workdir).load(h) is not None for h in s.plan.hosts)
        (cache / "dispatched").chmod(0o777)  # a directory others may write to: not used at all
        assert all(drecords.Records(s.plan.workdir).load(h) is None for h in s.plan.hosts)


def test_manifests_unused_for_a_month_are_swept_at_most_once_a_day(tmp_path, monkeypatch):
    """Every dispatch used to stat every manifest ever recorded (3,204 files on the development machine: ~25 ms
    of each `clusterctl dispatch`); the month-old ones are now looked for at most once a day."""
    import time

    from clusterctl.ops.dispatch import records as drecords
    from clusterctl.ops.dispatch import scan as dscan

    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setattr(drecords, "RECORDS_DIR", cache / "dispatched")
    monkeypatch.setattr(dscan, "HASH_CACHE_DIR", cache / "hashes")
    c = FakeCluster(tmp_path, files={"train.py": "print(1)\n"})
    manifests = cache / "dispatched" / "manifests"
    month = time.time() - drecords.MANIFEST_KEEP_S - 60
    with c.session() as s:
        dispatch(s)  # the first sweep: the stamp is written
        stale = manifests / ("0" * 64 + ".json")
        stale.write_bytes(b"{}")
        os.utime(stale, (month, month))
        c.write("train.py", "print(2)\n")
        dispatch(s)
        assert stale.exists()  # swept less than a day ago: not looked for
        stamp = manifests / ".swept"
        day = time.time() - drecords.SWEEP_EVERY_S - 60
        os.utime(stamp, (day, day))
        c.write("train.py", "print(3)\n")
        dispatch(s)
        assert not stale.exists()  # a day later: gone
        assert stamp.stat().st_mtime > day + 60 and len(list(manifests.glob("*.json"))) >= 1  # the ones in use stay


def test_the_table_shows_a_host_that_names_no_generation_as_a_dash():
    """A host package before the empty-generation change replies `unchanged` with no generation for an empty
    workspace (ops/dispatch/run.py accepts it): the row says "-" rather than failing the command."""
    import io

    from clusterctl.commands.lifecycle import render_dispatch
    from clusterctl.ops.dispatch.run import HostDispatch
    from clusterctl.plan import Host

    buf = io.StringIO()
    render_dispatch([HostDispatch(Host("n0", 22, "u", 0), 0, 0, 0, None)], 0.1, file=buf)
    assert [line.split("│")[-2].strip() for line in buf.getvalue().splitlines() if "n0" in line] == ["-"], buf.getvalue()
