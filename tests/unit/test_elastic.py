"""clusterctl/host/elastic.py: the next attempt's hosts when one is lost, and what each host runs then (pure).

Sections come from the real pipeline (spec -> plan -> job files), as the hosts get them."""

from __future__ import annotations

import json

import pytest

from clusterctl.host import elastic
from clusterctl.host.elastic import CannotContinue
from clusterctl.host.jobfile import check_elastic
from clusterctl.ops.job import job_files
from clusterctl.plan import make_plan
from clusterctl.spec import parse_spec


def spec_text(hosts=4, spares=1, trainers=2, extra_job="", mode="collective", host_extra=""):
    lines = ["name: el", "ssh: {config: none}", "hosts:"]
    for i in range(hosts + spares):
        lines.append(f"  - {{address: 10.0.0.{i + 1}{', spare: true' if i >= hosts else ''}{host_extra}}}")
    lines += ["job:", f"  mode: {mode}", "  entrypoint: [python3, train.py]", f"  trainers: {trainers}",
              "  restarts: 5"]
    lines += ["  " + line for line in extra_job.splitlines() if line]
    return "\n".join(lines) + "\n"


def sections(text, data_files=None):
    """{host index: the "elastic" section of its job file} (every host, spares included), JSON round-tripped."""
    plan = make_plan(parse_spec(text), data_files=data_files)
    files = job_files(plan, None, "tok")
    assert sorted(h.index for h in files) == [h.index for h in plan.hosts]
    return {h.index: json.loads(json.dumps(f["elastic"])) for h, f in files.items()}, plan


def env_of(section, view, index):
    """{(role, id): env} of the processes host `index` runs in `view`'s attempt."""
    part = elastic.attempt_part(section, view, index, "/home/u")
    return {(p["role"], p["id"]): p["env"] for p in part["processes"]}


@pytest.fixture
def four_and_a_spare():
    secs, plan = sections(spec_text(extra_job="min_hosts: 3"))
    return secs, plan


def test_the_first_view_is_the_plan(four_and_a_spare):
    secs, plan = four_and_a_spare
    sec = secs[0]
    view = elastic.initial_view(sec)
    assert view == {"attempt": 0, "members": [0, 1, 2, 3], "coordinator": 0, "pservers": [], "changes": []}
    # what each host would run in it is exactly what the plan gave it
    for i, host in enumerate(plan.hosts):
        want = {(p.role, p.id): p.env for p in plan.on_host(host)}
        assert env_of(secs[i], view, i) == want
    assert all(s["index"] == i for i, s in secs.items())
    assert {json.dumps(dict(s, index=0), sort_keys=True) for s in secs.values()} == {json.dumps(sec, sort_keys=True)}


def test_a_spare_takes_a_lost_hosts_place_and_every_other_rank_stays(four_and_a_spare):
    secs, _ = four_and_a_spare
    sec = secs[4]
    v0 = elastic.initial_view(sec)
    v1, change = elastic.next_view(sec, v0, lost=[2], available={4: 0.0}, now=1000.0)
    assert v1["members"] == [0, 1, 4, 3] and v1["attempt"] == 1 and v1["coordinator"] == 0
    assert change == {"attempt": 1, "at": 1000.0, "lost": [2], "replaced": [[2, 4]], "left_out": [],
                      "coordinator": None}
    assert v1["changes"] == [change]
    assert elastic.describe_change(sec, change) == "host 10.0.0.3 lost at attempt 0; 10.0.0.5 (spare) in its place at attempt 1"
    # the spare runs the lost host's ranks; the others keep theirs; the world is as big as before
    assert env_of(sec, v1, 4) == {k: dict(e, POD_IP="10.0.0.5", PADDLE_CURRENT_ENDPOINT="10.0.0.5:" + e["PADDLE_PORT"],
                                          PADDLE_TRAINER_ENDPOINTS=e["PADDLE_TRAINER_ENDPOINTS"].replace("10.0.0.3", "10.0.0.5"))
                                  for k, e in env_of(sec, v0, 2).items()}
    assert sorted(env_of(sec, v1, 4)) == [("trainer", 4), ("trainer", 5)]
    for i in (0, 1, 3):
        before, after = env_of(sec, v0, i), env_of(sec, v1, i)
        assert sorted(before) == sorted(after)
        for key in before:
            assert {k: v for k, v in after[key].items() if k != "PADDLE_TRAINER_ENDPOINTS"} == \
                {k: v for k, v in before[key].items() if k != "PADDLE_TRAINER_ENDPOINTS"}
    assert env_of(sec, v1, 0)[("trainer", 0)]["WORLD_SIZE"] == "8"
    assert env_of(sec, v1, 2) == {}  # the lost host runs nothing (it is not in the attempt)


