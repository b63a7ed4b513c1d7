"""The controller's cache directory (clusterctl.cache): where it is, and what it never makes."""

import os
import subprocess
import sys

import pytest

from clusterctl import cache


@pytest.fixture
def no_home(tmp_path, monkeypatch):
    """A service account's environment: HOME names a directory that does not exist, XDG_CACHE_HOME unset."""
    home = tmp_path / "nonexistent"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    return home


def test_a_home_that_does_not_exist_is_never_made(no_home):
    assert cache.cache_root_path() == str(no_home / ".cache" / "clusterctl")
    assert cache.private_dir("plans") is None  # the caller works without its cache
    with pytest.raises(FileNotFoundError, match=f"the home directory {no_home} does not exist"):
        cache.cache_dir("fab")
    with pytest.raises(FileNotFoundError):
        cache.makedirs(no_home / ".ssh")
    assert not no_home.exists()


def test_a_home_that_exists_gets_its_cache(no_home):
    no_home.mkdir()
    assert cache.private_dir("plans") == str(no_home / ".cache" / "clusterctl" / "plans")
    assert oct(os.stat(no_home / ".cache" / "clusterctl" / "plans").st_mode & 0o777) == "0o700"


def test_xdg_cache_home_is_made_when_absolute_and_ignored_when_relative(no_home, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg" / "cache"))  # made, like any cache below it
    assert cache.private_dir("plans") == str(tmp_path / "xdg" / "cache" / "clusterctl" / "plans")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", "rel")  # the XDG spec: a relative path is invalid, ignored
    assert cache.cache_root_path() == str(no_home / ".cache" / "clusterctl")
    assert cache.private_dir("plans") is None and not (tmp_path / "rel").exists()


def test_commands_run_with_a_home_that_does_not_exist_and_make_none(tmp_path):
    """validate, plan and exec (with an `ssh` that runs the command here) as a service account: they work without
    the cache (the plan, the ssh answers, the connections' sockets) and make no home directory."""
    home = tmp_path / "nonexistent"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_ssh = bin_dir / "ssh"
    fake_ssh.write_text('#!/bin/sh\nfor last; do :; done\nexec sh -c "$last"\n')
    fake_ssh.chmod(0o755)
    spec = tmp_path / "c.yaml"
    spec.write_text("name: svc\nssh: {config: none}\nhosts: [{address: 10.0.0.1}]\njob: {entrypoint: [true]}\n")
    env = {k: v for k, v in os.environ.items() if k != "XDG_CACHE_HOME"}
    env.update(HOME=str(home), PATH=f"{bin_dir}:{env['PATH']}")
    for argv in (["validate", str(spec)], ["plan", str(spec)], ["exec", str(spec), "--", "echo", "hi"]):
        res = subprocess.run([sys.executable, "-m", "clusterctl.cli", *argv], capture_output=True, text=True,
                             env=env, timeout=60)
        assert res.returncode == 0, (argv, res.stderr)
    assert res.stdout.strip().endswith("hi"), res.stdout
    assert not home.exists()
