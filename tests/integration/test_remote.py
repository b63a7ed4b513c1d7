"""The remote layer over real SSH to the dockerized test cluster: fan-out, host keys, faults, quoting."""

from __future__ import annotations

import time

import pytest
import yaml

from clusterctl.ops import open_session
from clusterctl.ops.execute import execute
from clusterctl.transport.base import cut_short

from clusterlib import bastion_pins, clusterctl, clusterctl_while_paused, docker, node_exec, via, write_spec

pytestmark = pytest.mark.integration


@pytest.mark.timeout(60)
def test_exec_on_four_nodes_returns_four_distinct_hostnames(testcluster, tmp_path):
    spec = write_spec(testcluster, tmp_path / "c.yaml", name="fanout", job={"entrypoint": ["true"]})
    res = clusterctl("exec", spec, "--", "hostname", check=True)
    lines = sorted(res.stdout.splitlines())
    expected = sorted(f"[{n.ip}] {n.hostname}" for n in testcluster.nodes)
    assert len(testcluster.nodes) == 4
    assert [line.split(maxsplit=1)[0] for line in lines] == sorted(f"[{n.ip}]" for n in testcluster.nodes)
    assert lines == expected
    assert len({line.split()[1] for line in lines}) == 4


@pytest.mark.timeout(60)
def test_exit_code_is_the_worst_hosts(testcluster, tmp_path):
    spec = write_spec(testcluster, tmp_path / "c.yaml", name="worst", job={"entrypoint": ["true"]})
    script = 'case "$(hostname)" in *node1) exit 3;; *node2) exit 7;; esac'
    res = clusterctl("exec", spec, "--", "sh", "-c", script)
    assert res.returncode == 7
    assert "exit 3" in res.stderr and "exit 7" in res.stderr


NASTY = ["a b", "semi;colon", "$(touch /tmp/pwned)", "`touch /tmp/pwned`", "it's", 'dq"', "new\nline", "*", "$HOME", "-n", ""]


@pytest.mark.timeout(60)
def test_metacharacters_arrive_verbatim(testcluster, tmp_path):
    spec = write_spec(testcluster, tmp_path / "c.yaml", name="quote", hosts=2, job={"entrypoint": ["true"]})
    with open_session(str(spec)) as session:
        results = execute(session.remote, ["python3", "-c", "import sys, json; print(json.dumps(sys.argv[1:]))", *NASTY])
    import json

    for res in results.values():
        assert res.exit_code == 0, res.stderr
        assert json.loads(res.stdout) == NASTY
    for node in testcluster.nodes[:2]:
        assert node_exec(node.container, "ls /tmp/pwned 2>/dev/null || echo absent").strip() == "absent"


@pytest.mark.timeout(60)
def test_unknown_host_key_fails_without_prompting(testcluster, tmp_path):
    (tmp_path / "empty_known_hosts").write_text(bastion_pins(testcluster))  # empty of the nodes' keys
    spec = write_spec(
        testcluster, tmp_path / "c.yaml", name="unknownkey", hosts=1,
        ssh={"known_hosts": str(tmp_path / "empty_known_hosts")}, job={"entrypoint": ["true"]},
    )
    t0 = time.monotonic()
    res = clusterctl("exec", spec, "--", "true", timeout=30)
    ip = testcluster.nodes[0].ip
    assert res.returncode == 255
    if testcluster.bastion:  # through the bastion OpenSSH names the key type only: paramiko adds its fingerprint
        assert f"cannot connect to {ip}{via(testcluster)}: unknown host key for {ip} (ssh-ed25519 SHA256:" in res.stderr, res.stderr
        assert f"); not in {tmp_path / 'empty_known_hosts'}. Verify it" in res.stderr
    else:
        assert f"unknown host key for {ip} (ssh-ed25519 SHA256:" in res.stderr
    assert time.monotonic() - t0 < 15
    assert (tmp_path / "empty_known_hosts").read_text() == bastion_pins(testcluster)  # strict records nothing


def _fingerprint(b64: str) -> str:
    import base64
    import hashlib

    return "SHA256:" + base64.b64encode(hashlib.sha256(base64.b64decode(b64)).digest()).decode().rstrip("=")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("persist", [60, 0])  # 60: kept connections, whose bastion hop's own words ssh discards
