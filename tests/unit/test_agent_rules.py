"""The supervisor's rules (clusterctl/host/rules.py), its membership, policy, trainer gate and the protocol's
parsing: pure functions over small state objects, tested without processes, sockets or a real clock."""

from __future__ import annotations

import itertools
import json

import pytest

from clusterctl.host import protocol, rules
from clusterctl.host.common import InputError
from clusterctl.host.membership import Membership
from clusterctl.host.policy import DEFAULT_TIMINGS, Policy, Timings
from clusterctl.host.processes import TrainerGate
from clusterctl.host.rules import ExitEvent, JobCore, Verdict
from clusterctl.host.states import HostState, JobState
from clusterctl.host.status import AttemptRecord, HostStatus

S = JobState


def core(restarts=0, on_failure="stop", trainers=2, attempt=0):
    c = JobCore(Policy(on_failure=on_failure, restarts=restarts), trainers, started_at=100.0)
    c.attempt = attempt
    rules.mark_running(c)
    return c


def ev(role, id, code=None, error=None, host="h1", attempt=0):
    return ExitEvent(role, id, code, error, host, attempt)


# -- the transition table ----------------------------------------------------------------------------------------


def test_every_move_outside_the_table_is_refused():
    states = [S.STARTING, S.RUNNING, S.STOPPING, S.RESTARTING, S.SUCCEEDED, S.FAILED, S.STOPPED]
    for old, new in itertools.product(states, states):
        if new in rules.TRANSITIONS[old]:
            rules.check_transition(old, new)
        else:
            with pytest.raises(rules.IllegalTransition, match="job state %s -> %s is not allowed" % (old, new)):
                rules.check_transition(old, new)
    assert all(not rules.TRANSITIONS[t] for t in (S.SUCCEEDED, S.FAILED, S.STOPPED))  # terminal
    c = core()
    with pytest.raises(rules.IllegalTransition):
        c.move(S.SUCCEEDED)  # running -> succeeded skips the stop
    assert c.state == S.RUNNING


# -- a process exit anywhere ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("on_failure, events, want", [
    # fail-fast: the first trainer failure decides
    ("stop", [ev("trainer", 1, 3)], Verdict(S.FAILED, "trainer.1 on h1 exited with code 3",
                                            {"role": "trainer", "id": 1, "host": "h1", "exit_code": 3})),
    ("stop", [ev("trainer", 0, -9, host="h2")], Verdict(S.FAILED, "trainer.0 on h2 exited with code -9",
                                                        {"role": "trainer", "id": 0, "host": "h2", "exit_code": -9})),
    # a pserver that dies while trainers run is a failure; one that exits 0 is nothing
    ("stop", [ev("pserver", 0, 1)], Verdict(S.FAILED, "pserver.0 on h1 exited with code 1",
                                            {"role": "pserver", "id": 0, "host": "h1", "exit_code": 1})),
    ("stop", [ev("pserver", 0, 0)], None),
    ("continue", [ev("pserver", 0, 1)], None),
    ("continue", [ev("trainer", 0, 3)], None),
    # every trainer known: the verdict
    ("stop", [ev("trainer", 0, 0), ev("trainer", 1, 0)], Verdict(S.SUCCEEDED, "all 2 trainers exited 0")),
    ("continue", [ev("trainer", 0, 3), ev("trainer", 1, 0)],
     Verdict(S.FAILED, "all trainers ended; 1 failure(s), first: trainer.0 on h1 code 3",
             {"role": "trainer", "id": 0, "host": "h1", "exit_code": 3})),
    ("continue", [ev("pserver", 0, 1), ev("trainer", 0, 0), ev("trainer", 1, 0)],
     Verdict(S.FAILED, "all trainers ended; 1 failure(s), first: pserver.0 on h1 code 1",
             {"role": "pserver", "id": 0, "host": "h1", "exit_code": 1})),
    # a process that could not start fails the job whatever on_failure says
    ("continue", [ev("trainer", 1, None, "cannot start trainer.1 (x in /w): No such file or directory")],
     Verdict(S.FAILED, "trainer.1 on h1 failed to start: cannot start trainer.1 (x in /w): No such file or directory",
             {"role": "trainer", "id": 1, "host": "h1", "exit_code": None,
              "error": "cannot start trainer.1 (x in /w): No such file or directory"})),
])
def test_a_process_exit_anywhere(on_failure, events, want):
    c = core(on_failure=on_failure)
    got = [rules.on_exit(c, e) for e in events]
    assert got[:-1] == [None] * (len(events) - 1) and got[-1] == want
    assert len(c.exits) == len(events)


