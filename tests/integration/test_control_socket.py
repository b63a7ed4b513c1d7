"""status, top, logs and stop answered by the hosts' supervisors over their control sockets (issue 23.2), on the
fleet: login `ubuntu` (root login off), nodes behind a bastion, real sshd and OpenSSH client. Each node's
`python3` is replaced for the test by a wrapper that records every start (/usr/local/bin comes first on sshd's
PATH), so the test sees that a running job is asked with no Python started on its hosts, and that a host whose
supervisor was killed is answered by the agent from its state files."""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path

import pytest
from clusterlib import assert_no_orphans, clusterctl, node_exec, status_json
from test_fleet import fleet_spec

from clusterctl.cache import cache_root_path

NODES = (0, 1)
GRACE = 2  # the job's grace: a stop waits at most this plus the agent's SIGKILL phase (5 s)
# what a busy machine may add to a wait for a state that follows at once (a process that prints at its start, a
# supervisor's death read from /proc): scheduling only; the waits poll and end as soon as the state is there
SLACK = 30.0
LOGS = {"python3": "/tmp/clusterctl-python-starts", "cat": "/tmp/clusterctl-cat-starts"}  # program: its starts


def _wrap(info, program: str):
    """Put a wrapper of /usr/bin/PROGRAM first on the nodes' PATH (/usr/local/bin) that records each start."""
    log = LOGS[program]
    wrapper = f'#!/bin/sh\necho "$*" >> {log}\nexec /usr/bin/{program} "$@"\n'
    for i in NODES:
        node_exec(info.nodes[i].container, f"/usr/bin/cat > /usr/local/bin/{program} <<'EOF'\n{wrapper}EOF\n"
                  f"chmod 755 /usr/local/bin/{program} && rm -f {log} && touch {log} && chmod 666 {log}")


def _unwrap(info, program: str):
    for i in NODES:
        node_exec(info.nodes[i].container, f"rm -f /usr/local/bin/{program} {LOGS[program]}", check=False)


def _starts(info, i, program: str = "python3") -> list[str]:
    return node_exec(info.nodes[i].container, f"/usr/bin/cat {LOGS[program]}").splitlines()  # not a wrapped cat


def _clear(info, program: str = "python3"):
    for i in NODES:
        node_exec(info.nodes[i].container, f": > {LOGS[program]}")


def _sleep_job(info, path: Path, name: str, trainers: int, say: str | None = None) -> Path:
    """A spec of `trainers` sleeping processes per node (each printing `say` first), and no job of its name
    running."""
    sleep = ["/bin/sleep", "300"] if say is None else ["/bin/sh", "-c", f"echo {say}; exec /bin/sleep 300"]
    spec = fleet_spec(info, path, name=name, workspace={"local": str(path.parent)},
                      job={"mode": "collective", "trainers": trainers, "grace": GRACE, "entrypoint": sleep})
    clusterctl("stop", spec)
    return spec