def test_without_a_spare_a_lost_host_is_left_out_while_min_hosts_remain(four_and_a_spare):
    secs, _ = four_and_a_spare
    sec = secs[1]
    v1, c1 = elastic.next_view(sec, elastic.initial_view(sec), lost=[2], available={}, now=10.0)
    assert v1["members"] == [0, 1, 3] and c1["left_out"] == [2] and c1["replaced"] == []
    assert elastic.describe_change(sec, c1) == "host 10.0.0.3 lost at attempt 0; left out from attempt 1"
    envs = {**env_of(sec, v1, 0), **env_of(sec, v1, 1), **env_of(sec, v1, 3)}
    assert sorted(envs) == [("trainer", r) for r in range(6)]
    assert {e["WORLD_SIZE"] for e in envs.values()} == {"6"}
    assert {e["MASTER_ADDR"] for e in envs.values()} == {"10.0.0.1"}
    assert [envs[("trainer", r)]["POD_IP"] for r in range(6)] == ["10.0.0.1"] * 2 + ["10.0.0.2"] * 2 + ["10.0.0.4"] * 2
    assert envs[("trainer", 5)]["PADDLE_TRAINER_ENDPOINTS"] == ",".join(
        f"10.0.0.{h}:{p}" for h in (1, 2, 4) for p in (6180, 6181))
    # one more loss: 2 of min 3 is one too few
    with pytest.raises(CannotContinue) as info:
        elastic.next_view(sec, v1, lost=[3], available={}, now=20.0)
    assert str(info.value) == "cannot continue: 2 of min 3 hosts (lost: 10.0.0.4; no spare left)"


def test_the_data_shards_are_dealt_again_over_the_new_world():
    files = [f"part-{i}" for i in range(8)]
    secs, _ = sections(spec_text(spares=0, trainers=1, extra_job="min_hosts: 2") + "data: {local: /tmp, remote: d}\n",
                       data_files=files)
    sec = secs[0]
    v1, _ = elastic.next_view(sec, elastic.initial_view(sec), lost=[1], available={}, now=0.0)
    shards = {r: e["CLUSTERCTL_DATA_FILES"] for i in v1["members"] for (_, r), e in env_of(sec, v1, i).items()}
    assert shards == {0: "d/part-0:d/part-3:d/part-6", 1: "d/part-1:d/part-4:d/part-7", 2: "d/part-2:d/part-5"}


def test_the_coordinators_host_lost_the_next_member_takes_over_and_a_spare_takes_its_place(four_and_a_spare):
    secs, _ = four_and_a_spare
    sec = secs[1]
    v0 = elastic.initial_view(sec)
    assert elastic.successor(v0) == 1 and elastic.successor(v0, skip=[1]) == 2
    assert elastic.control_endpoint(sec, 1) == ("10.0.0.2", 6168)
    v1, change = elastic.next_view(sec, v0, lost=[0], available={4: 5.0}, now=10.0)
    assert v1["members"] == [4, 1, 2, 3] and v1["coordinator"] == 1 and change["coordinator"] == [0, 1]
    assert elastic.describe_change(sec, change) == (
        "host 10.0.0.1 lost at attempt 0 (the coordinator; 10.0.0.2 took over); "
        "10.0.0.5 (spare) in its place at attempt 1")
    part = elastic.attempt_part(sec, v1, 1, "/home/u")
    assert part["coordinator"] == {"address": "10.0.0.2", "port": 6168, "is_coordinator": True, "hosts": 4,
                                   "trainers_total": 8}
    spare = elastic.attempt_part(sec, v1, 4, "/home/u")
    assert spare["coordinator"]["is_coordinator"] is False and spare["member"] is True
    assert [p["env"]["RANK"] for p in spare["processes"]] == ["0", "1"]
    assert {p["env"]["MASTER_ADDR"] for p in spare["processes"]} == {"10.0.0.5"}  # rank 0 is on the spare now
    assert elastic.successor({"members": [0], "coordinator": 0}) is None