def test_continue_records_each_failure_and_the_rest_goes_on():
    c = core(on_failure="continue", trainers=3)
    assert rules.on_exit(c, ev("trainer", 0, 3)) is None
    assert rules.on_exit(c, ev("trainer", 1, 4, host="h2")) is None
    assert [f["exit_code"] for f in c.failures] == [3, 4]
    v = rules.on_exit(c, ev("trainer", 2, 0))
    assert v.reason == "all trainers ended; 2 failure(s), first: trainer.0 on h1 code 3"


def test_repeats_other_attempts_and_exits_after_the_verdict_change_nothing():
    c = core(attempt=1)
    assert rules.on_exit(c, ev("trainer", 0, 1, attempt=0)) is None  # an exit of the attempt before
    assert c.exits == {} and c.failures == []
    v = rules.on_exit(c, ev("trainer", 0, 1, attempt=1))
    assert v.outcome == S.FAILED
    rules.apply_verdict(c, v)
    assert rules.on_exit(c, ev("trainer", 1, 0, attempt=1)) is None  # decided already
    c2 = core(on_failure="continue")
    assert rules.on_exit(c2, ev("trainer", 0, 3)) is None
    assert rules.on_exit(c2, ev("trainer", 0, 3)) is None  # the same exit again (a hello repeats exits)
    assert len(c2.failures) == 1


def test_a_job_without_trainers_never_succeeds_by_itself():
    c = core(trainers=0)
    assert rules.on_exit(c, ev("pserver", 0, 0)) is None


# -- restart or final ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("restarts, attempt, restart", [(0, 0, False), (2, 0, True), (2, 1, True), (2, 2, False)])
def test_a_failure_restarts_while_restarts_are_left(restarts, attempt, restart):
    c = core(restarts=restarts, attempt=attempt)
    assert rules.on_exit(c, ev("trainer", 0, 1, attempt=attempt)).restart is restart
    assert rules.on_host_lost(core(restarts, attempt=attempt), "h2", "x").restart is restart


def test_success_stop_requests_and_failures_to_start_are_never_restarted():
    c = core(restarts=5, trainers=1)
    assert rules.on_exit(c, ev("trainer", 0, 0)).restart is False
    assert rules.on_exit(core(restarts=5), ev("trainer", 0, None, "cannot start")).restart is False
    assert rules.on_stop_request(core(restarts=5), "stop requested on h1").restart is False


def test_the_back_off_doubles_and_has_a_floor_and_a_cap():
    p = Policy(restart_backoff=1)
    assert [p.restart_delay(k) for k in (0, 1, 2, 3, 4, 9, 10, 60)] == [0.0, 1, 2, 4, 8, 256, 300, 300]
    with pytest.raises(InputError, match="restart_backoff: must be a number between 1.0 and 300.0, got 0.5"):
        Policy(restart_backoff=0.5)


def test_a_whole_restart_cycle_moves_along_the_table_and_is_recorded():
    c = core(restarts=1)
    v = rules.on_exit(c, ev("trainer", 0, 1))
    assert rules.apply_verdict(c, v) == rules.BEGIN_STOP and c.state == S.STOPPING and c.restart_pending
    assert rules.apply_verdict(c, Verdict(S.FAILED, "later", restart=True)) is None  # the first verdict stands
    rules.stop_finished(c, 200.0)
    assert c.state == S.RESTARTING and c.stop_done
    assert c.history.kept == [AttemptRecord(0, S.FAILED, "trainer.0 on h1 exited with code 1",
                                            {"role": "trainer", "id": 0, "host": "h1", "exit_code": 1}, 100.0, 200.0)]
    rules.begin_attempt(c, 1, 201.0)
    assert (c.state, c.attempt, c.verdict, c.exits, c.failures, c.stop_done) == (S.STARTING, 1, None, {}, [], False)
    rules.mark_running(c)
    v = rules.on_exit(c, ev("trainer", 0, 1, attempt=1))
    assert v.restart is False  # the last attempt
    rules.apply_verdict(c, v)
    rules.stop_finished(c, 300.0)
    assert c.state == S.FAILED and c.final and c.history.total == 1


