"""The dockerized sshd test cluster itself: real OpenSSH and paramiko clients against real nodes."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paramiko
import pytest
import yaml

from clusterctl import cli, docker, testcluster_slurm
from clusterctl import testcluster as tc
from clusterctl.spec import load_spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# The session cluster (conftest.py) and `flat` below have this many nodes; names and packages are read from
# ClusterInfo (tests do not import conftest: that module name is not unique across test directories).
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


_FLAT: dict = {}


@pytest.fixture(scope="module")
def flat(testcluster: tc.ClusterInfo) -> Iterator[tc.ClusterInfo]:
    """`up`'s default shape (root login on a flat network this machine reaches), `<session name>-flat`: the
    tests below check that shape itself (direct ssh and paramiko as root, the default spec), which the
    session cluster no longer has (it is non-root behind a bastion); the session's packages (image cached)."""
    name = f"{testcluster.name}-flat"
    start = time.monotonic()
    info = tc.up(NODES, name=name, packages=testcluster.packages)
    _FLAT["seconds"] = time.monotonic() - start
    yield info
    if os.environ.get("CLUSTERCTL_KEEP_TESTCLUSTER", "") != "1":
        tc.down(name)


def test_cluster_shape(flat: tc.ClusterInfo) -> None:
    assert flat.name == os.environ.get("CLUSTERCTL_TESTCLUSTER_NAME", "clusterctl-pytest") + "-flat"
    assert [n.container for n in flat.nodes] == [f"{flat.name}-node{i}" for i in range(NODES)]
    assert [n.hostname for n in flat.nodes] == [n.container for n in flat.nodes]
    assert len({n.ip for n in flat.nodes}) == NODES
    assert flat.key_path.stat().st_mode & 0o777 == 0o600
    assert flat.state_dir == tc.state_dir(flat.name)


def test_known_hosts_pins_one_distinct_key_per_node(flat: tc.ClusterInfo) -> None:
    lines = flat.known_hosts_path.read_text().splitlines()
    assert [line.split()[0] for line in lines] == [n.ip for n in flat.nodes]
    assert all(line.split()[1] == "ssh-ed25519" for line in lines)
    assert len({line.split()[2] for line in lines}) == NODES  # per-container host keys


def test_real_ssh_reaches_every_node_with_distinct_hostnames(flat: tc.ClusterInfo) -> None:
    hostnames = []
    for node in flat.nodes:
        proc = ssh(flat, node.ip, "hostname")
        assert proc.returncode == 0, proc.stderr
        hostnames.append(proc.stdout.strip())
    assert hostnames == [n.hostname for n in flat.nodes]


def test_wrong_pin_is_refused(flat: tc.ClusterInfo, tmp_path: Path) -> None:
    first, second = flat.nodes[0], flat.nodes[1]
    pins = dict(line.split(" ", 1) for line in flat.known_hosts_path.read_text().splitlines())
    wrong = tmp_path / "known_hosts"
    wrong.write_text(f"{first.ip} {pins[second.ip]}\n")  # node1's key claimed for node0
    proc = ssh(flat, first.ip, "true", known_hosts=wrong)
    assert proc.returncode == 255
    assert "Host key verification failed." in proc.stderr


