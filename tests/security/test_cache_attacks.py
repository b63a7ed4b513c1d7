"""Attacks on the controller's caches (issue 21 part 6): the plan cache and the `ssh -G` answer cache.

Each attack is tried as an attacker would: a crafted entry that changes a trainer's argv and points the
connection options at the attacker's ssh config (whose ProxyCommand would run at `clusterctl exec`), an
entry that lists no inputs so that it survives any change, a cache directory someone else can write to or
owns, entry files of the wrong mode or owner, a symlink, and malformed or crafted ssh-answer files. Every
one must be a miss (the spec planned again, ssh asked again), never a crash and never used.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from clusterctl import plancache, sshconfig
from clusterctl.ops import load_plan
from clusterctl.sshconfig import Target, resolve

needs_ssh = pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the OpenSSH client")
as_root = pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")

SPEC = """\
name: cachevictim
ssh: {user: alice, config: sshcfg, known_hosts: kh}
hostfile: hosts.txt
job: {entrypoint: [python3, train.py], trainers: 1}
"""


def _age(*paths: Path) -> None:
    old = time.time() - 60
    for p in paths:
        os.utime(p, (old, old))


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A spec with a hostfile and an ssh config of its own, planned once (its entry in the cache)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts.txt").write_text("10.0.0.1\n10.0.0.2\n")
    (tmp_path / "sshcfg").write_text("Host 10.0.0.*\n    Port 2201\n")
    (tmp_path / "cluster.yaml").write_text(SPEC)
    _age(tmp_path / "hosts.txt", tmp_path / "sshcfg", tmp_path / "cluster.yaml", tmp_path)
    spec, plan, _ = load_plan("cluster.yaml")
    assert spec is not None and Path(plancache.entry_path("cluster.yaml")).exists()
    assert load_plan("cluster.yaml")[0] is None  # a hit, before any attack
    return tmp_path


def _craft(path: Path, evil_config: Path) -> str:
    """Rewrite the entry as an attacker would: every trainer's argv and the ssh config option changed."""
    mine = str(Path.cwd() / "sshcfg")
    changed = []

    def walk(value):
        if value == ["python3", "train.py"]:
            changed.append("argv")
            return ["sh", "-c", "touch /tmp/pwned-by-cache"]
        if value == mine:
            changed.append("config")
            return str(evil_config)
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        return value

    crafted = json.dumps(walk(json.loads(path.read_text())), separators=(",", ":"))
    assert sorted(set(changed)) == ["argv", "config"], changed
    return crafted


def _evil_config(tmp_path: Path) -> Path:
    marker = tmp_path / "proxycommand-ran"
    evil = tmp_path / "evil_ssh_config"
    evil.write_text(f"Host *\n    ProxyCommand touch {marker}\n")
    return evil


def _argv_of(plan) -> list[list[str]]:
    return [list(p.argv) for p in plan.processes]


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722, 0o702])
def test_a_crafted_entry_in_a_directory_others_can_write_is_not_used(project, mode):
    entry = Path(plancache.entry_path("cluster.yaml"))
    entry.write_text(_craft(entry, _evil_config(project)))
    entry.chmod(0o600)
    assert load_plan("cluster.yaml")[0] is None  # the crafted entry would be used from a private directory...
    entry.parent.chmod(mode)  # ...but this one group or others can write to: it is not trusted at all
    assert plancache.entry_path("cluster.yaml") is None and plancache.load("cluster.yaml") is None
    spec, plan, options = load_plan("cluster.yaml")
    assert spec is not None and _argv_of(plan) == [["python3", "train.py"]] * 2
    assert options.config == str(project / "sshcfg")
    assert "pwned-by-cache" in entry.read_text()  # nothing was written into a directory others can write to


def test_the_cache_root_writable_by_others_disables_the_cache(project):
    entry = Path(plancache.entry_path("cluster.yaml"))
    root = project / "cache" / "clusterctl"
    root.chmod(0o777)
    assert plancache.entry_path("cluster.yaml") is None and plancache.load("cluster.yaml") is None
    spec, _, _ = load_plan("cluster.yaml")
    assert spec is not None  # planned from the spec
    root.chmod(0o700)
    assert entry.exists() and load_plan("cluster.yaml")[0] is None  # private again: a hit