def test_a_stop_request_is_final_also_over_a_pending_restart():
    c = core(restarts=3)
    assert rules.on_stop_request(c, "stop requested on h1", grace=2.0) == Verdict(S.STOPPED, "stop requested on h1",
                                                                                   grace=2.0)
    rules.apply_verdict(c, rules.on_exit(c, ev("trainer", 0, 1)))  # restart pending, stop under way
    stop = rules.on_stop_request(c, "stop requested on h2")
    assert rules.apply_verdict(c, stop) == rules.FINALIZED and c.state == S.STOPPING and c.final
    rules.stop_finished(c, 5.0)
    assert c.state == S.STOPPED and c.history.total == 0  # final: the current attempt, not a finished one
    assert rules.on_stop_request(c, "again") is None
    # during the back-off (stopped already): straight to stopped
    c = core(restarts=3)
    rules.apply_verdict(c, rules.on_exit(c, ev("trainer", 0, 1)))
    rules.stop_finished(c, 5.0)
    assert rules.apply_verdict(c, rules.on_stop_request(c, "stop requested on h1")) == rules.FINALIZED
    assert c.state == S.STOPPED and [a.outcome for a in c.history.kept] == [S.FAILED]


def test_the_attempt_history_is_bounded_and_counts_every_attempt():
    c = core(restarts=rules.ATTEMPTS_KEPT + 10)
    for k in range(rules.ATTEMPTS_KEPT + 5):
        rules.apply_verdict(c, rules.on_exit(c, ev("trainer", 0, 1, attempt=k)))
        rules.stop_finished(c, float(k))
        rules.begin_attempt(c, k + 1, float(k))
        rules.mark_running(c)
    assert c.history.total == rules.ATTEMPTS_KEPT + 5 and c.history.dropped == 5
    assert [a.attempt for a in c.history.kept] == list(range(5, rules.ATTEMPTS_KEPT + 5))


# -- hosts ---------------------------------------------------------------------------------------------------------


def test_a_lost_or_failed_host_and_peers_that_never_connect():
    c = core()
    assert rules.on_host_lost(c, "h2", "no heartbeat for 5.1s") == Verdict(
        S.FAILED, "lost host h2: no heartbeat for 5.1s", {"host": "h2", "role": None, "id": None, "exit_code": None})
    assert rules.on_host_failed(c, "h3", "lost connection to coordinator") == Verdict(
        S.FAILED, "host h3: lost connection to coordinator", {"host": "h3", "role": None, "id": None, "exit_code": None})
    t = Timings(connect_timeout=30)
    assert rules.on_peers_missing(c, {"h2"}, 2, 29.9, t) is None
    assert rules.on_peers_missing(c, {"h2", "h3"}, 2, 99, t) is None
    assert rules.on_peers_missing(c, {"h3", "h2"}, 3, 30.1, t).reason == (
        "only 2 of 3 peer host(s) connected within 30s (connected: ['h2', 'h3'])")
    assert rules.on_peers_missing(c, set(), 1, 31, t).reason == "only 0 of 1 peer host(s) connected within 30s (connected: none)"
    rules.apply_verdict(c, Verdict(S.STOPPED, "x"))
    assert rules.on_host_lost(c, "h2", "x") is None and rules.on_host_failed(c, "h2", "x") is None
    assert rules.on_peers_missing(c, set(), 1, 31, t) is None


def test_membership_joined_done_lost_and_never_joined():
    m = Membership(3)
    m.join("b", "10.0.0.2:5000", 1.0)
    m.join("c", "10.0.0.3:5000", 1.0)
    assert m.waiting() == ["b", "c"] and m.unjoined() == 1
    m.mark_done("b", 2.0)
    m.mark_done("x", 2.0)  # not connected: nothing
    assert m.waiting() == ["c"] and m.to_json()["b"] == {"state": HostState.DONE, "since": 2.0}
    assert m.leave("b", "connection closed", 3.0, deciding=True) is False  # done: expected to go
    assert m.to_json()["b"]["state"] == HostState.DONE
    assert m.leave("c", "no heartbeat", 3.0, deciding=True) is True
    assert m.to_json()["c"] == {"state": HostState.LOST, "since": 3.0, "why": "no heartbeat"}
    m.join("c", "10.0.0.3:5001", 4.0)
    assert m.leave("c", "connection closed", 5.0, deciding=False) is False
    assert m.to_json()["c"]["state"] == HostState.DISCONNECTED
    m.join("b", "10.0.0.2:5001", 6.0, done=True)
    m.join("d", "10.0.0.4:5000", 6.0)
    m.new_attempt(7.0)
    assert m.waiting() == ["b", "d"] and m.unjoined() == 0
    assert m.to_json()["d"] == {"state": HostState.CONNECTED, "since": 7.0, "addr": "10.0.0.4:5000"}