@pytest.mark.parametrize("case", ["unknown", "changed"])
def test_an_unknown_or_changed_bastion_key_is_named_with_its_fingerprint(testcluster, tmp_path, case, persist):
    """Issue 21 part 7: under `strict`, a bastion whose key is not the one on record is named as the bastion,
    with the key's fingerprint (and the recorded one's, when it changed), as a node's is; nothing recorded."""
    if not testcluster.bastion:
        pytest.skip("the session cluster has no bastion")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    b = testcluster.bastion.ip
    pins = bastion_pins(testcluster).split()
    assert pins[:2] == [b, "ssh-ed25519"]
    real = _fingerprint(pins[2])
    nodes_only = "".join(ln for ln in testcluster.known_hosts_path.read_text().splitlines(keepends=True)
                         if ln.split(maxsplit=1)[0] not in (b, f"[{b}]:22"))
    kh = tmp_path / "known_hosts"
    if case == "unknown":
        kh.write_text(nodes_only)
    else:
        impostor = Ed25519PrivateKey.generate().public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
        kh.write_text(nodes_only + f"{b} {impostor}\n")
    before = kh.read_text()
    spec = write_spec(testcluster, tmp_path / "c.yaml", name=f"bkey-{case}-{persist}", hosts=2,
                      ssh={"known_hosts": str(kh), "persist": persist}, job={"entrypoint": ["true"]})
    t0 = time.monotonic()
    res = clusterctl("exec", spec, "--", "true", timeout=60)
    assert res.returncode == 255
    if case == "unknown":
        why = (f"bastion {b}: unknown host key for {b} (ssh-ed25519 {real}); not in {kh}. Verify it and add it "
               "(ssh-keyscan), or use host_key_policy: accept-new")
    else:
        why = (f"bastion {b}: host key for {b} CHANGED: server offers {real}, {kh} has "
               f"{_fingerprint(impostor.split()[1])}. Possible man-in-the-middle; if the host was reinstalled, "
               "remove the old key")
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("clusterctl: error:")]
    assert errors == [f"clusterctl: error: cannot connect to {n.ip}{via(testcluster)}: {why}"
                      for n in testcluster.nodes[:2]], res.stderr
    assert "closed the connection" not in res.stderr
    assert kh.read_text() == before  # strict records nothing
    assert time.monotonic() - t0 < 30


@pytest.mark.timeout(120)
def test_commands_over_a_kept_connection_start_no_ssh_process(testcluster, tmp_path, monkeypatch):
    """Issue 23 part 4: over a kept connection a command is a session asked of the master on its control
    socket (clusterctl.transport.mux), not an `ssh` process; what the hosts see and send back is the same
    as through `ssh` (output, stderr, exit code, a large stdin, the environment SendEnv passes)."""
    import subprocess

    monkeypatch.setenv("LANG", "C.UTF-8")  # the system ssh_config's SendEnv LANG, on both paths
    script = 'echo "$LANG|$(hostname)"; wc -c; echo to-stderr >&2; exit 3'
    payload = b"x" * 3_000_000
    plain = write_spec(testcluster, tmp_path / "p.yaml", name="mux-plain", hosts=2, ssh={"persist": 0},
                       job={"entrypoint": ["true"]})
    kept = write_spec(testcluster, tmp_path / "k.yaml", name="mux-kept", hosts=2, ssh={"persist": 60},
                      job={"entrypoint": ["true"]})
    with open_session(str(plain)) as session:
        want = session.remote.run(script, stdin=payload, check=False, timeout=60)
    with open_session(str(kept)) as session:
        session.remote.run("true", timeout=60)  # the first command makes the kept connections
    started = []
    real = subprocess.Popen.__init__

    def spy(self, args, *a, **kw):
        started.append(list(args) if isinstance(args, (list, tuple)) else args)
        return real(self, args, *a, **kw)

    with open_session(str(kept)) as session:
        monkeypatch.setattr(subprocess.Popen, "__init__", spy)
        got = session.remote.run(script, stdin=payload, check=False, timeout=60)
        late = session.remote.run("sleep 30", check=False, timeout=2)
        monkeypatch.undo()
    assert started == []  # no ssh (nor anything else) was started for these commands
    assert [(r.exit_code, r.stdout, r.stderr) for r in got.values()] == [
        (r.exit_code, r.stdout, r.stderr) for r in want.values()]
    assert [r.exit_code for r in got.values()] == [3, 3] and all("3000000" in r.stdout for r in got.values())
    assert [(r.exit_code, r.timed_out) for r in late.values()] == [(124, True)] * 2


@pytest.mark.timeout(60)
def test_accept_new_records_the_key_then_verifies_it(testcluster, tmp_path):
    kh = tmp_path / "kh"
    kh.write_text(bastion_pins(testcluster))  # the first hop pinned as usual: the node's key is the one recorded
    seeded = len(kh.read_text().splitlines())
    spec = write_spec(
        testcluster, tmp_path / "c.yaml", name="acceptnew", hosts=1,
        ssh={"known_hosts": str(kh), "host_key_policy": "accept-new"}, job={"entrypoint": ["true"]},
    )
    assert clusterctl("exec", spec, "--", "true").returncode == 0
    recorded = kh.read_text().splitlines()[seeded].split()
    assert recorded[0] == testcluster.nodes[0].ip and recorded[1] == "ssh-ed25519"
    assert clusterctl("exec", spec, "--", "true").returncode == 0
    assert len(kh.read_text().splitlines()) == seeded + 1