def test_a_cache_root_under_a_non_sticky_shared_directory_is_not_trusted(project, monkeypatch):
    shared = project / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # anyone may rename our directory away and put theirs in its place
    monkeypatch.setenv("XDG_CACHE_HOME", str(shared))
    assert plancache.entry_path("cluster.yaml") is None
    assert load_plan("cluster.yaml")[0] is not None and load_plan("cluster.yaml")[0] is not None  # never a hit
    shared.chmod(0o1777)  # sticky, as /tmp: others cannot move ours
    load_plan("cluster.yaml")
    assert load_plan("cluster.yaml")[0] is None


@as_root
def test_a_cache_directory_owned_by_someone_else_is_not_used(project):
    entry = Path(plancache.entry_path("cluster.yaml"))
    entry.write_text(_craft(entry, _evil_config(project)))
    entry.chmod(0o600)
    os.chown(entry.parent, 65534, 65534)  # the attacker made (or was given) the directory
    try:
        assert plancache.load("cluster.yaml") is None
        spec, plan, _ = load_plan("cluster.yaml")
        assert spec is not None and _argv_of(plan) == [["python3", "train.py"]] * 2
    finally:
        os.chown(entry.parent, 0, 0)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o666, 0o660])
def test_an_entry_file_readable_or_writable_by_others_is_a_miss(project, mode):
    entry = Path(plancache.entry_path("cluster.yaml"))
    entry.chmod(mode)
    spec, _, _ = load_plan("cluster.yaml")
    assert spec is not None  # a miss, and the entry is written again, 0600
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600 and load_plan("cluster.yaml")[0] is None


@as_root
def test_an_entry_file_owned_by_someone_else_is_a_miss(project):
    entry = Path(plancache.entry_path("cluster.yaml"))
    os.chown(entry, 65534, 65534)
    assert plancache.load("cluster.yaml") is None


def test_a_symlinked_entry_is_a_miss(project):
    entry = Path(plancache.entry_path("cluster.yaml"))
    planted = project / "planted.json"
    planted.write_text(_craft(entry, _evil_config(project)))
    planted.chmod(0o600)
    entry.unlink()
    entry.symlink_to(planted)
    assert plancache.load("cluster.yaml") is None
    spec, plan, _ = load_plan("cluster.yaml")
    assert spec is not None and _argv_of(plan) == [["python3", "train.py"]] * 2
    assert not entry.is_symlink() and "pwned" not in entry.read_text()  # replaced by a real entry of ours


def test_an_entry_that_lists_no_inputs_is_not_trusted(project):
    """The old attack: an entry naming no inputs (so no change is ever seen) carrying a crafted plan. Inputs
    are now read from the spec's bytes: the hostfile and the ssh config are checked whatever the entry says."""
    entry = Path(plancache.entry_path("cluster.yaml"))
    doc = json.loads(_craft(entry, _evil_config(project)))
    doc["inputs"] = {"files": [], "stamped": [], "listings": []}
    doc["digests"] = plancache._digests(doc["inputs"])
    entry.write_text(json.dumps(doc))
    entry.chmod(0o600)
    assert plancache.load("cluster.yaml") is None
    spec, plan, options = load_plan("cluster.yaml")
    assert spec is not None and _argv_of(plan) == [["python3", "train.py"]] * 2
    assert options.config == str(project / "sshcfg")


def test_a_changed_hostfile_is_seen_whatever_the_entry_says(project):
    (project / "hosts.txt").write_text("10.0.0.1\n10.0.0.3\n")
    _age(project / "hosts.txt")
    spec, plan, _ = load_plan("cluster.yaml")
    assert spec is not None and [h.address for h in plan.hosts] == ["10.0.0.1", "10.0.0.3"]


FAKE_SSH = """\
#!/bin/sh
# records every argv it is given (one per line), prints nothing, succeeds
printf '%s\\n' "$*" >> "{log}"
exit 0
"""


