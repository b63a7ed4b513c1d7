"""The dispatch planner, pure: local files + each host's state -> what each host is sent, by change set.

No host and no file: every LocalFile here names a source that does not exist, so a planner that read a
file would fail these tests."""

from __future__ import annotations

import pytest

from clusterctl.ops.dispatch import (
    DispatchPlan,
    HostView,
    LocalFile,
    Patch,
    block_size,
    plan_dispatch,
    plan_host,
    view_of,
)
from clusterctl.ops.dispatch.plan import BULK, INLINE

MISSING = "/nonexistent/clusterctl-planner-test"
BS = 4096


def sha(tag: str) -> str:
    return (tag * 64)[:64]


def digests(*tags: str) -> str:
    """Block digests: one 16-hex-character digest per block."""
    return "".join((t * 16)[:16] for t in tags)


def lf(rel: str, size: int, tag: str, *, mode: int = 0o644, mtime: int = 1000, blocks: str = "",
       previous: tuple[str, str] | None = None) -> LocalFile:
    return LocalFile(f"{MISSING}/{rel}", size, sha(tag), mode, mtime, blocks, previous)


def manifest_of(files: dict[str, LocalFile]) -> dict[str, dict]:
    return {rel: f.entry() for rel, f in files.items()}


V1 = {"a.py": lf("a.py", 10, "1"), "b.py": lf("b.py", 20, "2"), "old.txt": lf("old.txt", 5, "3")}
V2 = {"a.py": lf("a.py", 11, "4"), "b.py": V1["b.py"], "new.txt": lf("new.txt", 7, "5")}


def test_a_host_that_has_nothing_gets_every_file_whole():
    p = plan_host("g2", HostView(None, {}), V2)
    assert (p.gen, p.base, p.check) == ("g2", None, False)
    assert p.whole == ["a.py", "b.py", "new.txt"] and p.patches == {} and p.delete == []
    assert p.manifest == manifest_of(V2)
    assert p.payload == 11 + 20 + 7 and p.inline is True and not p.empty
    assert p.key == (("a.py", sha("4"), None), ("b.py", sha("2"), None), ("new.txt", sha("5"), None))


def test_changed_and_new_files_travel_removed_ones_are_deleted():
    p = plan_host("g2", HostView("g1", manifest_of(V1)), V2)
    assert p.whole == ["a.py", "new.txt"] and p.delete == ["old.txt"]
    assert p.manifest == manifest_of(V2) and p.base == "g1"
    assert p.payload == 11 + 7


def test_a_deletion_only_update_has_no_content_and_an_empty_change_set():
    files = {k: v for k, v in V1.items() if k != "old.txt"}
    p = plan_host("g2", HostView("g1", manifest_of(V1)), files)
    assert (p.whole, p.patches, p.delete, p.key, p.payload) == ([], {}, ["old.txt"], (), 0)
    assert not p.empty and "old.txt" not in p.manifest


def test_an_mtime_alone_does_not_send_a_file_but_a_mode_does():
    view = HostView("g1", manifest_of(V1))
    touched = {**V1, "a.py": lf("a.py", 10, "1", mtime=2000)}
    assert plan_host("g2", view, touched).empty
    chmodded = {**V1, "a.py": lf("a.py", 10, "1", mode=0o755)}
    p = plan_host("g2", view, chmodded)
    assert p.whole == ["a.py"] and p.manifest["a.py"]["m"] == 0o755


def test_a_drifted_file_is_sent_whole_even_when_its_entry_matches():
    view = HostView("g1", manifest_of(V1), drift=frozenset({"b.py"}))
    p = plan_host("g2", view, V1)
    assert p.whole == ["b.py"] and p.delete == [] and p.patches == {}


def _big(tag: str, blocks: str, previous=None) -> LocalFile:
    return lf("big.bin", 8 * BS, tag, blocks=blocks, previous=previous)


OLD_BLOCKS = digests(*"abcdefgh")


def test_a_file_whose_previous_content_the_host_has_travels_as_its_changed_blocks():
    old = _big("o", OLD_BLOCKS)
    view = HostView("g1", manifest_of({"big.bin": old}))
    new = _big("n", digests(*"abXdeYZh"), previous=(old.sha256, OLD_BLOCKS))  # blocks 2, 5 and 6 changed
    p = plan_host("g2", view, {"big.bin": new})
    assert p.whole == [] and p.patches == {"big.bin": Patch(old.sha256, BS, ((2, 1), (5, 2)), 3 * BS)}
    assert p.payload == 3 * BS and p.key == (("big.bin", new.sha256, old.sha256),)
    assert p.manifest["big.bin"] == new.entry()


@pytest.mark.parametrize("why", ["more than half changed", "host has other content", "no previous scan",
                                 "deltas off", "drifted", "block size changed"])
def test_a_changed_file_travels_whole_when_a_delta_does_not_apply_or_does_not_pay(why):
    old = _big("o", OLD_BLOCKS)
    manifest = manifest_of({"big.bin": old})
    new = _big("n", digests(*"abXdeYZh"), previous=(old.sha256, OLD_BLOCKS))
    view, deltas = HostView("g1", manifest), True
    if why == "more than half changed":
        new = _big("n", digests(*"XYZWefgQ"), previous=(old.sha256, OLD_BLOCKS))
    elif why == "host has other content":
        new = _big("n", new.blocks, previous=(sha("z"), OLD_BLOCKS))
    elif why == "no previous scan":
        new = _big("n", new.blocks)
    elif why == "deltas off":
        deltas = False
    elif why == "drifted":
        view = HostView("g1", manifest, drift=frozenset({"big.bin"}))
    elif why == "block size changed":
        assert block_size(4096 * 1024 + 1) != block_size(8 * BS)
        view = HostView("g1", {"big.bin": {**manifest["big.bin"], "s": 4096 * 1024 + 1}})
    p = plan_host("g2", view, {"big.bin": new}, deltas=deltas)
    assert p.whole == ["big.bin"] and p.patches == {} and p.payload == 8 * BS