def test_password_login_is_disabled(flat: tc.ClusterInfo) -> None:
    argv = ssh_argv(flat, flat.nodes[0].ip, "true")
    argv[1:1] = ["-o", "PreferredAuthentications=password,keyboard-interactive", "-o", "PubkeyAuthentication=no"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 255
    assert "Permission denied (publickey)." in proc.stderr


def test_paramiko_connects_with_reject_policy(flat: tc.ClusterInfo) -> None:
    node = flat.nodes[-1]
    client = paramiko.SSHClient()
    client.load_host_keys(str(flat.known_hosts_path))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    try:
        client.connect(node.ip, username="root", key_filename=str(flat.key_path), timeout=10,
                       allow_agent=False, look_for_keys=False)  # fmt: skip
        _stdin, stdout, _stderr = client.exec_command("hostname", timeout=30)
        assert stdout.read().decode().strip() == node.hostname
        assert stdout.channel.recv_exit_status() == 0
    finally:
        client.close()


def test_venv_python_has_the_packages(flat: tc.ClusterInfo) -> None:
    code = "import numpy, mpi4py, zmq, torch; print(torch.__version__, numpy.__name__)"
    proc = ssh(flat, flat.nodes[0].ip, f"/opt/venv/bin/python -c '{code}'")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["2.13.0+cpu", "numpy"]
    assert "torch==2.13.0" in flat.packages


def test_pid1_is_an_init_that_reaps_and_sshd_is_its_child(flat: tc.ClusterInfo) -> None:
    proc = ssh(flat, flat.nodes[1].ip, "ps -o comm= -p 1; ps -o ppid=,args= -C sshd")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].strip() == "docker-init"
    listeners = [line.split(None, 1) for line in lines[1:] if "[listener]" in line]
    assert [(ppid, args.split(" [")[0]) for ppid, args in listeners] == [("1", "sshd: /usr/sbin/sshd -D -e")]


def test_nodes_reach_each_other_by_hostname(flat: tc.ClusterInfo) -> None:
    last = flat.nodes[-1].hostname
    inner = f"ssh -o BatchMode=yes -o StrictHostKeyChecking=yes {last} hostname"
    proc = ssh(flat, flat.nodes[0].ip, inner)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == last


def test_spec_written_and_loadable(flat: tc.ClusterInfo) -> None:
    raw = yaml.safe_load(flat.spec_path.read_text())
    assert raw["ssh"] == {
        "user": "root",
        "port": 22,
        "identity_file": str(flat.key_path),
        "known_hosts": str(flat.known_hosts_path),
        "host_key_policy": "strict",
        "connect_timeout": 5,
    }
    assert raw["hosts"] == [{"address": n.ip} for n in flat.nodes]
    spec = load_spec(flat.spec_path)
    assert [h.address for h in spec.hosts] == [n.ip for n in flat.nodes]
    assert spec.ssh.host_key_policy == "strict"


def test_status_reports_every_node_running_with_ssh(flat: tc.ClusterInfo) -> None:
    assert tc.status(flat.name) == [
        tc.NodeStatus(n.container, n.hostname, n.ip, "running", True) for n in flat.nodes
    ]


def test_second_up_reuses_image_and_containers(flat: tc.ClusterInfo) -> None:
    start = time.monotonic()
    again = tc.up(NODES, name=flat.name, packages=flat.packages)
    elapsed = time.monotonic() - start
    assert (again.image_built, again.reused) == (False, True)
    assert again.image == flat.image
    assert again.nodes == flat.nodes
    assert again.known_hosts_path.read_text() == flat.known_hosts_path.read_text()
    assert elapsed < 15, f"second up took {elapsed:.1f}s (first: {_FLAT['seconds']:.1f}s)"


def test_up_restarts_a_stopped_node(flat: tc.ClusterInfo) -> None:
    victim = flat.nodes[2]
    docker.run(["stop", "--time", "1", victim.container])
    assert tc.status(flat.name)[2].state == "exited"
    again = tc.up(NODES, name=flat.name, packages=flat.packages)
    assert again.reused is True
    node = again.nodes[2]
    proc = ssh(again, node.ip, "hostname")
    assert (proc.returncode, proc.stdout.strip()) == (0, victim.hostname), proc.stderr


@pytest.mark.timeout(300)
def test_down_of_another_cluster_leaves_this_one_intact(flat: tc.ClusterInfo) -> None:
    other_name = f"{flat.name}-other"
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
    assert [s.ssh for s in tc.status(flat.name)] == [True] * NODES
    for node in flat.nodes:
        proc = ssh(flat, node.ip, "hostname")
        assert (proc.returncode, proc.stdout.strip()) == (0, node.hostname), proc.stderr