def test_an_elastic_jobs_membership_counts_its_views_members_only():
    m = Membership(2, members=["b", "c"], everyone=3)  # b and c run the attempt; d is a spare
    for host in ("b", "c", "d"):
        m.join(host, "a:1", 1.0, index=ord(host) - ord("a"))
    assert m.all_joined() and m.waiting() == ["b", "c"] and m.connected_members() == {"b", "c"}
    assert m.to_json()["d"] == {"state": HostState.CONNECTED, "since": 1.0, "addr": "a:1", "index": 3}
    assert m.leave("d", "connection closed", 2.0, deciding=True) is False  # an idle host going away: no verdict
    assert m.to_json()["d"] == {"state": HostState.DISCONNECTED, "since": 2.0, "why": "connection closed", "index": 3}
    assert not m.all_joined() and m.unjoined() == 0
    assert m.leave("c", "no heartbeat", 3.0, deciding=True) is True
    m.set_members(["b", "d"])  # the next view: d in c's place
    assert (m.expected, m.is_member("d"), m.is_member("c"), m.unjoined()) == (2, True, False, 0)
    m.join("d", "a:2", 4.0)
    m.mark_done("d", 5.0)
    assert m.waiting() == ["b"] and m.joined_at == {"b": 1.0, "d": 4.0}


def test_the_start_barrier_waits_for_every_host_and_past_connect_timeout_for_the_members_only():
    t, c = DEFAULT_TIMINGS, core()
    assert rules.barrier_passed(c, True, True, 0.1, t)  # every host joined
    assert not rules.barrier_passed(c, False, True, 29.0, t)  # a spare is missing: wait for it ...
    assert rules.barrier_passed(c, False, True, 30.1, t)  # ... up to connect_timeout
    assert not rules.barrier_passed(c, False, False, 31.0, t)  # a member is missing: on_peers_missing decides
    rules.apply_verdict(c, Verdict(S.STOPPED, "stop requested on h2"))
    assert not rules.barrier_passed(c, True, True, 1.0, t)  # decided at the barrier: nothing starts


def test_an_elastic_peer_turns_to_the_successor_after_reconnect_timeout_and_from_a_silent_one_after_connect():
    t, c = DEFAULT_TIMINGS, core(restarts=2)
    assert not rules.next_coordinator_due(c, t, 10.0, None, None, False)  # never lost (or never connected)
    assert not rules.next_coordinator_due(c, t, 13.0, 10.0, None, False)
    assert rules.next_coordinator_due(c, t, 13.1, 10.0, None, False)  # the coordinator: reconnect_timeout
    assert not rules.next_coordinator_due(c, t, 40.0, None, 10.0, True)
    assert rules.next_coordinator_due(c, t, 40.1, None, 10.0, True)  # a successor that never answered
    rules.apply_verdict(c, Verdict(S.FAILED, "x"))  # final: nothing to take over
    assert not rules.next_coordinator_due(c, t, 100.0, 10.0, None, False)
    # the coordinator's silence fails the attempt as for any job, but never makes it final: the successor rule does
    c = core(restarts=2)
    v = rules.on_coordinator_silence(c, t, 13.1, 0.0, True, 10.0, "connection closed", "h1:1", elastic=True)
    assert v.restart and v.reason == "lost connection to coordinator h1:1: connection closed"
    rules.apply_verdict(c, v)
    assert rules.on_coordinator_silence(c, t, 100.0, 0.0, True, 10.0, "x", "h1:1", elastic=True) is None
    assert rules.on_coordinator_silence(c, t, 100.0, 0.0, True, 10.0, "x", "h1:1").restart is False
    assert rules.takeover_gathered([], 0.0, 0.0, t) and not rules.takeover_gathered(["h3"], 30.0, 0.0, t)
    assert rules.takeover_gathered(["h3"], 30.1, 0.0, t)


# -- the peer's side -------------------------------------------------------------------------------------------------


def test_the_coordinators_verdict_on_a_peer():
    c = core(restarts=1, attempt=1)
    assert rules.on_verdict_received(c, S.FAILED, "old", None, 0, True) is None  # an attempt this host left
    v = rules.on_verdict_received(c, S.FAILED, "trainer.0 on h2 exited with code 1", {"role": "trainer"}, 1, True)
    assert v == Verdict(S.FAILED, "trainer.0 on h2 exited with code 1", {"role": "trainer"}, restart=True)
    rules.apply_verdict(c, v)
    assert rules.on_verdict_received(c, S.FAILED, "again", None, 1, True) is None
    final = rules.on_verdict_received(c, S.STOPPED, "stop requested on h1", None, 1, True)
    assert final == Verdict(S.STOPPED, "stop requested on h1")  # restart only ever follows a failure
    assert rules.apply_verdict(c, final) == rules.FINALIZED


