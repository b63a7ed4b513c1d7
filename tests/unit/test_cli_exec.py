"""`clusterctl exec`'s own options: before the spec, or after it up to `--`; the command after `--` untouched."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from clusterctl import cli
from clusterctl.plan import Host
from clusterctl.remote import Remote, SshOptions
from clusterctl.transport.local import LocalTransport


class _Session:
    def __init__(self, remote):
        self.remote, self.plan = remote, type("P", (), {"hosts": remote.hosts})()


@pytest.fixture
def seen(tmp_path, monkeypatch):
    """Runs exec against two local fake hosts; records the timeout each command got."""
    import clusterctl.backends
    import clusterctl.ops.execute as execute

    got = {}
    real = execute.execute

    def spy(remote, argv, on_line=None, timeout=None):
        got["timeout"], got["argv"] = timeout, list(argv)
        return real(remote, argv, on_line=on_line, timeout=timeout)

    @contextmanager
    def fake_session(spec):
        hosts = [Host("n0", 22, "u", 0), Host("n1", 22, "u", 1)]
        with Remote(hosts, SshOptions(), transport=LocalTransport(tmp_path)) as remote:
            yield _Session(remote)

    monkeypatch.setattr(execute, "execute", spy)
    monkeypatch.setattr(clusterctl.backends, "ssh_session", fake_session)
    return got


@pytest.mark.parametrize("args", [["--timeout", "7", "s.yaml", "--", "echo", "--timeout", "3"],
                                  ["s.yaml", "--timeout", "7", "--", "echo", "--timeout", "3"],
                                  ["s.yaml", "--timeout=7", "--", "echo", "--timeout", "3"]])
def test_timeout_before_or_after_the_spec_is_execs_own(seen, args, capsys):
    assert cli.main(["exec", *args]) == 0
    assert seen == {"timeout": 7.0, "argv": ["echo", "--timeout", "3"]}
    assert "--timeout 3" in capsys.readouterr().out


def test_an_unknown_option_before_the_command_is_one_line(seen, capsys):
    assert cli.main(["exec", "s.yaml", "--tiemout", "7", "--", "true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tiemout" in err[0] and "before --" in err[0], err
    assert seen == {}