def test_a_majority_must_remain_so_that_a_cut_off_minority_never_runs_the_job_as_well(four_and_a_spare):
    secs, _ = four_and_a_spare
    sec = secs[0]
    v0 = elastic.initial_view(sec)
    # half lost, the coordinator's side: it goes on (the other half cannot: it lacks the coordinator)
    v1, change = elastic.next_view(sec, v0, lost=[2, 3], available={4: 0.0}, now=0.0)
    assert v1["members"] == [0, 1, 4] and change["replaced"] == [[2, 4]] and change["left_out"] == [3]
    with pytest.raises(CannotContinue) as info:
        elastic.next_view(sec, v0, lost=[0, 3], available={4: 0.0}, now=0.0)
    assert str(info.value) == (
        "cannot continue: 2 of the 4 hosts of attempt 0 are lost (10.0.0.1, 10.0.0.4): a majority must remain "
        "(half, with the coordinator), so that a cut-off minority never runs the job as well")
    with pytest.raises(CannotContinue, match=r"^cannot continue: 3 of the 4 hosts of attempt 0 are lost"):
        elastic.next_view(sec, v0, lost=[1, 2, 3], available={4: 0.0}, now=0.0)


def test_half_lost_on_the_coordinators_side_goes_on_with_the_spares_then_the_min():
    secs, _ = sections(spec_text(hosts=4, spares=2, extra_job="min_hosts: 3"))
    sec = secs[0]
    v1, change = elastic.next_view(sec, elastic.initial_view(sec), lost=[3, 1], available={5: 0.0}, now=0.0)
    assert v1["members"] == [0, 5, 2] and change["replaced"] == [[1, 5]] and change["left_out"] == [3]
    assert elastic.describe_change(sec, change) == ("host 10.0.0.2 lost at attempt 0; 10.0.0.6 (spare) in its place "
                                                    "at attempt 1; host 10.0.0.4 lost at attempt 0; left out from "
                                                    "attempt 1")


def test_no_member_lost_is_a_plain_restart_on_the_same_hosts(four_and_a_spare):
    secs, _ = four_and_a_spare
    sec = secs[0]
    v0 = elastic.initial_view(sec)
    v1, change = elastic.next_view(sec, v0, lost=[4, 9], available={}, now=0.0)  # an idle host lost: no change
    assert change is None and v1 == dict(v0, attempt=1)


def test_changes_are_bounded_per_window():
    secs, _ = sections(spec_text(hosts=4, spares=3, extra_job="min_hosts: 2\nmax_host_changes: 2"))
    sec = secs[0]
    assert sec["max_host_changes"] == 2 and sec["host_change_window"] == elastic.HOST_CHANGE_WINDOW == 3600.0
    v = elastic.initial_view(sec)
    v, _ = elastic.next_view(sec, v, lost=[1], available={4: 0.0, 5: 0.0, 6: 0.0}, now=100.0)
    v, _ = elastic.next_view(sec, v, lost=[2], available={5: 0.0, 6: 0.0}, now=200.0)
    with pytest.raises(CannotContinue) as info:
        elastic.next_view(sec, v, lost=[3], available={6: 0.0}, now=300.0)
    assert str(info.value) == ("cannot continue without 10.0.0.4: the job's hosts changed 2 time(s) within the "
                               "last 3600s (job.max_host_changes: 2)")
    # an hour after the first change, one more may happen
    v3, change = elastic.next_view(sec, v, lost=[3], available={6: 0.0}, now=3700.0)
    assert v3["members"] == [0, 4, 5, 6] and change["attempt"] == 3
    none = dict(sec, max_host_changes=0)
    with pytest.raises(CannotContinue, match=r"changed 0 time\(s\) .* \(job.max_host_changes: 0\)"):
        elastic.next_view(none, elastic.initial_view(none), lost=[1], available={4: 0.0}, now=0.0)


