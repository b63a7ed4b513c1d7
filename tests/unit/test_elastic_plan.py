"""Elastic jobs from the spec to the hosts: hosts[].spare and job.min_hosts validated at their line, the plan
(spares in plan.hosts, running nothing), every host's job file (the "elastic" section, checked by the host's
own validator), the plan cache, and dispatch and start over fake hosts (tests/unit/fakehosts.py)."""

from __future__ import annotations

import copy
import json
import os
import sys

import pytest

from clusterctl import plancache
from clusterctl.errors import SpecError
from clusterctl.host import elastic
from clusterctl.host.common import InputError
from clusterctl.host.jobfile import check_elastic, load_job, with_elastic
from clusterctl.ops import load_plan
from clusterctl.ops.dispatch import dispatch
from clusterctl.ops.job import job_files, start, status, stop
from clusterctl.plan import make_plan
from clusterctl.spec import load_spec, parse_spec

sys.path.insert(0, os.path.dirname(__file__))
from fakehosts import FakeCluster, wait_until  # noqa: E402

SPEC = """\
name: el
ssh: {config: none}
hosts:
  - address: 10.0.0.1
  - address: 10.0.0.2
  - address: 10.0.0.3
  - address: 10.0.0.4
    spare: true
job:
  entrypoint: [python3, train.py]
  trainers: 2
  restarts: 2
  min_hosts: 2
"""

BAD = [
    pytest.param(SPEC.replace("min_hosts: 2", "min_hosts: 4"),
                 ["13:3: job.min_hosts: 4, but the job starts on 3 host(s) (the 1 spare(s) only take a lost host's "
                  "place)"], id="min-above-members"),
    pytest.param(SPEC.replace("min_hosts: 2", "min_hosts: 0"),
                 ["13:3: job.min_hosts: input should be greater than or equal to 1"], id="min-zero"),
    pytest.param(SPEC.replace("restarts: 2", "restarts: 0"),
                 ["12:3: job.restarts: an elastic job (hosts[].spare, job.min_hosts) goes on without a lost host by "
                  "restarting: set job.restarts (1 or more)"], id="no-restarts"),
    pytest.param(SPEC.replace("    spare: true", "    spare: maybe"),
                 ["8:5: hosts[3].spare: expected true or false"], id="spare-not-a-bool"),
    pytest.param(SPEC.replace("  - address: 10.0.0.1\n  - address: 10.0.0.2\n  - address: 10.0.0.3\n", ""),
                 ["3:1: hosts: every host is a spare: at least one host must run the job"], id="only-spares"),
    pytest.param(SPEC.replace("job:\n", "job:\n  launcher: mpi\n"),
                 ["10:3: job.launcher: launcher: mpi cannot change the job's hosts (mpiexec's world is fixed); "
                  "elastic jobs (hosts[].spare, job.min_hosts) use launcher: ssh"], id="mpi"),
    pytest.param(SPEC.replace("job:\n", "job:\n  mode: pserver\n  pservers: [10.0.0.1, 10.0.0.4]\n"),
                 ["11:24: job.pservers[1]: 10.0.0.4 is a spare: spares run nothing until they take a lost host's "
                  "place"], id="pserver-on-a-spare"),
    pytest.param(SPEC + "  max_host_changes: 101\n",
                 ["14:3: job.max_host_changes: input should be less than or equal to 100"], id="too-many-changes"),
    # any host may become the coordinator or rank 0's: those ports are reserved on every host
    pytest.param(SPEC.replace("  - address: 10.0.0.1\n", "  - address: 10.0.0.1\n    slots: 1\n")
                 + "  ports: {control: 6181}\n",
                 ["15:3: job.ports: two planned endpoints on 10.0.0.2:6181: trainer.2 and the job's control port "
                  "(reserved: elastic job)"], id="control-port-on-another-host"),
    pytest.param(SPEC.replace("    spare: true", "    spare: true\n    slots: 3") + "  ports: {master: 6182}\n",
                 ["15:3: job.ports: two planned endpoints on 10.0.0.4:6182: trainer.8 and the trainers' "
                  "master port (reserved: elastic job)"], id="master-port-on-a-spare"),
]


