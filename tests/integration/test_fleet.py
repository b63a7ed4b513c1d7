"""clusterctl on a cluster shaped like real fleets (issue 11): login `ubuntu` with sudo and root login off,
nodes on a network this machine has no address on, reached only through a bastion, named by aliases of
an ssh config. Real sshd, real sudo, real OpenSSH client; host keys checked on every hop.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from clusterlib import (
    ROOT, assert_no_orphans, clusterctl, clusterctl_while_paused, docker, dump_spec, node_exec, status_json, wait_until,
)

from clusterctl import testcluster as tc

JOBS = Path(__file__).resolve().parent / "jobs"
ALIASES = ["node0", "node1"]  # passwordless sudo; node2's sudo wants a password


def fleet_spec(info: tc.ClusterInfo, path: Path, *, name: str, aliases: bool = True, nodes=(0, 1), **sections) -> Path:
    """A spec for the fleet: by alias through its ssh config (the config's ProxyJump), or by address with
    the spec's own ssh.proxy_jump and key, as `testcluster up` wrote it."""
    base = yaml.safe_load(info.spec_path.read_text())
    if aliases:
        spec = {"name": name, "ssh": {"config": str(info.ssh_config_path), "connect_timeout": 5},
                "hosts": [{"address": f"node{i}"} for i in nodes]}
    else:
        spec = {"name": name, "ssh": dict(base["ssh"]), "hosts": [base["hosts"][i] for i in nodes]}
    return dump_spec(path, spec, sections)


@pytest.mark.timeout(60)
def test_exec_reaches_nodes_only_through_the_bastion_as_the_login_user(fleet, tmp_path):
    by_alias = fleet_spec(fleet, tmp_path / "a.yaml", name="fleet-exec", job={"entrypoint": ["true"]})
    res = clusterctl("exec", by_alias, "--", "sh", "-c", "id -un; sudo -n id -un; hostname", check=True)
    assert sorted(res.stdout.splitlines()) == sorted(
        [f"[node{i}] {w}" for i in (0, 1) for w in ("ubuntu", "root", fleet.nodes[i].hostname)])
    plan = yaml.safe_load(clusterctl("plan", by_alias, "--json", check=True).stdout)
    assert plan["hosts"][0] == {"address": "node0", "user": "ubuntu", "hostname": fleet.nodes[0].ip, "port": 22,
                                "jump": ["bastion"], "train_address": fleet.nodes[0].ip}
    # the same through the spec's own proxy_jump (no ssh config at all)
    by_address = fleet_spec(fleet, tmp_path / "b.yaml", name="fleet-exec", aliases=False, job={"entrypoint": ["true"]},
                            ssh={"config": "none"})
    res = clusterctl("exec", by_address, "--", "id", "-un", check=True)
    assert sorted(res.stdout.splitlines()) == sorted(f"[{fleet.nodes[i].ip}] ubuntu" for i in (0, 1))
    # this machine has no route to the nodes: without the bastion nothing connects
    direct = fleet_spec(fleet, tmp_path / "c.yaml", name="fleet-exec", aliases=False, job={"entrypoint": ["true"]},
                        ssh={"config": "none", "proxy_jump": "none", "connect_timeout": 2})
    assert clusterctl("exec", direct, "--", "true", timeout=30).returncode == 255


@pytest.mark.timeout(240)
def test_pserver_job_lifecycle_behind_the_bastion(fleet, tmp_path):
    """dispatch, start -> succeeded, logs, status, stop with no orphan: as `ubuntu`, through the bastion."""
    name = "fleet-cycle"
    spec = fleet_spec(
        fleet, tmp_path / "j.yaml", name=name,
        workspace={"local": str(ROOT / "examples" / "fit_a_line")},  # default remote: clusterctl/<name> in ~ubuntu
        job={"mode": "pserver", "entrypoint": ["/opt/venv/bin/python", "train.py"], "pservers": 1,
             "env": {"FIT_A_LINE_PASSES": "5"}},
    )
    clusterctl("stop", spec)
    try:
        clusterctl("dispatch", spec, check=True)
        assert node_exec(fleet.nodes[1].container, "ls /home/ubuntu/clusterctl/fleet-cycle/train.py").strip()
        res = clusterctl("start", spec, "--follow", timeout=200)
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"job {name}: succeeded" in res.stdout
        st = status_json(spec)
        assert st["state"] == "succeeded"
        assert {(p["role"], p["host"]) for p in st["processes"]} == {
            ("pserver", "node0"), ("trainer", "node0"), ("trainer", "node1")}
        logs = clusterctl("logs", spec, "--role", "trainer", check=True).stdout.splitlines()
        assert any(line.startswith("[node1 trainer.1] ") for line in logs), logs
        owners = node_exec(fleet.nodes[0].container, "stat -c %U /home/ubuntu/clusterctl/fleet-cycle.logs/trainer.0.log")
        assert owners.strip() == "ubuntu"  # the job ran as the login user, never as root
    finally:
        stop = clusterctl("stop", spec)
    assert stop.returncode == 0, stop.stderr
    assert_no_orphans(fleet, name, [6170, 6180, 6168], hosts=fleet.nodes[:2])


@pytest.mark.timeout(90)
def test_a_fab_double_dash_command_runs_on_every_node_with_host_keys_checked(fleet, tmp_path):
    """`clusterctl-fab -S CONFIG -H node0,node1 -- 'CMD'`: through a shell on both nodes at once, as the login user
    through the bastion. It was Fabric's own run: paramiko, one host after another, any host key it had not seen
    added (AutoAddPolicy); with a known_hosts that knows no key it is now refused, and nothing is written to it."""
    def fab(config: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "clusterctl.fab", "-S", str(config), "-H", ",".join(ALIASES),
                               "--", "id -un | tr a-z A-Z; test -d /proc/self"], capture_output=True, text=True,
                              timeout=60, stdin=subprocess.DEVNULL, cwd=tmp_path)

    res = fab(fleet.ssh_config_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(res.stdout.splitlines()) == ["[node0] UBUNTU", "[node1] UBUNTU"], res.stdout + res.stderr
    empty = tmp_path / "known_hosts"
    res = fab(_config_knowing_no_key(fleet, tmp_path / "ssh_config", empty))
    assert res.returncode == 255 and "UBUNTU" not in res.stdout, res.stdout + res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("clusterctl: error: ")]
    assert len(errors) == 2 and all(f"bastion {fleet.bastion.ip}: unknown host key for {fleet.bastion.ip} " in line
                                    and f"not in {empty}." in line for line in errors), res.stderr
    assert empty.read_text() == ""