def test_a_host_that_came_back_waits_as_a_spare_and_is_picked_only_once_it_stayed(four_and_a_spare):
    secs, _ = four_and_a_spare
    sec = secs[0]
    v1, _ = elastic.next_view(sec, elastic.initial_view(sec), lost=[2], available={4: 0.0}, now=1000.0)
    # host 2 reconnects during attempt 1: it is not let into the running attempt
    assert elastic.admission(v1, 2) == "spare" and elastic.admission(v1, 4) == "member"
    assert elastic.eligible(sec, v1, {2: 1010.0, 0: 0.0, 99: 0.0}, now=1030.0) == []  # back 20 s: not yet
    assert elastic.eligible(sec, v1, {2: 1010.0}, now=1070.0) == [2]  # back 60 s
    lines = elastic.describe_view(sec, v1, connected={2: 1010.0}, now=1030.0)
    assert lines == [
        "attempt 1 runs on 4 host(s) (min 3): 10.0.0.1, 10.0.0.2, 10.0.0.5, 10.0.0.4; coordinator 10.0.0.1",
        "10.0.0.3: came back after it was lost at attempt 0: a spare for the next attempt, not in this one "
        "(eligible 60s after it came back)",
        "host 10.0.0.3 lost at attempt 0; 10.0.0.5 (spare) in its place at attempt 1"]
    # the spare is lost: host 2, back long enough, takes its place
    v2, change = elastic.next_view(sec, v1, lost=[4], available={2: 1010.0}, now=1100.0)
    assert v2["members"] == [0, 1, 2, 3] and change["replaced"] == [[4, 2]]
    # too early: it is not used, and the lost host is left out instead
    v2b, change = elastic.next_view(sec, v1, lost=[4], available={2: 1090.0}, now=1100.0)
    assert v2b["members"] == [0, 1, 3] and change["left_out"] == [4]
    assert elastic.describe_view(sec, v2b, connected={}) == [
        "attempt 2 runs on 3 host(s) (min 3): 10.0.0.1, 10.0.0.2, 10.0.0.4; coordinator 10.0.0.1",
        "10.0.0.3: lost at attempt 0", "10.0.0.5: lost at attempt 1",
        "host 10.0.0.3 lost at attempt 0; 10.0.0.5 (spare) in its place at attempt 1",
        "host 10.0.0.5 lost at attempt 1; left out from attempt 2"]


def test_describe_view_names_spares_connected_or_not(four_and_a_spare):
    secs, _ = four_and_a_spare
    sec = secs[0]
    v0 = elastic.initial_view(sec)
    assert elastic.describe_view(sec, v0)[1:] == ["10.0.0.5: spare"]
    assert elastic.describe_view(sec, v0, connected={})[1:] == ["10.0.0.5: spare (not connected)"]
    assert elastic.host_name(sec, 9) == "hosts[9]"
    with pytest.raises(KeyError):
        elastic.control_endpoint(sec, 9)
    assert elastic.missing(v0, connected={1, 3}, me=0) == [2]


def pserver_sections(on="per_host: 1", spares=1, extra=""):
    return sections(spec_text(hosts=4, spares=spares, trainers=1, mode="pserver",
                              extra_job=f"pservers: {{{on}}}\nmin_hosts: 2\n{extra}"))


def test_pservers_keep_their_ids_and_hosts_a_lost_hosts_go_to_its_replacement_or_the_least_loaded():
    secs, plan = pserver_sections()
    sec = secs[0]
    v0 = elastic.initial_view(sec)
    assert v0["pservers"] == [0, 1, 2, 3] == [p.host.index for p in plan.pservers]
    v1, _ = elastic.next_view(sec, v0, lost=[2], available={4: 0.0}, now=0.0)
    assert v1["pservers"] == [0, 1, 4, 3]
    v2, _ = elastic.next_view(sec, v1, lost=[1], available={}, now=10.0)
    assert v2["members"] == [0, 4, 3] and v2["pservers"] == [0, 0, 4, 3]  # pserver.1 to the first least-loaded
    assert elastic.check_view(v2, sec) == v2
    with pytest.raises(ValueError, match=r"^view.pservers: must place each of the job's 4 pserver\(s\) on a member$"):
        elastic.check_view(dict(v2, pservers=[0, 0, 4]), sec)
    laid = elastic.laid_out(sec, v2)
    ps = [(p["id"], p["endpoint"]) for p in laid["processes"] if p["role"] == "pserver"]
    assert ps == [(0, "10.0.0.1:6170"), (1, "10.0.0.1:6171"), (2, "10.0.0.5:6170"), (3, "10.0.0.4:6170")]
    part = elastic.attempt_part(sec, v2, 3, "/home/u", laid=laid, pserver_wait=7.0)
    assert part["start_trainers_after"] == {"endpoints": [e for _, e in ps], "timeout": 7.0}
    trainer = next(p for p in part["processes"] if p["role"] == "trainer")
    assert trainer["env"]["PADDLE_PSERVERS_IP_PORT_LIST"] == ",".join(e for _, e in ps)
    assert trainer["env"]["PADDLE_TRAINERS_NUM"] == "3"