@pytest.mark.timeout(90)
def test_changed_host_key_is_refused_with_both_fingerprints(testcluster, tmp_path):
    node = testcluster.nodes[3]
    spec = write_spec(testcluster, tmp_path / "c.yaml", name="changedkey", job={"entrypoint": ["true"]})
    spec_data = yaml.safe_load(spec.read_text())
    spec_data["hosts"] = [{"address": node.ip}]
    spec_data["ssh"]["persist"] = 0  # a connection left open by an earlier test would carry on regardless
    spec.write_text(yaml.safe_dump(spec_data))
    rotate = (
        "mkdir -p /root/keybak && cp -a /etc/ssh/ssh_host_* /root/keybak/ && rm /etc/ssh/ssh_host_* && "
        "ssh-keygen -A >/dev/null && kill -HUP $(cat /run/sshd.pid 2>/dev/null || pidof sshd | cut -d' ' -f1)"
    )
    restore = "cp -a /root/keybak/ssh_host_* /etc/ssh/ && kill -HUP $(cat /run/sshd.pid 2>/dev/null || pidof sshd | cut -d' ' -f1)"
    node_exec(node.container, rotate)
    try:
        time.sleep(1)
        res = clusterctl("exec", spec, "--", "true", timeout=30)
        assert res.returncode == 255
        assert f"host key for {node.ip} CHANGED: server offers SHA256:" in res.stderr
        assert "has SHA256:" in res.stderr
        res = clusterctl("dispatch", spec, timeout=30)  # through the OpenSSH client: the same words
        assert res.returncode != 0
        assert f"host key for {node.ip} CHANGED: server offers SHA256:" in res.stderr, res.stderr
    finally:
        node_exec(node.container, restore)
        time.sleep(1)
    assert clusterctl("exec", spec, "--", "true").returncode == 0  # restored


@pytest.mark.timeout(60)
def test_paused_node_fails_within_connect_timeout_and_is_named(testcluster, tmp_path):
    node = testcluster.nodes[2]
    spec = write_spec(testcluster, tmp_path / "c.yaml", name="paused", ssh={"connect_timeout": 3}, job={"entrypoint": ["true"]})
    res, elapsed = clusterctl_while_paused(node.container, "exec", spec, "--", "hostname", timeout=40)
    assert res.returncode == 255
    assert f"cannot connect to {node.ip}{via(testcluster)}: timed out after 3s" in res.stderr
    others = {n.hostname for n in testcluster.nodes if n is not node}
    assert {line.split()[1] for line in res.stdout.splitlines()} == others
    assert elapsed < 3 + 6


@pytest.mark.timeout(90)
@pytest.mark.parametrize("policy", ["strict", "accept-new"])  # the OpenSSH client; paramiko connections
def test_bounded_run_keeps_late_stderr_and_streams_large_stdin(testcluster, tmp_path, policy):
    spec = write_spec(testcluster, tmp_path / "c.yaml", name="pumps", hosts=2, job={"entrypoint": ["true"]},
                      ssh={"host_key_policy": policy})
    payload = bytes(range(256)) * (64 * 1024)  # 16 MiB: far beyond the channel window
    lines = []
    with open_session(str(spec)) as session:
        late = session.remote.run("echo early >&2; sleep 2; echo late >&2", timeout=20)
        big = session.remote.run("sha256sum", stdin=payload, timeout=60)
        slow = session.remote.run("sleep 30", timeout=2, check=False)
        capped = session.remote.run("head -c 3000000 /dev/zero | tr '\\0' y; echo; echo end", max_output=1 << 20)
        session.remote.run("echo one; echo two >&2", on_line=lambda h, stream, line: lines.append((h.label, stream, line)))
        assert any(map(session.remote.is_open, session.remote.hosts)) == (policy == "accept-new")
    import hashlib

    for res in late.values():
        assert res.stderr == "early\nlate\n"
    for res in big.values():
        assert res.stdout.split()[0] == hashlib.sha256(payload).hexdigest()
    for res in slow.values():
        assert res.exit_code == 124 and res.stderr == "timed out after 2s running sleep 30"
    for res in capped.values():  # a caller's bound on what it keeps (Remote.run's max_output), over either transport
        assert cut_short(res.stdout) and len(res.stdout) < (1 << 20) + 100 and res.stdout.startswith("yyy"), res.stdout[-99:]
    assert sorted(lines) == sorted((n.ip, s, w) for n in testcluster.nodes[:2] for s, w in (("out", "one"), ("err", "two")))


