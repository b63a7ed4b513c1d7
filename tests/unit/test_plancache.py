"""The plan cache (clusterctl.plancache): a hit is exactly a miss's plan; any changed input is a miss."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from clusterctl import plancache
from clusterctl.ops import load_plan
from clusterctl.plan import JobPlan

SPEC = """\
name: cachejob
ssh:
  user: alice
  port: 2222
  config: none
  identity_file: id_test
  connect_timeout: 7
hostfile: hosts.txt
data:
  local: data
  pattern: "*.txt"
job:
  mode: pserver
  entrypoint: train.py
  args: ["--job", "{job}"]
  trainers: 2
  pservers: 2
  env: {FOO: bar}
"""


def _age(*paths: Path) -> None:
    """Date files back a minute: the cache keeps nothing made from files changed as it planned."""
    old = time.time() - 60
    for p in paths:
        os.utime(p, (old, old))


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A spec with a hostfile and a data directory, and a private cache directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts.txt").write_text("10.0.0.1 slots=2\n10.0.0.2 slots=2\n")
    data = tmp_path / "data"
    data.mkdir()
    for i in range(5):
        (data / f"part{i}.txt").write_text(str(i))
    (tmp_path / "cluster.yaml").write_text(SPEC)
    _age(tmp_path / "hosts.txt", tmp_path / "cluster.yaml", data, *data.iterdir())
    return tmp_path


def test_hit_is_exactly_the_plan_a_miss_gives(project):
    spec, plan, options = load_plan("cluster.yaml")
    assert spec is not None  # a miss: loaded and validated
    assert Path(plancache.entry_path("cluster.yaml")).exists()
    spec2, plan2, options2 = load_plan("cluster.yaml")
    assert spec2 is None  # a hit: no spec loaded
    assert isinstance(plan2, JobPlan)
    assert plan2 == plan and options2 == options
    assert plan2.to_json(expand=True) == plan.to_json(expand=True)
    assert repr(plan2) == repr(plan)  # tuples stay tuples, None stays None: not merely equal JSON
    assert plan2.hosts[0] is plan2.processes[0].host  # hosts are shared, as make_plan shares them
    assert [p.env["CLUSTERCTL_DATA_FILES"] for p in plan2.trainers] == [p.env["CLUSTERCTL_DATA_FILES"] for p in plan.trainers]
    assert options2.identity_file == str(project / "id_test") and options2.connect_timeout == 7


def test_entry_is_private_and_atomic(project):
    load_plan("cluster.yaml")
    path = Path(plancache.entry_path("cluster.yaml"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind


@pytest.mark.parametrize("change", ["spec", "hostfile", "new data file", "removed data file", "code"])
def test_a_changed_input_is_a_miss(project, change, monkeypatch):
    _, before, _ = load_plan("cluster.yaml")
    assert load_plan("cluster.yaml")[0] is None
    if change == "spec":
        (project / "cluster.yaml").write_text(SPEC.replace("FOO: bar", "FOO: baz"))
    elif change == "hostfile":
        (project / "hosts.txt").write_text("10.0.0.1 slots=2\n10.0.0.3 slots=2\n")
    elif change == "new data file":
        (project / "data" / "part9.txt").write_text("9")
    elif change == "removed data file":
        (project / "data" / "part0.txt").unlink()
    else:
        monkeypatch.setattr(plancache, "_code_stamp", lambda: [["plan.py", 1, 2]])
    spec, after, _ = load_plan("cluster.yaml")
    assert spec is not None, "a changed input must be a miss"
    if change == "spec":
        assert after.trainers[0].env["FOO"] == "baz"
    elif change == "hostfile":
        assert [h.address for h in after.hosts] == ["10.0.0.1", "10.0.0.3"]
    elif change == "new data file":
        assert "part9.txt" in after.trainers[0].env["CLUSTERCTL_DATA_FILES"] + after.trainers[1].env["CLUSTERCTL_DATA_FILES"]
    elif change == "removed data file":
        assert "part0.txt" not in after.trainers[0].env["CLUSTERCTL_DATA_FILES"]
    else:
        assert after == before


def test_a_file_changed_while_planning_is_not_kept(project):
    (project / "hosts.txt").write_text("10.0.0.1 slots=2\n10.0.0.2 slots=2\n")  # mtime: now
    assert load_plan("cluster.yaml")[0] is not None
    assert not Path(plancache.entry_path("cluster.yaml")).exists()
    assert load_plan("cluster.yaml")[0] is not None  # still a miss


@pytest.mark.parametrize("garble", [
    b"", b"{", b"not json", b"[]", b"null", b'{"version": 1}', b"\xff\xfe garbage",
    b"[" * 100000,  # deeper than json's recursion limit
])
def test_a_garbled_entry_is_a_miss(project, garble):
    _, plan, _ = load_plan("cluster.yaml")
    Path(plancache.entry_path("cluster.yaml")).write_bytes(garble)
    spec, again, _ = load_plan("cluster.yaml")
    assert spec is not None and again == plan
    assert load_plan("cluster.yaml")[0] is None  # and the miss wrote a good entry again


def test_a_tampered_entry_is_a_miss(project):
    """Valid JSON of the right shape, wrong content: a class not in the plan, a field that is not one."""
    load_plan("cluster.yaml")
    path = Path(plancache.entry_path("cluster.yaml"))
    good = path.read_text()
    for bad in (good.replace('"c":"Host"', '"c":"Popen"'), good.replace('"c":"Host","f":{', '"c":"Host","f":{"evil":1,'),
                good.replace('"h":0', '"h":99')):
        assert bad != good
        path.write_text(bad)
        assert plancache.load("cluster.yaml") is None


def test_an_invalid_spec_is_still_reported_as_without_the_cache(project):
    from clusterctl.errors import SpecError
    from clusterctl.spec import load_spec

    load_plan("cluster.yaml")
    (project / "cluster.yaml").write_text(SPEC.replace("entrypoint:", "entry:"))
    with pytest.raises(SpecError) as exc:
        load_plan("cluster.yaml")
    assert [str(p) for p in exc.value.problems] == [
        "cluster.yaml:12:1: job.entrypoint: required key is missing",
        "cluster.yaml:14:3: job.entry: unknown key (did you mean 'entrypoint'?)",
    ]
    with pytest.raises(SpecError) as direct:
        load_spec("cluster.yaml")
    assert direct.value.problems == exc.value.problems


def test_command_table_matches_the_plugins():
    """cli._COMMAND_PLUGIN names exactly the commands each plugin adds (a stale table only costs time,
    but a wrong one would hide a command)."""
    import argparse
    import importlib

    from clusterctl import cli

    found = {}
    for name in cli._PLUGINS:
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(name).add_cli(sub)
        found.update(dict.fromkeys(sub.choices, name))
    assert found == cli._COMMAND_PLUGIN


FAKE_SSH = """\
#!/bin/sh
# stands in for OpenSSH: `exec` on a cache hit must not need the spec models, paramiko or Fabric
exit 0
"""


def test_exec_on_a_cache_hit_imports_no_pydantic_paramiko_fabric(project):
    """`clusterctl exec` twice (miss, then hit) under `python -X importtime`; the hit's imports are read back."""
    bindir = project / "bin"
    bindir.mkdir()
    (bindir / "ssh").write_text(FAKE_SSH)
    (bindir / "ssh").chmod(0o755)
    (project / "cluster.yaml").write_text(textwrap.dedent("""\
        name: fast
        ssh: {user: alice, config: none, known_hosts: kh}
        hosts: [{address: 10.0.0.1}, {address: 10.0.0.2}]
        job: {entrypoint: train.py}
        """))
    _age(project / "cluster.yaml")
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    argv = [sys.executable, "-X", "importtime", "-m", "clusterctl.cli", "exec", "cluster.yaml", "--", "true"]
    modules = []
    for _ in range(2):
        res = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=project, timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        modules.append({m.group(1) for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)", res.stderr, re.M)})
    miss, hit = modules
    assert {"pydantic", "clusterctl.spec"} <= miss  # the probe sees what it looks for
    assert "clusterctl.plancache" in hit
    for absent in ("pydantic", "clusterctl.spec", "paramiko", "fabric", "invoke", "yaml", "rich", "jinja2", "numpy", "zmq"):
        assert absent not in hit, f"{absent} imported on a cache hit"


def test_a_changed_ssh_config_is_a_miss(project):
    """The ssh config files are checked by size and mtime, as clusterctl.sshconfig's own cache does."""
    (project / "sshcfg").write_text("Host 10.0.0.1\n  Port 2201\n")
    (project / "cluster.yaml").write_text(SPEC.replace("config: none", "config: sshcfg").replace("  port: 2222\n", ""))
    _age(project / "sshcfg", project / "cluster.yaml", project)
    _, plan, _ = load_plan("cluster.yaml")
    assert [h.port for h in plan.hosts] == [2201, 22]
    assert load_plan("cluster.yaml")[0] is None
    (project / "sshcfg").write_text("Host 10.0.0.1\n  Port 2209\n")
    spec, plan, _ = load_plan("cluster.yaml")
    assert spec is not None and [h.port for h in plan.hosts] == [2209, 22]


def test_long_strings_are_stored_once_and_huge_plans_not_at_all(project, monkeypatch):
    _, plan, _ = load_plan("cluster.yaml")
    endpoints = plan.trainers[0].env["PADDLE_TRAINER_ENDPOINTS"]
    assert len(endpoints) >= plancache._LONG
    assert Path(plancache.entry_path("cluster.yaml")).read_text().count(endpoints) == 1
    Path(plancache.entry_path("cluster.yaml")).unlink()
    monkeypatch.setattr(plancache, "_MAX_PROCESSES", len(plan.processes) - 1)
    assert load_plan("cluster.yaml")[0] is not None
    assert not Path(plancache.entry_path("cluster.yaml")).exists()


def test_the_code_stamp_covers_every_module_that_plans():
    """The layout (host/layout.py) and the elastic section (host/elastic.py) plan as much as plan.py does: an edit
    to either in a checkout must miss the cache, not serve a plan that the code would no longer make."""
    stamped = {name for name, _size, _mtime in plancache._code_stamp()}
    assert {"plan.py", "host/layout.py", "host/elastic.py", "host/policy.py", "spec/loading.py"} <= stamped