def test_pservers_named_by_address_or_counted_are_placed_as_the_plan_placed_them():
    text = spec_text(hosts=3, spares=1, trainers=1, mode="pserver",
                     extra_job="pservers: [10.0.0.3, 10.0.0.3, 10.0.0.1]\nmin_hosts: 2")
    secs, plan = sections(text)
    assert elastic.initial_view(secs[0])["pservers"] == [2, 2, 0] == [p.host.index for p in plan.pservers]
    text = spec_text(hosts=3, spares=1, trainers=1, mode="pserver", extra_job="pservers: 4")
    secs, plan = sections(text)
    assert elastic.initial_view(secs[0])["pservers"] == [0, 1, 2, 0] == [p.host.index for p in plan.pservers]


def test_hosts_that_cannot_be_laid_out_end_the_job_in_one_line():
    # pserver ports 6170.. and trainer ports 6171..: a second pserver on a host collides with its trainer
    secs, _ = pserver_sections(extra="ports: {pserver: 6170, trainer: 6171}")
    sec = secs[0]
    with pytest.raises(CannotContinue) as info:
        elastic.next_view(sec, elastic.initial_view(sec), lost=[1], available={}, now=0.0)
    assert str(info.value) == ("cannot continue on 10.0.0.1, 10.0.0.3, 10.0.0.4: two planned endpoints on "
                               "10.0.0.1:6171: pserver.1 and trainer.0")


def test_an_idle_host_runs_nothing_and_paths_resolve_against_the_home(four_and_a_spare):
    secs, plan = four_and_a_spare
    sec = secs[4]
    v0 = elastic.initial_view(sec)
    part = elastic.attempt_part(sec, v0, 4, "/home/u")
    assert part == {"member": False, "processes": [], "start_trainers_after": None,
                    "coordinator": {"address": "10.0.0.1", "port": 6168, "is_coordinator": False, "hosts": 4,
                                    "trainers_total": 8}}
    first = elastic.attempt_part(secs[0], v0, 0, "/home/u")["processes"][0]
    assert first["cwd"] == "/home/u/clusterctl/el" and first["log"] == "/home/u/clusterctl/el.logs/trainer.0.log"
    assert first["ports"] == ["10.0.0.1:6180"] and first["argv"] == ["python3", "train.py"]
    absolute = dict(sec, log_dir="/var/log/el")
    assert elastic.attempt_part(absolute, v0, 1, "/home/u")["processes"][0]["log"] == "/var/log/el/trainer.2.log"


def test_views_from_other_hosts_are_checked(four_and_a_spare):
    secs, _ = four_and_a_spare
    sec = secs[0]
    v1, _ = elastic.next_view(sec, elastic.initial_view(sec), lost=[1], available={4: 3.0}, now=7)
    assert elastic.check_view(json.loads(json.dumps(v1)), sec) == v1
    bad = [
        ([], "view: must be an object"),
        (dict(v1, attempt=-1), "view.attempt: must be an integer >= 0"),
        (dict(v1, attempt=True), "view.attempt: must be an integer >= 0"),
        (dict(v1, members=[0, 0]), "view.members: must list distinct hosts of the job"),
        (dict(v1, members=[0, 17]), "view.members: must list distinct hosts of the job"),
        (dict(v1, members=[]), "view.members: must list distinct hosts of the job"),
        (dict(v1, coordinator=1), "view.coordinator: must be one of the members"),
        (dict(v1, pservers=[1]), "view.pservers: must place each of the job's 0 pserver(s) on a member"),
        (dict(v1, pservers="x"), "view.pservers: must place each of the job's 0 pserver(s) on a member"),
        (dict(v1, changes={}), "view.changes: must be a list of at most 100 changes"),
        (dict(v1, changes=[{}] * 101), "view.changes: must be a list of at most 100 changes"),
        (dict(v1, changes=[dict(v1["changes"][0], at="now")]), "view.changes: malformed change"),
        (dict(v1, changes=[dict(v1["changes"][0], replaced=[[1]])]), "view.changes: malformed change"),
        (dict(v1, changes=[dict(v1["changes"][0], coordinator=[1])]), "view.changes: malformed change"),
        (dict(v1, changes=[7]), "view.changes: malformed change 7"),
    ]
    for raw, message in bad:
        with pytest.raises(ValueError) as info:
            elastic.check_view(raw, sec)
        assert str(info.value).startswith(message), (raw, str(info.value))


# -- pserver checkpoints on the new placement ------------------------------------------------------------------