@pytest.mark.timeout(120)
def test_dispatch_with_accept_new_goes_over_paramiko_and_records_keys(testcluster, tmp_path):
    """accept-new: the OpenSSH client cannot record keys the way we pin them, so the connections are
    paramiko's (bulk data still goes through `ssh`, once paramiko has recorded the key)."""
    kh = tmp_path / "kh"
    kh.write_text(bastion_pins(testcluster))  # the first hop pinned as usual: the nodes' keys are the ones recorded
    seeded = len(kh.read_text().splitlines())
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "small.txt").write_text("small\n")
    (ws / "big.bin").write_bytes(bytes(range(256)) * (40 * 1024 * 4))  # 40 MiB: over the bulk threshold
    spec = write_spec(testcluster, tmp_path / "c.yaml", name="acceptnew", hosts=2, job={"entrypoint": ["true"]},
                      ssh={"known_hosts": str(kh), "host_key_policy": "accept-new"},
                      workspace={"local": str(ws), "remote": "clusterctl-it/acceptnew"})
    clusterctl("dispatch", spec, check=True, timeout=100)
    assert len(kh.read_text().splitlines()) == seeded + 2
    (ws / "small.txt").write_text("changed\n")
    clusterctl("dispatch", spec, check=True, timeout=100)
    for n in testcluster.nodes[:2]:
        assert node_exec(n.container, f"cat {testcluster.home}/clusterctl-it/acceptnew/small.txt") == "changed\n"
        assert node_exec(n.container, f"stat -c %s {testcluster.home}/clusterctl-it/acceptnew/big.bin").strip() == str(40 << 20)


@pytest.mark.timeout(120)
def test_stopped_container_fails_within_connect_timeout_and_is_named(testcluster, tmp_path):
    """`docker stop`, on a throwaway one-node cluster so the session cluster's addresses never move."""
    from clusterctl import testcluster as tc

    name = f"{testcluster.name}-stopped"  # the session cluster's shape (login user, bastion)
    info = tc.up(1, name=name, user=testcluster.user, bastion=testcluster.bastion is not None)
    try:
        spec = write_spec(info, tmp_path / "c.yaml", name="stopped", ssh={"connect_timeout": 3}, job={"entrypoint": ["true"]})
        assert clusterctl("exec", spec, "--", "true").returncode == 0
        docker("stop", "-t", "1", info.nodes[0].container)
        t0 = time.monotonic()
        res = clusterctl("exec", spec, "--", "true", timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        tc.down(name)
    assert res.returncode == 255
    assert f"clusterctl: error: cannot connect to {info.nodes[0].ip}{via(info)}: " in res.stderr
    assert elapsed < 3 + 6, elapsed


@pytest.mark.timeout(120)
def test_ctrl_c_over_paramiko_closes_the_channels_and_a_writing_command_ends(testcluster, tmp_path):
    """With `accept-new` the commands run over paramiko channels. Ctrl+C in a fan-out (a followed log, say) closes
    them, as killing the `ssh` clients does under OpenSSH: a command that writes ends on its host while the
    session, and its connections, are still open (before, the channels streamed on in the worker threads)."""
    import os
    import signal
    import threading

    spec = write_spec(testcluster, tmp_path / "c.yaml", name="pmkill", hosts=2, job={"entrypoint": ["true"]},
                      ssh={"host_key_policy": "accept-new"})
    nodes = testcluster.nodes[:2]
    started, up = threading.Event(), set()

    def on_line(host, stream, line):
        if line.strip() == "up":
            up.add(host)
            if len(up) == len(nodes):
                started.set()

    def interrupt():
        started.wait(60)
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # however the suite was started
    try:
        with open_session(str(spec)) as session:
            threading.Thread(target=interrupt, daemon=True).start()
            with pytest.raises(KeyboardInterrupt):
                session.remote.run("echo $$ > /tmp/pmkill.pid; echo up; while echo tick; do sleep 0.2; done",
                                   on_line=on_line, check=False)
            assert started.is_set()
            assert any(map(session.remote.is_open, session.remote.hosts))  # the connections stay open
            for n in nodes:  # the loop's next `echo` meets a closed channel: it ends
                pid = node_exec(n.container, "cat /tmp/pmkill.pid").strip()
                deadline = time.monotonic() + 20
                while node_exec(n.container, f"kill -0 {pid} 2>/dev/null && echo alive", check=False).strip():
                    assert time.monotonic() < deadline, f"{n.ip}: the command (pid {pid}) still runs"
                    time.sleep(0.2)
    finally:
        signal.signal(signal.SIGINT, previous)
