"""The supervisor's elastic wiring (clusterctl/host/supervisor.py with host/elastichost.py) in this process: job
files from the real pipeline (spec -> plan -> job files), stand-in links that record what is sent, a clock the
test moves. The decisions themselves are host/elastic.py's (tests/unit/test_elastic.py); end to end with real
supervisors: tests/unit/test_elastic_fake.py and, on the docker cluster, tests/integration/test_elastic_cluster.py."""

from __future__ import annotations

import json
import os
import sys

import pytest

from clusterctl.host import elastic, protocol
from clusterctl.host.elastichost import ElasticHost
from clusterctl.host.jobdir import STATE_FILE
from clusterctl.host.jobfile import validate_job
from clusterctl.host.states import HostState, JobState, ProcState
from clusterctl.host.supervisor import Supervisor
from clusterctl.ops.job import job_files
from clusterctl.plan import make_plan
from clusterctl.spec import parse_spec
from helpers import free_port_base

sys.path.insert(0, os.path.dirname(__file__))
from test_agent_supervisor import Clock, FakeCoordLink, FakePeerLink, run_until  # noqa: E402

S = JobState
TOKEN = "e1a5" * 16
SLEEP = "import time; time.sleep(60)"


def addr(i):
    return "127.0.0.%d" % (i + 1)


def jobs(tmp_path, monkeypatch, members=4, spares=1, extra_job=(), mode="collective"):
    """{host index: its validated job file} for an elastic job on 127.0.0.1.. (the last `spares` spares)."""
    home = tmp_path / "home"
    (home / "ws").mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("HOME", str(home))
    base = free_port_base(8, tuple(addr(i) for i in range(members + spares)))
    lines = ["name: el", "ssh: {config: none}", "workspace: {local: ., remote: ws}", "hosts:"]
    lines += ["  - {address: %s%s}" % (addr(i), ", spare: true" if i >= members else "")
              for i in range(members + spares)]
    lines += ["job:", "  mode: %s" % mode, "  entrypoint: [%s, -c, %s]" % (json.dumps(sys.executable),
                                                                          json.dumps(SLEEP)),
              "  trainers: 1", "  restarts: 3", "  restart_backoff: 1", "  grace: 1",
              "  ports: {control: %d, master: %d, trainer: %d, pserver: %d}" % (base, base + 1, base + 2, base + 5)]
    lines += ["  " + line for line in extra_job]
    plan = make_plan(parse_spec("\n".join(lines) + "\n"))
    files = job_files(plan, {h: str(home) for h in plan.hosts}, TOKEN)
    return {h.index: validate_job(json.loads(json.dumps(f)), "job.json") for h, f in files.items()}


def supervisor(tmp_path, job, clock):
    jobdir = tmp_path / ("jobdir-%s" % job["host"])
    jobdir.mkdir(exist_ok=True)
    sup = Supervisor(job, str(jobdir), clock=clock)
    sup.tick = 0.01
    sup.link = FakeCoordLink() if sup.members is not None else FakePeerLink()
    sup.my_ticks, sup.started_at = None, 1.0
    return sup


def hello(index, attempt=0, idle=False, failed=None, ps=None):
    return protocol.parse_message(json.loads(json.dumps(protocol.hello(
        "el", addr(index), "ab" * 32, "p", [], None, attempt, idle, failed, index, ps))))


def join(sup, *indices, **kw):
    for i in indices:
        sup.link.peers.add(addr(i))
        sup.peer_joined(addr(i), "%s:9" % addr(i), hello(i, **kw))


def state_file(sup):
    with open(os.path.join(sup.jobdir, STATE_FILE)) as f:
        return json.load(f)


def restart_coordinator(sup, clock, done=()):
    """Let the coordinator stop the failed attempt, hear `done` from `done`, wait the back-off: the next attempt."""
    assert run_until(sup, lambda: sup.core.stop_done)
    for i in done:
        sup.peer_message(addr(i), {"type": protocol.Msg.DONE, "attempt": sup.core.attempt, "ps": None})
    sup.step()
    assert sup.restart_at is not None, (sup.members.waiting(), sup.core.state)
    clock.t = sup.restart_at
    sup.step()


