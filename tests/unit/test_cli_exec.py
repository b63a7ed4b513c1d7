"""`clusterctl exec`'s own options: before the spec, or after it up to `--`; the command after `--` untouched.
The command runs on two fake hosts (tests/unit/fakehosts.py), reached through the transport seam."""

from __future__ import annotations

import pytest

from clusterctl import cli
from fakehosts import FakeCluster


@pytest.fixture
def seen(tmp_path, monkeypatch):
    """Runs exec against two local fake hosts; records the timeout and argv each command got."""
    import clusterctl.ops.execute as execute

    got = {}
    real = execute.execute

    def spy(remote, argv, on_line=None, timeout=None):
        got["timeout"], got["argv"] = timeout, list(argv)
        return real(remote, argv, on_line=on_line, timeout=timeout)

    monkeypatch.setattr(execute, "execute", spy)
    got["spec"] = str(FakeCluster(tmp_path).everywhere(monkeypatch).spec_path)
    return got


def _args(args, spec):
    return [spec if a == "s.yaml" else a for a in args]


@pytest.mark.parametrize("args", [["--timeout", "7", "s.yaml", "--", "echo", "--timeout", "3"],
                                  ["s.yaml", "--timeout", "7", "--", "echo", "--timeout", "3"],
                                  ["s.yaml", "--timeout=7", "--", "echo", "--timeout", "3"]])
def test_timeout_before_or_after_the_spec_is_execs_own(seen, args, capsys):
    spec = seen.pop("spec")
    assert cli.main(["exec", *_args(args, spec)]) == 0
    assert seen == {"timeout": 7.0, "argv": ["echo", "--timeout", "3"]}
    out = capsys.readouterr().out.splitlines()
    assert sorted(out) == ["[n0] --timeout 3", "[n1] --timeout 3"], out


def test_an_unknown_option_before_the_command_is_one_line(seen, capsys):
    spec = seen.pop("spec")
    assert cli.main(["exec", spec, "--tiemout", "7", "--", "true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tiemout" in err[0] and "before --" in err[0], err
    assert seen == {}
