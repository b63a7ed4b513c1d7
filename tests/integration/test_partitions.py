"""Network partitions and frozen hosts mid-run: every side decides within the documented time
(docs/lifecycle.md: peer_timeout 5 s, reconnect_timeout 3 s, connect_timeout 30 s), and once the network is
back `status` tells the truth on every host and `stop` leaves no orphan and no port held."""

from __future__ import annotations

import json
import time

import pytest

from clusterlib import assert_no_orphans, clusterctl, docker, job_ports, job_spec, node_exec, tagged_pids, wait_state

pytestmark = pytest.mark.integration

PEER_TIMEOUT, RECONNECT_TIMEOUT = 5.0, 3.0  # the agent's defaults (docs/agent.md)
SLACK = 4.0  # polling, the local stop (grace) and a loaded machine


def network_of(container: str) -> str:
    nets = json.loads(docker("inspect", container, "--format", "{{json .NetworkSettings.Networks}}").stdout)
    (net,) = nets
    return net


_HOME = {"home": "/root"}  # the login user's home on the nodes (set from the session cluster below)


@pytest.fixture(autouse=True)
def _login_home(testcluster):
    _HOME["home"] = testcluster.home


def host_state(node, job: str) -> dict:
    """state.json of `job` on `node`, read through docker (works while the node is cut off)."""
    out = node_exec(node.container, f"cat {_HOME['home']}/.clusterctl/jobs/{job}/state.json 2>/dev/null || true",
                    check=False)
    return json.loads(out) if out.strip() else {}


def wait_host(node, job, pred, timeout):
    """Poll a node's own view until pred(state, tagged pids); return the seconds it took."""
    t0 = time.monotonic()
    while True:
        st, pids = host_state(node, job), tagged_pids(node.container, job)
        if pred(st, pids):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{node.container}: no decision within {timeout}s: {st.get('state')} {st.get('reason')} pids={pids}")
        time.sleep(0.3)


def stopped_on_its_own(st, pids):
    return not pids and st.get("state") in ("failed", "stopped", "restarting")


class Cut:
    """Cut a node off (network disconnect) or freeze it (pause); restore on exit."""

    def __init__(self, node, how):
        self.node, self.how = node, how
        self.net = network_of(node.container)

    def __enter__(self):
        if self.how == "disconnect":
            docker("network", "disconnect", self.net, self.node.container)
        else:
            docker("pause", self.node.container)
        return self

    def restore(self):
        if self.how == "disconnect":
            if self.net not in json.loads(docker("inspect", self.node.container, "--format",
                                                 "{{json .NetworkSettings.Networks}}").stdout):
                docker("network", "connect", self.net, self.node.container)
                ip = docker("inspect", self.node.container, "--format",
                            "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}").stdout.strip()
                assert ip == self.node.ip, f"docker gave {self.node.container} a new address {ip}"
        elif docker("inspect", self.node.container, "--format", "{{.State.Paused}}").stdout.strip() == "true":
            docker("unpause", self.node.container)

    def __exit__(self, *exc):
        self.restore()


def long_job(info, tmp_path, name, **job):
    return job_spec(info, tmp_path, name, hosts=3, mode="collective", env={"STEPS": "600", "STEP_S": "0.1"}, **job)


def truth_then_stop(info, spec, job, want_state):
    """After the network is back: status reaches every host and says `want_state`; stop leaves nothing."""
    st = wait_state(spec, {want_state}, timeout=30)
    assert not st["unreachable"], st
    assert not [p for p in st["processes"] if p["state"] == "running"], st
    res = clusterctl("stop", spec)
    assert res.returncode == 0, res.stderr
    assert_no_orphans(info, job, job_ports(spec), hosts=info.nodes[:3])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["disconnect", pytest.param("pause", marks=pytest.mark.slow)])
def test_a_peer_cut_off_mid_run(testcluster, tmp_path, how):
    name = f"it-cut-peer-{how}"
    spec = long_job(testcluster, tmp_path, name)
    coord, peer = testcluster.nodes[0], testcluster.nodes[2]
    clusterctl("dispatch", spec, check=True)
    clusterctl("start", spec, check=True)
    with Cut(peer, how) as cut:
        t0 = time.monotonic()
        took = wait_host(coord, name, lambda st, pids: st.get("state") == "failed" and not pids, PEER_TIMEOUT + SLACK)
        assert host_state(coord, name)["reason"].startswith(f"lost host {peer.ip}: "), host_state(coord, name)
        assert host_state(coord, name)["hosts"][peer.ip]["state"] == "lost"
        if how == "disconnect":  # the cut-off host's supervisor stops its own processes
            wait_host(peer, name, stopped_on_its_own, PEER_TIMEOUT + RECONNECT_TIMEOUT + SLACK - (time.monotonic() - t0))
            assert host_state(peer, name)["reason"].startswith("lost connection to coordinator")
        cut.restore()
    if how == "pause":  # a frozen host decides as soon as it runs again
        wait_host(peer, name, stopped_on_its_own, PEER_TIMEOUT + RECONNECT_TIMEOUT + SLACK)
    assert took < PEER_TIMEOUT + SLACK
    truth_then_stop(testcluster, spec, name, "failed")


@pytest.mark.timeout(180)
def test_the_coordinators_host_cut_off_mid_run(testcluster, tmp_path):
    name = "it-cut-coord"
    spec = long_job(testcluster, tmp_path, name)
    coord, peers = testcluster.nodes[0], testcluster.nodes[1:3]
    clusterctl("dispatch", spec, check=True)
    clusterctl("start", spec, check=True)
    with Cut(coord, "disconnect"):
        for p in peers:
            wait_host(p, name, stopped_on_its_own, PEER_TIMEOUT + RECONNECT_TIMEOUT + SLACK)
            assert host_state(p, name)["reason"].startswith("lost connection to coordinator"), host_state(p, name)
        wait_host(coord, name, lambda st, pids: st.get("state") == "failed" and not pids, SLACK)
        assert host_state(coord, name)["reason"].startswith("lost host ")
    truth_then_stop(testcluster, spec, name, "failed")


@pytest.mark.slow  # restarts after a lost peer: tests/integration/test_restarts.py and the fake-host tests
@pytest.mark.timeout(240)
def test_with_restarts_a_partition_that_heals_restarts_the_job_which_then_succeeds(testcluster, tmp_path):
    name = "it-cut-heal"
    spec = job_spec(testcluster, tmp_path, name, hosts=3, mode="collective", env={"STEPS": "80", "STEP_S": "0.1"},
                    restarts=3, restart_backoff=1)
    peer = testcluster.nodes[2]
    clusterctl("dispatch", spec, check=True)
    clusterctl("start", spec, check=True)
    with Cut(peer, "disconnect"):
        wait_host(peer, name, stopped_on_its_own, PEER_TIMEOUT + RECONNECT_TIMEOUT + SLACK)
        assert host_state(peer, name)["state"] == "restarting"  # it waits (connect_timeout) to rejoin
    st = wait_state(spec, {"succeeded", "failed"}, timeout=120)
    assert st["state"] == "succeeded" and st["attempt"] >= 1, st
    assert st["attempts"][0]["reason"].startswith(f"lost host {peer.ip}: "), st["attempts"]
    assert_no_orphans(testcluster, name, job_ports(spec), hosts=testcluster.nodes[:3])
