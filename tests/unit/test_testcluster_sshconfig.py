"""The ssh config `clusterctl testcluster up --ssh-config` writes, read back by the real OpenSSH client: file names
with blanks, `%`, quotes, `#`, `$` or a backslash arrive as they are (ssh_config(5) splits values at blanks and
%-expands IdentityFile, UserKnownHostsFile and ProxyCommand), and the nodes' jump to the bastion names a config
whose own name needs quoting as the shell reads it. Nothing connects anywhere: the bastion's ProxyCommand runs a
fake `ssh` that records its argv, and `ssh -G` only prints what it read."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from clusterctl import testcluster as tc

SSH = shutil.which("ssh")
needs_ssh = pytest.mark.skipif(SSH is None, reason="needs the OpenSSH client")
NODES = [tc.Node("c-node0", "10.0.0.2", "c-node0"), tc.Node("c-node1", "10.0.0.3", "c-node1")]
BASTION = tc.Node("c-bastion", "10.1.0.2", "c-bastion")
FAKE_SSH = '#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGV_OUT"\nexit 1\n'

ODD_DIRS = ["a b", "a%b", "a%d%%h", "x #y", "q'u\"o\\te", "d$HOME", "all of it %C #'\"\\ $x"]


def _write(directory: Path, bastion: tc.Node | None = BASTION) -> Path:
    directory.mkdir(parents=True)
    config = directory / "ssh_config"
    config.write_text(tc._ssh_config_text("c", NODES, "ubuntu", directory / "id_ed25519", directory / "known_hosts",
                                          bastion, config))
    return config


def _as_ssh_reads(config: Path, alias: str) -> dict[str, str]:
    proc = subprocess.run([SSH, "-G", "-F", str(config), alias], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)


@needs_ssh
@pytest.mark.parametrize("odd", ODD_DIRS)
def test_ssh_reads_back_the_key_and_known_hosts_of_an_odd_directory(tmp_path, odd) -> None:
    directory = tmp_path / odd
    config = _write(directory)
    for alias in ("bastion", "node0", "node1"):
        seen = _as_ssh_reads(config, alias)
        assert seen["userknownhostsfile"] == str(directory / "known_hosts")  # %-expanded by -G already
        assert seen["identityfile"] == str(directory / "id_ed25519").replace("%", "%%")  # -G shows it unexpanded
        assert (seen["user"], seen["port"], seen["identitiesonly"], seen["stricthostkeychecking"]) == (
            "ubuntu", "22", "yes", "true")


@needs_ssh
@pytest.mark.parametrize("odd", ODD_DIRS)
def test_a_node_reaches_the_bastion_through_this_very_config(tmp_path, odd) -> None:
    """ProxyJump would run `ssh -F <name unquoted, %-expanded> -W ... bastion` (`%b`: "unknown key"); the
    command written instead gives the bastion's ssh the config's name as it is. The outer ssh %-expands the
    identity file it loads: its -v line names the file as it is (ssh's log doubles a backslash)."""
    directory = tmp_path / odd
    config = _write(directory)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ssh").write_text(FAKE_SSH)
    (fake / "ssh").chmod(0o755)
    argv_out = tmp_path / "argv"
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ.get('PATH', '')}", "ARGV_OUT": str(argv_out)}
    proc = subprocess.run([SSH, "-v", "-F", str(config), "-o", "BatchMode=yes", "node1", "true"],
                          capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 255
    assert argv_out.read_text().splitlines() == ["-F", str(config), "-W", "[10.0.0.3]:22", "bastion"], proc.stderr
    key = str(directory / "id_ed25519").replace("\\", "\\\\")
    assert f"debug1: identity file {key} type -1" in proc.stderr.splitlines(), proc.stderr


def test_a_plain_config_keeps_proxy_jump_and_plain_names(tmp_path) -> None:
    directory = tmp_path / "plain"
    text = _write(directory).read_text()
    node0 = text.split("\nHost node0\n")[1].split("\n\n")[0]
    assert node0.splitlines() == [
        "    HostName 10.0.0.2", "    User ubuntu", "    Port 22", f"    IdentityFile {directory}/id_ed25519",
        "    IdentitiesOnly yes", f"    UserKnownHostsFile {directory}/known_hosts", "    StrictHostKeyChecking yes",
        "    ProxyJump bastion",
    ]  # fmt: skip


def test_an_odd_config_name_writes_its_jump_out(tmp_path) -> None:
    config = _write(tmp_path / "a b%c")
    lines = [line.strip() for line in config.read_text().splitlines() if "Proxy" in line]
    assert lines == [f"ProxyCommand ssh -F '{tmp_path}/a b%%c/ssh_config' -W '[%h]:%p' bastion"] * 2


def test_no_jump_without_a_bastion(tmp_path) -> None:
    assert "Proxy" not in _write(tmp_path / "a b%c", bastion=None).read_text()


@pytest.mark.parametrize(("odd", "why"), [
    ("a${HOME}b", "it holds '${' (ssh expands an environment variable there, with no way to escape it)"),
    ("a\nb", "it holds a line break"),
    ("a\rb", "it holds a line break"),
])
def test_a_name_no_ssh_config_can_hold_is_refused(tmp_path, odd, why) -> None:
    directory = tmp_path / odd
    with pytest.raises(tc.DockerClusterUsageError) as info:
        tc._ssh_config_text("c", NODES, "ubuntu", directory / "id_ed25519", directory / "known_hosts", None)
    assert str(info.value) == f"cannot write {str(directory / 'id_ed25519')!r} into an ssh config: {why}"


@pytest.mark.parametrize("where", ["state", "spec"])
def test_up_refuses_such_a_name_before_docker(tmp_path, monkeypatch, where) -> None:
    def no_docker() -> None:
        raise AssertionError("docker touched")

    monkeypatch.setattr(tc, "ensure_docker", no_docker)
    odd = tmp_path / "a\nb"
    monkeypatch.setenv("CLUSTERCTL_TESTCLUSTER_HOME", str(odd if where == "state" else tmp_path / "state"))
    spec_out = odd / "cluster.yaml" if where == "spec" else None
    with pytest.raises(tc.DockerClusterUsageError, match="into an ssh config: it holds a line break"):
        tc.up(1, name="clusterctl-h3never", ssh_config=True, bastion=True, spec_out=spec_out)
    with pytest.raises(AssertionError, match="docker touched"):  # without --ssh-config the name is no matter
        tc.up(1, name="clusterctl-h3never", bastion=True, spec_out=spec_out)


def test_the_state_root_is_absolute(tmp_path, monkeypatch) -> None:
    # the spec and the ssh config name the key and known_hosts in it: a relative name would be read from the cwd
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CLUSTERCTL_TESTCLUSTER_HOME", "rel/state")
    assert tc.state_dir("x") == tmp_path / "rel" / "state" / "x"


def test_an_up_without_ssh_config_removes_the_one_an_earlier_up_wrote_and_nothing_else(tmp_path) -> None:
    """`up --ssh-config`, then `up` (the nodes recreated): the config left beside the spec named the old nodes."""
    ours = _write(tmp_path / "ours")
    tc._remove_our_ssh_config(ours, "c")
    assert not ours.exists()
    other_cluster = _write(tmp_path / "other")  # written for test cluster c, asked for cluster c2
    tc._remove_our_ssh_config(other_cluster, "c2")
    users = tmp_path / "users" / "ssh_config"
    users.parent.mkdir()
    users.write_text("Host node0\n    HostName 10.9.9.9\n")
    tc._remove_our_ssh_config(users, "c")
    tc._remove_our_ssh_config(tmp_path / "none" / "ssh_config", "c")  # nothing there: nothing to do
    assert other_cluster.exists() and users.read_text() == "Host node0\n    HostName 10.9.9.9\n"
