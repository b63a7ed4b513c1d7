"""The controller's wheelhouse stays bounded: download() keeps a folder of wheels per group (requirements, platform,
index, the wheels offered), and every clusterctl version offers its own wheel, so each upgrade (each source change,
for a developer) made a new 31 MB group that nothing removed: 1.1 GB after a day of provisioning tests."""

from __future__ import annotations

import os
import time

from clusterctl.provision import wheelhouse
from clusterctl.provision.steps import HostFacts
from clusterctl.provision.wheelhouse import IDLE_S, RECENT, _group_key, download, platform_args

FACTS = HostFacts(python="3.11", machine="x86_64", glibc="2.36")


def _aged(path, age_s, now):
    os.utime(path, (now - age_s, now - age_s))


def _group(root, n):
    """A finished group of requirements `pkg==n`: its folder, as download() leaves it."""
    folder = root / _group_key([f"pkg=={n}"], platform_args(FACTS), None)
    folder.mkdir(parents=True)
    (folder / f"pkg-{n}-py3-none-any.whl").write_bytes(b"wheel")
    (folder / ".clusterctl-complete").write_text("[]\n")
    return folder


def _no_pip(*args, **kwargs):
    raise AssertionError("a finished group is reused without running pip")


def test_reusing_a_group_marks_it_used_and_prunes_the_old_groups_but_never_a_users_files(tmp_path, monkeypatch):
    monkeypatch.setattr(wheelhouse.subprocess, "run", _no_pip)
    now = time.time()
    groups = [_group(tmp_path, n) for n in range(RECENT + 3)]
    mine = [tmp_path / "my-wheels", tmp_path / "notes.txt", tmp_path / "0123456789ABCDEF"]  # the user's, not groups
    mine[0].mkdir()
    mine[1].write_text("x")
    mine[2].mkdir()
    for age, path in enumerate([*groups, *mine]):  # every entry unused for longer than IDLE_S, groups[0] newest
        _aged(path, IDLE_S + 60 + age, now)
    used = groups[-1]  # the oldest: reused now, so it counts as the most recent
    assert download(["pkg==%d" % (RECENT + 2)], FACTS, tmp_path, index_url=None, force=False, log=print) == used
    assert now - used.stat().st_mtime < 60
    kept = {p.name for p in tmp_path.iterdir()}
    assert kept == {used.name, *(g.name for g in groups[: RECENT - 1]), *(p.name for p in mine)}


def test_groups_used_within_idle_s_are_kept_however_many(tmp_path, monkeypatch):
    monkeypatch.setattr(wheelhouse.subprocess, "run", _no_pip)
    now = time.time()
    groups = [_group(tmp_path, n) for n in range(RECENT * 2)]
    for age, path in enumerate(groups):
        _aged(path, IDLE_S - 3600 - age, now)
    download(["pkg==0"], FACTS, tmp_path, index_url=None, force=False, log=print)
    assert {p.name for p in tmp_path.iterdir()} == {g.name for g in groups}