def _config_knowing_no_key(fleet, path: Path, known_hosts: Path) -> Path:
    """The fleet's ssh config with every UserKnownHostsFile an empty file (`known_hosts`)."""
    known_hosts.write_text("")
    path.write_text("\n".join(f"    UserKnownHostsFile {known_hosts}" if line.strip().startswith("UserKnownHostsFile")
                              else line for line in fleet.ssh_config_path.read_text().splitlines()) + "\n")
    return path


def _config_with_keys(fleet, tmp_path: Path, identity: str) -> Path:
    """The fleet's ssh config with its pins (in a known_hosts of the test's own) and each `IdentityFile` line
    replaced by `identity` (lines of the host block, indented)."""
    known = tmp_path / "known_hosts"
    config = _config_knowing_no_key(fleet, tmp_path / "ssh_config", known)
    known.write_text(fleet.known_hosts_path.read_text())
    lines = config.read_text().splitlines()
    assert any(line.strip().startswith("IdentityFile ") for line in lines)
    config.write_text("\n".join(identity if line.strip().startswith("IdentityFile ") else line for line in lines) + "\n")
    return config


def _exec_through(fleet, tmp_path: Path, name: str, config: Path):
    """run(policy, *command, **ssh): `clusterctl exec` on node0 and node1 through the ssh config `config` under that
    host_key_policy (command: `id -un`; ssh: more of the spec's `ssh:` keys), each run over new connections (a kept
    one would skip what is tested)."""
    spec = fleet_spec(fleet, tmp_path / "a.yaml", name=name, job={"entrypoint": ["true"]})
    data = yaml.safe_load(spec.read_text())

    def run(policy: str, *command: str, **ssh) -> subprocess.CompletedProcess:
        data["ssh"].update({"config": str(config), "host_key_policy": policy, "persist": 0, "forward_agent": False,
                            **ssh})
        spec.write_text(yaml.safe_dump(data))
        return clusterctl("exec", spec, "--", *(command or ("id", "-un")), timeout=60)

    return run


@contextlib.contextmanager
def _agent_forwarding_allowed(fleet):
    """Nodes 0 and 1's sshd with `AllowAgentForwarding yes` (the test cluster's, like many fleets', says no), put
    back after: the listener re-reads its config on SIGHUP, and is waited for until it answers again."""
    nodes = [n.container for n in fleet.nodes[:2]]

    def allow(value: str) -> None:
        for container in nodes:
            node_exec(container, f"sed -i 's/^AllowAgentForwarding .*/AllowAgentForwarding {value}/' "
                                 "/etc/ssh/sshd_config && kill -HUP $(cat /run/sshd.pid)")
        for container in nodes:
            assert wait_until(lambda c=container: "ssh-" in node_exec(
                c, "ssh-keyscan -T 1 127.0.0.1 2>/dev/null", check=False), timeout=20, interval=0.1), container

    allow("yes")
    try:
        yield
    finally:
        allow("no")


def _both_logged_in(res: subprocess.CompletedProcess, policy: str) -> None:
    assert res.returncode == 0, policy + res.stdout + res.stderr
    assert sorted(res.stdout.splitlines()) == ["[node0] ubuntu", "[node1] ubuntu"], policy + res.stdout + res.stderr


