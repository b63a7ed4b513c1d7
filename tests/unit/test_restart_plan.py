"""job.restarts / job.restart_backoff: spec errors, the job files the hosts get, the back-off, the folded state."""

import pytest

from clusterctl.host.agent import attempt_log, restart_delay, validate_job
from clusterctl.errors import SpecError
from clusterctl.ops.job import job_files, overall_state
from clusterctl.plan import make_plan
from clusterctl.spec import load_spec, parse_spec

BASE = """\
name: rs
hosts:
  - address: 10.0.0.1
  - address: 10.0.0.2
job:
  mode: collective
  entrypoint: [python3, train.py]
"""


@pytest.mark.parametrize("extra, want", [
    ("  restarts: -1\n", "8:3: job.restarts: "),
    ("  restarts: two\n", "8:3: job.restarts: "),
    ("  restart_backoff: -0.5\n", "8:3: job.restart_backoff: "),
    ("  env: {TORCHELASTIC_RESTART_COUNT: '1'}\n", "8:3: job.env: TORCHELASTIC_RESTART_COUNT is set by clusterctl"),
    ("  env: {CLUSTERCTL_RESTART_COUNT: '1'}\n", "8:3: job.env: CLUSTERCTL_RESTART_COUNT is set by clusterctl"),
])
def test_bad_restart_keys_fail_at_once_naming_the_key(write_spec, extra, want):
    path = write_spec(BASE + extra)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    lines = [str(p) for p in info.value.problems]
    assert len(lines) == 1 and lines[0].startswith(f"{path}:{want}"), lines


def test_defaults_keep_todays_behaviour_and_every_host_gets_the_keys():
    plan = make_plan(parse_spec(BASE))
    assert (plan.restarts, plan.restart_backoff) == (0, 1.0)
    plan = make_plan(parse_spec(BASE + "  restarts: 3\n  restart_backoff: 2.5\n"))
    files = job_files(plan, {h: "/home/u" for h in plan.hosts}, "t" * 32)
    assert [(f["restarts"], f["restart_backoff"]) for f in files.values()] == [(3, 2.5), (3, 2.5)]
    for f in files.values():  # what the host agent accepts
        job = validate_job(f, "job.json")
        assert (job["restarts"], job["restart_backoff"]) == (3, 2.5)
    mpi = make_plan(parse_spec(BASE + "  launcher: mpi\n  restarts: 2\n"))
    (only,) = job_files(mpi, {h: "/home/u" for h in mpi.hosts}, "t" * 32).values()
    assert only["restarts"] == 2


def test_backoff_doubles_per_restart_and_is_capped():
    assert [restart_delay(1.5, n) for n in (1, 2, 3, 4)] == [1.5, 3.0, 6.0, 12.0]
    assert restart_delay(10, 40) == 300.0
    assert restart_delay(0, 3) == 0.0


def test_attempt_log_names():
    assert attempt_log("/l/trainer.0.log", 0) == "/l/trainer.0.log"
    assert attempt_log("/l/trainer.0.log", 2) == "/l/trainer.0.attempt2.log"
    assert attempt_log("/l/out", 1) == "/l/out.attempt1"


@pytest.mark.parametrize("hosts, want", [
    (["restarting", "restarting"], "restarting"),
    (["restarting", "stopping"], "restarting"),  # one host still stopping the failed attempt
    (["restarting", "running"], "running"),  # the next attempt is starting
    (["failed", "restarting"], "stopping"),
    (["lost", "restarting"], "lost"),
])
def test_restarting_is_not_a_verdict(hosts, want):
    assert overall_state(hosts) == want