def test_updates_up_to_the_inline_limit_travel_in_the_header():
    assert plan_host("g", HostView(None, {}), {"x": lf("x", INLINE, "1")}).inline is True
    assert plan_host("g", HostView(None, {}), {"x": lf("x", INLINE + 1, "1")}).inline is False


def _hosts(n: int) -> list[str]:
    return [f"h{i}" for i in range(n)]


def test_hosts_at_different_generations_get_their_own_updates():
    h_new, h_old, h_cur, h_rec = _hosts(4)
    views = {
        h_new: HostView(None, {}),  # never dispatched to
        h_old: HostView("g1", manifest_of(V1)),  # one generation behind
        h_cur: HostView("g2", manifest_of(V2)),  # read just now, up to date
        h_rec: HostView("g2", manifest_of(V2), check=True),  # up to date by our records: it must confirm
    }
    plan = plan_dispatch("g3", views, dict.fromkeys(views, V2))
    assert isinstance(plan, DispatchPlan)
    assert list(plan.send) == [h_new, h_old, h_rec] and plan.current == [h_cur] and plan.confirm == []
    assert plan.send[h_new].whole == ["a.py", "b.py", "new.txt"]
    assert plan.send[h_old].whole == ["a.py", "new.txt"] and plan.send[h_old].delete == ["old.txt"]
    assert plan.send[h_rec].empty and plan.send[h_rec].check and plan.send[h_rec].base == "g2"
    assert all(p.gen == "g3" for p in plan.send.values())
    sets = plan.change_sets()
    assert sets == {plan.send[h_new].key: [h_new], plan.send[h_old].key: [h_old], (): [h_rec]}


def test_hosts_in_the_same_state_share_a_plan_and_equal_change_sets_one_archive():
    a, b, c, d = _hosts(4)
    shared = manifest_of(V1)  # our records: hosts that got the same manifest share one object
    views = {
        a: HostView("g1", shared, check=True),
        b: HostView("g1", shared, check=True),
        c: HostView("g1", manifest_of(V1)),  # read from the host: its own dict, the same content
        d: HostView("g0", manifest_of(V1)),  # another generation with the same files
    }
    plan = plan_dispatch("g2", views, dict.fromkeys(views, V2))
    assert plan.send[a] is plan.send[b]
    assert plan.send[c] is not plan.send[a] and plan.send[d].base == "g0"
    assert plan.change_sets() == {plan.send[a].key: [a, b, c, d]}


def test_hosts_wanting_different_shards_are_in_different_change_sets():
    a, b = _hosts(2)
    wanted = {a: {**V2, "data/s0": lf("data/s0", 100, "6")}, b: {**V2, "data/s1": lf("data/s1", 100, "7")}}
    plan = plan_dispatch("g2", {a: HostView(None, {}), b: HostView(None, {})}, wanted)
    assert plan.send[a].whole == ["a.py", "b.py", "data/s0", "new.txt"]
    assert plan.send[b].whole == ["a.py", "b.py", "data/s1", "new.txt"]
    assert len(plan.change_sets()) == 2


def test_a_big_update_planned_from_records_is_confirmed_first():
    a, b, c = _hosts(3)
    big = {"huge.bin": lf("huge.bin", BULK, "8")}
    views = {a: HostView("g1", {}, check=True), b: HostView("g1", {}), c: HostView("g1", {}, check=True)}
    wanted = {a: big, b: big, c: {"small": lf("small", 10, "9")}}
    plan = plan_dispatch("g2", views, wanted)
    assert plan.confirm == [a] and list(plan.send) == [b, c] and plan.current == []
    assert plan.send[b].payload == BULK and plan.send[b].inline is False


def test_hosts_whose_patch_did_not_apply_get_the_file_whole():
    old = _big("o", OLD_BLOCKS)
    new = _big("n", digests(*"abXdefgh"), previous=(old.sha256, OLD_BLOCKS))
    a, b = _hosts(2)
    shared = manifest_of({"big.bin": old})
    views = {a: HostView("g1", shared), b: HostView("g1", shared)}
    plan = plan_dispatch("g2", views, dict.fromkeys(views, {"big.bin": new}), no_deltas={b})
    assert list(plan.send[a].patches) == ["big.bin"] and plan.send[a].whole == []
    assert plan.send[b].whole == ["big.bin"] and plan.send[b].patches == {}
    assert len(plan.change_sets()) == 2  # a patch and a whole file are different archives


def test_the_view_of_a_state_reply():
    reply = {"gen": "g1", "manifest": {"a.py": {"s": 1, "h": "00", "m": 420, "t": 5}},
             "drift": [{"path": "a.py", "problem": "modified"}, {"path": "b.py", "problem": "missing"}]}
    view = view_of(reply)
    assert (view.gen, view.manifest, view.drift, view.check) == ("g1", reply["manifest"], frozenset({"a.py", "b.py"}), False)
