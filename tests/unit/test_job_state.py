"""How the hosts' job states fold into the job's state (`clusterctl status`, `start --follow`)."""

import pytest

from clusterctl.ops.job import overall_state


@pytest.mark.parametrize(
    "hosts, want",
    [
        ([], "not running"),
        (["unknown", "unknown"], "not running"),
        (["starting", "running"], "running"),
        # nothing runs yet: every live host at the start barrier, or every pod waiting to be scheduled
        (["starting", "starting"], "starting"),
        (["starting", "unknown"], "starting"),
        (["failed", "starting"], "starting"),
        (["running", "stopping"], "running"),
        (["stopping", "stopped"], "stopping"),
        (["succeeded", "succeeded"], "succeeded"),
        (["succeeded", "stopped"], "stopped"),
        (["failed", "stopped"], "failed"),
        (["failed", "lost"], "failed"),
        (["lost", "running"], "lost"),
        # a trainer failed: not a verdict while processes still run elsewhere
        (["failed", "stopping", "running"], "stopping"),  # fail-fast: the rest is being stopped
        (["failed", "running"], "running"),  # on_failure: continue, or the stop not yet arrived
    ],
)
def test_a_terminal_state_only_once_nothing_runs(hosts, want):
    assert overall_state(hosts) == want


def test_an_ipv6_coordinator_is_written_without_brackets():
    """The coordinator listens on its bare address: '[fd00::1]' (the endpoint form) cannot be bound."""
    import socket

    from clusterctl.host.jobfile import validate_job
    from clusterctl.ops.job import job_files
    from clusterctl.plan import make_plan
    from clusterctl.spec import parse_spec

    spec = parse_spec('name: v6\nssh: {config: none}\nhosts: [{address: "fd00::1"}, {address: "fd00::2"}]\n'
                      'job: {mode: pserver, entrypoint: [python3, t.py], pservers: 1}\n')
    plan = make_plan(spec)
    assert plan.control_endpoint.startswith("[fd00::1]:")
    files = job_files(plan, {h: "/home/u" for h in plan.hosts}, "t" * 64)
    for job in files.values():
        coord = validate_job(job, "job.json")["coordinator"]
        assert coord["address"] == "fd00::1"
        socket.getaddrinfo(coord["address"], coord["port"], type=socket.SOCK_STREAM)  # an address a socket takes