def test_an_interrupted_up_takes_away_what_it_started(flat: tc.ClusterInfo) -> None:
    """Ctrl+C while `up` starts the nodes left them running, with no spec and no word of them."""
    import signal
    import sys

    name, label = f"{flat.name}-int", f"{tc.LABEL}={flat.name}-int"
    argv = [sys.executable, "-m", "clusterctl.cli", "testcluster", "up", "--nodes", "2", "--name", name]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal's
    try:
        deadline = time.monotonic() + 60
        while not docker.ids_with_label("container", label) and proc.poll() is None:  # its first node is there
            assert time.monotonic() < deadline, "no node of the cluster appeared"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, out
        assert f"interrupted: removing the containers and networks of {name}" in " ".join(out.split()), out
        assert docker.ids_with_label("container", label) == [] and docker.ids_with_label("network", label) == []
    finally:
        proc.kill()
        tc.down(name)


def test_containers_and_network_carry_the_cluster_label(flat: tc.ClusterInfo) -> None:
    label = f"{tc.LABEL}={flat.name}"
    ids = docker.ids_with_label("container", label)
    assert len(ids) == NODES
    nets = docker.inspect("network", docker.ids_with_label("network", label))
    assert [n["Name"] for n in nets] == [flat.network]
    assert json.dumps(nets[0]["Labels"]) == json.dumps({tc.LABEL: flat.name})


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

    from clusterctl import testcluster_cli

    parser = argparse.ArgumentParser()
    testcluster_cli.add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["testcluster", "up", "--nodes", "3", "--name", "x", "--packages", "numpy,torch==2.13.0"])
    assert (args.func, args.nodes, args.name, args.packages, args.spec_out, args.base_image) == (
        testcluster_cli.cmd_up, 3, "x", "numpy,torch==2.13.0", None, None,
    )  # fmt: skip
    assert parser.parse_args(["testcluster", "down"]).func is testcluster_cli.cmd_down
    assert parser.parse_args(["testcluster", "status", "--name", "y"]).name == "y"


# ---- a cluster shaped like real fleets: the session's `fleet` (conftest.py): login ubuntu with sudo, root
# login off, nodes only behind a bastion on a network this machine has no address on, an ssh config, one
# node whose sudo wants a password. Checked here with plain OpenSSH (`ssh -F`, `ssh -J`) and docker.


def fleet_ssh(info: tc.ClusterInfo, alias: str, command: str, *options: str) -> subprocess.CompletedProcess[str]:
    """`ssh -F <the cluster's ssh_config> [options] alias -- command`, never prompting."""
    assert info.ssh_config_path is not None
    argv = ["ssh", "-F", str(info.ssh_config_path), "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", *options]
    return subprocess.run([*argv, alias, "--", command], capture_output=True, text=True, timeout=60)


def sudo_nodes(info: tc.ClusterInfo) -> list[int]:
    """Indexes of the nodes with passwordless sudo."""
    return [i for i in range(len(info.nodes)) if i not in info.sudo_password_nodes]


def test_fleet_shape_and_written_files(fleet: tc.ClusterInfo) -> None:
    assert (fleet.user, fleet.home) == ("ubuntu", "/home/ubuntu")
    assert len(fleet.sudo_password_nodes) == 1 and len(sudo_nodes(fleet)) >= 2
    assert [n.container for n in fleet.nodes] == [f"{fleet.name}-node{i}" for i in range(len(fleet.nodes))]
    assert fleet.bastion is not None and fleet.bastion.container == f"{fleet.name}-bastion"
    assert (fleet.network, fleet.front_network) == (f"{fleet.name}-net", f"{fleet.name}-front")
    assert fleet.proxy_jump == f"ubuntu@{fleet.bastion.ip}"
    assert fleet.ssh_config_path == fleet.spec_path.parent / "ssh_config"
    assert fleet.aliases == [f"node{i}" for i in range(len(fleet.nodes))]
    raw = yaml.safe_load(fleet.spec_path.read_text())
    assert raw["ssh"] == {
        "user": "ubuntu",
        "port": 22,
        "identity_file": str(fleet.key_path),
        "known_hosts": str(fleet.known_hosts_path),
        "host_key_policy": "strict",
        "connect_timeout": 5,
        "proxy_jump": f"ubuntu@{fleet.bastion.ip}",
    }
    assert raw["hosts"] == [{"address": n.ip} for n in fleet.nodes]
    assert raw["workspace"] == {"local": ".", "remote": "work"}
    spec = load_spec(fleet.spec_path)
    assert (spec.ssh.user, spec.ssh.proxy_jump, spec.workspace.remote) == ("ubuntu", (fleet.proxy_jump,), "work")
    pins = [line.split()[0] for line in fleet.known_hosts_path.read_text().splitlines()]
    assert pins == [*(n.ip for n in fleet.nodes), fleet.bastion.ip]  # the bastion is pinned like the nodes
    common = (
        f"    User ubuntu\n    Port 22\n    IdentityFile {fleet.key_path}\n    IdentitiesOnly yes\n"
        f"    UserKnownHostsFile {fleet.known_hosts_path}\n    StrictHostKeyChecking yes\n"
    )
    nodes = [f"\nHost node{i}\n    HostName {n.ip}\n{common}    ProxyJump bastion\n" for i, n in enumerate(fleet.nodes)]
    assert fleet.ssh_config_path.read_text() == (
        f"# Written by `clusterctl testcluster up` for test cluster {fleet.name}: ssh -F, fab -S or ssh.config.\n"
        f"\nHost bastion\n    HostName {fleet.bastion.ip}\n{common}" + "".join(nodes)
    )


