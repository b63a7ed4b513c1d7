"""The dockerized sshd test cluster itself: real OpenSSH and paramiko clients against real nodes."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import paramiko
import pytest
import yaml

from clusterctl import docker
from clusterctl import testcluster as tc
from clusterctl.spec import load_spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# The session cluster (conftest.py) has this many nodes; its name and packages are read from ClusterInfo
# (tests do not import conftest: that module name is not unique across test directories).
NODES = 4


def ssh_argv(info: tc.ClusterInfo, ip: str, command: str, known_hosts: Path | None = None) -> list[str]:
    """OpenSSH client argv with the cluster's pinned host keys and key; never prompts, never trusts new keys."""
    return [
        "ssh",
        "-o", "StrictHostKeyChecking=yes",  # an unpinned or changed host key is an error
        "-o", f"UserKnownHostsFile={known_hosts or info.known_hosts_path}",
        "-o", "GlobalKnownHostsFile=/dev/null",  # only the cluster's pins count
        "-o", "BatchMode=yes",  # no password or passphrase prompts
        "-o", "IdentitiesOnly=yes",  # only the cluster key, not the agent's keys
        "-o", "ConnectTimeout=5",
        "-i", str(info.key_path),
        f"root@{ip}",
        command,
    ]  # fmt: skip


def ssh(info: tc.ClusterInfo, ip: str, command: str, **kw: object) -> subprocess.CompletedProcess[str]:
    """Run command on ip over real ssh; returns the completed process (never raises on exit code)."""
    return subprocess.run(ssh_argv(info, ip, command, **kw), capture_output=True, text=True, timeout=60)  # type: ignore[arg-type]


def test_cluster_shape(testcluster: tc.ClusterInfo) -> None:
    assert testcluster.name == os.environ.get("CLUSTERCTL_TESTCLUSTER_NAME", "clusterctl-pytest")
    assert [n.container for n in testcluster.nodes] == [f"{testcluster.name}-node{i}" for i in range(NODES)]
    assert [n.hostname for n in testcluster.nodes] == [n.container for n in testcluster.nodes]
    assert len({n.ip for n in testcluster.nodes}) == NODES
    assert testcluster.key_path.stat().st_mode & 0o777 == 0o600
    assert testcluster.state_dir == tc.state_dir(testcluster.name)


def test_known_hosts_pins_one_distinct_key_per_node(testcluster: tc.ClusterInfo) -> None:
    lines = testcluster.known_hosts_path.read_text().splitlines()
    assert [line.split()[0] for line in lines] == [n.ip for n in testcluster.nodes]
    assert all(line.split()[1] == "ssh-ed25519" for line in lines)
    assert len({line.split()[2] for line in lines}) == NODES  # per-container host keys


def test_real_ssh_reaches_every_node_with_distinct_hostnames(testcluster: tc.ClusterInfo) -> None:
    hostnames = []
    for node in testcluster.nodes:
        proc = ssh(testcluster, node.ip, "hostname")
        assert proc.returncode == 0, proc.stderr
        hostnames.append(proc.stdout.strip())
    assert hostnames == [n.hostname for n in testcluster.nodes]


def test_wrong_pin_is_refused(testcluster: tc.ClusterInfo, tmp_path: Path) -> None:
    first, second = testcluster.nodes[0], testcluster.nodes[1]
    pins = dict(line.split(" ", 1) for line in testcluster.known_hosts_path.read_text().splitlines())
    wrong = tmp_path / "known_hosts"
    wrong.write_text(f"{first.ip} {pins[second.ip]}\n")  # node1's key claimed for node0
    proc = ssh(testcluster, first.ip, "true", known_hosts=wrong)
    assert proc.returncode == 255
    assert "Host key verification failed." in proc.stderr