def test_a_restart_order_on_a_peer():
    c = core(restarts=2)
    assert rules.on_restart_order(c, 0) == (False, None)
    assert rules.on_restart_order(c, 1) == (True, Verdict(S.FAILED, "the coordinator started attempt 1", restart=True))
    rules.apply_verdict(c, Verdict(S.FAILED, "x", restart=True))
    assert rules.on_restart_order(c, 1) == (True, None)
    rules.apply_verdict(c, Verdict(S.STOPPED, "y"))
    assert rules.on_restart_order(c, 1) == (False, None)  # final


def test_a_peer_without_its_coordinator():
    t = Timings(connect_timeout=30, reconnect_timeout=3)
    ep = "10.0.0.1:6168"
    silence = rules.on_coordinator_silence
    c = core(restarts=1)
    # never connected: connect_timeout from the start, final
    assert silence(c, t, 29.0, 0.0, False, None, "Connection refused", ep) is None
    v = silence(c, t, 30.5, 0.0, False, None, "coordinator rejected this host: bad token", ep)
    assert v == Verdict(S.FAILED, "could not connect to coordinator 10.0.0.1:6168 within 30s: "
                                  "coordinator rejected this host: bad token")
    # connected, then lost: the attempt fails after reconnect_timeout (a restart may follow: keep trying)
    assert silence(c, t, 12.9, 0.0, True, 10.0, "connection closed by coordinator", ep) is None
    v = silence(c, t, 13.1, 0.0, True, 10.0, "connection closed by coordinator", ep)
    assert v == Verdict(S.FAILED, "lost connection to coordinator 10.0.0.1:6168: connection closed by coordinator",
                        restart=True)
    rules.apply_verdict(c, v)
    assert silence(c, t, 42.9, 0.0, True, 10.0, "x", ep) is None  # waiting to rejoin
    assert silence(c, t, 43.1, 0.0, True, 10.0, "x", ep) == Verdict(
        S.FAILED, "lost connection to coordinator 10.0.0.1:6168 and could not rejoin within 30s: x")
    assert silence(c, t, 99.0, 0.0, True, None, "x", ep) is None  # connected again
    # a verdict that waits for a restart, never connected: made final with its own reason
    c = core(restarts=1)
    rules.apply_verdict(c, Verdict(S.FAILED, "mine", {"host": "h1"}, restart=True))
    assert silence(c, t, 31.0, 0.0, False, None, "x", ep) == Verdict(S.FAILED, "mine", {"host": "h1"})
    rules.apply_verdict(c, Verdict(S.FAILED, "mine"))
    assert silence(c, t, 31.0, 0.0, False, None, "x", ep) is None  # final already


# -- when to restart, when to exit -------------------------------------------------------------------------------


def test_restart_ready_and_may_exit():
    c = core(restarts=1)
    assert not rules.restart_ready(c, 0.0, None, (), 10.0)
    rules.apply_verdict(c, rules.on_exit(c, ev("trainer", 0, 1)))
    rules.stop_finished(c, 1.0)
    assert rules.restart_ready(c, 1.0, 1.0, (), 10.0)
    assert not rules.restart_ready(c, 15.9, 1.0, ["h2"], 10.0)  # h2 still stopping: grace + PEER_DONE_LINGER
    assert rules.restart_ready(c, 16.1, 1.0, ["h2"], 10.0)
    assert not rules.may_exit(c, 99.0, True)  # a restart follows
    rules.apply_verdict(c, Verdict(S.STOPPED, "stop"))
    assert rules.may_exit(c, 1.0, False)  # a peer: at once
    assert not rules.may_exit(c, 5.9, True, 1.0, ["h2"])  # waiting for h2's done
    assert rules.may_exit(c, 6.1, True, 1.0, ["h2"])
    # a peer that never joined: the coordinator answers it with the verdict until the join deadline
    assert not rules.may_exit(c, 6.1, True, 1.0, (), unjoined=1, join_deadline=30.0)
    assert rules.may_exit(c, 6.1, True, 1.0, (), unjoined=1, join_deadline=30.0, term_requested=True)
    assert rules.may_exit(c, 30.1, True, 1.0, (), unjoined=1, join_deadline=30.0)


# -- policy and timings ----------------------------------------------------------------------------------------------