@pytest.mark.timeout(300)
def test_a_running_job_is_asked_through_its_supervisors_with_no_python_on_the_hosts(fleet, tmp_path):
    name = "fleet-ctl"
    spec = fleet_spec(fleet, tmp_path / "c.yaml", name=name, workspace={"local": str(tmp_path)},
                      job={"mode": "collective", "trainers": 2, "grace": GRACE,
                           "entrypoint": ["/bin/sh", "-c", "echo hello from $RANK; exec sleep 300"]})
    clusterctl("stop", spec)
    _wrap(fleet, "python3")
    try:
        res = clusterctl("start", spec, "--dispatch", timeout=180)
        assert res.returncode == 0, res.stdout + res.stderr
        _clear(fleet)  # start runs `agent up` (Python) on every host: from here on, count
        st = status_json(spec)
        assert st["state"] == "running" and [(p["host"], p["state"]) for p in st["processes"]] == [
            ("node0", "running"), ("node0", "running"), ("node1", "running"), ("node1", "running")]
        deadline = time.monotonic() + SLACK
        while (logs := clusterctl("logs", spec, check=True).stdout.splitlines()) and len(logs) < 4 \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        assert sorted(logs) == ["[node0 trainer.0] hello from 0", "[node0 trainer.1] hello from 1",
                                "[node1 trainer.2] hello from 2", "[node1 trainer.3] hello from 3"]
        top = json.loads(clusterctl("top", spec, "--once", "--json", "--no-gpu", check=True).stdout)
        assert [(h["host"], h["status"]) for h in top["hosts"]] == [("node0", "ok"), ("node1", "ok")]
        assert all(p["rss_bytes"] for p in top["processes"]), top["processes"]
        assert _starts(fleet, 0) == [] and _starts(fleet, 1) == []  # the supervisors answered every one
        # kill node1's supervisor: its host is answered by the agent, from its state files
        pid = json.loads(node_exec(fleet.nodes[1].container, f"cat /home/ubuntu/.clusterctl/jobs/{name}/state.json"))[
            "supervisor"]["pid"]
        node_exec(fleet.nodes[1].container, f"kill -9 {pid}")
        deadline = time.monotonic() + SLACK
        while (st := status_json(spec)) and not any(p["host"] == "node1" and p["state"] != "running"
                                                     for p in st["processes"]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert st["state"] in ("lost", "failed", "stopping"), st
        assert any(" agent top " in f" {line} " for line in _starts(fleet, 1)), _starts(fleet, 1)
    finally:
        stopped = clusterctl("stop", spec, timeout=120)
        _unwrap(fleet, "python3")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert_no_orphans(fleet, name, hosts=[fleet.nodes[i] for i in NODES], within=GRACE + 5 + SLACK)
    assert status_json(spec)["state"] in ("failed", "stopped")


@pytest.mark.timeout(300)
def test_a_stop_through_the_supervisors_counts_every_process_once(fleet, tmp_path):
    name = "fleet-ctl-stop"
    spec = _sleep_job(fleet, tmp_path / "s.yaml", name, trainers=2)
    _wrap(fleet, "python3")
    try:
        res = clusterctl("start", spec, "--dispatch", timeout=180)
        assert res.returncode == 0, res.stdout + res.stderr
        _clear(fleet)
        res = clusterctl("stop", spec, timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        assert res.stdout.strip() == f"job {name} stopped on 2 host(s), 4 process(es) killed"
        # each node answered over its socket, unless the other node's stop ended the job there first (the two are
        # asked at once; on a loaded machine either may be reached after the other's stop went through the
        # coordinator, whose supervisor may then be gone): its agent answered from the state files
        starts = {i: _starts(fleet, i) for i in NODES}
        assert all(" agent stop " in f" {line} " for i in NODES for line in starts[i]), starts
        assert any(not starts[i] for i in NODES), starts
        assert_no_orphans(fleet, name, hosts=[fleet.nodes[i] for i in NODES], within=GRACE + 5 + SLACK)
        again = clusterctl("stop", spec, timeout=120)
        assert again.stdout.strip() == f"job {name} is not running"
    finally:
        clusterctl("stop", spec, timeout=120)
        _unwrap(fleet, "python3")


def _kept(name: str) -> Path:
    return Path(cache_root_path()) / "control" / f"{name}.json"


@pytest.mark.timeout(300)
def test_the_controller_that_started_a_job_asks_its_supervisors_with_nothing_started_on_the_hosts(fleet, tmp_path):
    """Through the kept connections (stdio forwarding to the supervisors' control ports): no shell, no `cat`, no
    Python on the hosts. An endpoint that no longer answers as the supervisor's would is forgotten, and that host
    is asked with the line as before."""
    name = "fleet-ctl-direct"
    spec = _sleep_job(fleet, tmp_path / "d.yaml", name, trainers=1, say="up")
    _wrap(fleet, "python3")
    _wrap(fleet, "cat")
    try:
        res = clusterctl("start", spec, "--dispatch", timeout=180)
        assert res.returncode == 0, res.stdout + res.stderr
        kept = _kept(name)
        assert stat.S_IMODE(kept.stat().st_mode) == 0o600
        endpoints = json.loads(kept.read_text())
        assert sorted(endpoints) == sorted(f"ubuntu@{fleet.nodes[i].ip}:22" for i in NODES)
        _clear(fleet)
        _clear(fleet, "cat")
        st = status_json(spec)
        assert [(p["host"], p["state"]) for p in st["processes"]] == [("node0", "running"), ("node1", "running")]
        top = json.loads(clusterctl("top", spec, "--once", "--json", "--no-gpu", check=True).stdout)
        assert [(h["host"], h["status"]) for h in top["hosts"]] == [("node0", "ok"), ("node1", "ok")]
        logs = clusterctl("logs", spec, "-n", "5", check=True).stdout  # the last lines: a bounded answer
        assert sorted(logs.splitlines()) == ["[node0 trainer.0] up", "[node1 trainer.1] up"], logs
        assert [_starts(fleet, i) + _starts(fleet, i, "cat") for i in NODES] == [[], []]  # nothing ran on either host
        assert "[node0 trainer.0] up" in clusterctl("logs", spec, check=True).stdout  # the whole logs: by the line
        assert all(_starts(fleet, i, "cat") for i in NODES), [_starts(fleet, i, "cat") for i in NODES]
        _clear(fleet, "cat")
        # node1's endpoint turned stale (a port nothing listens on), node0's supervisor answers with another secret
        # than the one kept: both are asked with the line (`cat` runs there), answer right, and are forgotten
        key0, key1 = (f"ubuntu@{fleet.nodes[i].ip}:22" for i in NODES)
        endpoints[key1]["port"] = 1
        endpoints[key0]["server"] = "ab" * 32
        kept.write_text(json.dumps(endpoints))
        st = status_json(spec)
        assert [(p["host"], p["state"]) for p in st["processes"]] == [("node0", "running"), ("node1", "running")]
        assert all(_starts(fleet, i, "cat") for i in NODES), [_starts(fleet, i, "cat") for i in NODES]
        assert not kept.exists()
    finally:
        stopped = clusterctl("stop", spec, timeout=120)
        _unwrap(fleet, "python3")
        _unwrap(fleet, "cat")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert_no_orphans(fleet, name, hosts=[fleet.nodes[i] for i in NODES], within=GRACE + 5 + SLACK)


@pytest.mark.timeout(300)
def test_a_stop_through_the_kept_connections_forgets_the_endpoints(fleet, tmp_path):
    name = "fleet-ctl-direct-stop"
    spec = _sleep_job(fleet, tmp_path / "e.yaml", name, trainers=1)
    _wrap(fleet, "cat")
    try:
        res = clusterctl("start", spec, "--dispatch", timeout=180)
        assert res.returncode == 0, res.stdout + res.stderr
        assert _kept(name).exists()
        _clear(fleet, "cat")
        res = clusterctl("stop", spec, timeout=120)
        assert res.returncode == 0 and res.stdout.strip() == f"job {name} stopped on 2 host(s), 2 process(es) killed", (
            res.stdout + res.stderr)
        assert not _kept(name).exists()
        # the first host to get the stop ends the job everywhere through the coordinator; the other's supervisor
        # may be gone before its own request reaches it, and that host is asked with the line
        assert any(not _starts(fleet, i, "cat") for i in NODES), [_starts(fleet, i, "cat") for i in NODES]
        assert_no_orphans(fleet, name, hosts=[fleet.nodes[i] for i in NODES], within=GRACE + 5 + SLACK)
    finally:
        clusterctl("stop", spec, timeout=120)
        _unwrap(fleet, "cat")


@pytest.mark.timeout(300)
def test_a_host_whose_sshd_forwards_nothing_is_asked_with_the_line(fleet, tmp_path):
    """node1's sshd set to `AllowTcpForwarding no` (as some fleets have it): the forwarding to its supervisor is
    refused there, so node1 is asked with the line (`cat` runs there) and its endpoint forgotten, while node0 is
    still asked directly; status, and then stop, are right on both."""
    name = "fleet-ctl-noforward"
    node1 = fleet.nodes[1].container
    config = tmp_path / "ssh_config"  # a config of the test's own: new kept connections, made after sshd's change
    config.write_text(fleet.ssh_config_path.read_text())
    spec = _sleep_job(fleet, tmp_path / "f.yaml", name, trainers=1)
    spec.write_text(spec.read_text().replace(str(fleet.ssh_config_path), str(config)))
    sshd = "kill -HUP $(pgrep -o -x sshd)"  # the listener re-reads its config; open connections keep theirs
    node_exec(node1, f"echo 'AllowTcpForwarding no' >> /etc/ssh/sshd_config && {sshd}")
    _wrap(fleet, "cat")
    try:
        res = clusterctl("start", spec, "--dispatch", timeout=180)
        assert res.returncode == 0, res.stdout + res.stderr
        assert sorted(json.loads(_kept(name).read_text())) == sorted(f"ubuntu@{fleet.nodes[i].ip}:22" for i in NODES)
        _clear(fleet, "cat")
        st = status_json(spec)
        assert [(p["host"], p["state"]) for p in st["processes"]] == [("node0", "running"), ("node1", "running")]
        assert [bool(_starts(fleet, i, "cat")) for i in NODES] == [False, True]
        assert sorted(json.loads(_kept(name).read_text())) == [f"ubuntu@{fleet.nodes[0].ip}:22"]
        _clear(fleet, "cat")
        st = status_json(spec)  # node1 now goes by the line at once, with no refused channel first
        assert [(p["host"], p["state"]) for p in st["processes"]] == [("node0", "running"), ("node1", "running")]
        assert [bool(_starts(fleet, i, "cat")) for i in NODES] == [False, True]
    finally:
        stopped = clusterctl("stop", spec, timeout=120)
        _unwrap(fleet, "cat")
        node_exec(node1, f"sed -i '/^AllowTcpForwarding no$/d' /etc/ssh/sshd_config && {sshd}", check=False)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert_no_orphans(fleet, name, hosts=[fleet.nodes[i] for i in NODES], within=GRACE + 5 + SLACK)