def test_fleet_user_logs_in_by_alias_with_passwordless_sudo(fleet: tc.ClusterInfo) -> None:
    index = sudo_nodes(fleet)[0]
    proc = fleet_ssh(fleet, f"node{index}", "id -un; id -u; echo $HOME; hostname; sudo -n id -un")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ubuntu", "1000", "/home/ubuntu", fleet.nodes[index].hostname, "root"]
    proc = fleet_ssh(fleet, f"node{index}", "sudo -n true")
    assert (proc.returncode, proc.stderr) == (0, "")


def test_fleet_root_login_is_refused_although_root_has_the_key(fleet: tc.ClusterInfo) -> None:
    assert fleet.bastion is not None
    pub = (fleet.state_dir / "id_ed25519.pub").read_text()
    for container in (fleet.nodes[0].container, fleet.bastion.container):
        keys = docker.run(["exec", container, "cat", "/root/.ssh/authorized_keys"]).stdout
        assert keys == pub  # so what refuses root below is sshd's PermitRootLogin no, not a missing key
    for alias in ("node0", "bastion"):
        proc = fleet_ssh(fleet, alias, "true", "-l", "root")
        assert proc.returncode == 255, (alias, proc.stdout)
        assert "root@" in proc.stderr and "Permission denied (publickey)." in proc.stderr, (alias, proc.stderr)


def test_fleet_this_machine_has_no_address_and_no_route_to_the_nodes(fleet: tc.ClusterInfo) -> None:
    import ipaddress
    import socket

    net = docker.inspect("network", [fleet.network])[0]
    subnet = ipaddress.ip_network(net["IPAM"]["Config"][0]["Subnet"])
    assert net["Internal"] is True and net["Options"] == {"com.docker.network.bridge.inhibit_ipv4": "true"}
    mine = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    addresses = [ipaddress.ip_interface(line.split()[3]) for line in mine.splitlines()]
    assert addresses and not [a for a in addresses if a.ip in subnet]
    if os.geteuid() != 0:
        pytest.skip("only root gets the `unreachable` route; without it a connect would leave by the default route")
    node = fleet.nodes[0]
    route = subprocess.run(["ip", "-4", "route", "get", node.ip], capture_output=True, text=True)
    assert (route.returncode, route.stderr.strip()) == (2, "RTNETLINK answers: No route to host")
    started = time.monotonic()
    with pytest.raises(OSError, match="No route to host"):
        socket.create_connection((node.ip, 22), timeout=5).close()
    assert time.monotonic() - started < 1  # refused here at once, nothing sent anywhere