def test_exec_never_runs_a_crafted_entrys_proxycommand(project):
    """`clusterctl exec` (a new process) with a crafted entry in a directory others may write to: the
    spec's own options are used; the attacker's ssh config (and its ProxyCommand) never reaches ssh."""
    evil = _evil_config(project)
    entry = Path(plancache.entry_path("cluster.yaml"))
    entry.write_text(_craft(entry, evil))
    entry.chmod(0o600)
    entry.parent.chmod(0o777)
    bindir = project / "bin"
    bindir.mkdir()
    log = project / "ssh-argv.log"
    (bindir / "ssh").write_text(FAKE_SSH.format(log=log))
    (bindir / "ssh").chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    res = subprocess.run([sys.executable, "-m", "clusterctl.cli", "exec", "cluster.yaml", "--", "true"],
                         capture_output=True, text=True, env=env, cwd=project, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = log.read_text().splitlines()
    runs = [ln for ln in lines if not ln.startswith("-G ")]
    assert len(runs) == 2 and all(f"-F {project / 'sshcfg'} " in ln for ln in runs), lines
    assert str(evil) not in log.read_text() and not (project / "proxycommand-ran").exists()


# ------------------------------------------------------------------ the ssh -G answer cache


@pytest.fixture
def sshg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host gpu*\n    HostName %h.cluster.example\n    User ubuntu\n")
    _age(cfg, tmp_path)
    return cfg


def _sshg_file(tmp_path: Path) -> Path:
    (found,) = (tmp_path / "cache" / "clusterctl" / "sshg").glob("*.json")
    return found


@needs_ssh
@pytest.mark.parametrize("garbage", [
    b"", b"{", b"not json", b"[]", b"null", b"42", b"\xff\xfe\x00garbage", b"[" * 100000,
    b'{"[\\"gpu0\\", null, null]": 5}',
    b'{"[\\"gpu0\\", null, null]": {"hostname": 5, "user": "u", "port": 22}}',
    b'{"[\\"gpu0\\", null, null]": {"hostname": "evil.example", "user": "u", "port": "22", "proxy_jump": [],'
    b' "proxy_command": null, "known_hosts": [], "identity_files": []}}',
    b'{"[\\"gpu0\\", null, null]": {"hostname": "evil.example", "user": "u", "port": 99999999999999999999,'
    b' "proxy_jump": [], "proxy_command": null, "known_hosts": [], "identity_files": []}}',
    b'{"[\\"gpu0\\", null, null]": {"hostname": "evil.example", "user": "u", "port": 22, "proxy_jump": "x",'
    b' "proxy_command": null, "known_hosts": [], "identity_files": []}}',
    b'{"[\\"gpu0\\", null, null]": {"hostname": "evil.example", "user": "u", "port": 22, "proxy_jump": [],'
    b' "proxy_command": null, "known_hosts": [], "identity_files": [], "extra": 1}}',
])
def test_a_malformed_ssh_answer_file_is_a_miss_not_a_crash(sshg, tmp_path, garbage):
    (first,) = resolve([Target("gpu0")], str(sshg))
    assert first.hostname == "gpu0.cluster.example"
    path = _sshg_file(tmp_path)
    path.write_bytes(garbage)
    (again,) = resolve([Target("gpu0")], str(sshg))
    assert again == first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@needs_ssh
@pytest.mark.parametrize("how", ["group-writable dir", "file 0644", "symlink"])
def test_a_crafted_ssh_answer_cannot_redirect_a_host(sshg, tmp_path, how):
    (first,) = resolve([Target("gpu0")], str(sshg))
    path = _sshg_file(tmp_path)
    doc = json.loads(path.read_text())
    key = json.dumps(["gpu0", None, None])
    doc[key] = {**doc[key], "hostname": "attacker.example", "proxy_command": "touch /tmp/pwned-by-sshg"}
    crafted = json.dumps(doc)
    if how == "group-writable dir":
        path.write_text(crafted)
        path.parent.chmod(0o775)
    elif how == "file 0644":
        path.write_text(crafted)
        path.chmod(0o644)
    else:
        planted = tmp_path / "planted.json"
        planted.write_text(crafted)
        planted.chmod(0o600)
        path.unlink()
        path.symlink_to(planted)
    (again,) = resolve([Target("gpu0")], str(sshg))
    assert again == first and again.hostname == "gpu0.cluster.example" and again.proxy_command is None


@needs_ssh
def test_ssh_answers_are_written_0600_in_a_0700_directory(sshg, tmp_path):
    resolve([Target("gpu0"), Target("10.0.0.1")], str(sshg))
    path = _sshg_file(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    targets = [Target("gpu0"), Target("10.0.0.1")]
    assert sshconfig._Cache(str(sshg), sshconfig.stamp_paths(str(sshg)), targets).get(Target("gpu0")) is not None


def test_spec_keys_read_as_pyyaml_reads_them():
    """The plan cache's inputs come from the spec's bytes: the fast reader must agree with PyYAML, or
    decline (and PyYAML is asked)."""
    import yaml

    from clusterctl import speckeys

    cases = [
        SPEC, "name: x\nhostfile: 'h''s.txt' # c\nssh:\n  config: none\n",
        'ssh: {config: "a # b", user: u}\ndata: {local: ./d}\n',
        "ssh:\n  user: |\n    config: trap\n  config: real\ndata:\n  local: ~/data\n  pattern: '*.txt'\n",
        "hostfile: h#1\nssh:\n  config:\ndata:\n", "data: {}\n", "ssh: null\ndata: ~\n",
        "hostfile: 10.0.0.1\n", "hostfile: yes\n", "hostfile: *alias\n", "x: &a 1\nhostfile: h\n",
        "ssh:\n  config: >\n    folded\n", 'ssh:\n  config: "esc\\"aped"\n', "ssh: {config: a:b}\n",
        "ssh:\n  known_hosts: \"multi\n  config: line\"\n", "  indented: doc\n", "---\nhostfile: h\n",
        "hostfile: plain\n  continued\n", "job: {a: [1,\n  2]}\nhostfile: h\n", "ssh:\n- config: x\n",
        "hostfile: h\nhostfile: g\n", "ssh:\n  config: a\n  config: b\n", "hostfile:\n  nested: 1\n",
        "data:\n  local: d\n  remote: r\nssh: {config: c, user: [a, b]}\n", "hostfile: '2fa.txt'\n",
        "hosts:\n- address: a\n- {address: b}\nhostfile: h\n", "- a\n- b\n", "hostfile:\n- h\n",
        "ssh:\n  proxy_jump:\n  - a\n  - b\n  config: c\n", "ssh:\n  config:\n  - c\n", "x:\n- '[a\n  b]'\n",
        yaml.safe_dump({"name": "n", "ssh": {"user": "u", "config": "cfg", "proxy_jump": ["a", "b"]},
                        "hosts": [{"address": "h", "gpus": [0, 1]}], "data": {"local": "d", "pattern": "*.txt"},
                        "job": {"entrypoint": ["python3", "t.py"], "env": {"A": "1"}}}, sort_keys=False),
    ]
    for text in cases:
        try:
            want = yaml.safe_load(text)
        except yaml.YAMLError:
            continue
        if not isinstance(want, dict):
            assert speckeys.spec_keys(text) is None, text
            continue
        ssh, data = want.get("ssh"), want.get("data")
        expected = (want.get("hostfile") if isinstance(want.get("hostfile"), str) else None,
                    ssh.get("config") if isinstance(ssh, dict) and isinstance(ssh.get("config"), str) else None,
                    data.get("local") if isinstance(data, dict) and isinstance(data.get("local"), str) else None,
                    data is not None)
        assert speckeys.spec_keys(text) == expected, text
        try:
            fast = speckeys._fast(text)
        except speckeys._Unsure:
            continue
        assert fast == expected, text
    # the specs clusterctl writes itself (PyYAML's style: lists at their key's column) are read fast
    assert speckeys._fast(cases[-1]) == (None, "cfg", "d", True)


def test_a_spec_the_fast_reader_declines_still_hits(tmp_path, monkeypatch):
    """A spec in a form the fast reader leaves to PyYAML (an anchor here) is cached and hit all the same."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cluster.yaml").write_text(textwrap.dedent("""\
        name: anchored
        ssh: &s {config: none, user: u}
        hosts: [{address: 10.0.0.1}]
        job: {entrypoint: [x]}
        """))
    _age(tmp_path / "cluster.yaml", tmp_path)
    assert load_plan("cluster.yaml")[0] is not None
    assert load_plan("cluster.yaml")[0] is None