@pytest.mark.timeout(60)
def test_the_coordinator_waits_for_every_host_puts_the_spare_in_a_lost_hosts_place_then_ends_below_the_min(
        tmp_path, monkeypatch):
    files = jobs(tmp_path, monkeypatch, extra_job=["min_hosts: 3"])
    clock = Clock()
    sup = supervisor(tmp_path, files[0], clock)
    link = sup.link
    sup._start_attempt()
    join(sup, 1, 2, 3)
    sup.step()
    assert sup.awaiting_go and link.sent == []  # the spare has not joined yet
    join(sup, 4)
    sup.step()
    assert not sup.awaiting_go and [m for _, m in link.sent] == [protocol.go(0)] * 4
    assert sup.procs.rows[0].state == ProcState.RUNNING
    link.sent.clear()

    # the spare going away is no verdict; a member going away is
    link.peers.discard(addr(4))
    sup.peer_left(addr(4), "connection closed")
    assert sup.core.verdict is None and sup.members.to_json()[addr(4)]["state"] == HostState.DISCONNECTED
    join(sup, 4)
    link.peers.discard(addr(2))
    sup.peer_left(addr(2), "no heartbeat for 5.1s")
    assert sup.core.verdict.reason == "lost host 127.0.0.3: no heartbeat for 5.1s" and sup.core.verdict.restart
    restart_coordinator(sup, clock, done=(1, 3))
    assert sup.core.attempt == 1 and sup.core.state == S.RUNNING
    view = sup.elastic.view
    assert (view["members"], view["coordinator"]) == ([0, 1, 4, 3], 0)  # the spare at the lost host's place
    assert view["changes"][0]["replaced"] == [[2, 4]]
    assert [(h, m["type"], m.get("attempt")) for h, m in link.sent if m["type"] == "restart"] == [
        (addr(1), "restart", 1), (addr(3), "restart", 1), (addr(4), "restart", 1)]
    assert link.sent[-1][1]["view"] == view
    st = state_file(sup)
    assert st["elastic"]["lines"] == [
        "attempt 1 runs on 4 host(s) (min 3): 127.0.0.1, 127.0.0.2, 127.0.0.5, 127.0.0.4; coordinator 127.0.0.1",
        "127.0.0.3: lost at attempt 0",
        "host 127.0.0.3 lost at attempt 0; 127.0.0.5 (spare) in its place at attempt 1"]
    env = dict(sup.procs.rows[0].env)
    assert (env["RANK"], env["WORLD_SIZE"]) == ("0", "4")

    # the lost host comes back: it never joins the running attempt; it waits, idle, as a spare
    link.sent.clear()
    join(sup, 2, idle=True, failed="lost connection to coordinator")
    assert link.sent == [(addr(2), protocol.restart(1, view))] and sup.core.verdict is None
    sup.step()
    st = state_file(sup)
    assert ("127.0.0.3: came back after it was lost at attempt 0: a spare for the next attempt, not in this one "
            "(eligible 60s after it came back)") in st["elastic"]["lines"]
    assert st["elastic"]["idle"] == ["127.0.0.3"]

    # two members lost at once, no spare left that may take a place (the one back for less than 60 s): the end
    for i in (1, 3):
        link.peers.discard(addr(i))
        sup.peer_left(addr(i), "connection closed")
    assert sup.core.verdict.restart
    restart_coordinator(sup, clock, done=(4,))  # the spare that took a place is a member now: it is waited for
    assert sup.core.final and sup.core.state == S.FAILED
    assert sup.core.verdict.reason == "cannot continue: 2 of min 3 hosts (lost: 127.0.0.2, 127.0.0.4; no spare left)"
    final = protocol.stop(S.FAILED, sup.core.verdict.reason, sup.core.verdict.failure, 1, False)
    assert (addr(2), final) in link.sent and (addr(4), final) in link.sent


