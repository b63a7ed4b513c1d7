"""The OpenSSH command line used for bulk transfers: strict host keys, no prompts, no user config."""

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
        "-p", "2222", "-l", "train",
        "-i", "/keys/id", "-o", "IdentitiesOnly=yes",
        "10.0.0.7", "python3 tool.py apply 'my ws'",
    ]
