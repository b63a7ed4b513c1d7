"""The OpenSSH command line used for bulk transfers: strict host keys, no prompts, no user config."""

import re
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from clusterctl.plan import Host
from clusterctl.remote import Remote, SshOptions
from clusterctl.transport import openssh as remote_mod  # the argv, control sockets and shed live there now
from clusterctl.transport import process as process_mod
from clusterctl.transport.process import ProcessRun


def test_ssh_argv_is_strict_and_quiet(tmp_path):
    opts = SshOptions(identity_file="/keys/id", known_hosts=str(tmp_path / "kh"), connect_timeout=4.5, keepalive=7)
    host = Host("10.0.0.7", 2222, "train", 0)
    with Remote([host], opts) as remote:
        argv = remote._ssh_argv(host, "python3 tool.py apply 'my ws'")
    assert argv == [
        "ssh", "-F", "none",
        "-o", "BatchMode=yes",
        "-o", "StrictHostKeyChecking=yes",
        "-o", "ConnectTimeout=4",
        "-o", "KexAlgorithms=-sntrup761x25519-sha512@openssh.com,sntrup761x25519-sha512",
        *(["-o", f"Ciphers={remote_mod.CIPHERS}"] if remote_mod.CIPHERS else []),
        "-o", f"UserKnownHostsFile={tmp_path / 'kh'}",
        "-o", "GlobalKnownHostsFile=/dev/null",
        "-o", "IdentityFile=/keys/id", "-o", "IdentitiesOnly=yes",  # not -i: ssh %-expands its name (see openssh)
        "-T",
        "-o", "ServerAliveInterval=7",
        "-o", "ForwardAgent=no",
        "-p", "2222", "-l", "train",
        "--", "10.0.0.7", "python3 tool.py apply 'my ws'",
    ]


def test_ssh_argv_reads_the_users_config_and_leaves_known_hosts_to_it():
    """spec without ssh.config / known_hosts: ssh's own config files decide (no -F, no UserKnownHostsFile),
    while the host-key policy stays ours."""
    host = Host("gpu0", 22, "ubuntu", 0, hostname="10.1.0.5")
    with Remote([host], SshOptions(config=None)) as remote:
        argv = remote._ssh_argv(host, "true")
    assert "-F" not in argv
    assert not any(a.startswith(("UserKnownHostsFile=", "GlobalKnownHostsFile=")) for a in argv)
    assert _options(argv)["StrictHostKeyChecking"] == "yes"
    assert argv[-4:] == ["ubuntu", "--", "gpu0", "true"]  # the alias, as `ssh gpu0` is given it
    with Remote([host], SshOptions(config="/etc/cc/ssh_config")) as remote:
        assert remote._ssh_argv(host, "true")[:3] == ["ssh", "-F", "/etc/cc/ssh_config"]


def test_a_host_that_looks_like_an_option_is_never_read_as_one():
    host = Host("-oProxyCommand=touch /tmp/pwned", 22, "root", 0)  # the spec refuses it; the argv does too
    with Remote([host], SshOptions()) as remote:
        argv = remote._ssh_argv(host, "true")
    assert argv[argv.index("--") + 1] == host.address


def test_bastions_are_reached_by_our_own_ssh_with_the_same_checks(tmp_path):
    """Every hop gets the same strict options and known_hosts (ssh's own ProxyJump would not pass them on);
    inner hops' %h/%p are escaped once per level so that each ssh expands only its own."""
    import shlex

    kh = str(tmp_path / "kh")
    opts = SshOptions(identity_file="/keys/id", known_hosts=kh, config="/cfg")
    host = Host("node0", 22, "ubuntu", 0, hostname="10.9.0.2", jump=("jump@b1.example:2200", "b2"))
    with Remote([host], opts) as remote:
        outer = _options(remote._ssh_argv(host, "true"))["ProxyCommand"]
    words = shlex.split(outer)
    assert words[:3] == ["ssh", "-F", "/cfg"]
    assert words[-4:] == ["-W", "%h:%p", "--", "b2"]
    inner = _options(words)["ProxyCommand"]  # b2 is reached through b1
    assert inner.endswith("-l jump -p 2200 -W %%h:%%p -- b1.example")
    for cmd in (words, shlex.split(inner.replace("%%", "%"))):
        o = _options(cmd)
        assert o["StrictHostKeyChecking"] == "yes" and o["BatchMode"] == "yes"
        assert o["UserKnownHostsFile"] == kh and o["IdentitiesOnly"] == "yes"
        assert o["IdentityFile"] == "/keys/id" and "-i" not in cmd
    assert _options(shlex.split(inner.replace("%%", "%")))["ProxyJump"] == "none"