@pytest.mark.timeout(60)
def test_a_spare_that_never_joins_is_not_waited_for_past_connect_timeout_but_a_member_is(tmp_path, monkeypatch):
    files = jobs(tmp_path, monkeypatch, members=2, spares=1)
    clock = Clock()
    sup = supervisor(tmp_path, files[0], clock)
    sup._start_attempt()
    join(sup, 1)
    sup.step()
    assert sup.awaiting_go
    clock.t += 30.5  # connect_timeout: the members are all here, the spare is not: go without it
    sup.step()
    assert not sup.awaiting_go and sup.link.sent == [(addr(1), protocol.go(0))]

    (tmp_path / "b").mkdir()
    sup2 = supervisor(tmp_path / "b", files[0], Clock())
    sup2._start_attempt()
    join(sup2, 2)  # the spare joined, a member did not
    sup2.clock.t += 30.5
    assert run_until(sup2, lambda: sup2.core.state in (S.RESTARTING, S.FAILED))
    assert sup2.core.verdict.reason == "only 0 of 1 peer host(s) connected within 30s (connected: none)"
    assert [r.pid for r in sup2.procs.rows] == [None]  # nothing was started


def test_a_hello_must_name_the_host_it_comes_from(tmp_path, monkeypatch):
    files = jobs(tmp_path, monkeypatch, members=2, spares=1)
    sup = supervisor(tmp_path, files[0], Clock())
    assert sup.refuse(addr(2), hello(2)) is None
    assert sup.refuse(addr(2), hello(1)) == "elastic job: host index 1 is not 127.0.0.3"
    assert sup.refuse(addr(2), hello(7)) == "elastic job: host index 7 is not 127.0.0.3"
    assert sup.refuse(addr(2), dict(hello(2), index=None)) == (
        "elastic job: the hello of 127.0.0.3 has no host index (an older agent?)")


@pytest.mark.timeout(60)
def test_a_spare_runs_nothing_until_a_view_gives_it_a_place_and_a_host_left_out_keeps_its_old_logs(
        tmp_path, monkeypatch):
    files = jobs(tmp_path, monkeypatch, members=3, spares=1, extra_job=["min_hosts: 2"])
    section = files[0]["elastic"]
    v0 = elastic.initial_view(section)
    v1, _ = elastic.next_view(section, v0, lost=[1], available={3: 0.0}, now=100.0)
    v2, _ = elastic.next_view(section, v1, lost=[3], available={}, now=200.0)  # the spare lost in turn: 2 left
    clock = Clock()
    spare = supervisor(tmp_path, files[3], clock)
    spare._start_attempt()
    spare.coordinator_message(protocol.parse_message(protocol.go(0)))
    assert spare.core.state == S.RUNNING and spare.procs.rows == []
    assert spare.hello_fields()["index"] == 3 and spare.hello_fields()["ps"] is None
    spare.coordinator_message(protocol.parse_message(json.loads(json.dumps(protocol.stop(
        S.FAILED, "lost host 127.0.0.2: connection closed", None, 0, True)))))
    assert run_until(spare, lambda: spare.core.state == S.RESTARTING)
    spare.coordinator_message(protocol.parse_message(json.loads(json.dumps(protocol.restart(1, v1)))))
    assert spare.core.attempt == 1 and spare.elastic.view == v1
    (row,) = spare.procs.rows
    assert (row.role, row.id, row.state) == ("trainer", 1, ProcState.RUNNING)
    with open("/proc/%d/environ" % row.pid, "rb") as f:
        env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
    assert (env[b"RANK"], env[b"WORLD_SIZE"], env[b"CLUSTERCTL_RESTART_COUNT"]) == (b"1", b"3", b"1")
    assert env[b"CLUSTERCTL_JOB_TOKEN"]  # the job's processes' secret, as on every other host
    assert spare.core.trainers_total == 3

    # a view it is not in: it runs nothing; what it ran stays listed for `logs` (state.json "retired")
    spare.coordinator_message(protocol.parse_message(json.loads(json.dumps(protocol.restart(2, v2)))))
    assert run_until(spare, lambda: spare.core.attempt == 2)
    assert spare.procs.rows == [] and spare.state == S.RUNNING
    st = state_file(spare)
    assert [(r["role"], r["id"], [e["attempt"] for e in r["logs"]]) for r in st["retired"]] == [("trainer", 1, [1])]
    assert st["elastic"]["member"] is False
    # a view that does not fit this job is refused (logged), and nothing changes
    spare.coordinator_message(protocol.parse_message(json.loads(json.dumps(protocol.restart(3, dict(v2, members=[9]))))))
    assert spare.core.attempt == 2 and spare.elastic.view == v2