def test_policy_and_timings_from_a_job_file():
    assert Policy.from_job({}, "j") == Policy() and Policy().to_job() == {
        "on_failure": "stop", "grace": 10.0, "restarts": 0, "restart_backoff": 1.0}
    p = Policy.from_job({"on_failure": "continue", "grace": 0, "restarts": 3, "restart_backoff": 2}, "j")
    assert p == Policy("continue", 0.0, 3, 2.0) and isinstance(p.grace, float)
    assert Timings.from_job({}, "c") == DEFAULT_TIMINGS
    assert Timings.from_job({"heartbeat": 0.5}, "c").to_job()["heartbeat"] == 0.5
    with pytest.raises(InputError, match=r"^c.peer_timeout: must be a number >= 0.0, got 'x'$"):
        Timings.from_job({"peer_timeout": "x"}, "c")
    with pytest.raises(InputError, match="^policy: on_failure: must be 'stop' or 'continue', got 'x'$"):
        Policy(on_failure="x")
    with pytest.raises(InputError, match=r"^j: grace: must be a number between 0.0 and 3600.0, got inf$"):
        Policy.from_job({"grace": float("inf")}, "j")


# -- start_trainers_after -----------------------------------------------------------------------------------------------


def test_the_trainer_gate_opens_when_every_endpoint_accepts_and_times_out_naming_the_rest():
    accepting = set()
    probes = []

    def probe(ep):
        probes.append(ep)
        return ep in accepting

    gate = TrainerGate(["a:1", "b:2"], 5.0, 100.0, probe=probe, interval=0.2)
    assert gate.poll(100.0) == TrainerGate.WAIT and probes == ["a:1", "b:2"]
    assert gate.poll(100.1) == TrainerGate.WAIT and len(probes) == 2  # not before the interval
    accepting.add("a:1")
    assert gate.poll(100.2) == TrainerGate.WAIT and gate.closed() == ["b:2"]
    assert gate.poll(100.4) == TrainerGate.WAIT and probes[-1] == "b:2" and probes.count("a:1") == 2  # open stays open
    assert gate.poll(105.0) == TrainerGate.TIMEOUT
    assert gate.timeout_message() == "pserver endpoint(s) b:2 did not accept connections within 5s"
    accepting.add("b:2")
    assert gate.poll(106.0) == TrainerGate.OPEN


# -- the protocol: constructors, parsing, lines --------------------------------------------------------------------


def _wire(msg):
    return json.loads(json.dumps(msg))


def test_every_message_built_by_its_constructor_parses_back():
    n = "ab" * 32
    exits = [{"role": "trainer", "id": 1, "code": 3, "error": None, "host": "h2", "attempt": 0, "note": None}]
    for msg in (protocol.challenge(n), protocol.hello("j", "h2", n, "p", exits, None, 0, False, None),
                protocol.welcome("j", "p"), protocol.error("bad token"),
                protocol.exit_event("trainer", 1, None, "cannot start", "h2", 2), protocol.stopping("why"),
                protocol.stop(S.FAILED, "r", {"host": "h2"}, 1, True), protocol.done("h2", 1), protocol.restart(2),
                protocol.restart(3, {"attempt": 3, "members": [0, 2]}), protocol.go(0), protocol.ping()):
        parsed = protocol.parse_message(_wire(msg))
        assert parsed == msg and parsed["type"] in protocol.Msg
    assert [m.value for m in protocol.Msg] == ["challenge", "hello", "welcome", "error", "exit", "stopping", "stop",
                                               "done", "restart", "go", "ping"]
    # an elastic host's hello and done carry its index and its pserver checkpoint shards (ids are JSON keys)
    hello = protocol.parse_message(_wire(protocol.hello("j", "h2", n, "p", index=3, ps={0: [20, 10], 1: [20]})))
    assert (hello["index"], hello["ps"]) == (3, {0: [20, 10], 1: [20]})
    assert protocol.parse_message(_wire(protocol.done("h2", 1, {0: [7]})))["ps"] == {0: [7]}