def manifest(root, name, server_id, count, step):
    d = root / name
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({"server_id": server_id, "num_servers": count, "step": step}))


def test_ps_inventory_reads_each_shards_steps_and_ignores_what_is_not_one(tmp_path):
    manifest(tmp_path, "pserver-0", 0, 3, 40)
    manifest(tmp_path, "pserver-0.prev", 0, 3, 30)
    manifest(tmp_path, "pserver-1", 1, 2, 40)  # saved by a job of 2 pservers: not ours
    manifest(tmp_path, "pserver-2", 0, 3, 40)  # another pserver's manifest under this name
    (tmp_path / "pserver-2.prev").mkdir()
    (tmp_path / "pserver-2.prev" / "manifest.json").write_text("{not json")
    assert elastic.ps_inventory(str(tmp_path), 3) == {0: [40, 30]}
    assert elastic.ps_inventory(str(tmp_path / "absent"), 3) == {}
    (tmp_path / "big").mkdir()
    manifest(tmp_path / "big", "pserver-0", 0, 1, 5)
    (tmp_path / "big" / "pserver-0" / "manifest.json").write_bytes(b" " * (elastic.MAX_MANIFEST + 1))
    manifest(tmp_path / "big", "pserver-0.prev", 0, 1, True)  # a step that is not a number
    assert elastic.ps_inventory(str(tmp_path / "big"), 1) == {}


def test_checkpoint_dir_is_job_envs_relative_to_the_workspace():
    secs, _ = pserver_sections(extra="env: {CLUSTERCTL_PS_CHECKPOINT: ckpt}")
    assert elastic.checkpoint_dir(secs[0], "/home/u") == "/home/u/clusterctl/el/ckpt"
    secs, _ = pserver_sections(extra="env: {CLUSTERCTL_PS_CHECKPOINT: /shared/ckpt}")
    assert elastic.checkpoint_dir(secs[0], "/home/u") == "/shared/ckpt"
    secs, _ = pserver_sections()
    assert elastic.checkpoint_dir(secs[0], "/home/u") is None
    secs, _ = sections(spec_text(extra_job="min_hosts: 3"))
    assert elastic.checkpoint_dir(secs[0], "/home/u") is None


def test_a_moved_pserver_without_its_shard_refuses_the_attempt_in_one_line():
    secs, _ = pserver_sections(extra="env: {CLUSTERCTL_PS_CHECKPOINT: /ckpt}")
    sec = secs[0]
    v0 = elastic.initial_view(sec)
    v1, _ = elastic.next_view(sec, v0, lost=[2], available={4: 0.0}, now=0.0)  # pserver.2 moves to host 4
    local = {0: {0: [40, 30]}, 1: {1: [40, 30]}, 3: {3: [40]}}
    assert elastic.shard_problem(sec, v0, v1, {**local, 4: {}}) == (
        "cannot resume the parameters: pserver.2's checkpoint shard (pserver-2 in /ckpt) was on 10.0.0.3, which is "
        "gone, and 10.0.0.5 does not hold it; put CLUSTERCTL_PS_CHECKPOINT on storage every host shares "
        "(docs/lifecycle.md)")
    # on storage every host shares, the new host holds it (inventories as JSON carries them: string keys)
    shared = {str(k): [40, 30] for k in range(4)}
    assert elastic.shard_problem(sec, v0, v1, {h: shared for h in (0, 1, 3, 4)}) is None
    # nothing saved yet anywhere: every pserver starts afresh
    assert elastic.shard_problem(sec, v0, v1, {}) is None
    # the shards are there, but at no step in common
    odd = {0: {0: [40]}, 1: {1: [40]}, 3: {3: [40]}, 4: {2: [20]}}
    assert elastic.shard_problem(sec, v0, v1, odd) == (
        "cannot resume the parameters: the pservers hold no checkpoint step in common "
        "(pserver.0: [40]; pserver.1: [40]; pserver.2: [20]; pserver.3: [40])")
    assert elastic.shard_problem(sec, v0, dict(v0, attempt=1), {**local, 2: {2: [40]}}) is None  # nothing moved
    secs, _ = pserver_sections()  # no checkpoints kept: nothing to check
    assert elastic.shard_problem(secs[0], v0, v1, {}) is None


def test_every_section_passes_the_hosts_own_validator(four_and_a_spare):
    secs, _ = four_and_a_spare
    for i, sec in secs.items():
        assert check_elastic(sec, "s", f"10.0.0.{i + 1}") == sec