@pytest.mark.timeout(60)
def test_peers_turn_to_the_coordinators_successor_which_takes_over(tmp_path, monkeypatch):
    files = jobs(tmp_path, monkeypatch, members=4, spares=0, extra_job=["min_hosts: 3"])
    clock = Clock()
    sups = {i: supervisor(tmp_path, files[i], clock) for i in (1, 2)}
    for sup in sups.values():
        sup._start_attempt()
        sup.coordinator_message(protocol.parse_message(protocol.go(0)))
        sup.link.lost_since = None
    # the coordinator's host is lost: both notice (the link's record), then reconnect_timeout passes
    for sup in sups.values():
        sup.link.connected = False
        sup.link.lost_since = clock.t
    clock.t += 3.1
    for sup in sups.values():
        sup.step()
        assert sup.core.verdict.reason.startswith("lost connection to coordinator 127.0.0.1:")
        assert sup.core.verdict.restart
    one, two = sups[1], sups[2]
    try:
        # host 1 is the successor: it listens on its own control endpoint; host 2 turns to it
        assert one.is_coord and one.link.endpoint == "127.0.0.2:%d" % files[0]["coordinator"]["port"]
        assert not two.is_coord and two.link.endpoint == "127.0.0.2:%d" % files[0]["coordinator"]["port"]
        assert two.elastic.target == 1
        coord_link = one.link
        one.link = FakeCoordLink()
        coord_link.close()
        assert run_until(one, lambda: one.core.stop_done)
        join(one, 2, idle=True, failed="lost connection to coordinator")
        one.step()
        assert one.restart_at is None  # host 3 has not joined yet (connect_timeout at most)
        join(one, 3, idle=True, failed="lost connection to coordinator")
        one.step()
        clock.t = one.restart_at
        one.step()
        view = one.elastic.view
        assert (one.core.attempt, view["members"], view["coordinator"]) == (1, [1, 2, 3], 1)
        assert view["changes"][-1]["coordinator"] == [0, 1]
        assert state_file(one)["elastic"]["lines"][-1] == (
            "host 127.0.0.1 lost at attempt 0 (the coordinator; 127.0.0.2 took over); left out from attempt 1")
        assert (addr(2), protocol.restart(1, view)) in one.link.sent
        env = dict(one.procs.rows[0].env)
        assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"]) == ("0", "3", "127.0.0.2")

        # host 2's successor never answers: after connect_timeout it is the next in line, and takes over itself
        clock.t += 30.5
        two.step()
        assert two.is_coord and two.link.endpoint == "127.0.0.3:%d" % files[0]["coordinator"]["port"]
    finally:
        for sup in sups.values():
            sup.link.close()


def test_plan_next_refuses_a_pserver_placement_whose_shard_is_gone_and_the_taker_over_plans_its_own_attempt(
        tmp_path, monkeypatch):
    files = jobs(tmp_path, monkeypatch, members=3, spares=1, mode="pserver",
                 extra_job=["min_hosts: 2", "pservers: {per_host: 1}", "env: {CLUSTERCTL_PS_CHECKPOINT: ckpt}"])
    section = files[0]["elastic"]
    el = ElasticHost(section, str(tmp_path / "home"))
    assert el.view["pservers"] == [0, 1, 2]
    el.index_of = {addr(i): i for i in range(4)}
    # pserver.1's shard was on host 1's own disk; host 3 (the spare) takes its place and lacks it
    el.inventories = {2: {2: [20]}, 3: {}}
    with pytest.raises(elastic.CannotContinue) as info:
        el.plan_next({addr(2), addr(3)}, {addr(3): 0.0}, 1000.0, {0: [20]})
    assert str(info.value) == (
        "cannot resume the parameters: pserver.1's checkpoint shard (pserver-1 in ckpt) was on 127.0.0.2, which is "
        "gone, and 127.0.0.4 does not hold it; put CLUSTERCTL_PS_CHECKPOINT on storage every host shares "
        "(docs/lifecycle.md)")
    el.inventories[3] = {1: [20, 10]}  # shared storage: every host holds every shard
    view, change = el.plan_next({addr(2), addr(3)}, {addr(3): 0.0}, 1000.0, {0: [20]})
    assert (view["members"], view["pservers"], change["replaced"]) == ([0, 3, 2], [0, 3, 2], [[1, 3]])
    # this host took over from host 0, but host 1 answered late: the next view is still this host's to run
    taker = ElasticHost(dict(section, index=2), str(tmp_path / "home"))
    taker.index_of = {addr(i): i for i in range(4)}
    taker.lost = {0}
    view, change = taker.plan_next({addr(1)}, {}, 1000.0, None)
    assert (view["coordinator"], change["coordinator"], view["changes"][-1]) == (2, [0, 2], change)