@pytest.mark.parametrize("chain", [("b1",), ("b1", "b2")])
def test_the_first_bastions_own_proxy_command_is_run_with_its_own_tokens(chain):
    """The first bastion's ProxyCommand from the ssh config (hop_command) is run to reach it, as ssh runs it (it
    was overridden by ProxyJump=none): each ssh on the way expands only its own tokens, and the bastion's ssh gets
    the command as the config wrote it (the fleet test runs one: tests/integration/test_fleet.py)."""
    import shlex

    from clusterctl.sshconfigfile import expand_tokens

    first = "relay --to %h:%p --as %r %%literal"
    host = Host("node0", 22, "ubuntu", 0, hostname="10.9.0.2", jump=chain, hop_command=first)
    with Remote([host], SshOptions()) as remote:
        command = _options(remote._ssh_argv(host, "true"))["ProxyCommand"]
    for target in (*reversed(chain[1:]), chain[0]):  # each ssh expands the ProxyCommand it runs, then runs it
        words = shlex.split(expand_tokens(command, {"h": "H", "p": "P", "r": "R"}))
        assert words[-1] == target
        command = _options(words)["ProxyCommand"]
    assert command == first and "ProxyJump" not in _options(words)
    plain = Host("node0", 22, "ubuntu", 0, jump=chain)
    with Remote([plain], SshOptions()) as remote:
        words = shlex.split(expand_tokens(_options(remote._ssh_argv(plain, "true"))["ProxyCommand"],
                                          {"h": "H", "p": "P", "r": "R"}))
    while "ProxyCommand" in _options(words):
        words = shlex.split(expand_tokens(_options(words)["ProxyCommand"], {"h": "H", "p": "P", "r": "R"}))
    assert _options(words)["ProxyJump"] == "none"  # no command of its own: straight to it, as before


def test_spec_direct_over_a_config_proxyjump_says_so():
    host = Host("node0", 22, "u", 0, jump_none=True)
    with Remote([host], SshOptions()) as remote:
        assert _options(remote._ssh_argv(host, "true"))["ProxyJump"] == "none"
    with Remote([Host("node0", 22, "u", 0)], SshOptions()) as remote:
        assert "ProxyJump" not in _options(remote._ssh_argv(Host("node0", 22, "u", 0), "true"))


@pytest.fixture()
def short_cache(monkeypatch):
    """An XDG_CACHE_HOME short enough for socket paths (pytest's tmp_path is not)."""
    base = tempfile.mkdtemp(prefix="cc", dir="/tmp")
    monkeypatch.setenv("XDG_CACHE_HOME", base)
    monkeypatch.setattr(remote_mod, "_CONTROL_DIRS", {})
    yield Path(base)
    shutil.rmtree(base, ignore_errors=True)


def _options(argv: list[str]) -> dict[str, str]:
    return dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "-o")