def test_fleet_ssh_jump_through_the_bastion(fleet: tc.ClusterInfo) -> None:
    # `ssh -J`: the jump host comes from the config; the target is the node's bare address.
    node = fleet.nodes[1]
    pinned = ["-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={fleet.known_hosts_path}",
              "-o", "IdentitiesOnly=yes", "-i", str(fleet.key_path), "-J", "bastion"]  # fmt: skip
    proc = fleet_ssh(fleet, f"ubuntu@{node.ip}", "hostname", *pinned)
    assert (proc.returncode, proc.stdout.strip()) == (0, node.hostname), proc.stderr


def test_fleet_bastion_without_its_pin_is_refused(fleet: tc.ClusterInfo, tmp_path: Path) -> None:
    # A config whose known_hosts pins the nodes but not the bastion: the first hop already fails.
    assert fleet.bastion is not None and fleet.ssh_config_path is not None
    unpinned = tmp_path / "known_hosts"
    unpinned.write_text("".join(f"{line}\n" for line in fleet.known_hosts_path.read_text().splitlines()[:-1]))
    config = tmp_path / "ssh_config"
    config.write_text(fleet.ssh_config_path.read_text().replace(str(fleet.known_hosts_path), str(unpinned)))
    argv = ["ssh", "-F", str(config), "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "node0", "true"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 255
    assert f"No ED25519 host key is known for {fleet.bastion.ip}" in proc.stderr
    assert "Host key verification failed." in proc.stderr


def test_fleet_nodes_route_nowhere_but_their_network(fleet: tc.ClusterInfo) -> None:
    front = docker.inspect("network", [fleet.front_network])[0]["IPAM"]["Config"][0]["Gateway"]
    probe = f"import socket; socket.create_connection(('{front}', 22), timeout=3)"
    proc = fleet_ssh(fleet, "node0", f"ip -4 route; python3 -c \"{probe}\"")
    assert proc.returncode == 1
    subnet = docker.inspect("network", [fleet.network])[0]["IPAM"]["Config"][0]["Subnet"]
    assert [line.split()[:3] for line in proc.stdout.splitlines()] == [[subnet, "dev", "eth0"]]  # no default route
    assert "OSError: [Errno 101] Network is unreachable" in proc.stderr


def test_fleet_nodes_reach_each_other_as_the_user(fleet: tc.ClusterInfo) -> None:
    first, second = sudo_nodes(fleet)[:2]
    other = fleet.nodes[second].hostname
    proc = fleet_ssh(fleet, f"node{first}", f"ssh -o BatchMode=yes -o StrictHostKeyChecking=yes {other} id -un")
    assert (proc.returncode, proc.stdout.strip()) == (0, "ubuntu"), proc.stderr


def test_fleet_venv_is_usable_and_opt_is_writable_only_through_sudo(fleet: tc.ClusterInfo) -> None:
    command = (
        "/opt/venv/bin/python -c 'import numpy, sys; print(sys.prefix)'; "
        "touch /opt/x 2>/dev/null && echo opt-writable || echo opt-readonly; "
        "sudo -n install -d -o ubuntu /opt/tc-shape && touch /opt/tc-shape/x && echo sudo-ok; "
        "sudo -n rm -rf /opt/tc-shape"
    )
    proc = fleet_ssh(fleet, f"node{sudo_nodes(fleet)[0]}", command)
    assert (proc.returncode, proc.stdout.split()) == (0, ["/opt/venv", "opt-readonly", "sudo-ok"]), proc.stderr


def test_fleet_password_sudo_node_fails_fast_and_names_it(fleet: tc.ClusterInfo) -> None:
    index = fleet.sudo_password_nodes[0]
    started = time.monotonic()
    proc = fleet_ssh(fleet, f"node{index}", "sudo -n true")
    assert (proc.returncode, proc.stderr.strip()) == (1, "sudo: a password is required")
    assert time.monotonic() - started < 10
    container = fleet.nodes[index].container
    rules = docker.run(["exec", container, "ls", "/etc/sudoers.d"]).stdout.split()
    assert "90-clusterctl-user" not in rules
    shadow = docker.run(["exec", container, "getent", "shadow", "ubuntu"]).stdout.split(":")
    assert shadow[1].startswith("$")  # a real (random) password: the account is usable, its sudo asks
    assert fleet_ssh(fleet, f"node{sudo_nodes(fleet)[0]}", "sudo -n true").returncode == 0  # the others are not


def test_fleet_status_probes_the_nodes_through_the_bastion(fleet: tc.ClusterInfo) -> None:
    assert fleet.bastion is not None
    expected = [tc.NodeStatus(n.container, n.hostname, n.ip, "running", True) for n in fleet.nodes]
    expected.append(tc.NodeStatus(fleet.bastion.container, fleet.bastion.hostname, fleet.bastion.ip, "running", True))
    assert tc.status(fleet.name) == expected


def test_fleet_second_up_reuses_it_and_another_shape_would_not(fleet: tc.ClusterInfo) -> None:
    start = time.monotonic()
    again = tc.up(len(fleet.nodes), name=fleet.name, packages=fleet.packages, user=fleet.user, bastion=True,
                  ssh_config=True, sudo_password_nodes=fleet.sudo_password_nodes)  # fmt: skip
    assert (again.reused, again.nodes, again.bastion) == (True, fleet.nodes, fleet.bastion)
    assert time.monotonic() - start < 15
    nodes, bastion, count = tc._cluster_containers(fleet.name), tc._bastion_info(fleet.name), len(fleet.nodes)
    same = tc.Shape(fleet.user, True, fleet.sudo_password_nodes)
    assert tc._reusable(nodes, count, fleet.image, fleet.name, same, bastion)
    for other in (tc.Shape(), tc.Shape("ubuntu"), tc.Shape("ubuntu", True), tc.Shape("admin", True, (1,))):
        assert not tc._reusable(nodes, count, fleet.image, fleet.name, other, bastion), other


@pytest.mark.timeout(180)
def test_bastion_cluster_down_removes_containers_networks_and_the_route(testcluster: tc.ClusterInfo) -> None:
    # A cluster of its own (the session's fleet stays): 1 node behind a bastion, up and down.
    name = f"{testcluster.name}-down"
    try:
        info = tc.up(1, name=name, packages=testcluster.packages, user="ubuntu", bastion=True)
        subnet = docker.inspect("network", [info.network])[0]["IPAM"]["Config"][0]["Subnet"]
        routes = subprocess.run(["ip", "-4", "route", "show", "type", "unreachable"], capture_output=True, text=True)
        if os.geteuid() == 0:
            assert f"unreachable {subnet} metric {tc.ROUTE_METRIC}" in routes.stdout
        assert [s.ssh for s in tc.status(name)] == [True, True]  # the node (through the bastion), the bastion
    finally:
        removed = tc.down(name)
    assert removed == 4  # the node, the bastion, two networks
    assert tc.status(name) == [] and tc.down(name) == 0
    assert docker.ids_with_label("network", f"{tc.LABEL}={name}") == []
    routes = subprocess.run(["ip", "-4", "route", "show", "type", "unreachable"], capture_output=True, text=True)
    assert subnet not in routes.stdout


# ---- pure parts of the fleet shape ----


def test_shape_layout_keeps_the_default_and_tells_shapes_apart() -> None:
    shapes = [tc.Shape(), tc.Shape("ubuntu"), tc.Shape("ubuntu", True), tc.Shape("ubuntu", True, (1,))]
    assert shapes[0].layout() == tc.LAYOUT  # running default clusters are still reused
    assert len({s.layout() for s in shapes}) == len(shapes)
    assert shapes[3].layout() == f"{tc.LAYOUT};user=ubuntu;bastion;sudo-password=1"
    assert shapes[3].run_args(1) == [
        "--env", "CLUSTERCTL_USER=ubuntu", "--env", "CLUSTERCTL_SUDO=password",
        "--cap-add", "NET_ADMIN", "--env", "CLUSTERCTL_NO_DEFAULT_ROUTE=1",
    ]  # fmt: skip
    assert shapes[3].run_args(None) == ["--env", "CLUSTERCTL_USER=ubuntu", "--env", "CLUSTERCTL_SUDO=nopasswd"]
    assert shapes[0].run_args(0) == [] and shapes[0].home == "/root" and shapes[1].home == "/home/ubuntu"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"user": "Bad User"}, "invalid user name 'Bad User'"),
        ({"sudo_password_nodes": [0]}, "--sudo-password-node needs --user NAME: root does not use sudo"),
        ({"user": "ubuntu", "sudo_password_nodes": [2]}, "--sudo-password-node 2: nodes are numbered 0..1"),
        ({"spec_out": Path("/")}, "--spec-out / is a directory: give the spec file's path (e.g. /cluster.yaml)"),
        ({"spec_out": Path("/proc/no-such-dir/c.yaml")}, "--spec-out /proc/no-such-dir/c.yaml: cannot make its directory"),
        ({"packages": ["numpy", ";rm -rf /"]}, "invalid package requirement ';rm -rf /': Expected package name at the start"),
    ],
)
def test_up_refuses_a_bad_shape_before_touching_docker(kwargs: dict[str, Any], message: str, monkeypatch) -> None:
    monkeypatch.setattr(tc, "ensure_docker", _no_docker)
    for up in (tc.up, *(() if set(kwargs) - {"spec_out", "packages"} else (testcluster_slurm.up,))):
        with pytest.raises(tc.DockerClusterError) as info:
            up(2, name="never-started", **kwargs)
        assert str(info.value).startswith(message) and "\n" not in str(info.value), info.value


