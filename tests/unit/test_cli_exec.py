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


def test_a_command_longer_than_ssh_can_take_is_one_line_naming_it(seen, capsys):
    """A 130 KB argument: "clusterctl: error: Argument list too long: ssh" (execve of the ssh client). The bound is
    on the command as sent: with --timeout it travels twice (the `timeout` wrapper and the fallback without it)."""
    spec = seen.pop("spec")
    fits = "x" * 110_000
    assert cli.main(["exec", spec, "--", "sh", "-c", 'echo "${#1}"', "sh", fits]) == 0
    assert sorted(capsys.readouterr().out.splitlines()) == ["[n0] 110000", "[n1] 110000"]
    for argv in (["--", "echo", "x" * 130_000], ["--timeout", "5", "--", "echo", "x" * 62_000]):
        assert cli.main(["exec", spec, *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("clusterctl: error: exec: the command is ") \
            and "over the 122,880 ssh can take as one argument" in err[0], err