@pytest.mark.parametrize("text, expected", BAD)
def test_bad_elastic_specs_are_refused_at_their_line(write_spec, text, expected):
    path = write_spec(text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    lines = [str(p) for p in info.value.problems]
    assert lines == [f"{path}:{want}" for want in expected]


def test_spares_are_hosts_that_run_nothing_and_the_members_plan_is_unchanged():
    plan = make_plan(parse_spec(SPEC))
    without = make_plan(parse_spec(SPEC.replace("  - address: 10.0.0.4\n    spare: true\n", "")
                                   .replace("  min_hosts: 2\n", "")))
    assert [h.address for h in plan.hosts] == ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"]
    assert [h.address for h in plan.spares] == ["10.0.0.4"] and plan.members == plan.hosts[:3]
    assert plan.on_host(plan.hosts[3]) == ()
    assert plan.min_hosts == 2 and without.min_hosts is None and without.elastic is None
    # the members run what they would without a spare (control and master ports are only reserved elsewhere)
    assert [p.to_json() for p in plan.processes] == [p.to_json() for p in without.processes]
    assert plan.control_endpoint == without.control_endpoint == "10.0.0.1:6168"
    assert plan.to_json()["elastic"] == {"spares": ["10.0.0.4"], "min_hosts": 2, "max_host_changes": 3}
    assert "elastic" not in without.to_json()
    e = plan.elastic
    assert e["members"] == [0, 1, 2] and e["spares"] == [3] and e["min_hosts"] == 2
    assert e["host_change_window"] == 3600.0 and e["workdir"] == "clusterctl/el" and e["log_dir"] == "clusterctl/el.logs"
    assert [h["address"] for h in e["hosts"]] == ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"]
    assert e["job"]["elastic"] is True and e["job"]["name"] == "el"


def test_min_hosts_alone_makes_a_job_elastic_and_all_hosts_not_elastic():
    shrink = make_plan(parse_spec(SPEC.replace("    spare: true\n", "")))
    assert shrink.spares == () and shrink.min_hosts == 2 and shrink.elastic["members"] == [0, 1, 2, 3]
    fixed = make_plan(parse_spec(SPEC.replace("    spare: true\n", "").replace("min_hosts: 2", "min_hosts: 4")))
    plain = make_plan(parse_spec(SPEC.replace("    spare: true\n", "").replace("  min_hosts: 2\n", "")))
    assert fixed == plain and fixed.min_hosts is None and fixed.elastic is None


def test_a_spare_listed_first_leaves_the_coordinator_to_the_first_member():
    text = SPEC.replace("  - address: 10.0.0.1\n", "  - address: 10.0.0.1\n    spare: true\n").replace(
        "  - address: 10.0.0.4\n    spare: true\n", "  - address: 10.0.0.4\n")
    plan = make_plan(parse_spec(text))
    assert plan.control_endpoint == "10.0.0.2:6168" and plan.trainers[0].env["MASTER_ADDR"] == "10.0.0.2"
    files = job_files(plan, None, "tok")
    assert {h.address: f["coordinator"]["is_coordinator"] for h, f in files.items()} == {
        "10.0.0.1": False, "10.0.0.2": True, "10.0.0.3": False, "10.0.0.4": False}
    assert files[plan.hosts[0]]["processes"] == []


def test_every_host_gets_a_job_file_with_its_section_and_the_host_reads_it_back(tmp_path):
    plan = make_plan(parse_spec(SPEC))
    files = job_files(plan, {h: "/home/u" for h in plan.hosts}, "tok")
    assert list(files) == list(plan.hosts)
    for host, job in files.items():
        sec = job["elastic"]
        assert sec["index"] == host.index
        assert {k: v for k, v in sec.items() if k != "index"} == {k: v for k, v in plan.elastic.items()}
        assert job["coordinator"]["hosts"] == 4 and job["coordinator"]["trainers_total"] == 6
        path = tmp_path / f"{host.address}.json"
        path.write_text(json.dumps(job))
        assert load_job(str(path))["elastic"] == json.loads(json.dumps(sec))
    assert [len(f["processes"]) for f in files.values()] == [2, 2, 2, 0]
    # what the spare would run in the first attempt is what the plan gives it: nothing; host 1 its two trainers
    sec = files[plan.hosts[1]]["elastic"]
    part = elastic.attempt_part(sec, elastic.initial_view(sec), 1, "/home/u")
    assert part["processes"] == [dict(p, env={**files[plan.hosts[1]]["env"], **p["env"]})
                                 for p in files[plan.hosts[1]]["processes"]]


def _section():
    plan = make_plan(parse_spec(SPEC))
    return job_files(plan, {h: "/home/u" for h in plan.hosts}, "tok")[plan.hosts[1]]


def _bad(mutate):
    job = _section()
    sec = copy.deepcopy(job["elastic"])
    mutate(sec)
    return job, sec


BAD_SECTIONS = [
    (lambda s: s.update(index=3), "elastic.index: hosts[3] is 10.0.0.4, not this job file's host 10.0.0.2"),
    (lambda s: s.update(index=7), "elastic.index: 7 is not the index of one of the job's hosts"),
    (lambda s: s.update(colour="red"), "elastic: unknown key 'colour'"),
    (lambda s: s.update(hosts=[]), "elastic.hosts: must be a non-empty list"),
    (lambda s: s["hosts"][0].pop("gpus"), "elastic.hosts[0]: must be an object with exactly index, address, endpoint, "
                                          "trainers, gpus"),
    (lambda s: s["hosts"][1].update(index=0), "elastic.hosts[1].index: 0 appears twice"),
    (lambda s: s["hosts"][1].update(trainers=-1), "elastic.hosts[1].trainers: must be an integer >= 0, got -1"),
    (lambda s: s["hosts"][1].update(gpus=[True]), "elastic.hosts[1].gpus: must be a list of GPU indices"),
    (lambda s: s.update(members=[0, 0, 1]), "elastic.members: a host is listed twice"),
    (lambda s: s.update(members=[0, 9]), "elastic.members: 9 is not the index of one of the job's hosts"),
    (lambda s: s.update(members="0"), "elastic.members: must be a list of host indices"),
    (lambda s: s.update(members=[]), "elastic.members: the job needs at least one host"),
    (lambda s: s.update(spares=[2, 3]), "elastic: every host must be either a member or a spare, once"),
    (lambda s: s.update(min_hosts=4), "elastic.min_hosts: 4, but the job starts on 3 host(s)"),
    (lambda s: s.update(min_hosts=0), "elastic.min_hosts: must be an integer >= 1, got 0"),
    (lambda s: s.update(max_host_changes=-1), "elastic.max_host_changes: must be an integer >= 0, got -1"),
    (lambda s: s.update(host_change_window=0), "elastic.host_change_window: must be a number >= 1.0, got 0"),
    (lambda s: s.update(workdir=""), "elastic.workdir: must be a non-empty string, got ''"),
    (lambda s: s.update(job=[]), "elastic.job: must be an object"),
    (lambda s: s["job"].update(mode="solo"), "elastic.job.mode: must be 'collective' or 'pserver', got 'solo'"),
    (lambda s: s["job"].update(entrypoint=[]), "elastic.job.entrypoint: must be a non-empty list of strings"),
    (lambda s: s["job"].update(args=[1]), "elastic.job.args: must be a list of strings"),
    (lambda s: s["job"].update(env={"A=B": "x"}), "elastic.job.env: must be an object of string to string (no '=' "
                                                  "in names)"),
    (lambda s: s["job"].update(ports=None), "elastic.job.ports: must be an object"),
    (lambda s: s["job"]["ports"].update(master=70000), "elastic.job.ports.master: must be <= 65535"),
    (lambda s: s["job"].update(pservers={"count": 1, "on": []}), "elastic.job.pservers: must be one of {count: N}, "
                                                                "{per_host: N}, {on: [addresses]}, {at: [indices]}"),
    (lambda s: s["job"].update(pservers={"per_host": "2"}), "elastic.job.pservers.per_host: must be an integer >= 0"),
    (lambda s: s["job"].update(pservers={"on": [1]}), "elastic.job.pservers.on: must be a list of strings"),
    (lambda s: s["job"].update(pservers={"at": ["a"]}), "elastic.job.pservers.at: must be a list of host indices"),
    (lambda s: s["job"].update(k_steps=0), "elastic.job.k_steps: must be an integer >= 1, got 0"),
    (lambda s: s["job"].update(data=[]), "elastic.job.data: must be null or an object"),
    (lambda s: s["job"].update(data={"remote": "d", "files": "x"}), "elastic.job.data.files: must be a list of "
                                                                    "strings"),
    (lambda s: s["job"].pop("elastic"), "elastic.job.elastic: must be true"),
]


@pytest.mark.parametrize("mutate, message", BAD_SECTIONS)
def test_a_bad_elastic_section_is_refused_by_the_builder_and_the_host_naming_the_key(tmp_path, mutate, message):
    job, sec = _bad(mutate)
    with pytest.raises(ValueError) as info:
        with_elastic([(job, sec["index"])], sec)
    assert str(info.value).startswith("job file for 10.0.0.2: " + message), str(info.value)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(dict(job, elastic=sec)))
    with pytest.raises(InputError) as info:
        load_job(str(path))
    assert str(info.value).startswith(f"{path}: {message}"), str(info.value)


