"""A command lays out its plan once, also when the ssh config renames hosts or the spec has data shards
(the spec's own check and the command used to lay it out twice: 2 x 0.3 s at 10,000 processes)."""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
import time

import pytest

from clusterctl import cli
from clusterctl.ops import load_plan
from clusterctl.plan import make_plan

LAYOUT = make_plan.__wrapped__.__code__  # the layout itself, under make_plan's reuse of the last plan


def layouts(fn) -> int:
    """How many times `fn()` lays out a plan."""
    count = 0

    def profile(frame, event, _arg):
        nonlocal count
        if event == "call" and frame.f_code is LAYOUT:
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


@pytest.fixture
def spec(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "ssh_config").write_text("Host gpu0\n    HostName 127.0.0.5\nHost gpu1\n    HostName 127.0.0.6\n")
    (tmp_path / "data").mkdir()
    for i in range(4):
        (tmp_path / "data" / f"part{i}.txt").write_text(str(i))
    path = tmp_path / "cluster.yaml"
    path.write_text(textwrap.dedent("""\
        name: once
        ssh: {config: ssh_config}
        hosts: [{address: gpu0}, {address: gpu1}]
        data: {local: data, pattern: "*.txt"}
        job: {mode: pserver, entrypoint: [python3, train.py], pservers: 1}
        """))
    old = time.time() - 60  # the plan cache keeps nothing made from files changed as it planned
    for p in (path, tmp_path / "ssh_config", tmp_path / "data", *(tmp_path / "data").iterdir()):
        os.utime(p, (old, old))
    return path


@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the OpenSSH client (ssh -G)")
@pytest.mark.parametrize("command", ["validate", "plan"])
def test_validate_and_plan_lay_out_once(spec, command, capsys):
    assert layouts(lambda: cli.main([command, str(spec)])) == 1
    assert "once" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the OpenSSH client (ssh -G)")
def test_an_operation_lays_out_once_and_a_cached_plan_not_at_all(spec):
    seen = []
    assert layouts(lambda: seen.append(load_plan(str(spec)))) == 1
    plan = seen[0][1]
    assert [h.connect_name for h in plan.hosts] == ["127.0.0.5", "127.0.0.6"]
    assert layouts(lambda: seen.append(load_plan(str(spec)))) == 0  # the plan cache
    assert seen[1][1] == plan


def test_a_layout_problem_is_still_reported_at_its_key(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(textwrap.dedent("""\
        name: bad
        ssh: {config: none}
        hosts: [{address: 10.0.0.1}]
        job:
          mode: pserver
          entrypoint: [python3, train.py]
          pservers: 1
          launcher: mpi
        """))
    assert cli.main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml:8:" in err and "launcher: mpi runs collective jobs" in err, err