def test_connections_are_reused_through_a_private_socket_per_option_set(short_cache):
    host = Host("10.0.0.7", 22, "root", 0)
    opts = SshOptions(identity_file="/keys/id", known_hosts="/kh", connect_timeout=3, keepalive=15, persist=60)
    with Remote([host], opts) as remote:
        o = _options(remote._ssh_argv(host, "true"))
    control = short_cache / "clusterctl" / "ssh"
    assert o["ControlMaster"] == "auto" and o["ControlPersist"] == "60"
    assert re.fullmatch(re.escape(str(control)) + r"/[0-9a-f]{12}-%C", o["ControlPath"]), o["ControlPath"]
    assert stat.S_IMODE(control.stat().st_mode) == 0o700
    # a frozen host holding a reused connection is given up on after a third of connect_timeout (at least 2 s)
    assert (o["ServerAliveInterval"], o["ServerAliveCountMax"]) == ("1", "2")
    with Remote([host], SshOptions(known_hosts="/kh", connect_timeout=10, persist=60)) as remote:
        o = _options(remote._ssh_argv(host, "true"))
    assert (o["ServerAliveInterval"], o["ServerAliveCountMax"]) == ("1", "4")
    other = SshOptions(identity_file="/keys/other", known_hosts="/kh", connect_timeout=3, persist=60)
    with Remote([host], other) as remote:
        assert _options(remote._ssh_argv(host, "true"))["ControlPath"] != o["ControlPath"]  # other key, other connection
    with Remote([host], SshOptions(known_hosts="/kh", persist=0)) as remote:
        assert not {"ControlMaster", "ControlPath", "ControlPersist"} & set(_options(remote._ssh_argv(host, "true")))


def test_no_reuse_without_a_private_directory(short_cache, monkeypatch):
    control = short_cache / "clusterctl" / "ssh"
    control.mkdir(parents=True, mode=0o755)
    control.chmod(0o755)  # readable by others: not ours to put sockets in
    (short_cache / "taken").write_text("a file, not a directory")
    monkeypatch.setattr(remote_mod, "_CONTROL_FALLBACK", str(short_cache / "taken"))
    host = Host("10.0.0.7", 22, "root", 0)
    with Remote([host], SshOptions(known_hosts="/kh", persist=60)) as remote:
        assert "ControlMaster" not in _options(remote._ssh_argv(host, "true"))


def test_ssh_failures_read_as_one_line_naming_the_host():
    host = Host("10.0.0.7", 22, "root", 0)
    with Remote([host], SshOptions(known_hosts="/kh", connect_timeout=4)) as remote:
        said = remote._ssh_failure
        assert said(host, "Connection timed out during banner exchange\r\nConnection to 10.0.0.7 port 22 timed out\r\n") == (
            "cannot connect to 10.0.0.7: timed out after 4s")
        assert said(host, "ssh: connect to host 10.0.0.7 port 22: Connection refused\r\n") == (
            "cannot connect to 10.0.0.7: Connection refused")
        assert said(host, "Connection to 10.0.0.7 closed by remote host.\r\n") == (
            "connection to 10.0.0.7 lost: Connection to 10.0.0.7 closed by remote host.")
        assert said(host, "") == "connection to 10.0.0.7 lost: ssh exited 255"
    from clusterctl.transport.openssh import ssh_failure

    unknown = "ssh: Could not resolve hostname n1.invalid: Name or service not known\r\n"
    n1 = Host("n1.invalid", 22, "root", 0)
    assert ssh_failure(n1, unknown, SshOptions(config="none")) == (  # was "not an alias in none"
        "cannot connect to n1.invalid: Could not resolve hostname n1.invalid (ssh.config: none, and DNS does not know it)")
    assert ssh_failure(n1, unknown, SshOptions(config=None)) == (
        "cannot connect to n1.invalid: Could not resolve hostname n1.invalid (not an alias in your ssh config, nor a "
        "name DNS knows)")


CHANGED_BASTION = """\
@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@\r
@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @\r
The fingerprint for the ED25519 key sent by the remote host is
SHA256:sD2X9lyMFv/bTF5c+G6LLgMiqzLmA4j5S2HawtDYguc.\r
Host key for 10.9.0.1 has changed and you have requested strict checking.\r
Host key verification failed.\r
kex_exchange_identification: Connection closed by remote host\r
Connection closed by UNKNOWN port 65535\r
"""