@pytest.mark.timeout(90)
@pytest.mark.parametrize("hop", ["ProxyJump", "ProxyCommand"])
def test_accept_new_through_an_ssh_config_uses_its_keys_and_known_hosts(fleet, tmp_path, hop):
    """`host_key_policy: accept-new` goes over paramiko, which read neither the ssh config's IdentityFile (every
    node: "No authentication methods available") nor its UserKnownHostsFile (the bastion's key was recorded in
    ~/.ssh/known_hosts, and checked there), nor ran its ProxyCommand (it connected to the nodes' address
    directly: "Unable to connect to port 22"). Now all three are the config's, as ssh's own are; strict then
    verifies every key that accept-new recorded."""
    known = tmp_path / "known_hosts"
    config = _config_knowing_no_key(fleet, tmp_path / "ssh_config", known)
    if hop == "ProxyCommand":  # the bastion by a command of the config's own, with ssh's tokens: that ssh checks
        config.write_text(config.read_text().replace(  # the bastion's key itself, so that one is known beforehand
            "    ProxyJump bastion", f"    ProxyCommand ssh -F {config} -W %h:%p -l %r bastion"))
        known.write_text("".join(line + "\n" for line in fleet.known_hosts_path.read_text().splitlines()
                                 if line.split()[:1] == [fleet.bastion.ip]))
        assert known.read_text()
    spec = fleet_spec(fleet, tmp_path / "a.yaml", name="fleet-accept-new", job={"entrypoint": ["true"]})
    data = yaml.safe_load(spec.read_text())
    data["ssh"].update(config=str(config), host_key_policy="accept-new")
    spec.write_text(yaml.safe_dump(data))
    home = Path("~/.ssh/known_hosts").expanduser()
    before = home.read_bytes() if home.exists() else None
    res = clusterctl("exec", spec, "--", "id", "-un", timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(res.stdout.splitlines()) == ["[node0] ubuntu", "[node1] ubuntu"], res.stdout + res.stderr
    recorded = {line.split()[0] for line in known.read_text().splitlines()}
    assert recorded == {fleet.bastion.ip, fleet.nodes[0].ip, fleet.nodes[1].ip}, known.read_text()
    assert (home.read_bytes() if home.exists() else None) == before
    data["ssh"]["host_key_policy"] = "strict"
    spec.write_text(yaml.safe_dump(data))
    assert clusterctl("exec", spec, "--", "id", "-un", timeout=60).returncode == 0  # the OpenSSH client, those keys


@pytest.mark.timeout(90)
def test_identities_only_of_the_ssh_config_is_honoured_under_accept_new(fleet, tmp_path, monkeypatch):
    """The config's `IdentitiesOnly yes` with its key in the agent (the file there as its .pub only): paramiko offered
    every key the agent held, and sshd (MaxAuthTries 6) ended the connection after six wrong ones ("Too many
    authentication failures"), where ssh offers the named key only."""
    from helpers import SshAgent, ssh_keygen

    agent = SshAgent(tmp_path)
    try:
        for i in range(6):
            agent.add(ssh_keygen(tmp_path / f"wrong{i}"))
        agent.add(fleet.key_path)  # the right key last, as a user's agent holds many
        pub_only = tmp_path / "fleet_key"
        (tmp_path / "fleet_key.pub").write_text(Path(f"{fleet.key_path}.pub").read_text())
        known = tmp_path / "known_hosts"
        config = _config_knowing_no_key(fleet, tmp_path / "ssh_config", known)
        text = config.read_text()
        assert text.count("IdentitiesOnly yes") == len(fleet.nodes) + 1  # every node's entry and the bastion's
        config.write_text("\n".join(f"    IdentityFile {pub_only}" if line.strip().startswith("IdentityFile")
                                    else line for line in text.splitlines()) + "\n")
        known.write_text(fleet.known_hosts_path.read_text())
        spec = fleet_spec(fleet, tmp_path / "a.yaml", name="fleet-ids-only", job={"entrypoint": ["true"]})
        data = yaml.safe_load(spec.read_text())
        data["ssh"].update(config=str(config), host_key_policy="accept-new")
        spec.write_text(yaml.safe_dump(data))
        monkeypatch.setenv("SSH_AUTH_SOCK", str(agent.sock))
        res = clusterctl("exec", spec, "--", "id", "-un", timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr
        assert sorted(res.stdout.splitlines()) == ["[node0] ubuntu", "[node1] ubuntu"], res.stdout + res.stderr
        # without IdentitiesOnly ssh still offers the agent's key of the IdentityFile first, and so do we
        with_agent = config.read_text().replace("    IdentitiesOnly yes\n", "")
        config.write_text(with_agent)
        res = clusterctl("exec", spec, "--", "id", "-un", timeout=60)
        assert res.returncode == 0 and len(res.stdout.splitlines()) == 2, res.stdout + res.stderr
        # a key the agent does not hold: its six others are offered, and sshd closes the connection (as for ssh)
        config.write_text(with_agent.replace(f"IdentityFile {pub_only}", f"IdentityFile {tmp_path / 'absent'}"))
        res = clusterctl("exec", spec, "--", "id", "-un", timeout=60)
        errors = res.stderr.splitlines()
        assert res.returncode == 255 and len(errors) == 2 and all(
            line.startswith("clusterctl: error: authentication failed as ubuntu@node") and "sshd's MaxAuthTries?" in line
            for line in errors), res.stderr
        ssh = subprocess.run(["ssh", "-F", str(config), "-o", "BatchMode=yes", "node0", "true"], capture_output=True,
                             text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert ssh.returncode == 255 and "Too many authentication failures" in ssh.stderr, ssh.stderr
    finally:
        agent.stop()


# A ProxyCommand that relays stdin/stdout to HOST PORT and notes each connection in LOG.
RELAY = """
import socket, sys, threading
host, port, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with open(log, "a") as f:
    f.write(f"{host}:{port}\\n")
s = socket.create_connection((host, port), timeout=10)
s.settimeout(None)
def up():
    while data := sys.stdin.buffer.read1(65536):
        s.sendall(data)
    s.shutdown(socket.SHUT_WR)
threading.Thread(target=up, daemon=True).start()
while data := s.recv(65536):
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()
"""


@pytest.mark.timeout(90)
def test_a_bastions_own_proxy_command_is_run_under_accept_new(fleet, tmp_path):
    """The bastion's entry in the ssh config has a ProxyCommand of its own (a relay that notes each connection):
    ssh runs it for the first hop; paramiko's path connected to the bastion's address directly."""
    relay, log, known = tmp_path / "relay.py", tmp_path / "relay.log", tmp_path / "known_hosts"
    relay.write_text(RELAY)
    config = _config_knowing_no_key(fleet, tmp_path / "ssh_config", known)
    known.write_text(fleet.known_hosts_path.read_text())
    lines = config.read_text().splitlines()
    at = lines.index("Host bastion") + 1
    config.write_text("\n".join(lines[:at] + [f"    ProxyCommand {sys.executable} {relay} %h %p {log}"] + lines[at:])
                      + "\n")
    spec = fleet_spec(fleet, tmp_path / "a.yaml", name="fleet-bastion-pc", job={"entrypoint": ["true"]})
    data = yaml.safe_load(spec.read_text())
    data["ssh"].update(config=str(config), host_key_policy="accept-new")
    spec.write_text(yaml.safe_dump(data))
    res = clusterctl("exec", spec, "--", "id", "-un", timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(res.stdout.splitlines()) == ["[node0] ubuntu", "[node1] ubuntu"], res.stdout + res.stderr
    noted = log.read_text().splitlines() if log.exists() else []
    assert noted and set(noted) == {f"{fleet.bastion.ip}:22"}, noted
    relayed = len(noted)
    data["ssh"]["host_key_policy"] = "strict"  # the OpenSSH path runs it too, as ssh does
    spec.write_text(yaml.safe_dump(data))
    assert clusterctl("exec", spec, "--", "true", timeout=60).returncode == 0
    assert len(log.read_text().splitlines()) > relayed


@pytest.mark.timeout(90)
@pytest.mark.parametrize("policy", ["strict", "accept-new"])  # the OpenSSH path, the paramiko path
def test_a_bastion_behind_another_by_its_own_proxy_jump(fleet, tmp_path, policy):
    """The bastion's entry in the ssh config has a ProxyJump of its own, to `outer` (the same machine by another
    name, whose own entry relays through a command that notes each connection), as ssh follows it: the chain is
    outer -> bastion -> node, both paths. Before, the bastion was reached directly (ProxyJump=none)."""
    relay, log, known = tmp_path / "relay.py", tmp_path / "relay.log", tmp_path / "known_hosts"
    relay.write_text(RELAY)
    config = _config_knowing_no_key(fleet, tmp_path / "ssh_config", known)
    known.write_text(fleet.known_hosts_path.read_text())
    text = config.read_text()
    at = text.index("Host bastion\n")
    entry = text[at:].split("\n\n")[0].rstrip("\n")
    outer = entry.replace("Host bastion", "Host outer") + f"\n    ProxyCommand {sys.executable} {relay} %h %p {log}\n"
    config.write_text(text[:at] + entry + "\n    ProxyJump outer\n" + text[at + len(entry):] + "\n" + outer)
    spec = fleet_spec(fleet, tmp_path / "a.yaml", name="fleet-bastion-pj", job={"entrypoint": ["true"]})
    data = yaml.safe_load(spec.read_text())
    data["ssh"].update(config=str(config), host_key_policy=policy)
    spec.write_text(yaml.safe_dump(data))
    plan = yaml.safe_load(clusterctl("plan", spec, "--json", check=True).stdout)
    assert [h["jump"] for h in plan["hosts"]] == [["outer", "bastion"]] * 2
    res = clusterctl("exec", spec, "--", "id", "-un", timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(res.stdout.splitlines()) == ["[node0] ubuntu", "[node1] ubuntu"], res.stdout + res.stderr
    noted = log.read_text().splitlines() if log.exists() else []
    assert noted and set(noted) == {f"{fleet.bastion.ip}:22"}, noted  # outer, through the relay


@pytest.mark.timeout(120)
def test_a_host_key_alias_is_where_both_paths_look_the_key_up(fleet, tmp_path):
    """The nodes' entries in the ssh config have a HostKeyAlias; known_hosts has their keys under the aliases only,
    as ssh records them. ssh (strict) and paramiko (accept-new) look the keys up there and nowhere else: a wrong key
    under an alias is refused by both, and a key accept-new records goes under the alias. Before, paramiko looked
    the node's address up, found nothing and recorded whatever key the node sent: a changed key accepted."""
    known = tmp_path / "known_hosts"
    config = _config_knowing_no_key(fleet, tmp_path / "ssh_config", known)
    text = config.read_text()
    for i in (0, 1):
        text = text.replace(f"Host node{i}\n", f"Host node{i}\n    HostKeyAlias fleet-alias-{i}\n")
    config.write_text(text)
    pins = fleet.known_hosts_path.read_text().splitlines()
    by_ip = {n.ip: [line.split(None, 1)[1] for line in pins if line.split()[0] == n.ip] for n in fleet.nodes[:2]}
    bastion = [line for line in pins if line.split()[0] == fleet.bastion.ip]
    assert bastion and all(by_ip.values())

    def pin(keys_of: dict[int, str]) -> str:  # alias i -> the keys of the node at that address
        known.write_text("".join(f"{line}\n" for line in bastion)
                         + "".join(f"fleet-alias-{i} {key}\n" for i, ip in keys_of.items() for key in by_ip[ip]))
        return known.read_text()

    run = _exec_through(fleet, tmp_path, "fleet-alias", config)
    ip0, ip1 = fleet.nodes[0].ip, fleet.nodes[1].ip
    pinned = pin({0: ip0, 1: ip1})
    for policy in ("strict", "accept-new"):
        _both_logged_in(run(policy), policy)
        assert known.read_text() == pinned  # found under the aliases: nothing recorded
    pinned = pin({0: ip1, 1: ip1})  # node1's key under node0's alias: both paths refuse node0
    for policy in ("strict", "accept-new"):
        res = run(policy)
        assert res.returncode != 0 and "[node1] ubuntu" in res.stdout, res.stdout + res.stderr
        assert "[node0] ubuntu" not in res.stdout and "node0" in res.stderr, res.stdout + res.stderr
        assert known.read_text() == pinned
    assert f"host key for fleet-alias-0 (HostKeyAlias of {ip0}) CHANGED" in res.stderr, res.stderr
    pin({1: ip1})  # no key under node0's alias: accept-new records the one it meets there, as ssh would
    assert run("accept-new").returncode == 0
    recorded = [line for line in known.read_text().splitlines() if line.startswith("fleet-alias-0 ")]
    assert sorted(line.split(None, 1)[1] for line in recorded) == sorted(by_ip[ip0][:1] or by_ip[ip0]), recorded
    assert ip0 not in known.read_text()
    assert run("strict").returncode == 0  # and ssh finds it there


@pytest.mark.timeout(90)
def test_identity_file_tokens_name_each_hosts_key_on_both_paths(fleet, tmp_path, monkeypatch):
    """`IdentityFile ${VAR}/%n-%r-%p.key` (a key per host and login, a common fleet layout): ssh expands it when it
    opens the file, `ssh -G` prints it as written. Before, paramiko's path looked for that literal name, found no
    file and had no key to offer ("No authentication methods available"), where ssh logs in."""
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    for name in ("bastion", "node0", "node1"):  # the cluster's key under each host's own name
        (keys / f"{name}-ubuntu-22.key").write_bytes(fleet.key_path.read_bytes())
        (keys / f"{name}-ubuntu-22.key").chmod(0o600)
    monkeypatch.setenv("CLUSTERCTL_FLEET_KEYS", str(keys))
    config = _config_with_keys(fleet, tmp_path, "    IdentityFile ${CLUSTERCTL_FLEET_KEYS}/%n-%r-%p.key")
    run = _exec_through(fleet, tmp_path, "fleet-idtokens", config)
    for policy in ("strict", "accept-new"):
        _both_logged_in(run(policy), policy)
    (keys / "node1-ubuntu-22.key").unlink()  # and the file really is the one of that host: both fail without it
    for policy in ("strict", "accept-new"):
        res = run(policy)
        assert res.returncode != 0 and "[node0] ubuntu" in res.stdout and "[node1]" not in res.stdout, res.stdout


@pytest.mark.timeout(120)
def test_keys_pinned_in_a_global_known_hosts_file_count_on_both_paths(fleet, tmp_path):
    """A fleet's configuration management pins its hosts' keys in a system-wide file (GlobalKnownHostsFile, here
    with a `@cert-authority` line beside them) and the user's own known_hosts starts empty. ssh checks both files;
    paramiko's path read only the user's: under accept-new it met every key as new, recorded it, and would have
    taken whatever key a host sent (and a `@cert-authority` line in a file it read stopped it altogether)."""
    known, system = tmp_path / "known_hosts", tmp_path / "ssh_known_hosts"
    config = _config_knowing_no_key(fleet, tmp_path / "ssh_config", known)
    config.write_text(config.read_text().replace(
        "    UserKnownHostsFile", f"    GlobalKnownHostsFile {system}\n    UserKnownHostsFile"))
    pins = fleet.known_hosts_path.read_text().splitlines()
    key_of = {line.split()[0]: line.split(None, 1)[1] for line in pins}
    ip0, ip1 = fleet.nodes[0].ip, fleet.nodes[1].ip
    ca = f"@cert-authority *.fleet.invalid {key_of[fleet.bastion.ip]}\n"
    run = _exec_through(fleet, tmp_path, "fleet-global-kh", config)
    system.write_text(ca + "".join(f"{line}\n" for line in pins))
    for policy in ("strict", "accept-new"):
        _both_logged_in(run(policy), policy)
        assert known.read_text() == ""  # found in the system's file: nothing recorded
    system.write_text(ca + "".join(f"{line}\n" for line in pins if not line.startswith(f"{ip0} "))
                      + f"{ip0} {key_of[ip1]}\n")  # node1's key pinned for node0: both paths refuse node0
    for policy in ("strict", "accept-new"):
        res = run(policy)
        assert res.returncode != 0 and res.stdout.splitlines() == ["[node1] ubuntu"], policy + res.stdout + res.stderr
        assert known.read_text() == ""
    assert "CHANGED" in res.stderr, res.stderr
    system.write_text(ca + "".join(f"{line}\n" for line in pins if not line.startswith(f"{ip1} "))
                      + f"@revoked * {key_of[ip1]}\n")  # node1's key revoked: refused, never recorded
    for policy in ("strict", "accept-new"):
        res = run(policy)
        assert res.returncode != 0 and res.stdout.splitlines() == ["[node0] ubuntu"], policy + res.stdout + res.stderr
        assert known.read_text() == ""
    assert "marked @revoked" in res.stderr, res.stderr


@pytest.mark.timeout(150)
def test_keys_pinned_by_pattern_count_on_both_paths(fleet, tmp_path):
    """A fleet pins its hosts' keys by pattern in its system-wide file (`10.1.*,!10.1.0.9`). paramiko compared
    exact names only: under accept-new such a host's key was met as new, and whatever key the host sent was
    recorded; and a host listed with two keys of a type (a stale entry in the user's file beside the system's
    pin) was refused, where ssh accepts any key listed for it. Both paths now agree with ssh."""
    known, system = tmp_path / "known_hosts", tmp_path / "ssh_known_hosts"
    config = _config_knowing_no_key(fleet, tmp_path / "ssh_config", known)
    config.write_text(config.read_text().replace(
        "    UserKnownHostsFile", f"    GlobalKnownHostsFile {system}\n    UserKnownHostsFile"))
    pins = fleet.known_hosts_path.read_text().splitlines()
    keys_of = {ip: [line.split(None, 1)[1] for line in pins if line.split()[0] == ip]
               for ip in (fleet.bastion.ip, fleet.nodes[0].ip, fleet.nodes[1].ip)}
    bastion, ip0, ip1 = keys_of
    assert all(keys_of.values())
    prefix = ip0.rsplit(".", 1)[0] + ".*"  # the nodes' network: node0, node1 and the bastion's other address

    def pin(node0: str, node1: str, excluded: str = "") -> None:  # node i's pattern line carries node `nodei`'s keys
        lines = [f"{bastion} {k}" for k in keys_of[bastion]]
        for me, other, keys in ((ip0, ip1, keys_of[node0]), (ip1, ip0, keys_of[node1])):
            lines += [f"{prefix},!{other},!{bastion}{excluded} {k}" for k in keys]
        system.write_text("".join(f"{line}\n" for line in lines))

    run = _exec_through(fleet, tmp_path, "fleet-pattern-kh", config)
    pin(ip0, ip1)
    for policy in ("strict", "accept-new"):
        _both_logged_in(run(policy), policy)
        assert known.read_text() == ""  # matched by pattern: nothing recorded
    known.write_text("".join(f"{ip0} {k}\n" for k in keys_of[ip1]))  # a stale key of node0's beside its pin
    for policy in ("strict", "accept-new"):
        _both_logged_in(run(policy), policy)
    known.write_text("")
    pin(ip1, ip1)  # node1's keys under node0's pattern: both paths refuse node0, nothing recorded
    for policy in ("strict", "accept-new"):
        res = run(policy)
        assert res.returncode != 0 and res.stdout.splitlines() == ["[node1] ubuntu"], policy + res.stdout + res.stderr
        assert known.read_text() == ""
    assert "CHANGED" in res.stderr, res.stderr
    pin(ip0, ip1, excluded=f",!{ip0}")  # node0 negated out of every line: unknown to both paths
    res = run("strict")
    assert res.returncode != 0 and res.stdout.splitlines() == ["[node1] ubuntu"], res.stdout + res.stderr
    _both_logged_in(run("accept-new"), "accept-new")
    assert [line.split()[0] for line in known.read_text().splitlines()] == [ip0]  # the key it met, once


@pytest.mark.timeout(120)
def test_a_user_certificate_logs_in_on_both_paths(fleet, tmp_path):
    """The fleet trusts a user CA (`cert-authority` in authorized_keys) and the user's key is authorized nowhere:
    only its certificate, named by the ssh config's CertificateFile, logs in. Before, paramiko's path used no
    CertificateFile and offered the bare key, which every host refused, where ssh logs in."""
    import subprocess

    from helpers import ssh_keygen

    ca, key = ssh_keygen(tmp_path / "user_ca"), ssh_keygen(tmp_path / "id_fleet")
    subprocess.run(["ssh-keygen", "-q", "-s", str(ca), "-I", "fleet-user", "-n", "ubuntu", f"{key}.pub"], check=True,
                   capture_output=True, stdin=subprocess.DEVNULL)
    cert = tmp_path / "certs" / "fleet-user.cert"
    cert.parent.mkdir()
    Path(f"{key}-cert.pub").rename(cert)  # away from the key: only CertificateFile names it
    trust = f'cert-authority,principals="ubuntu" {Path(f"{ca}.pub").read_text().strip()}'
    hosts = [fleet.bastion.container, fleet.nodes[0].container, fleet.nodes[1].container]
    config = _config_with_keys(fleet, tmp_path, f"    IdentityFile {key}\n    CertificateFile {cert}")
    run = _exec_through(fleet, tmp_path, "fleet-cert", config)
    try:
        for container in hosts:
            node_exec(container, f"printf '%s\\n' '{trust}' >> /home/ubuntu/.ssh/authorized_keys")
        for policy in ("strict", "accept-new"):
            _both_logged_in(run(policy), policy)
    finally:
        for container in hosts:
            node_exec(container, "sed -i '/^cert-authority,/d' /home/ubuntu/.ssh/authorized_keys")
    for policy in ("strict", "accept-new"):  # the CA no longer trusted: the certificate alone fails
        assert run(policy, "true").returncode != 0


@pytest.mark.timeout(90)
def test_a_key_held_by_the_configs_identity_agent_logs_in_on_both_paths(fleet, tmp_path, monkeypatch):
    """The key is only in an agent whose socket the ssh config names (IdentityAgent; a password manager's, say), its
    file there as `.pub` only, and SSH_AUTH_SOCK unset. ssh asks that agent; paramiko's path only ever asked
    SSH_AUTH_SOCK's, so it had no key to offer. With `ssh.forward_agent`, that agent is the one the nodes see, on
    both paths (paramiko's forwarded no agent at all)."""
    from helpers import SshAgent

    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    home = tmp_path / "agent"
    home.mkdir(mode=0o700)
    agent = SshAgent(home)
    try:
        key = tmp_path / "keys" / "id_fleet"
        key.parent.mkdir(mode=0o700)
        key.write_bytes(fleet.key_path.read_bytes())
        key.chmod(0o600)
        agent.add(key)
        Path(f"{key}.pub").write_text(Path(f"{fleet.key_path}.pub").read_text())
        key.unlink()  # the private key in the agent alone
        config = _config_with_keys(fleet, tmp_path, f"    IdentityFile {key}\n    IdentityAgent {agent.sock}")
        run = _exec_through(fleet, tmp_path, "fleet-identity-agent", config)
        pub = Path(f"{key}.pub").read_text().split()[:2]
        for policy in ("strict", "accept-new"):
            _both_logged_in(run(policy), policy)
        with _agent_forwarding_allowed(fleet):
            for policy in ("strict", "accept-new"):
                res = run(policy, "ssh-add", "-L")  # not forwarded: the nodes have no agent
                assert res.returncode != 0 and pub[1] not in res.stdout, policy + res.stdout + res.stderr
                # forwarded: that agent, as ssh forwards it (paramiko's path forwarded none, SSH_AUTH_SOCK's at best)
                res = run(policy, "ssh-add", "-L", forward_agent=True)
                assert res.returncode == 0, policy + res.stdout + res.stderr
                assert sorted(line.split()[1:3] for line in res.stdout.splitlines()) == [pub, pub], policy + res.stdout
        config.write_text(config.read_text().replace(f"IdentityAgent {agent.sock}", "IdentityAgent none"))
        for policy in ("strict", "accept-new"):  # no agent: the .pub alone logs in nowhere
            assert run(policy, "true").returncode != 0
    finally:
        agent.stop()


@pytest.mark.timeout(240)
def test_fab_workflow_through_ssh_config_aliases(fleet, tmp_path):
    """`fab -S CONFIG -H node0,node1 start | tail-log | status | kill` with the seed's positional script;
    `status` afterwards from the same directory needs no -H (the last start's hosts)."""
    fab = [sys.executable, "-m", "fabric", "-r", str(ROOT), "-S", str(fleet.ssh_config_path)]
    hosts = ["-H", ",".join(ALIASES)]
    cwd = tmp_path / "here"
    cwd.mkdir()

    def run(*words, timeout=120):
        return subprocess.run(fab + list(words), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, cwd=cwd)

    run(*hosts, "kill")
    try:
        start = run(*hosts, "start", "--workspace", str(ROOT / "examples" / "seed_positional"),
                    "--entrypoint", "/opt/venv/bin/python train.py")
        assert start.returncode == 0, start.stdout + start.stderr
        deadline = time.monotonic() + 90
        while "succeeded" not in (status := run("status")).stdout and time.monotonic() < deadline:
            time.sleep(1)
        assert "job fabjob: succeeded" in status.stdout, status.stdout + status.stderr
        tail = run(*hosts, "tail-log", "--lines", "200").stdout.splitlines()
        done = [line for line in tail if "] done steps=" in line]
        assert {line.split("]")[0] for line in done} == {"[node0 trainer.0", "[node1 trainer.1"}, tail
        # the default remote directory is under the login user's home
        assert node_exec(fleet.nodes[0].container, "test -f /home/ubuntu/clusterctl/fabjob/train.py && echo ok") == "ok\n"
    finally:
        kill = run(*hosts, "kill")
    assert kill.returncode == 0, kill.stderr
    assert_no_orphans(fleet, "fabjob", [6173, 6174], hosts=fleet.nodes[:2])
    nothing = subprocess.run([sys.executable, "-m", "fabric", "-r", str(ROOT), "status"], capture_output=True, text=True,
                             timeout=60, stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert nothing.returncode == 1
    assert nothing.stderr.strip() == ("clusterctl: error: no hosts: give -H host1,host2 or --spec FILE, "
                                      "or run where a cluster.yaml is")


@pytest.mark.timeout(90)
def test_a_frozen_or_refusing_bastion_is_named_within_connect_timeout(fleet, tmp_path):
    spec = fleet_spec(fleet, tmp_path / "d.yaml", name="fleet-down", aliases=False, job={"entrypoint": ["true"]},
                      ssh={"connect_timeout": 3, "persist": 0})
    bastion = fleet.bastion
    res, elapsed = clusterctl_while_paused(bastion.container, "exec", spec, "--", "true", timeout=60)
    assert res.returncode == 255
    for node in fleet.nodes[:2]:
        assert f"cannot connect to {node.ip} (through ubuntu@{bastion.ip}): timed out after 3s" in res.stderr, res.stderr
    assert elapsed < 3 + 6, elapsed
    refusing = fleet_spec(fleet, tmp_path / "r.yaml", name="fleet-down", aliases=False, job={"entrypoint": ["true"]},
                          ssh={"connect_timeout": 3, "persist": 0, "proxy_jump": f"ubuntu@{bastion.ip}:2299"})
    t0 = time.monotonic()
    res = clusterctl("exec", refusing, "--", "true", timeout=60)
    assert res.returncode == 255 and time.monotonic() - t0 < 3 + 6
    assert f"cannot connect to {fleet.nodes[0].ip}: bastion {bastion.ip} port 2299: Connection refused" in res.stderr


@pytest.mark.timeout(60)
def test_a_changed_bastion_host_key_is_refused_with_both_fingerprints(fleet, tmp_path):
    import base64
    import hashlib

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    bastion = fleet.bastion
    lines = fleet.known_hosts_path.read_text().splitlines()
    (real,) = [ln for ln in lines if ln.split()[0] == bastion.ip]
    impostor = Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    kh = tmp_path / "known_hosts"
    kh.write_text("\n".join(ln if ln != real else f"{bastion.ip} {impostor}" for ln in lines) + "\n")
    spec = fleet_spec(fleet, tmp_path / "k.yaml", name="fleet-key", aliases=False, job={"entrypoint": ["true"]},
                      ssh={"known_hosts": str(kh), "persist": 0})

    def fp(b64: str) -> str:
        return "SHA256:" + base64.b64encode(hashlib.sha256(base64.b64decode(b64)).digest()).decode().rstrip("=")

    res = clusterctl("exec", spec, "--", "true", timeout=30)
    assert res.returncode == 255
    want = f"host key for {bastion.ip} CHANGED: server offers {fp(real.split()[2])}, {kh} has {fp(impostor.split()[1])}."
    assert want in res.stderr, res.stderr
    bulk = clusterctl("dispatch", spec, timeout=30)  # dispatch's own connections: refused the same way
    assert bulk.returncode != 0 and want in bulk.stderr, bulk.stderr


@pytest.mark.timeout(60)
def test_an_alias_the_config_does_not_know_is_one_clear_line(fleet, tmp_path):
    spec = fleet_spec(fleet, tmp_path / "u.yaml", name="fleet-alias", job={"entrypoint": ["true"]})
    data = yaml.safe_load(spec.read_text())
    data["hosts"] = [{"address": "node0"}, {"address": "nodee1"}]
    spec.write_text(yaml.safe_dump(data))
    res = clusterctl("exec", spec, "--", "true", timeout=30)
    assert res.returncode == 255
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("clusterctl: error:")]
    assert errors == [f"clusterctl: error: cannot connect to nodee1: Could not resolve hostname nodee1 (not an alias "
                      f"in {fleet.ssh_config_path}, nor a name DNS knows)"]


@pytest.mark.timeout(300)
def test_provision_and_doctor_as_a_sudo_user_behind_the_bastion(fleet, tmp_path):
    """wheelhouse, a venv under /opt (root-owned, made through sudo -n), the ssh mesh and a `commands` step
    that needs root, on nodes with no route out; node2's sudo wants a password: named, fast, no prompt."""
    prov = {
        "wheelhouse": True,
        "python": {"venv": "/opt/fleetvenv", "requirements": ["six"]},
        "ssh_mesh": True,
        "commands": [{"name": "rootmark", "run": "id -un > /etc/clusterctl-fleet-mark",
                      "creates": "/etc/clusterctl-fleet-mark", "root": True}],
    }
    good = fleet_spec(fleet, tmp_path / "g.yaml", name="fleet-prov", job={"entrypoint": ["true"]}, provision=prov)
    t0 = time.monotonic()
    res = clusterctl("provision", good, timeout=200)
    assert res.returncode == 0, res.stdout + res.stderr
    for node in fleet.nodes[:2]:
        assert node_exec(node.container, "cat /etc/clusterctl-fleet-mark") == "root\n"
        assert node_exec(node.container, "stat -c %U /opt/fleetvenv/bin/python").strip() == "root"
        assert node_exec(node.container, "/opt/fleetvenv/bin/python -c 'import six; print(six.__name__)'") == "six\n"
    # the mesh: node0 reaches node1 by its address, host key pinned, as ubuntu
    mesh = node_exec(fleet.nodes[0].container,
                     f"su ubuntu -c 'ssh -o BatchMode=yes {fleet.nodes[1].ip} id -un'", timeout=30)
    assert mesh == "ubuntu\n"
    again = clusterctl("provision", good, timeout=200)
    assert again.returncode == 0 and "\n0 changed, 0 failed" in again.stdout, again.stdout
    assert time.monotonic() - t0 < 200
    # node2's sudo wants a password: that host fails, named, within seconds; the others are untouched by it
    spec = fleet_spec(fleet, tmp_path / "p.yaml", name="fleet-prov", nodes=(0, 1, 2), job={"entrypoint": ["true"]},
                      provision=prov)
    t0 = time.monotonic()
    res = clusterctl("provision", spec, "--only", "python", timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    assert time.monotonic() - t0 < 30
    flat = " ".join(res.stdout.split())
    assert "sudo needs a password for ubuntu on node2: allow NOPASSWD sudo or log in as root" in flat, res.stdout
    doc = clusterctl("doctor", spec, timeout=120)
    assert "needs a password" in doc.stdout and "passwordless" in doc.stdout, doc.stdout


@pytest.mark.timeout(90)
def test_a_bastion_that_sheds_a_burst_of_connections_still_reaches_every_node(fleet, tmp_path):
    """A bastion with a tight MaxStartups drops most of a burst of new connections before the login (as a
    real bastion in front of many hosts does): those are tried again, and every node runs the command once."""
    bastion = fleet.bastion.container
    conf = "/etc/ssh/sshd_config"
    node_exec(bastion, f"cp {conf} /root/sshd_config.bak && sed -i 's/^MaxStartups .*/MaxStartups 1:100:1/' {conf} "
                       "&& kill -HUP $(pidof sshd | tr ' ' '\\n' | sort -n | head -1)")
    since = node_exec(bastion, "date -u +%Y-%m-%dT%H:%M:%S").strip()
    try:
        time.sleep(0.5)
        spec = fleet_spec(fleet, tmp_path / "s.yaml", name="fleet-shed", aliases=False, nodes=(0, 1, 2),
                          job={"entrypoint": ["true"]}, ssh={"persist": 0})
        for _ in range(2):
            res = clusterctl("exec", spec, "--", "hostname", timeout=60)
            assert res.returncode == 0, res.stdout + res.stderr
            assert sorted(ln.split()[1] for ln in res.stdout.splitlines()) == sorted(n.hostname for n in fleet.nodes)
        shed = docker("logs", "--since", since, bastion).stderr
        assert "past MaxStartups" in shed, shed[-2000:]  # the burst really was shed, and survived
    finally:
        node_exec(bastion, f"cp /root/sshd_config.bak {conf} && kill -HUP $(pidof sshd | tr ' ' '\\n' | sort -n | head -1)")