def test_status_folds_an_elastic_job_from_its_current_attempts_hosts():
    from clusterctl.ops.job import fold_status

    def reply(host, state, attempt, coordinator=False, members=None, lines=(), procs=()):
        out = {"ok": True, "job": "el", "host": host, "state": state, "attempt": attempt, "restarts": 3,
               "is_coordinator": coordinator, "reason": None if state == "succeeded" else "supervisor is not running",
               "processes": [{"role": "trainer", "id": i, "pid": 10 + i, "state": s, "exit_code": 0}
                             for i, s in procs]}
        if members is not None:
            out["elastic"] = {"index": 0, "member": True, "view": {"attempt": attempt}, "members": members,
                              "lines": list(lines), "idle": []}
        return out

    lines = ["attempt 1 runs on 3 host(s) (min 2): a, b, d; coordinator a", "c: lost at attempt 0",
             "host c lost at attempt 0; d (spare) in its place at attempt 1"]
    replies = {
        "A": reply("a", "succeeded", 1, True, ["a", "b", "d"], lines, [(0, "exited")]),
        "B": reply("b", "succeeded", 1, False, ["a", "b", "d"], ["peer's lines"], [(1, "exited")]),
        "C": reply("c", "lost", 0, False, ["a", "b", "c"], ["old"], [(2, "lost")]),
        "D": reply("d", "succeeded", 1, False, ["a", "b", "d"], [7, "\x1b[31mspoof"], [(2, "exited")]),
    }
    addresses = {"A": "a", "B": "b", "C": "c", "D": "d", "E": "e"}
    st = fold_status("el", replies, {"E": "No route to host"}, addresses, elastic_job=True)
    # c was lost and replaced, e is a spare that does not answer: neither decides the job's state or reason
    assert (st.state, st.reason, st.attempt) == ("succeeded", None, 1)
    assert st.elastic["lines"] == lines and st.elastic["members"] == ["a", "b", "d"]
    assert [(p.host, p.id, p.state) for p in st.processes] == [("A", 0, "exited"), ("B", 1, "exited"),
                                                               ("C", 2, "lost"), ("D", 2, "exited")]
    assert st.to_json()["elastic"]["lines"] == lines
    # a member that does not answer still makes the job `lost`; a host's control characters never reach the screen
    st = fold_status("el", {k: v for k, v in replies.items() if k != "B"}, {"B": "No route to host"},
                     {"A": "a", "B": "b", "C": "c", "D": "d"}, elastic_job=True)
    assert (st.state, st.reason) == ("lost", "unreachable: B")
    only_d = fold_status("el", {"D": replies["D"]}, {}, addresses, elastic_job=True)
    assert only_d.elastic["lines"] == ["?[31mspoof"]


def test_a_verdict_every_host_gives_is_said_once_with_who_gave_it():
    """Each host of a failed job gives the job's verdict: status said it once per host (`n0: trainer.1 on n1 exited
    with code 3; n1: trainer.1 on n1 exited with code 3`, 64 times at 64 hosts). Now once, with the hosts that said
    it (two and a count past three); another verdict is said apart."""
    from clusterctl.ops.job import fold_status

    def failed(host, reason):
        return {"ok": True, "job": "j", "host": host, "state": "failed", "reason": reason, "processes": []}

    same = "trainer.1 on h1 exited with code 3"
    st = fold_status("j", {f"h{i}": failed(f"h{i}", same) for i in range(2)}, {})
    assert st.reason == f"h0, h1: {same}"
    st = fold_status("j", {**{f"h{i}": failed(f"h{i}", same) for i in range(5)}, "h5": failed("h5", "other")}, {})
    assert st.reason == f"h0, h1 and 3 more hosts: {same}; h5: other"