def test_a_bastions_key_is_named_as_the_bastions_with_its_fingerprint():
    """Through a bastion: a changed key (OpenSSH prints its fingerprint) names the bastion; an unknown key
    (OpenSSH names only its type) and a bare "connection closed" (ControlPersist discards the bastion hop's
    stderr) ask `explain` (paramiko, the same policy) for the precise line; without one, what ssh said."""
    from clusterctl.transport.openssh import ssh_failure

    host = Host("10.0.1.5", 22, "u", 0, jump=("ops@10.9.0.1",))
    opts = SshOptions(known_hosts="/kh")
    asked = []

    def explain(h):
        asked.append(h)
        return "cannot connect to 10.0.1.5 (through ops@10.9.0.1): bastion 10.9.0.1: unknown host key for 10.9.0.1 (x)"

    assert ssh_failure(host, CHANGED_BASTION, opts, explain) == (
        "cannot connect to 10.0.1.5 (through ops@10.9.0.1): bastion 10.9.0.1: host key for 10.9.0.1 CHANGED: server "
        "offers SHA256:sD2X9lyMFv/bTF5c+G6LLgMiqzLmA4j5S2HawtDYguc, /kh has another key. Possible man-in-the-middle; "
        "if the host was reinstalled, remove the old key")
    assert asked == []  # both fingerprints were in ssh's own words (the recorded one read back when it can be)
    unknown = "No ED25519 host key is known for 10.9.0.1 and you have requested strict checking.\r\nHost key verification failed.\r\n"
    closed = "kex_exchange_identification: Connection closed by remote host\r\nConnection closed by UNKNOWN port 65535\r\n"
    for stderr in (unknown, closed):
        assert ssh_failure(host, stderr, opts, explain) == explain(host)
    assert asked == [host] * 4
    assert ssh_failure(host, unknown, opts, lambda h: None) == (
        "cannot connect to 10.0.1.5 (through ops@10.9.0.1): bastion 10.9.0.1: unknown host key for 10.9.0.1 (ed25519); "
        "not in /kh. Verify it and add it (ssh-keyscan), or use host_key_policy: accept-new")
    assert ssh_failure(host, closed, opts, lambda h: None) == (
        "cannot connect to 10.0.1.5 (through ops@10.9.0.1): the bastion closed the connection "
        "(Connection closed by UNKNOWN port 65535)")


@pytest.mark.parametrize("stderr, retried", [
    ("kex_exchange_identification: read: Connection reset by peer\r\nConnection reset by 10.0.0.7 port 22", True),
    ("kex_exchange_identification: Connection closed by remote host\nConnection closed by UNKNOWN port 65535", True),
    ("banner exchange: Connection to UNKNOWN port 65535: Broken pipe", True),  # a bastion's drop, seen from our side
    ("Connection timed out during banner exchange\nConnection to 10.0.0.7 port 22 timed out", False),
    ("ssh: connect to host 10.0.0.7 port 22: Connection refused", False),
    ("Connection closed by 10.0.0.7 port 22", False),  # after the login: the command may have run
    ("kex_exchange_identification: Connection closed by remote host\nssh: connect to host b port 22: timed out", False),
    ("ubuntu@10.0.0.7: Permission denied (publickey).", False),
])
def test_only_connections_shed_before_the_login_are_tried_again(stderr, retried):
    assert remote_mod.shed(stderr) is retried


