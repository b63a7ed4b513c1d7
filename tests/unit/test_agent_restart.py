"""Restarts in clusterctl/host (the agent) (job keys `restarts`, `restart_backoff`), with real processes on 127.0.0.1.

Same simulated hosts as tests/unit/test_agent.py: one job dir and host label per "host", one coordinator. What
each failure leads to (restart or final, the back-off's doubling, restarts running out, a peer cut off and
rejoining) is decided by the rules and tested there (test_agent_rules.py, test_agent_supervisor.py); these
tests prove the wiring end to end.
"""

import os
import subprocess
import time

import pytest
from test_agent import (
    AGENT,
    GRACE,
    PY,
    SLACK,
    Cluster,
    agent,
    coordinator,
    free_port,
    launch,
    proc,
    status,
    tagged,
    terminal,
    wait_for,
)


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.cleanup()


def state_when(jobdir, pred):
    st = status(jobdir)
    return st if pred(st) else None


def attempt_rows(st):
    return [(a["attempt"], a["outcome"], a["reason"]) for a in st["attempts"]]


BACKOFF = 1.0  # the least restart_backoff there is (clusterctl/host/policy.py): restart k waits BACKOFF * 2^(k-1)


@pytest.mark.timeout(120)
def test_single_host_restarts_until_the_trainer_succeeds(cluster):
    job_id = cluster.new_job_id()
    d = cluster.host("hA", job_id, [cluster.process("pserver", 0, "sleep"),
                                    cluster.process("trainer", 0, "attempts", 1, 3, 0.3)],
                     restarts=3, restart_backoff=BACKOFF)
    first = launch(d)
    final = wait_for(lambda: terminal(d), BACKOFF + 2 * GRACE + SLACK)
    assert final and final["state"] == "succeeded", status(d)
    assert (final["attempt"], final["restarts"]) == (1, 3)
    assert attempt_rows(final) == [
        (0, "failed", "trainer.0 on hA exited with code 3"),
        (1, "succeeded", "all 1 trainers exited 0"),
    ]
    a = final["attempts"]
    assert a[1]["started_at"] - a[0]["ended_at"] >= BACKOFF - 0.05  # the back-off (its doubling: the rule tests)
    pserver = proc(final, "pserver", 0)
    assert pserver["pid"] != first["pids"]["pserver.0"]  # the whole job started again, pservers too
    trainer = proc(final, "trainer", 0)
    assert (trainer["state"], trainer["exit_code"]) == ("exited", 0)
    logs = [e["path"] for e in trainer["logs"]]
    base = os.path.join(os.path.dirname(logs[0]), "trainer.0")
    assert logs == [base + ".log", base + ".attempt1.log"]
    for n, path in enumerate(logs):  # every attempt's log kept, each saw its attempt number twice
        with open(path) as f:
            assert f.read() == "attempt=%d torchelastic=%d\n" % (n, n)
    out = subprocess.run([PY, AGENT, "logs", d, "--role", "trainer"], stdout=subprocess.PIPE, timeout=SLACK)
    assert out.stdout.decode().splitlines() == [
        "[hA trainer.0] attempt=0 torchelastic=0",
        "[hA trainer.0#1] attempt=1 torchelastic=1",
    ]
    assert tagged(job_id) == []


@pytest.mark.timeout(120)
def test_a_trainer_failure_on_one_host_restarts_every_host(cluster):
    job_id = cluster.new_job_id()
    port, ps = free_port(), free_port()
    ep = "127.0.0.1:%d" % ps
    after = {"endpoints": [ep], "timeout": 10}
    hA = cluster.host("hA", job_id, [cluster.process("pserver", 0, "serve", "127.0.0.1", ps, ports=[ep]),
                                     cluster.process("trainer", 0, "attempts", 0, 0, 1.5)],
                      coordinator(port, True, 2, 2), restarts=2, restart_backoff=BACKOFF, start_trainers_after=after)
    hB = cluster.host("hB", job_id, [cluster.process("trainer", 1, "attempts", 1, 7, 0.3)],
                      coordinator(port, False, 2, 2), restarts=2, restart_backoff=BACKOFF, start_trainers_after=after)
    launch(hA)
    launch(hB)
    finals = [wait_for(lambda d=d: terminal(d), BACKOFF + 1.5 + 2 * GRACE + SLACK) for d in (hA, hB)]
    assert all(finals), [status(d) for d in (hA, hB)]
    stA, stB = finals
    for st in finals:
        assert st["state"] == "succeeded" and st["attempt"] == 1, st
        assert attempt_rows(st)[0] == (0, "failed", "trainer.1 on hB exited with code 7")
    # trainer.0 on hA was healthy but was stopped and started again with the rest of the job
    logs0 = [e["path"] for e in proc(stA, "trainer", 0)["logs"]]
    assert len(logs0) == 2 and open(logs0[0]).read() == "attempt=0 torchelastic=0\n"
    assert open(logs0[1]).read() == "attempt=1 torchelastic=1\n"
    assert proc(stA, "pserver", 0)["state"] == "stopped"
    assert tagged(job_id) == []


@pytest.mark.timeout(120)
def test_a_stop_while_a_restart_is_pending_is_final(cluster):
    job_id = cluster.new_job_id()
    port = free_port()
    hA = cluster.host("hA", job_id, [cluster.process("pserver", 0, "sleep")], coordinator(port, True, 2, 1),
                      restarts=5, restart_backoff=300)
    hB = cluster.host("hB", job_id, [cluster.process("trainer", 0, "attempts", 99, 1, 0.3)],
                      coordinator(port, False, 2, 1), restarts=5, restart_backoff=300)
    launch(hA)
    launch(hB)
    st = wait_for(lambda: state_when(hA, lambda s: s["state"] == "restarting" and s["restart_at"]), GRACE + SLACK)
    assert st and st["attempt"] == 0 and st["restart_at"] > time.time() + 200, status(hA)
    assert wait_for(lambda: status(hB)["state"] == "restarting", SLACK), status(hB)
    rc, out = agent("stop", hB, "--grace", "1")
    assert rc == 0 and out["state"] == "stopped", out
    finals = [wait_for(lambda d=d: terminal(d), SLACK) for d in (hA, hB)]
    assert all(finals), [status(d) for d in (hA, hB)]
    for f in finals:
        assert (f["state"], f["reason"], f["attempt"]) == ("stopped", "stop requested on hB", 0), f
        assert attempt_rows(f)[0][:2] == (0, "failed")
    assert tagged(job_id) == []


@pytest.mark.timeout(120)
def test_logs_follow_picks_up_each_attempts_file_and_ends_with_the_job(cluster):
    job_id = cluster.new_job_id()
    d = cluster.host("hA", job_id, [cluster.process("trainer", 0, "attempts", 1, 4, 0.5)],
                     restarts=2, restart_backoff=BACKOFF)
    launch(d)
    follow = subprocess.run([PY, AGENT, "logs", d, "--follow"], stdout=subprocess.PIPE,
                            timeout=BACKOFF + 2 * GRACE + SLACK)
    assert follow.returncode == 0
    assert follow.stdout.decode().splitlines() == ["[hA trainer.0] attempt=0 torchelastic=0",
                                                   "[hA trainer.0#1] attempt=1 torchelastic=1"]
    final = wait_for(lambda: terminal(d), SLACK)
    assert final and final["state"] == "succeeded" and final["attempt"] == 1, status(d)
