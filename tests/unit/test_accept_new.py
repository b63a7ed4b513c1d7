"""host_key_policy accept-new: a new key is recorded once, however many connections meet it at once (a bastion
in front of many hosts), and a different key recorded meanwhile is refused, not added beside it."""

from __future__ import annotations

import base64
import shutil
import subprocess
import threading
from pathlib import Path

import paramiko
import pytest

from clusterctl.sshkeys import AcceptNewPolicy, HostKeyError
from helpers import SshAgent, ssh_keygen


def test_a_key_met_by_many_connections_at_once_is_recorded_once(tmp_path):
    known = tmp_path / "known_hosts"
    key = paramiko.ECDSAKey.generate()
    other = paramiko.ECDSAKey.generate()
    known.write_text(f"other.example {other.get_name()} {other.get_base64()}\n")
    barrier = threading.Barrier(8)

    def meet():
        barrier.wait()
        AcceptNewPolicy(str(known)).missing_host_key(paramiko.SSHClient(), "[10.9.0.2]:22", key)

    threads = [threading.Thread(target=meet) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = known.read_text().splitlines()
    assert lines == [f"other.example {other.get_name()} {other.get_base64()}",
                     f"[10.9.0.2]:22 {key.get_name()} {key.get_base64()}"]


def test_a_different_key_recorded_meanwhile_is_refused(tmp_path):
    known = tmp_path / "known_hosts"
    first, second = paramiko.ECDSAKey.generate(), paramiko.ECDSAKey.generate()
    known.write_text(f"bastion.example {first.get_name()} {first.get_base64()}\n")
    with pytest.raises(HostKeyError, match="changed while connecting"):
        AcceptNewPolicy(str(known)).missing_host_key(paramiko.SSHClient(), "bastion.example", second)
    assert known.read_text().count("bastion.example") == 1


def test_paramiko_connections_take_the_ssh_configs_keys_and_known_hosts(tmp_path):
    # they took neither: `IdentityFile` of a fleet's ssh config was never offered ("No authentication methods
    # available" on every node under accept-new) and keys were checked and recorded in ~/.ssh/known_hosts, not its
    # `UserKnownHostsFile` (the fleet test: tests/integration/test_fleet.py, accept-new through an ssh config)
    from clusterctl.sshconfig import Resolved
    from clusterctl.sshconn import _connection
    from clusterctl.transport.base import SshOptions

    key, first, second = tmp_path / "id_ed25519", tmp_path / "known_hosts", tmp_path / "known_hosts2"
    key.write_text("")
    host_key, rotated = paramiko.ECDSAKey.generate(), paramiko.ECDSAKey.generate()
    first.write_text(f"10.9.0.5 {host_key.get_name()} {host_key.get_base64()}\n")
    second.write_text(f"10.9.0.5 {rotated.get_name()} {rotated.get_base64()}\n")
    r = Resolved("10.9.0.5", "ubuntu", 22, known_hosts=(str(first), str(second)),
                 identity_files=(str(key), str(tmp_path / "id_rsa")))  # ssh -G lists ssh's defaults, there or not
    for policy, kind in (("strict", "StrictPolicy"), ("accept-new", "AcceptNewPolicy")):
        conn = _connection(r, SshOptions(host_key_policy=policy), None)
        assert conn.connect_kwargs["key_filename"] == [str(key)] and conn.connect_kwargs["look_for_keys"]
        known = conn.client.get_host_keys().lookup("10.9.0.5")[host_key.get_name()]
        assert known == host_key and known == rotated and known != paramiko.ECDSAKey.generate()  # every file's keys
        assert type(conn.client._policy).__name__ == kind and conn.client._policy.known_hosts == str(first)
    spec_key, spec_known = tmp_path / "spec_key", tmp_path / "spec_known_hosts"
    spec_known.write_text("")
    conn = _connection(r, SshOptions(identity_file=str(spec_key), known_hosts=str(spec_known)), None)  # the spec's win
    assert conn.connect_kwargs["key_filename"] == [str(spec_key)] and not conn.connect_kwargs["look_for_keys"]
    assert not list(conn.client.get_host_keys()) and conn.client._policy.known_hosts == str(spec_known)
    bare = _connection(Resolved("10.9.0.5", "ubuntu", 22), SshOptions(), None)  # `ssh.config: none`: no key given
    assert "key_filename" not in bare.connect_kwargs and bare.client._policy.known_hosts.endswith("/.ssh/known_hosts")


def test_an_ssh_configs_proxy_command_is_run_as_ssh_runs_it():
    # paramiko's path connected to the host directly, past the config's ProxyCommand (fleet test beside the one above)
    import shlex

    from clusterctl.errors import ClusterctlError
    from clusterctl.sshconn import proxy_command_line
    from clusterctl.transport.host import Host

    h = Host(address="gpu7", port=2222, user="ops", index=0, hostname="10.0.0.7")
    line = proxy_command_line("ssh -W %h:%p -l %r jump # %n 100%% $HOME", h)
    argv = shlex.split(line)  # as paramiko.ProxyCommand splits it
    assert argv == ["/bin/sh", "-c", "exec ssh -W 10.0.0.7:2222 -l ops jump # gpu7 100% $HOME"]
    for token in "CdulLik":  # ssh 9.2 refuses these in a ProxyCommand ("unknown key"), as it connects
        with pytest.raises(ClusterctlError, match=rf"gpu7:2222: ProxyCommand token %{token} is not one ssh expands"):
            proxy_command_line(f"nc -X connect %{token}", h)
    with pytest.raises(ClusterctlError, match="token % is not"):  # a lone % at the end
        proxy_command_line("nc %", h)



@pytest.fixture
def agent(tmp_path, monkeypatch):
    """A real ssh-agent of this test's own; agent(path[, passphrase]) loads a key."""
    a = SshAgent(tmp_path)
    monkeypatch.setenv("SSH_AUTH_SOCK", str(a.sock))
    yield a.add
    a.stop()


def test_the_agents_key_of_the_named_file_goes_first_and_alone_under_identities_only(tmp_path, agent):
    # IdentitiesOnly (the config's, or the spec's key, which the OpenSSH path passes with IdentitiesOnly=yes) was
    # not honoured here: paramiko offered every key the agent held, and sshd's MaxAuthTries (6) ended the
    # connection before the right one (the fleet test: tests/integration/test_fleet.py, IdentitiesOnly)
    from clusterctl.sshconfig import Resolved, Target, parse_ssh_g
    from clusterctl.sshconn import _connection
    from clusterctl.transport.base import SshOptions

    wrong = [ssh_keygen(tmp_path / f"wrong{i}") for i in range(3)]
    right = ssh_keygen(tmp_path / "right")
    for k in (*wrong, right):
        agent(k)
    pub_only = tmp_path / "pub_only"  # the named file as its .pub only: the private key is in the agent alone
    (tmp_path / "pub_only.pub").write_text((tmp_path / "right.pub").read_text())
    r = parse_ssh_g(f"hostname 10.9.0.5\nuser ubuntu\nport 22\nidentityfile {pub_only}\nidentitiesonly yes\n",
                    Target("n"))
    assert r.identities_only
    conn = _connection(r, SshOptions(), None)
    kw = conn.connect_kwargs
    assert not kw["allow_agent"] and not kw["look_for_keys"] and "key_filename" not in kw
    assert kw["pkey"].asbytes() == paramiko.Ed25519Key.from_private_key_file(str(right)).asbytes()

    locked = ssh_keygen(tmp_path / "locked", passphrase="not-a-secret-test-passphrase")  # no .pub: the file's own half
    (tmp_path / "locked.pub").unlink()
    with pytest.raises(paramiko.PasswordRequiredException):
        paramiko.Ed25519Key.from_private_key_file(str(locked))
    agent(locked, "not-a-secret-test-passphrase")
    spec_key = _connection(Resolved("10.9.0.5", "ubuntu", 22), SshOptions(identity_file=str(locked)), None)
    kw = spec_key.connect_kwargs
    assert kw["key_filename"] == [str(locked)] and not kw["allow_agent"] and not kw["look_for_keys"]
    blob = paramiko.Ed25519Key.from_private_key_file(str(locked), password="not-a-secret-test-passphrase").asbytes()
    assert kw["pkey"].asbytes() == blob

    # without IdentitiesOnly, as ssh: the agent's key of the file first, then its others and ssh's default files
    kw = _connection(Resolved("10.9.0.5", "ubuntu", 22, identity_files=(str(right),)), SshOptions(),
                     None).connect_kwargs
    assert kw["allow_agent"] and kw["look_for_keys"] and kw["key_filename"] == [str(right)]
    assert kw["pkey"].asbytes() == paramiko.Ed25519Key.from_private_key_file(str(right)).asbytes()
    other = ssh_keygen(tmp_path / "other")  # not in the agent: nothing picked out
    kw = _connection(Resolved("10.9.0.5", "ubuntu", 22, identity_files=(str(other),)), SshOptions(),
                     None).connect_kwargs
    assert kw["allow_agent"] and "pkey" not in kw and kw["key_filename"] == [str(other)]



def test_known_hosts_are_read_as_ssh_reads_them_global_files_markers_and_all(tmp_path):
    """The system-wide files (GlobalKnownHostsFile) count too, as for ssh; a `@cert-authority` line no longer stops
    the reading (paramiko's own reader raised InvalidHostKey on it: no paramiko connection at all), a `@revoked`
    key is refused under strict and accept-new alike, and a host whose files list two keys of a type (the user's
    and the system's disagree) may present either, as ssh accepts any key listed for it."""
    from clusterctl.sshconfig import Resolved
    from clusterctl.sshconn import _connection
    from clusterctl.transport.base import SshOptions

    user, system = tmp_path / "known_hosts", tmp_path / "ssh_known_hosts"
    mine, pinned, theirs, bad = (paramiko.ECDSAKey.generate() for _ in range(4))
    line = lambda name, k: f"{name} {k.get_name()} {k.get_base64()}\n"  # noqa: E731
    user.write_text(line("10.9.0.5", mine) + "not a key line\n")
    system.write_text("# managed by the fleet's configuration management\n"
                      f"@cert-authority *.example {pinned.get_name()} {pinned.get_base64()}\n"
                      + line("10.9.0.5", theirs) + line("10.9.0.6", pinned) + line("10.9.0.7", bad)
                      + f"@revoked * {bad.get_name()} {bad.get_base64()}\n")

    def client(address: str, policy: str):
        r = Resolved(address, "ubuntu", 22, known_hosts=(str(user),), global_known_hosts=(str(system),))
        return _connection(r, SshOptions(host_key_policy=policy), None).client

    for policy in ("strict", "accept-new"):
        known = client("10.9.0.5", policy).get_host_keys().lookup("10.9.0.5")[mine.get_name()]
        assert known == mine and known == theirs and known != pinned  # either file's key, no other
        assert client("10.9.0.6", policy).get_host_keys().lookup("10.9.0.6")[pinned.get_name()] == pinned
        revoked = client("10.9.0.7", policy)
        assert revoked.get_host_keys().lookup("10.9.0.7") is None  # revoked: no entry offers it
        with pytest.raises(HostKeyError, match="marked @revoked"):
            revoked._policy.missing_host_key(revoked, "10.9.0.7", bad)
    assert user.read_text() == line("10.9.0.5", mine) + "not a key line\n"  # nothing recorded
    # a host ssh trusts through its certificate: paramiko cannot check one, and says so instead of "unknown key"
    certified = client("n1.example", "strict")
    with pytest.raises(HostKeyError, match=f"trusted in {system} through a @cert-authority line, and paramiko"):
        certified._policy.missing_host_key(certified, "n1.example", mine)
    with pytest.raises(HostKeyError, match="unknown host key for n1.other"):
        certified._policy.missing_host_key(certified, "n1.other", mine)  # no CA line covers it: as before
    spec_known = tmp_path / "spec_known_hosts"
    spec_known.write_text("")
    r = Resolved("10.9.0.5", "ubuntu", 22, known_hosts=(str(user),), global_known_hosts=(str(system),))
    only = _connection(r, SshOptions(known_hosts=str(spec_known)), None).client  # the spec's file alone
    assert not list(only.get_host_keys())


def test_a_known_hosts_that_is_no_regular_file_or_too_large_is_refused_in_one_line(tmp_path, monkeypatch):
    """/dev/zero as known_hosts was read until the controller ran out of memory (OOM-killed at 23 GB), a FIFO
    would wait for a writer: a known_hosts file is a regular file of at most KNOWN_HOSTS_LIMIT bytes."""
    import os

    from clusterctl import sshkeys
    from clusterctl.errors import ClusterctlError
    from clusterctl.sshconfig import Resolved
    from clusterctl.sshconn import _connection
    from clusterctl.transport.base import SshOptions

    r = Resolved("10.9.0.5", "ubuntu", 22)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in ("/dev/zero", str(fifo), str(tmp_path)):
        with pytest.raises(ClusterctlError) as info:
            _connection(r, SshOptions(known_hosts=path, host_key_policy="accept-new"), None)
        assert str(info.value) == f"known_hosts file {path} is not a regular file"
    big = tmp_path / "big_known_hosts"
    big.write_text("# " + "x" * 200 + "\n")
    monkeypatch.setattr(sshkeys, "KNOWN_HOSTS_LIMIT", 100)
    with pytest.raises(ClusterctlError, match=r"^known_hosts file .*big_known_hosts is larger than 0 MiB$"):
        _connection(r, SshOptions(known_hosts=str(big)), None)
    monkeypatch.setattr(sshkeys, "KNOWN_HOSTS_LIMIT", 1000)
    assert not list(_connection(r, SshOptions(known_hosts=str(big)), None).client.get_host_keys())


@pytest.mark.parametrize("names, host, port, matched", [
    ("10.9.*", "10.9.0.5", 22, True),
    ("10.9.*,!10.9.0.5", "10.9.0.5", 22, False),  # a negation that matches excludes the host
    ("!10.9.0.5,10.9.*", "10.9.0.6", 22, True),
    ("10.9.0.?", "10.9.0.5", 22, True),
    ("10.9.0.?", "10.9.0.55", 22, False),
    ("NODE*", "node3", 22, True),  # ssh matches without regard to case
    ("node*", "node3", 2222, False),  # off port 22 the name is [node3]:2222
    ("[node*]:2222", "node3", 2222, True),
    ("[node3]:2222", "node3", 2222, True),
    ("node3", "node3", 2222, False),
    ("a.b,node3", "node3", 22, True),
    ("node3.*", "node3", 22, False),
    ("HASHED", "node3", 22, True),
    ("HASHED", "node4", 22, False),
])
def test_known_hosts_patterns_match_as_ssh_matches_them(tmp_path, names, host, port, matched):
    """A fleet pins its hosts' keys by pattern (`10.1.*`, `node*,!node9`, `[node*]:2222`); paramiko compares exact
    names only, so such a pin was no key at all: accept-new recorded whatever key the host sent, and strict refused
    a host ssh accepts. The client holds the keys of the patterns that match the host as ssh matches them."""
    from clusterctl.sshconfig import Resolved
    from clusterctl.sshconn import _connection
    from clusterctl.transport.base import SshOptions

    key, known = paramiko.ECDSAKey.generate(), tmp_path / "known_hosts"
    named = host if port == 22 else f"[{host}]:{port}"
    if names == "HASHED":
        names = paramiko.HostKeys.hash_host("node3" if port == 22 else f"[node3]:{port}")
    known.write_text(f"{names} {key.get_name()} {key.get_base64()}\n")
    r = Resolved(host, "ubuntu", port, known_hosts=(str(known),))
    for policy in ("strict", "accept-new"):
        found = _connection(r, SshOptions(host_key_policy=policy), None).client.get_host_keys().lookup(named)
        assert (found is not None and found[key.get_name()] == key) is matched, (names, named, policy)
    if shutil.which("ssh-keygen"):  # and the table is OpenSSH's own answer (`ssh-keygen -F` matches as ssh does)
        asked = subprocess.run(["ssh-keygen", "-F", named, "-f", str(known)], capture_output=True, text=True,
                               stdin=subprocess.DEVNULL)
        assert ("found: line 1" in asked.stdout) is matched, asked.stdout + asked.stderr


def _sign(ca: Path, key: Path, out: Path, kind: str = "ed25519") -> Path:
    """A user certificate of `key` (its .pub) for principal ubuntu, signed by the CA key `ca`, moved to `out`."""
    subprocess.run(["ssh-keygen", "-q", "-s", str(ca), "-I", "test", "-n", "ubuntu", str(key) + ".pub"], check=True,
                   capture_output=True, stdin=subprocess.DEVNULL)
    Path(str(key) + "-cert.pub").rename(out)
    return out


@pytest.mark.parametrize("kind", ["ed25519", "ecdsa", "rsa"])
def test_a_certificate_file_is_paired_with_the_key_it_certifies(tmp_path, kind):
    """CertificateFile (anywhere, as the config names it) with the key file it certifies, offered first: paramiko's
    path used no CertificateFile, where ssh logs in with the certificate alone (a CA-trusting fleet)."""
    from clusterctl.sshconfig import Resolved
    from clusterctl.sshkeys import _certifies, certified_key

    ca, key, other = tmp_path / "ca", tmp_path / "id_user", tmp_path / "id_other"
    ssh_keygen(ca)
    for k in (key, other):
        subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", str(k)], check=True, capture_output=True)
    cert = _sign(ca, key, tmp_path / "certs-user.cert")
    r = Resolved("10.9.0.5", "ubuntu", 22, identity_files=(str(other), str(key)), certificate_files=(str(cert),))
    got = certified_key(r, "node0", [str(other), str(key)], None)
    assert got is not None and got.public_blob.key_type.endswith("-cert-v01@openssh.com")
    assert got.asbytes() == paramiko.PKey.from_path(str(key)).asbytes()  # the certified key, not the other one
    assert not _certifies(got.public_blob.key_blob, paramiko.PKey.from_path(str(other)).asbytes())
    assert certified_key(r, "node0", [str(other)], None) is None  # its key is not there: left out, as ssh leaves it
    beside = _sign(ca, other, Path(str(other) + "-cert.pub"))  # ssh's own pairing: FILE-cert.pub
    got = certified_key(Resolved("10.9.0.5", "ubuntu", 22), "node0", [str(other)], None)
    assert got is not None and got.public_blob.key_blob == paramiko.pkey.PublicBlob.from_file(str(beside)).key_blob


def test_a_certificate_of_a_key_under_a_passphrase_goes_with_the_agents_key(tmp_path, agent):
    from clusterctl.sshconfig import Resolved
    from clusterctl.sshkeys import agent_socket, certified_key

    ca, key = tmp_path / "ca", ssh_keygen(tmp_path / "id_locked", passphrase="s3cret-phrase")
    ssh_keygen(ca)
    cert = _sign(ca, key, tmp_path / "locked.cert")
    r = Resolved("10.9.0.5", "ubuntu", 22, identity_files=(str(key),), certificate_files=(str(cert),))
    assert certified_key(r, "node0", [str(key)], agent_socket(r)) is None  # no agent key yet; no passphrase asked
    agent(key, "s3cret-phrase")
    got = certified_key(r, "node0", [str(key)], agent_socket(r))
    assert isinstance(got, paramiko.AgentKey) and got.public_blob.key_type == "ssh-ed25519-cert-v01@openssh.com"


def test_the_agent_is_the_configs_identity_agent(tmp_path, monkeypatch):
    """IdentityAgent as ssh reads it (`ssh -G` gives a path with its tokens expanded): paramiko's path only ever
    asked SSH_AUTH_SOCK's agent (the fleet test: a key held only by the config's agent)."""
    from clusterctl.sshconfig import Resolved
    from clusterctl.sshkeys import agent_socket

    monkeypatch.setenv("SSH_AUTH_SOCK", "/run/env-agent.sock")
    monkeypatch.setenv("OTHER_AGENT", "/run/other.sock")
    at = lambda v: agent_socket(Resolved("10.9.0.5", "ubuntu", 22, identity_agent=v))  # noqa: E731
    assert (at(None), at("SSH_AUTH_SOCK"), at("none"), at("NONE")) == ("/run/env-agent.sock",) * 2 + (None, None)
    assert (at("$OTHER_AGENT"), at("$UNSET_AGENT_VAR"), at("/run/user/1000/1p.sock")) == (
        "/run/other.sock", None, "/run/user/1000/1p.sock")
    monkeypatch.delenv("SSH_AUTH_SOCK")
    assert at(None) is None


def test_a_forwarded_agent_request_is_relayed_to_the_agent_given(tmp_path, agent):
    """ssh.forward_agent on paramiko's path: it forwarded no agent at all (the fleet test: `ssh-add -L` on the nodes,
    with the config's IdentityAgent). Each agent connection the host opens is relayed to the socket given: here a
    real ssh-agent asked for its identities through the relay; with no agent, the host's connection is closed."""
    import socket
    import struct

    from clusterctl.sshkeys import forward_agent

    key = tmp_path / "id_fwd"
    ssh_keygen(key)
    agent(key)

    class Session:  # what forward_agent asks of paramiko's session channel
        def request_forward_agent(self, handler):
            self.handler = handler

    def ask(sock: str | None) -> bytes:
        session, (host_end, relay_end) = Session(), socket.socketpair()  # relay_end: the host's agent channel
        forward_agent(session, sock)
        session.handler(relay_end)
        with host_end:
            host_end.settimeout(10)
            try:
                host_end.sendall(struct.pack(">IB", 1, 11))  # SSH_AGENTC_REQUEST_IDENTITIES
            except BrokenPipeError:  # closed already
                return b""
            head = host_end.recv(4)
            if not head:
                return b""
            body = b""
            while len(body) < struct.unpack(">I", head)[0]:
                body += host_end.recv(65536)
            return body

    public = base64.b64decode(Path(f"{key}.pub").read_text().split()[1])
    answer = ask(str(tmp_path / "agent.sock"))
    assert answer[0] == 12 and struct.unpack(">I", answer[1:5])[0] == 1 and public in answer  # IDENTITIES_ANSWER
    assert ask(None) == b""  # no agent: closed at once


def test_paramikos_connection_failures_read_as_their_cause():
    """A port that accepts and says nothing read as `authentication failed ... (sshd's MaxAuthTries?)`; a port that
    answers garbage as `Error reading SSH protocol banner'utf-8' codec ...`, the two run together."""
    from clusterctl.errors import ClusterctlError
    from clusterctl.sshconn import _refused
    from clusterctl.transport.base import SshOptions
    from clusterctl.transport.host import Host

    host, opts = Host("10.9.0.5", 2222, "u", 0), SshOptions(connect_timeout=3)

    def said(exc, took):
        with pytest.raises(ClusterctlError) as info:
            _refused(exc, host, opts, took)
        return str(info.value)

    silent = paramiko.SSHException("No existing session")
    assert said(silent, 3.1) == "cannot connect to 10.9.0.5:2222: timed out after 3s (no SSH banner)"
    assert said(silent, 0.2).startswith("authentication failed as u@10.9.0.5:2222: the server closed the connection")
    garbage = paramiko.SSHException("Error reading SSH protocol banner'utf-8' codec can't decode byte 0xff")
    assert said(garbage, 0.1) == ("cannot connect to 10.9.0.5:2222: no SSH server there: Error reading SSH protocol "
                                  "banner: 'utf-8' codec can't decode byte 0xff")
    assert said(paramiko.SSHException("Error reading SSH protocol banner"), 0.1) == (
        "cannot connect to 10.9.0.5:2222: no SSH server there: Error reading SSH protocol banner")
    # a bastion that could not go on was `ChannelException(2, 'Connect failed')`, paramiko's repr
    from dataclasses import replace

    host = replace(host, jump=("ops@bastion",))
    assert said(paramiko.ChannelException(2, "Connect failed"), 0.1) == (
        "cannot connect to 10.9.0.5:2222 (through ops@bastion): a bastion could not open the connection onward "
        "(connect failed: the host is down, or the bastion cannot reach it)")
    assert said(paramiko.ChannelException(1, "Administratively prohibited"), 0.1).endswith(
        "(administratively prohibited: its sshd does not allow forwarding (AllowTcpForwarding))")


def test_the_openssh_path_refuses_a_known_hosts_that_is_no_regular_file_before_any_ssh(tmp_path):
    """ssh was given the spec's FIFO (or /dev/zero) as UserKnownHostsFile and waited on it, or read it, for ever."""
    import os

    from clusterctl.errors import ClusterctlError
    from clusterctl.remote import Remote
    from clusterctl.transport.base import SshOptions
    from clusterctl.transport.host import Host

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    hosts = [Host("10.9.0.5", 22, "u", 0)]
    for path in ("/dev/zero", str(fifo), str(tmp_path)):
        with pytest.raises(ClusterctlError) as info:
            Remote(hosts, SshOptions(known_hosts=path))
        assert str(info.value) == f"known_hosts file {path} is not a regular file"
    for path in (str(tmp_path / "missing"), str(tmp_path / "kh")):  # missing: ssh makes it or calls the key unknown
        (tmp_path / "kh").write_text("")
        Remote(hosts, SshOptions(known_hosts=path)).close()