def test_a_shed_connection_is_retried_with_a_fresh_stdin(monkeypatch, tmp_path):
    """The first two ssh processes are shed by the server (MaxStartups), the third runs: one Result, the
    whole stdin delivered to the one that ran."""
    import subprocess

    host = Host("10.0.0.7", 22, "root", 0)
    script = ("import sys, os; n = int(open(sys.argv[1]).read() or 0); open(sys.argv[1], 'w').write(str(n + 1));\n"
              "if n < 2: sys.stderr.write('kex_exchange_identification: read: Connection reset by peer\\n'); sys.exit(255)\n"
              "sys.stdout.write(str(len(sys.stdin.buffer.read())))")
    counter = tmp_path / "tries"
    counter.touch()
    import sys as _sys

    transport = remote_mod.OpenSshTransport(SshOptions())
    monkeypatch.setattr(transport, "popen", lambda h, c: subprocess.Popen(
        [_sys.executable, "-c", script, str(counter)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE))
    monkeypatch.setattr(process_mod.time, "sleep", lambda s: None)
    res = ProcessRun(transport, host, "cat").finish(lambda: [b"x" * 100_000], 30, None)
    assert (res.exit_code, res.stdout) == (0, "100000")
    assert Path(str(counter)).read_text() == "3"


def test_a_shed_try_prints_nothing_and_the_try_that_stands_prints_everything(monkeypatch, tmp_path):
    """Streamed lines (exec, logs): ssh's pre-login lines of a shed try are dropped, not shown as if the
    host had failed; those of the try that stands are shown, in order, stdout and stderr alike."""
    import subprocess
    import sys as _sys

    host = Host("10.0.0.7", 22, "root", 0)
    script = ("import sys; n = int(open(sys.argv[1]).read() or 0); open(sys.argv[1], 'w').write(str(n + 1));\n"
              "if n < 2:\n"
              "    sys.stderr.write('kex_exchange_identification: Connection closed by remote host\\n'\n"
              "                     'Connection closed by UNKNOWN port 65535\\n'); sys.exit(255)\n"
              "sys.stderr.write('Connection closed by a user line\\nwarning: w\\n'); sys.stdout.write('ran\\n')")
    counter = tmp_path / "tries"
    counter.touch()
    seen = []
    transport = remote_mod.OpenSshTransport(SshOptions())
    monkeypatch.setattr(transport, "popen", lambda h, c: subprocess.Popen(
        [_sys.executable, "-c", script, str(counter)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE))
    monkeypatch.setattr(process_mod.time, "sleep", lambda s: None)
    res = ProcessRun(transport, host, "true").finish(lambda: [], 30, lambda h, stream, line: seen.append((stream, line)))
    assert (res.exit_code, res.stdout) == (0, "ran\n")
    assert Path(str(counter)).read_text() == "3"
    assert sorted(seen) == [("err", "Connection closed by a user line"), ("err", "warning: w"), ("out", "ran")]
    assert [ln for s, ln in seen if s == "err"] == ["Connection closed by a user line", "warning: w"]


@pytest.mark.parametrize("how", ["flag there", "flag seen"])
def test_a_command_that_prints_sshs_words_after_the_login_is_not_run_again(monkeypatch, tmp_path, how):
    """A command's own stderr is ssh's stderr: one that ran `ssh` itself (or a hostile host) printing
    "kex_exchange_identification: ..." and exiting 255 was taken for a connection shed before the login and run
    up to 6 times. ssh touched the connection's login flag: it logged in, so the command ran, once."""
    import subprocess
    import sys as _sys

    host = Host("10.0.0.7", 22, "root", 0)
    script = ("import sys; n = int(open(sys.argv[1]).read() or 0); open(sys.argv[1], 'w').write(str(n + 1));\n"
              "sys.stderr.write('kex_exchange_identification: read: Connection reset by peer\\n'); sys.exit(255)\n")
    counter, flag = tmp_path / "tries", tmp_path / "flag"
    counter.touch()
    flag.touch()

    def popen(h, c):
        proc = subprocess.Popen([_sys.executable, "-c", script, str(counter)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if how == "flag there":
            proc.login_flag = str(flag)  # as OpenSshTransport.spawn sets it, the file not yet removed
        else:
            proc.logged_in = True  # as its _hold thread sets it before it removes the file
        return proc

    transport = remote_mod.OpenSshTransport(SshOptions())
    monkeypatch.setattr(transport, "popen", popen)
    monkeypatch.setattr(process_mod.time, "sleep", lambda s: None)
    res = ProcessRun(transport, host, "true").finish(lambda: [], 30, None)
    assert res.exit_code == 255 and counter.read_text() == "1"