def _no_docker() -> None:
    raise AssertionError("docker touched")


def test_up_from_the_command_line_says_a_bad_spec_out_in_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(tc, "ensure_docker", _no_docker)
    assert cli.main(["testcluster", "up", "--nodes", "1", "--name", "never-started", "--spec-out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"clusterctl: error: --spec-out {tmp_path} is a directory: give the spec file's path " \
                  f"(e.g. {tmp_path / 'cluster.yaml'})\n", err  # was IsADirectoryError, after the cluster was up


def test_spec_dict_for_a_user_behind_a_bastion() -> None:
    nodes = [tc.Node("c-node0", "10.0.0.2", "c-node0")]
    bastion = tc.Node("c-bastion", "10.1.0.2", "c-bastion")
    spec = tc._spec_dict("c", nodes, Path("/s/id_ed25519"), Path("/s/known_hosts"), user="ubuntu", bastion=bastion)
    assert spec["ssh"]["user"] == "ubuntu" and spec["ssh"]["proxy_jump"] == "ubuntu@10.1.0.2"
    assert spec["workspace"] == {"local": ".", "remote": "work"}
    flat = tc._spec_dict("c", nodes, Path("/s/id_ed25519"), Path("/s/known_hosts"), user="ubuntu")
    assert "proxy_jump" not in flat["ssh"]


def test_ssh_config_quotes_paths_with_blanks_and_has_no_jump_without_a_bastion() -> None:
    nodes = [tc.Node("c-node0", "10.0.0.2", "c-node0")]
    text = tc._ssh_config_text("c", nodes, "root", Path("/a b/key"), Path("/s/known_hosts"), None)
    assert text.splitlines()[1:] == [
        "", "Host node0", "    HostName 10.0.0.2", "    User root", "    Port 22", '    IdentityFile "/a b/key"',
        "    IdentitiesOnly yes", "    UserKnownHostsFile /s/known_hosts", "    StrictHostKeyChecking yes",
    ]  # fmt: skip


def test_cli_parses_the_fleet_options() -> None:
    import argparse

    from clusterctl import testcluster_cli

    parser = argparse.ArgumentParser()
    testcluster_cli.add_cli(parser.add_subparsers(dest="command"))
    words = ["testcluster", "up", "--nodes", "2", "--user", "ubuntu", "--bastion", "--ssh-config"]
    args = parser.parse_args([*words, "--sudo-password-node", "1", "--sudo-password-node", "0"])
    assert (args.user, args.bastion, args.ssh_config, args.sudo_password_node) == ("ubuntu", True, True, [1, 0])
    plain = parser.parse_args(["testcluster", "up", "--nodes", "2"])
    assert (plain.user, plain.bastion, plain.ssh_config, plain.sudo_password_node) == (None, False, False, None)