@pytest.mark.parametrize("obj, message", [
    ([1], "not a message object"),
    ({"type": "what"}, "unknown message type 'what'"),
    ({"type": 7}, "unknown message type 7"),
    ({"type": "challenge", "version": 2, "nonce": "ab"}, "malformed challenge: nonce: must be 64 hex digits"),
    ({"type": "hello", "job": "j", "host": "", "nonce": "ab" * 32, "proof": "p"},
     "malformed hello: host: must be a host label of 1-255 characters"),
    ({"type": "hello", "job": "j", "host": "h", "nonce": "ab" * 32}, "malformed hello: proof missing"),
    ({"type": "hello", "job": "j", "host": "h", "nonce": "ab" * 32, "proof": "p", "exits": [{"role": "x", "id": 0}]},
     "malformed hello: exits: role: must be one of pserver/trainer"),
    ({"type": "hello", "job": "j", "host": "h", "nonce": "ab" * 32, "proof": "p", "idle": 1},
     "malformed hello: idle: must be true or false"),
    ({"type": "exit", "role": "trainer", "id": [1], "code": {}}, "malformed exit: id: must be an integer >= 0"),
    ({"type": "exit", "role": "trainer", "id": 1, "code": True}, "malformed exit: code: must be an integer or null"),
    ({"type": "exit", "role": "trainer", "id": 1}, "malformed exit: needs a code or an error"),
    ({"type": "stop", "state": "running", "reason": "r", "attempt": 0},
     "malformed stop: state: must be one of succeeded/failed/stopped"),
    ({"type": "stop", "state": "failed", "reason": "r", "attempt": -1}, "malformed stop: attempt: must be an integer >= 0"),
    ({"type": "stop", "state": "failed", "reason": "r", "attempt": 0, "failure": []},
     "malformed stop: failure: must be an object or null"),
    ({"type": "restart"}, "malformed restart: attempt missing"),
    ({"type": "restart", "attempt": 1, "view": [0, 1]}, "malformed restart: view: must be an object or null"),
    ({"type": "go"}, "malformed go: attempt missing"),
    ({"type": "hello", "job": "j", "host": "h", "nonce": "ab" * 32, "proof": "p", "index": -1},
     "malformed hello: index: must be an integer >= 0 or null"),
    ({"type": "hello", "job": "j", "host": "h", "nonce": "ab" * 32, "proof": "p", "ps": {"x": [1]}},
     "malformed hello: ps: must be an object of pserver id to steps, or null"),
    ({"type": "done", "attempt": 0, "ps": {"0": [1, "2"]}}, "malformed done: ps: 0: must be a list of at most 16 steps"),
    ({"type": "done", "attempt": 0, "ps": {"0": list(range(17))}},
     "malformed done: ps: 0: must be a list of at most 16 steps"),
    ({"type": "done", "attempt": False}, "malformed done: attempt: must be an integer >= 0"),
])
def test_a_malformed_message_is_refused_naming_the_field(obj, message):
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.parse_message(obj)
    assert str(info.value) == message


def test_the_line_reader_splits_in_linear_time_and_refuses_garbage_at_once():
    r = protocol.LineReader(limit=100)
    assert r.feed(b'{"a": 1}\n{"b"') == [b'{"a": 1}']
    assert r.feed(b": 2}\n") == [b'{"b": 2}'] and r.buf == bytearray()
    for byte in b'{"c": 3}':  # one byte at a time: each feed looks at the new byte only
        assert r.feed(bytes([byte])) == []
        assert r.scanned == len(r.buf)
    assert r.feed(b"\n") == [b'{"c": 3}']
    many = b'{"x": 1}\n' * 10000  # many lines in one read: one pass
    assert len(protocol.LineReader(limit=100).feed(many)) == 10000
    for data, message in [(b"\n", "blank line"), (b'{"a": 1}\n\n', "blank line"), (b" {}\n", "not a JSON object"),
                          (b"G", "not a JSON object"), (b"{" + b"x" * 100, "line longer than 100 bytes"),
                          (b'{"a": 1}\nGET / HTTP/1.0', "not a JSON object")]:
        with pytest.raises(protocol.ProtocolError, match="^%s$" % message):
            protocol.LineReader(limit=100).feed(data)


def test_decode_line_checks_depth_before_parsing():
    assert protocol.decode_line(b'{"type": "ping"}') == {"type": "ping"}
    assert protocol.json_depth_ok(b'{"a": "' + b"[" * 5000 + b'"}')  # brackets inside a string do not nest
    for line, message in [(b'{"a":' + b"[" * 3000 + b"]" * 3000 + b"}", "JSON nested deeper than 16"),
                          (b"{not json", "not JSON"), (b'{"a": 1}', "not a message object"),
                          (b"{\xff}", "not JSON")]:
        with pytest.raises(protocol.ProtocolError, match="^%s$" % message):
            protocol.decode_line(line)


def test_the_log_limiter_suppresses_and_then_counts():
    lines = []
    limit = protocol.LogLimiter(burst=2, window=10.0, sink=lines.append)
    for i in range(5):
        limit("garbage", "line %d" % i, now=float(i))
    limit("garbage", "after", now=11.0)
    assert lines == ["line 0", "line 1", "(3 more garbage message(s) suppressed in the last 11s)", "after"]


# -- the status reply --------------------------------------------------------------------------------------------------