def test_a_section_that_is_not_an_object_is_refused():
    with pytest.raises(InputError, match=r"^s: must be an object$"):
        check_elastic([], "s")
    job, sec = _bad(lambda s: None)
    assert check_elastic(sec, "s")["index"] == 1 and with_elastic([(job, 1)], sec) == [dict(job, elastic=sec)]
    other = dict(job, host="10.0.0.3")  # the shared part is checked once, each index against its file's host
    assert [j["elastic"]["index"] for j in with_elastic([(job, 1), (other, 2)], sec)] == [1, 2]
    with pytest.raises(ValueError, match=r"^job file for 10.0.0.3: elastic.index: hosts\[1\] is 10.0.0.2, not this "
                                         r"job file's host 10.0.0.3$"):
        with_elastic([(job, 1), (other, 1)], sec)


def test_an_elastic_plan_comes_back_from_the_plan_cache_as_it_was_made(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cluster.yaml").write_text(SPEC)
    old = 1_600_000_000
    os.utime(tmp_path / "cluster.yaml", (old, old))
    spec, plan, _ = load_plan("cluster.yaml")
    assert spec is not None and os.path.exists(plancache.entry_path("cluster.yaml"))
    spec2, plan2, _ = load_plan("cluster.yaml")
    assert spec2 is None and plan2 == plan and repr(plan2) == repr(plan)
    assert plan2.spares[0] is plan2.hosts[3]
    assert job_files(plan2, None, "tok") == job_files(plan, None, "tok")


# -- over fake hosts ------------------------------------------------------------------------------------------


def fake(tmp_path, files=None, **job):
    """Three fake hosts, n2 a spare."""
    c = FakeCluster(tmp_path, hosts=3, files=files or {"train.py": "print('rank', __import__('os').environ['RANK'])\n"},
                    job={"restarts": 1, **job})
    spec = c.spec_path.read_text().replace("  train_address: 127.0.0.3\n", "  train_address: 127.0.0.3\n  spare: true\n")
    assert "spare: true" in spec
    c.spec_path.write_text(spec)
    return c


def test_dispatch_gives_every_host_of_an_elastic_job_every_data_shard(tmp_path):
    c = fake(tmp_path, files={"train.py": "pass\n"})
    text = c.spec_path.read_text() + "data: {local: shards, pattern: 'part-*', remote: data}\n"
    c.spec_path.write_text(text)
    (tmp_path / "shards").mkdir()
    for i in range(3):
        (tmp_path / "shards" / f"part-{i}").write_text(f"shard {i}\n")
    (tmp_path / "shards" / "README").write_text("not a shard")
    with c.session() as s:
        assert [p.env["CLUSTERCTL_DATA_FILES"] for p in s.plan.trainers] == ["data/part-0:data/part-2", "data/part-1"]
        dispatch(s)
    want = {"train.py", "data/part-0", "data/part-1", "data/part-2"}
    for i in range(3):  # the spare too: any later attempt may deal any shard to any host
        got = {os.path.relpath(os.path.join(d, n), c.workspace(i)) for d, _, ns in os.walk(c.workspace(i)) for n in ns}
        assert got == want, i


def test_an_elastic_job_starts_its_spare_idle_and_succeeds_on_its_members(tmp_path):
    c = fake(tmp_path)
    with c.session() as s:
        dispatch(s)
        try:
            start(s)
            done = wait_until(lambda: (x := status(s)).state == "succeeded" and x)
            assert [(p.host, p.role, p.id, p.state) for p in done.processes] == [
                ("n0", "trainer", 0, "exited"), ("n1", "trainer", 1, "exited")]
        finally:
            stop(s)
    job = json.loads((c.home(2) / ".clusterctl" / "jobs" / c.name / "job.json").read_text())
    assert job["processes"] == [] and job["elastic"]["index"] == 2 and job["elastic"]["spares"] == [2]


def test_a_later_attempts_part_is_a_valid_job_file_for_the_spare(tmp_path):
    """What the supervisor's wiring does with attempt_part: swap the processes, the coordinator's endpoint and
    the pserver wait into its job file; the host's validator takes the result."""
    plan = make_plan(parse_spec(SPEC.replace("job:\n", "job:\n  mode: pserver\n  pservers: {per_host: 1}\n")))
    files = job_files(plan, {h: "/home/u" for h in plan.hosts}, "tok")
    spare = files[plan.hosts[3]]
    sec = spare["elastic"]
    view, _ = elastic.next_view(sec, elastic.initial_view(sec), lost=[0], available={3: 0.0}, now=0.0)
    part = elastic.attempt_part(sec, view, 3, "/home/u")
    assert [(p["role"], p["id"]) for p in part["processes"]] == [("pserver", 0), ("trainer", 0), ("trainer", 1)]
    job = dict(spare, processes=part["processes"], start_trainers_after=part["start_trainers_after"],
               coordinator=dict(spare["coordinator"], **part["coordinator"]))
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    loaded = load_job(str(path))
    assert [p["env"]["RANK"] for p in loaded["processes"] if p["role"] == "trainer"] == ["0", "1"]
    assert loaded["coordinator"]["address"] == "10.0.0.2" and loaded["coordinator"]["is_coordinator"] is False
    assert loaded["start_trainers_after"]["endpoints"] == ["10.0.0.4:6170", "10.0.0.2:6170", "10.0.0.3:6170"]
