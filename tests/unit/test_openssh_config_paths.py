"""File names in the OpenSSH client's `-o` options (UserKnownHostsFile, IdentityFile, ControlPath) and behind
bastions, in ProxyCommand: ssh must read back exactly the name given, whatever it holds (a blank, a quote, a %, a
backslash). Found by fuzzing fab's --known-hosts. Checked with `ssh -G`, which prints the resolved config and
connects nowhere, and once with a loopback port that closes at once (ssh loads its keys only once connected)."""

from __future__ import annotations

import shlex
import shutil
import socket
import subprocess
import threading

import pytest

from clusterctl.plan import Host
from clusterctl.sshconfigfile import expand_tokens
from clusterctl.transport import openssh
from clusterctl.transport.base import SshOptions



NAMES = ["a b", "it's", 'q"x', "p%d", "pct%%", "bs\\x", "#h", "t\tab", "plain"]
needs_ssh = pytest.mark.skipif(shutil.which("ssh") is None, reason="no OpenSSH client")


def _resolved(argv: list[str]) -> dict[str, list[str]]:
    """What `ssh -G` (no connection) reads from `argv`'s options, for its target replaced by `somehost`."""
    end = argv.index("--") if "--" in argv else argv.index("-W")
    res = subprocess.run(["ssh", *argv[1:end], "-G", "somehost"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    out: dict[str, list[str]] = {}
    for line in res.stdout.splitlines():
        key, _, value = line.partition(" ")
        out.setdefault(key, []).append(value)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_config_path_quotes_as_ssh_config_reads(name):
    assert openssh.config_path(f"/k/{name}") == '"/k/' + name.replace("\\", "\\\\").replace('"', '\\"').replace(
        "%", "%%") + '"'


@needs_ssh
@pytest.mark.parametrize("name", NAMES)
def test_ssh_reads_back_exactly_the_file_names_given(tmp_path, name):
    # a blank split UserKnownHostsFile in two (accept-new recorded the key, then strict failed: "Host key verification
    # failed"), a quote was "command-line line 0: invalid quotes", a % a token
    d = tmp_path / name
    d.mkdir()
    (d / "cfg").write_text("ConnectionAttempts 7\n")  # -F is argv: read as it is
    opts = SshOptions(known_hosts=str(d / "kh"), identity_file=str(d / "id"), config=str(d / "cfg"), persist=30)
    argv = openssh.ssh_argv(Host("h", 22, "u", 0), opts, "true", str(d))
    got = _resolved(argv)
    assert got["userknownhostsfile"] == [str(d / "kh")]
    assert got["controlpath"][0].startswith(f"{d}/") and got["controlpath"][0].count("/") == str(d).count("/") + 1
    assert got["identityfile"] == [str(d / "id").replace("%", "%%")]  # ssh -G prints it before its % expansion
    assert got["connectionattempts"] == ["7"]
    assert "-i" not in argv


@needs_ssh
@pytest.mark.parametrize("hops", [("b1",), ("b1", "b2")])
def test_bastions_read_back_the_same_file_names(tmp_path, hops):
    # behind bastions each name is in a ProxyCommand, expanded once by the ssh that runs it: escaped once more
    d = tmp_path / "a b'%d\"q"
    d.mkdir()
    (d / "cfg").write_text("ConnectionAttempts 7\n")
    opts = SshOptions(known_hosts=str(d / "kh"), identity_file=str(d / "id"), config=str(d / "cfg"))
    argv = openssh.ssh_argv(Host("node0", 22, "u", 0, jump=hops), opts, "true", None, login_flag=str(d / "flag"))
    command = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "-o")["ProxyCommand"]
    for hop in reversed(hops):  # the ssh to the last bastion first, as each ssh runs the ProxyCommand it was given
        words = shlex.split(expand_tokens(command, {"h": "H", "p": "22"}))
        assert words[-4:] == ["-W", "H:22", "--", hop]
        got = _resolved(words)
        assert got["userknownhostsfile"] == [str(d / "kh")] and got["connectionattempts"] == ["7"]
        assert got["identityfile"] == [str(d / "id").replace("%", "%%")]
        options = dict(words[i + 1].split("=", 1) for i, a in enumerate(words) if a == "-o")
        if hop == hops[0]:
            assert options["LocalCommand"] == "touch " + shlex.quote(str(d / "flag")).replace("%", "%%")
        command = options.get("ProxyCommand", "")


@needs_ssh
def test_ssh_opens_the_key_file_named_with_a_percent(tmp_path):
    # `-i a%d` was read as the key a<home directory> (ssh %-expands -i's name after checking it as given); ssh -G
    # prints IdentityFile before that expansion, so the name ssh tries is read from its -v lines, on a connection to
    # a loopback port that closes at once (ssh loads the keys once connected)
    key = tmp_path / "p%d" / "id"
    key.parent.mkdir()
    key.write_text("")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)

    def refuse():
        try:
            conn, _ = server.accept()
            conn.close()
        except OSError:
            pass

    threading.Thread(target=refuse, daemon=True).start()
    try:
        opts = SshOptions(identity_file=str(key), config="none", known_hosts=str(tmp_path / "kh"))
        argv = openssh.ssh_argv(Host("127.0.0.1", server.getsockname()[1], "u", 0), opts, "true", None)
        res = subprocess.run([argv[0], "-v", *argv[1:]], capture_output=True, text=True, timeout=60,
                             stdin=subprocess.DEVNULL)
    finally:
        server.close()
    tried = [line for line in res.stderr.splitlines() if "identity file" in line]
    assert tried and tried[0].startswith(f"debug1: identity file {key} type"), res.stderr
