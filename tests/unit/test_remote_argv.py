"""The OpenSSH command line used for bulk transfers: strict host keys, no prompts, no user config."""

import re
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from clusterctl import remote as remote_mod
from clusterctl.plan import Host
from clusterctl.remote import Remote, SshOptions


def test_ssh_argv_is_strict_and_quiet(tmp_path):
    opts = SshOptions(identity_file="/keys/id", known_hosts=str(tmp_path / "kh"), connect_timeout=4.5, keepalive=7)
    host = Host("10.0.0.7", 2222, "train", 0)
    with Remote([host], opts) as remote:
        argv = remote._ssh_argv(host, "python3 tool.py apply 'my ws'")
    assert argv == [
        "ssh", "-F", "/dev/null", "-T",
        "-o", "BatchMode=yes",
        "-o", "StrictHostKeyChecking=yes",
        "-o", f"UserKnownHostsFile={tmp_path / 'kh'}",
        "-o", "GlobalKnownHostsFile=/dev/null",
        "-o", "ConnectTimeout=4",
        "-o", "ServerAliveInterval=7",
        "-o", "ForwardAgent=no",
        "-o", "KexAlgorithms=-sntrup761x25519-sha512@openssh.com,sntrup761x25519-sha512",
        *(["-o", f"Ciphers={remote_mod._CIPHERS}"] if remote_mod._CIPHERS else []),
        "-p", "2222", "-l", "train",
        "-i", "/keys/id", "-o", "IdentitiesOnly=yes",
        "10.0.0.7", "python3 tool.py apply 'my ws'",
    ]


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