def test_password_login_is_disabled(testcluster: tc.ClusterInfo) -> None:
    argv = ssh_argv(testcluster, testcluster.nodes[0].ip, "true")
    argv[1:1] = ["-o", "PreferredAuthentications=password,keyboard-interactive", "-o", "PubkeyAuthentication=no"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 255
    assert "Permission denied (publickey)." in proc.stderr


def test_paramiko_connects_with_reject_policy(testcluster: tc.ClusterInfo) -> None:
    node = testcluster.nodes[-1]
    client = paramiko.SSHClient()
    client.load_host_keys(str(testcluster.known_hosts_path))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    try:
        client.connect(node.ip, username="root", key_filename=str(testcluster.key_path), timeout=10,
                       allow_agent=False, look_for_keys=False)  # fmt: skip
        _stdin, stdout, _stderr = client.exec_command("hostname", timeout=30)
        assert stdout.read().decode().strip() == node.hostname
        assert stdout.channel.recv_exit_status() == 0
    finally:
        client.close()


def test_venv_python_has_the_packages(testcluster: tc.ClusterInfo) -> None:
    code = "import numpy, mpi4py, zmq, torch; print(torch.__version__, numpy.__name__)"
    proc = ssh(testcluster, testcluster.nodes[0].ip, f"/opt/venv/bin/python -c '{code}'")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["2.13.0+cpu", "numpy"]
    assert "torch==2.13.0" in testcluster.packages


def test_pid1_is_an_init_that_reaps_and_sshd_is_its_child(testcluster: tc.ClusterInfo) -> None:
    proc = ssh(testcluster, testcluster.nodes[1].ip, "ps -o comm= -p 1; ps -o ppid=,args= -C sshd")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].strip() == "docker-init"
    listeners = [line.split(None, 1) for line in lines[1:] if "[listener]" in line]
    assert [(ppid, args.split(" [")[0]) for ppid, args in listeners] == [("1", "sshd: /usr/sbin/sshd -D -e")]


def test_nodes_reach_each_other_by_hostname(testcluster: tc.ClusterInfo) -> None:
    last = testcluster.nodes[-1].hostname
    inner = f"ssh -o BatchMode=yes -o StrictHostKeyChecking=yes {last} hostname"
    proc = ssh(testcluster, testcluster.nodes[0].ip, inner)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == last


def test_spec_written_and_loadable(testcluster: tc.ClusterInfo) -> None:
    raw = yaml.safe_load(testcluster.spec_path.read_text())
    assert raw["ssh"] == {
        "user": "root",
        "port": 22,
        "identity_file": str(testcluster.key_path),
        "known_hosts": str(testcluster.known_hosts_path),
        "host_key_policy": "strict",
        "connect_timeout": 5,
    }
    assert raw["hosts"] == [{"address": n.ip} for n in testcluster.nodes]
    spec = load_spec(testcluster.spec_path)
    assert [h.address for h in spec.hosts] == [n.ip for n in testcluster.nodes]
    assert spec.ssh.host_key_policy == "strict"


def test_status_reports_every_node_running_with_ssh(testcluster: tc.ClusterInfo) -> None:
    assert tc.status(testcluster.name) == [
        tc.NodeStatus(n.container, n.hostname, n.ip, "running", True) for n in testcluster.nodes
    ]


def test_second_up_reuses_image_and_containers(testcluster: tc.ClusterInfo, testcluster_bringup_seconds: float) -> None:
    start = time.monotonic()
    again = tc.up(NODES, name=testcluster.name, packages=testcluster.packages)
    elapsed = time.monotonic() - start
    assert (again.image_built, again.reused) == (False, True)
    assert again.image == testcluster.image
    assert again.nodes == testcluster.nodes
    assert again.known_hosts_path.read_text() == testcluster.known_hosts_path.read_text()
    assert elapsed < 15, f"second up took {elapsed:.1f}s (first: {testcluster_bringup_seconds:.1f}s)"


def test_up_restarts_a_stopped_node(testcluster: tc.ClusterInfo) -> None:
    victim = testcluster.nodes[2]
    docker.run(["stop", "--time", "1", victim.container])
    assert tc.status(testcluster.name)[2].state == "exited"
    again = tc.up(NODES, name=testcluster.name, packages=testcluster.packages)
    assert again.reused is True
    node = again.nodes[2]
    proc = ssh(again, node.ip, "hostname")
    assert (proc.returncode, proc.stdout.strip()) == (0, victim.hostname), proc.stderr


