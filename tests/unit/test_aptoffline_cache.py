"""Offline apt's controller cache stays bounded: a private apt root per host configuration (each with its sources'
indexes, ~120 MB for Debian's main) and a dpkg status copy per host state were kept forever (22 GB of roots on the
development machine after a week of provisioning tests; a tier run then failed with "No space left on device")."""

from __future__ import annotations

import os
import time

from clusterctl.cache import prune_lru
from clusterctl.provision import aptoffline
from clusterctl.provision.aptoffline import IDLE_S, RECENT, prepare_root
from clusterctl.provision.aptstate import HostAptState


def _aged(path, age_s, now):
    os.utime(path, (now - age_s, now - age_s))


def test_prune_lru_keeps_the_recent_and_the_lately_used_and_removes_the_rest(tmp_path):
    now = time.time()
    old = IDLE_S + 3600
    names = {}
    for i in range(RECENT + 4):  # RECENT + 4 entries, every one unused for longer than IDLE_S, oldest last
        entry = tmp_path / f"root{i:02d}"
        entry.mkdir()
        (entry / "lists").mkdir()
        (entry / "lists" / "Packages").write_text("x")
        names[entry.name] = old + i
    status = tmp_path / "status-file"
    status.write_text("dpkg")
    names[status.name] = old + 100
    lately = tmp_path / "in-use"  # older than the RECENT newest, but used within IDLE_S: a run may be using it
    lately.mkdir()
    names[lately.name] = IDLE_S - 60
    for name, age in names.items():
        _aged(tmp_path / name, age, now)
    # the RECENT most recently used: in-use and root00..root06; the rest is past them and unused for IDLE_S
    gone = prune_lru(tmp_path, RECENT, IDLE_S, now=now)
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == ["in-use"] + [f"root{i:02d}" for i in range(RECENT - 1)]
    assert sorted(gone) == sorted(set(names) - set(kept))
    assert prune_lru(tmp_path, RECENT, IDLE_S, now=now) == []  # nothing more to do
    assert prune_lru(tmp_path / "missing", RECENT, IDLE_S, now=now) == []


def test_prune_lru_never_removes_what_was_used_within_idle_s(tmp_path):
    now = time.time()
    for i in range(RECENT * 3):
        (tmp_path / f"r{i}").mkdir()
        _aged(tmp_path / f"r{i}", IDLE_S - 10 - i, now)
    assert prune_lru(tmp_path, RECENT, IDLE_S, now=now) == []
    assert len(list(tmp_path.iterdir())) == RECENT * 3


def test_a_reused_root_counts_as_used_and_a_new_one_prunes_the_old(tmp_path, monkeypatch):
    def state(n):
        return HostAptState("amd64", {"etc/apt/sources.list": f"deb http://m{n}.example/d bookworm main\n".encode()}, b"")

    now = time.time()
    roots = [prepare_root(tmp_path, state(n), []) for n in range(RECENT + 2)]
    assert len(set(roots)) == RECENT + 2
    for root in roots:
        _aged(root, IDLE_S + 60, now)
    again = prepare_root(tmp_path, state(0), [])  # reused: its mtime is now
    assert again == roots[0] and now - again.stat().st_mtime < 60
    monkeypatch.setattr(aptoffline, "RECENT", 2)
    prepare_root(tmp_path, state("new"), [])  # a new root: the others unused for IDLE_S go, past the RECENT newest
    assert sorted(p.name for p in (tmp_path / "roots").iterdir()) == sorted(
        [roots[0].name, aptoffline._root_key(state("new"), [])])


def test_the_deb_cache_keeps_what_a_run_uses_and_drops_what_none_used_for_deb_idle_s(tmp_path):
    """The .debs were cached by content and never removed: a fleet's CUDA .debs (GBs) stayed after every upgrade."""
    import hashlib

    from clusterctl.provision.aptoffline import DEB_IDLE_S, Deadline, Deb, download

    roots = tmp_path / "mirror"
    roots.mkdir()
    debs = []
    for name in ("a_1_amd64.deb", "b_1_amd64.deb"):
        body = name.encode() * 100
        (roots / name).write_bytes(body)
        debs.append(Deb((roots / name).as_uri(), name, len(body), "sha256:" + hashlib.sha256(body).hexdigest()))
    cache = tmp_path / "cache"
    first = download(cache, debs, deadline=Deadline(60, "apt.offline.timeout"), file_roots=[roots])
    assert [p.name for p in first] == ["a_1_amd64.deb", "b_1_amd64.deb"]
    folder = cache / "debs"
    mine = folder / "notes.txt"  # not an entry of the cache: never removed
    mine.write_text("mine")
    now = time.time()
    for entry in [p.parent for p in first] + [mine]:
        _aged(entry, DEB_IDLE_S + 60, now)
    # a run that uses only a: a counts as used (and is not fetched again), b is past DEB_IDLE_S and goes
    (roots / "a_1_amd64.deb").unlink()
    [again] = download(cache, debs[:1], deadline=Deadline(60, "apt.offline.timeout"), file_roots=[roots])
    assert again == first[0] and again.is_file() and time.time() - again.parent.stat().st_mtime < 60
    assert sorted(p.name for p in folder.iterdir()) == sorted([first[0].parent.name, "notes.txt"])
