"""job.restarts / job.restart_backoff: spec errors, the job files the hosts get, the back-off, the folded state."""

import pytest

from clusterctl.host.agent import attempt_log, validate_job
from clusterctl.host.policy import RESTART_BACKOFF_MAX, Policy
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
    ("  restart_backoff: 0\n", "8:3: job.restart_backoff: input should be greater than or equal to 1"),  # no spinning restart loop
    ("  restart_backoff: 0.5\n", "8:3: job.restart_backoff: input should be greater than or equal to 1"),
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
    assert [Policy(restart_backoff=1.5).restart_delay(n) for n in (1, 2, 3, 4)] == [1.5, 3.0, 6.0, 12.0]
    assert Policy(restart_backoff=10).restart_delay(40) == RESTART_BACKOFF_MAX == 300.0
    assert Policy(restart_backoff=300).restart_delay(2) == 300.0
    assert Policy().restart_delay(0) == 0.0


@pytest.mark.parametrize("key, value, message", [
    ("restart_backoff", 0, "job.json: restart_backoff: must be a number between 1.0 and 300.0, got 0"),
    ("restart_backoff", 0.99, "job.json: restart_backoff: must be a number between 1.0 and 300.0, got 0.99"),
    ("restart_backoff", float("nan"), "job.json: restart_backoff: must be a number between 1.0 and 300.0, got nan"),
    ("restarts", 1001, "job.json: restarts: must be an integer between 0 and 1000, got 1001"),
    ("restarts", True, "job.json: restarts: must be an integer between 0 and 1000, got True"),
    ("grace", -1, "job.json: grace: must be a number between 0.0 and 3600.0, got -1"),
    ("on_failure", "retry", "job.json: on_failure: must be 'stop' or 'continue', got 'retry'"),
])
def test_the_job_file_validator_holds_the_policys_bounds(key, value, message):
    """The host refuses what the spec refuses: one bound each, in clusterctl/host/policy.py."""
    from clusterctl.host.common import InputError

    job = {"job": "j", "processes": [], key: value}
    with pytest.raises(InputError) as info:
        validate_job(job, "job.json")
    assert str(info.value) == message


def test_one_default_each_from_the_policy():
    """The spec, the plan and the job file take their defaults from clusterctl/host/policy.py."""
    from clusterctl.host.policy import DEFAULT_POLICY
    from clusterctl.spec.job import JobSpec

    plan = make_plan(parse_spec(BASE))
    assert plan.policy == DEFAULT_POLICY
    assert {k: JobSpec.model_fields[k].default for k in DEFAULT_POLICY.to_job()} == DEFAULT_POLICY.to_job()
    files = job_files(plan, {h: "/home/u" for h in plan.hosts}, "t" * 32)
    for f in files.values():
        assert {k: f[k] for k in DEFAULT_POLICY.to_job()} == DEFAULT_POLICY.to_job()
        assert Policy.from_job(f, "job.json") == DEFAULT_POLICY
    assert validate_job({"job": "j", "processes": []}, "job.json")["restart_backoff"] == DEFAULT_POLICY.restart_backoff


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