@pytest.mark.timeout(300)
def test_down_of_another_cluster_leaves_this_one_intact(testcluster: tc.ClusterInfo) -> None:
    other_name = f"{testcluster.name}-other"
    try:
        other = tc.up(1, name=other_name)
        assert [n.container for n in other.nodes] == [f"{other_name}-node0"]
        resized = tc.up(2, name=other_name)  # another node count: recreated, not reused
        assert resized.reused is False and len(resized.nodes) == 2
        assert ssh(resized, resized.nodes[1].ip, "/opt/venv/bin/python -c 'import sys'").returncode == 0
    finally:
        removed = tc.down(other_name)
    assert removed == 3  # two containers and one network
    assert tc.down(other_name) == 0  # idempotent
    assert tc.status(other_name) == []
    assert not tc.state_dir(other_name).exists()
    assert [s.ssh for s in tc.status(testcluster.name)] == [True] * NODES
    for node in testcluster.nodes:
        proc = ssh(testcluster, node.ip, "hostname")
        assert (proc.returncode, proc.stdout.strip()) == (0, node.hostname), proc.stderr


def test_containers_and_network_carry_the_cluster_label(testcluster: tc.ClusterInfo) -> None:
    label = f"{tc.LABEL}={testcluster.name}"
    ids = docker.ids_with_label("container", label)
    assert len(ids) == NODES
    nets = docker.inspect("network", docker.ids_with_label("network", label))
    assert [n["Name"] for n in nets] == [testcluster.network]
    assert json.dumps(nets[0]["Labels"]) == json.dumps({tc.LABEL: testcluster.name})


# ---- pure parts (no docker needed; they run even where the fixture skips) ----


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\n\n"
            "Types: deb\nURIs: http://deb.debian.org/debian-security\nSuites: bookworm-security\n",
            "http://deb.debian.org/debian",
        ),
        ("# comment\ndeb [arch=amd64] http://mirror.example/debian/ bookworm main\n", "http://mirror.example/debian"),
        ("deb http://deb.debian.org/debian-security bookworm-security main\n", None),
        ("deb https://packages.cloud.google.com/apt cloud-sdk-bookworm main\n", None),
    ],
)
def test_mirror_from_apt_sources(text: str, expected: str | None) -> None:
    assert tc._mirror_from_sources(text) == expected


def test_local_wheel_wins_only_when_it_satisfies_the_requirement(tmp_path: Path) -> None:
    for name in ("torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", "torch-2.12.0-cp311-cp311-linux_x86_64.whl"):
        (tmp_path / name).write_bytes(b"")
    newest = str(tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
    assert tc._local_wheel("torch==2.13.0", [tmp_path]) == newest
    assert tc._local_wheel("torch", [tmp_path]) == newest
    assert tc._local_wheel("torch==2.12.0", [tmp_path]) == str(tmp_path / "torch-2.12.0-cp311-cp311-linux_x86_64.whl")
    assert tc._local_wheel("torch==2.14.0", [tmp_path]) is None
    assert tc._local_wheel("numpy", [tmp_path]) is None


def test_spec_dict_has_the_documented_shape() -> None:
    nodes = [tc.Node("c-node0", "10.0.0.2", "c-node0"), tc.Node("c-node1", "10.0.0.3", "c-node1")]
    spec = tc._spec_dict("c", nodes, Path("/s/id_ed25519"), Path("/s/known_hosts"))
    assert spec == {
        "name": "c",
        "ssh": {
            "user": "root",
            "port": 22,
            "identity_file": "/s/id_ed25519",
            "known_hosts": "/s/known_hosts",
            "host_key_policy": "strict",
            "connect_timeout": 5,
        },
        "hosts": [{"address": "10.0.0.2"}, {"address": "10.0.0.3"}],
        "workspace": {"local": ".", "remote": "/root/work"},
        "job": {"mode": "pserver", "entrypoint": ["/opt/venv/bin/python", "train.py"], "pservers": 1, "trainers": 1},
    }


def test_cli_parses_the_documented_commands() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    tc.add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["testcluster", "up", "--nodes", "3", "--name", "x", "--packages", "numpy,torch==2.13.0"])
    assert (args.func, args.nodes, args.name, args.packages, args.spec_out, args.base_image) == (
        tc.cmd_up, 3, "x", "numpy,torch==2.13.0", None, None,
    )  # fmt: skip
    assert parser.parse_args(["testcluster", "down"]).func is tc.cmd_down
    assert parser.parse_args(["testcluster", "status", "--name", "y"]).name == "y"
