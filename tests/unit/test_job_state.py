"""How the hosts' job states fold into the job's state (`clusterctl status`, `start --follow`)."""

import pytest

from clusterctl.ops.job import overall_state


@pytest.mark.parametrize(
    "hosts, want",
    [
        ([], "not running"),
        (["unknown", "unknown"], "not running"),
        (["starting", "running"], "running"),
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