def test_a_hosts_status_reply_reads_back_keeping_only_well_typed_fields():
    reply = {"ok": True, "job": "j", "host": "h", "state": "stopping", "restart_pending": True, "attempt": 1,
             "attempts": [{"attempt": 0, "outcome": "failed", "reason": "r", "started_at": 1.0, "ended_at": 2.0},
                          {"attempt": "x"}, 5],
             "processes": [{"role": "trainer", "id": 0, "pid": 9, "state": "running", "exit_code": None,
                            "uptime_s": 1.5}, {"role": 1}, "junk"],
             "hosts": {"b": {}}, "coordinator": "junk", "failures": "junk"}
    st = HostStatus.from_json(reply)
    assert st.folded_state == S.RESTARTING and st.attempt == 1 and st.failures == []
    assert st.attempts == [AttemptRecord(0, "failed", "r", None, 1.0, 2.0)] and st.attempts_total == 1
    assert [(p.host, p.role, p.id, p.pid) for p in st.process_status("h")] == [("h", "trainer", 0, 9)]
    assert st.extra == {"hosts": {"b": {}}}
    again = HostStatus.from_json(st.to_json())
    assert again == st
    assert HostStatus.from_json("garbage").state == S.UNKNOWN


# -- MPI_Abort: the aborting rank's host says why its exit failed the job -------------------------------------


def test_an_exit_with_a_note_names_it_in_the_reason_and_the_failure():
    c = core()
    aborted = ExitEvent("trainer", 1, 3, None, "h2", 0, "rank 1 called MPI_Abort with error code 3")
    v = rules.on_exit(c, aborted)
    assert v.reason == "trainer.1 on h2 exited with code 3 (rank 1 called MPI_Abort with error code 3)"
    assert v.failure["note"] == "rank 1 called MPI_Abort with error code 3"
    c = core(on_failure="continue")
    rules.on_exit(c, aborted)
    v = rules.on_exit(c, ev("trainer", 0, 0))
    assert v.reason == ("all trainers ended; 1 failure(s), first: trainer.1 on h2 code 3 "
                        "(rank 1 called MPI_Abort with error code 3)")


def test_the_note_travels_in_exit_messages_and_hellos_and_is_checked():
    msg = protocol.exit_event(**ExitEvent("trainer", 1, 3, None, "h2", 0, "rank 1 called MPI_Abort").to_json())
    assert protocol.parse_message(json.loads(json.dumps(msg)))["note"] == "rank 1 called MPI_Abort"
    assert protocol.parse_message(protocol.exit_event("trainer", 1, 3, None, "h2", 0))["note"] is None
    hello = protocol.hello("j", "h2", "ab" * 32, "p", [dict(msg, type=None)], None, 0, False, None)
    assert protocol.parse_message(json.loads(json.dumps(hello)))["exits"][0]["note"] == "rank 1 called MPI_Abort"
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_message(dict(msg, note={"not": "text"}))


def _row(id=1, role="trainer", started_at=1000.0):
    from clusterctl.host.processes import ProcessRow

    r = ProcessRow.__new__(ProcessRow)
    r.role, r.id, r.started_at = role, id, started_at
    return r


def test_abort_note_reads_the_aborting_ranks_record_and_nothing_else(tmp_path):
    import os

    from clusterctl.collective import pmiclient
    from clusterctl.host.jobdir import ABORT_FILE, abort_note

    assert ABORT_FILE == pmiclient.ABORT_FILE  # the runtime writes the file the supervisor reads
    rec = pmiclient.abort_record(1, 3, "rank 1 called MPI_Abort with error code 3", host="h2", pid=42, spawned=None)
    rec["time"] = 1001.0
    path = tmp_path / ABORT_FILE
    assert abort_note(str(tmp_path), _row()) is None  # no file
    path.write_text(json.dumps(rec))
    assert abort_note(str(tmp_path), _row()) == "rank 1 called MPI_Abort with error code 3"
    assert abort_note(str(tmp_path), _row(id=0)) is None  # another rank aborted: this one was ended by it
    assert abort_note(str(tmp_path), _row(role="pserver")) is None
    assert abort_note(str(tmp_path), _row(started_at=1500.0)) is None  # an earlier attempt's record
    path.write_text(json.dumps(dict(rec, message="line\nbreaks\x1b[2J and " + "x" * 500)))
    note = abort_note(str(tmp_path), _row())
    assert "\n" not in note and len(note) <= 200
    for garbage in ("{", "[]", json.dumps(dict(rec, rank="1")), json.dumps(dict(rec, time=None)), "x" * 100_000):
        path.write_text(garbage)
        assert abort_note(str(tmp_path), _row()) is None, garbage[:40]
    path.unlink()
    (tmp_path / "elsewhere.json").write_text(json.dumps(rec))
    os.symlink(tmp_path / "elsewhere.json", path)
    assert abort_note(str(tmp_path), _row()) is None  # never followed
