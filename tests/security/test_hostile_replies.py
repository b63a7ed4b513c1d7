"""What a host answers to dispatch (`hostws state`, `apply`, `verify`) and to `start` (`agent up`) is untrusted: a
broken or compromised host whose reply is not what clusterctl's host side prints fails, by name and in lines, and
the other hosts get their update and are remembered. Before, such a reply ended the whole command in a KeyError,
TypeError or AttributeError traceback (dispatch: the other hosts updated but not recorded), or was taken as a
generation name.

The real host side runs on fake hosts (tests/unit/fakehosts.py); n1's command is replaced by a reply
(FaultyTransport's `hostile`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from clusterctl import cli
from clusterctl.errors import RemoteError
from clusterctl.ops.dispatch import dispatch, verify

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from fakehosts import FakeCluster, FaultyTransport  # noqa: E402


def Hostile(inner, reply: str, only: str) -> FaultyTransport:
    """n1 answers the commands that contain `only` with `reply` (after reading what it was sent), exit 0."""
    return FaultyTransport(inner, hostile={"n1": (reply, 0)}, only=only)


BAD_STATES = [
    ('{"gen": 5, "manifest": {}, "drift": []}', "'gen' is not a generation name: 5"),
    ('{"gen": "../../etc", "manifest": {}, "drift": []}', "'gen' is not a generation name: '../../etc'"),
    ('{"gen": "g\\u001b[2J", "manifest": {}, "drift": []}', "'gen' is not a generation name: 'g\\x1b[2J'"),
    ('{"gen": "g", "manifest": [], "drift": []}', "'manifest' is not a manifest of {path: entry}"),
    ('{"gen": "g", "manifest": {"a": 1}, "drift": []}', "'manifest' is not a manifest of {path: entry}"),
    ('{"gen": "g", "manifest": {"a": {"s": "1", "h": "x", "m": 1, "t": 1}}, "drift": []}',
     "'manifest' is not a manifest of {path: entry}"),
    ('{"gen": "g", "manifest": {}, "drift": "x"}', "'drift' is not a list of"),
    ('{"gen": "g", "manifest": {}, "drift": [1]}', "'drift' is not a list of"),
    ('{"manifest": {}}', "'drift' is not a list of"),
    ("[1, 2]", "exit 0 but no JSON reply on stdout (got '[1, 2]')"),
]


def _one_failure(info, said: str) -> str:
    text = str(info.value)
    assert text.startswith("dispatch failed on 1 host(s): n1") or text.startswith("verifying workspaces failed on 1 host(s): n1"), text
    assert f"n1: exit 1: unexpected reply from the host: {said}" in text, text
    return text


def _sent_again(c: FakeCluster) -> dict[str, int]:
    """{host: files sent} of one more dispatch through honest hosts."""
    with c.session() as s:
        return {r.host.label: r.files_sent for r in dispatch(s)}


@pytest.mark.parametrize("reply, said", BAD_STATES)
def test_a_bad_state_reply_fails_that_host_and_the_others_are_updated(tmp_path, reply, said):
    c = FakeCluster(tmp_path, files={"train.py": "print(1)\n"})
    with c.session(transport=Hostile(c.transport, reply, "hostws state")) as s:  # no records: both are asked
        with pytest.raises(RemoteError) as info:
            dispatch(s)
    _one_failure(info, said)
    assert (c.workspace(0) / "train.py").read_text() == "print(1)\n"
    assert not c.workspace(1).exists()
    assert _sent_again(c) == {"n0": 0, "n1": 1}  # n0 was recorded: nothing travels to it again; n1 gets it all now


@pytest.mark.parametrize("reply, said", [
    ('{"gen": 7}', "'gen' is not a generation name: 7"),
    ('{"nothing": 1}', "'gen' is not a generation name: None"),
    ('{"stale": "drift", "gen": "g"}', "'manifest' is not a manifest of {path: entry}"),
    ('{"stale": "drift", "gen": "g", "manifest": {}, "drift": [{"path": 1}]}', "'drift' is not a list of"),
])
def test_a_bad_apply_reply_fails_that_host_and_the_others_are_remembered(tmp_path, reply, said):
    c = FakeCluster(tmp_path, files={"train.py": "print(1)\n"})
    with c.session() as s:
        dispatch(s)
    c.write("train.py", "print(2)\n")
    with c.session(transport=Hostile(c.transport, reply, "hostws apply")) as s:
        with pytest.raises(RemoteError) as info:
            dispatch(s)
    _one_failure(info, said)
    assert (c.workspace(0) / "train.py").read_text() == "print(2)\n"
    assert (c.workspace(1) / "train.py").read_text() == "print(1)\n"  # the real apply never ran there
    assert _sent_again(c) == {"n0": 0, "n1": 1}


@pytest.mark.parametrize("reply, said", [
    ('{"gen": "g"}', "'drift' is not a list of"),
    ('{"gen": "g", "drift": [{"path": "a", "problem": 3}]}', "'drift' is not a list of"),
])
def test_a_bad_verify_reply_fails_that_host_by_name(tmp_path, reply, said):
    c = FakeCluster(tmp_path, files={"train.py": "print(1)\n"})
    with c.session() as s:
        dispatch(s)
    with c.session(transport=Hostile(c.transport, reply, "hostws verify")) as s:
        with pytest.raises(RemoteError) as info:
            verify(s)
    _one_failure(info, said)


def test_the_command_line_says_it_in_lines_not_a_traceback(tmp_path, monkeypatch, capsys):
    c = FakeCluster(tmp_path, files={"train.py": "print(1)\n"})
    c.everywhere(monkeypatch, transport=Hostile(c.transport, '{"gen": "g", "manifest": {}, "drift": [1]}',
                                                 "hostws state"))
    assert cli.main(["dispatch", str(c.spec_path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "n1: exit 1: unexpected reply from the host: 'drift' is not a list of" in err, err


# `start`: `agent up`'s reply (exit 1, a failure to report) with fields of the wrong type
@pytest.mark.parametrize("reply, said", [
    ('{"ok": false, "stage": "workspace", "drift": "xx"}', "n1: workspace differs from its last dispatch"),
    ('{"ok": false, "stage": "workspace", "drift": [1, {"path": 3}]}', "n1: workspace differs from its last dispatch"),
    ('{"ok": false, "stage": "preflight", "problems": [1, {"message": 5}, {"message": "port 6170 busy"}]}',
     "n1: 1\nn1: {'message': 5}\nn1: port 6170 busy"),
    ('{"ok": false, "stage": ["launched"], "pids": 5, "error": {"x": 1}}', "n1: exit 1"),
])
def test_a_bad_start_reply_is_that_hosts_failure_in_lines(tmp_path, reply, said):
    from clusterctl.errors import JobError
    from clusterctl.ops.job import start, stop

    c = FakeCluster(tmp_path, files={"train.py": "import time; time.sleep(30)\n"})
    with c.session() as s:
        dispatch(s)
    try:
        with c.session(transport=FaultyTransport(c.transport, hostile={"n1": (reply, 1)}, only=" agent up")) as s:
            with pytest.raises(JobError) as info:  # was an AttributeError or TypeError from the reply's fields
                start(s)
        assert str(info.value).endswith("\n" + said), str(info.value)
    finally:
        with c.session() as s:
            stop(s)


def test_a_host_that_floods_its_reply_fails_and_the_controller_keeps_a_bounded_amount(tmp_path, monkeypatch):
    # at the real limit (256 MiB) this is the same path; 1 MiB here keeps the test quick
    from clusterctl.transport.base import LineSplitter

    monkeypatch.setattr(LineSplitter, "MAX_KEPT", 1 << 20)
    c = FakeCluster(tmp_path, files={"train.py": "print(1)\n"})

    class Flood(FaultyTransport):  # n1 answers with 8 MiB of noise, then the reply a real host would print
        def popen(self, host, command: str):
            if host.address == "n1":
                command = ("cat >/dev/null; head -c 8388608 /dev/zero | tr '\\0' y; "
                           "echo '{\"gen\": null, \"manifest\": {}, \"drift\": []}'")
            return self.inner.popen(host, command)

    with c.session(transport=Flood(c.transport)) as s:
        with pytest.raises(RemoteError) as info:
            dispatch(s)
    _one_failure(info, "exit 0 but no JSON reply on stdout")
    assert "more bytes beyond 1 MiB dropped" in str(info.value)
    assert (c.workspace(0) / "train.py").read_text() == "print(1)\n"


# stop, logs, top, provision: the other readers of host replies on the controller (an audit drove each one)
@pytest.mark.parametrize("reply, code", [('{"ok": false, "error": {"x": 1}}', 1), ('{"ok": false, "error": 5}', 0)])
def test_a_stop_reply_with_an_error_of_another_type_is_that_hosts_failure(tmp_path, reply, code):
    from clusterctl.ops.job import stop

    c = FakeCluster(tmp_path)
    with c.session(transport=FaultyTransport(c.transport, hostile={"n1": (reply, code)}, only="--grace")) as s:
        with pytest.raises(RemoteError, match=r"stop failed on 1 host\(s\): n1\n  n1: exit 1: \"\"$"):
            stop(s)  # was an AttributeError ('dict' object has no attribute 'strip') building the message


# the same replies as tests/security/test_hostile_slurm_replies.py's and test_hostile_k8s_replies.py's: every
# backend counts a host's distinct integer pids (backends/base.py's killed_count)
@pytest.mark.parametrize("killed, counted", [
    (5, 0),
    ([[1]], 0),
    ([7, {"pid": 7, "via": "killpg"}, {"pid": 7, "via": "kill"}, {"pid": 8}, True, "9", [10], {"pid": [11]}], 2),
])
def test_a_stop_reply_counts_only_the_well_typed_distinct_pids_it_killed(tmp_path, killed, counted):
    from clusterctl.backends.ssh import SshBackend

    c = FakeCluster(tmp_path)
    reply = json.dumps({"ok": True, "killed": killed})
    t = FaultyTransport(c.transport, hostile={"n1": (reply, 0)}, only="--grace")
    with c.session(transport=t) as s:
        backend = SshBackend(s.spec, s.plan, transport=t)
        try:
            report = backend.stop()  # was a TypeError (len of an int); a list counted every entry
        finally:
            backend.close()
    assert (report.hosts, report.killed) == (2, counted)


def test_a_logs_reply_nested_too_deep_is_that_hosts_problem(tmp_path, monkeypatch, capsys):
    deep = '{"a": ' + "[" * 50000 + "]" * 50000 + "}"
    c = FakeCluster(tmp_path)
    c.everywhere(monkeypatch, transport=FaultyTransport(c.transport, hostile={"n1": (deep, 2)}, only="--host-label"))
    assert cli.main(["logs", str(c.spec_path)]) == 1  # was a RecursionError in the reader thread, and exit 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "clusterctl: error: n1: exit 2 without the agent's message" in err, err


def test_top_survives_a_reply_of_another_shape_and_prints_no_control_characters(tmp_path, monkeypatch, capsys):
    for reply in ['{"ok": true, "state": "running", "processes": 5}',
                  '{"ok": true, "state": "running", "processes": [{"role": "tr\\u001b[2J", "id": 0, '
                  '"state": "run\\u001b]0;x\\u0007"}]}']:
        c = FakeCluster(tmp_path / str(len(reply)))
        c.everywhere(monkeypatch, transport=FaultyTransport(c.transport, hostile={"n1": (reply, 0)}, only="--slices"))
        code = cli.main(["top", str(c.spec_path), "--once"])  # was a TypeError ('int' object is not iterable)
        out, err = capsys.readouterr()
        assert code in (0, 1) and "Traceback" not in err, err
        assert "\x1b" not in out + err, (out + err)[-400:]


@pytest.mark.parametrize("extra", [[], ["--lines"]])
def test_provision_prints_a_hosts_step_lines_without_their_control_characters(tmp_path, monkeypatch, capsys, extra):
    section = {"timeout": 30, "commands": [{"name": "mark", "run": "echo hi", "unless": "false"}]}
    reply = "hello \x1b[2J\nCLUSTERCTL_STEP commands failed \x1b]0;pwned\x07\x1b[2Jgone"
    c = FakeCluster(tmp_path, extra={"provision": section})
    c.everywhere(monkeypatch, transport=FaultyTransport(c.transport, hostile={"n1": (reply, 1)}, only="clusterctl-commands"))
    assert cli.main(["provision", str(c.spec_path), *extra]) == 1
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err and "\\x1b" in out + err, (out + err)[-600:]


def test_a_start_that_a_host_answers_with_exit_0_and_no_report_is_that_hosts_failure(tmp_path):
    # `agent up` replaced by a shell that prints a banner and exits 0: the host counted as started, no supervisor ran
    # there, and the others waited at the start barrier for ever (`start` said "started", the job stayed `starting`)
    from clusterctl.errors import JobError
    from clusterctl.ops.job import start, status, stop

    c = FakeCluster(tmp_path, files={"train.py": "import time; time.sleep(30)\n"})
    with c.session() as s:
        dispatch(s)
    try:
        with c.session(transport=Hostile(c.transport, "Welcome to n1 (motd)", " agent up")) as s:
            with pytest.raises(JobError) as info:
                start(s)
        assert str(info.value).endswith("\nn1: `agent up` exited 0 without its report (it printed: Welcome to n1 "
                                        "(motd))"), str(info.value)
        with c.session() as s:  # what this start launched on n0 was stopped
            assert status(s).state in ("stopped", "not running")
    finally:
        with c.session() as s:
            stop(s)


@pytest.mark.parametrize("reply", ["Traceback (most recent call last): boom", '{"ok": false, "error": "internal"}',
                                   "[1, 2]"])
def test_a_status_reply_with_no_state_is_that_hosts_problem_not_dropped(tmp_path, reply):
    # a host whose agent crashed, or that answered garbage, vanished from `status`: its rows gone, no reason, exit 0
    from clusterctl.ops.job import start, status, stop

    c = FakeCluster(tmp_path, files={"train.py": "import time; time.sleep(30)\n"})
    with c.session() as s:
        dispatch(s)
        start(s)
    try:
        with c.session(transport=Hostile(c.transport, reply, "progress")) as s:
            st = status(s)
        assert list(st.unreachable) == ["n1"] and st.unreachable["n1"].startswith("no status: "), st.unreachable
        assert st.state == "lost" and st.reason == "unreachable: n1", st
    finally:
        with c.session() as s:
            stop(s)


def test_status_and_top_json_stay_json_when_a_host_sends_numbers_json_has_not(tmp_path, monkeypatch, capsys):
    # Python's json reads `NaN` (and 1e999 as inf): status --json wrote `"uptime_s": NaN` and top --json
    # `"job_cpu_pct": Infinity` (two hosts' 1e308), which strict readers (JSON.parse, Go) refuse whole
    c = FakeCluster(tmp_path, files={"train.py": "import time; time.sleep(30)\n"})
    reply = ('{"ok": true, "job": "%s", "host": "n1", "state": "running", "processes": [{"role": "trainer", "id": 1, '
             '"pid": 1, "state": "running", "uptime_s": NaN, "started_at": 1e999, "resources": {"cpu_pct": 1e308}}, '
             '{"role": "trainer", "id": 2, "pid": 2, "state": "running", "resources": {"cpu_pct": 1e308}}]}')
    with c.session() as s:
        dispatch(s)
        from clusterctl.ops.job import start
        start(s)
    try:
        reply = reply % c.spec().name
        for argv, only in ((["status", str(c.spec_path), "--json"], "progress"),
                           (["top", str(c.spec_path), "--once", "--json", "--no-gpu"], "--slices")):
            c.everywhere(monkeypatch, transport=FaultyTransport(c.transport, hostile={"n1": (reply, 0)}, only=only))
            cli.main(argv)
            text = capsys.readouterr().out
            json.loads(text, parse_constant=lambda c: pytest.fail(f"{argv[0]} --json wrote {c}"))
    finally:
        from clusterctl.ops.job import stop
        with c.session() as s:
            stop(s)


def test_a_host_that_floods_logs_with_errors_and_stderr_is_shown_bounded(tmp_path, monkeypatch, capsys):
    # every stderr line and every `{"error": ...}` line of a host was kept until it ended, then printed: 400 MB of
    # stderr became 800 MB of memory; 409,600 error lines took 45 s to print as as many `clusterctl: error:` lines
    from clusterctl.ops import job as jobmod

    c = FakeCluster(tmp_path)

    class Flood(FaultyTransport):
        def popen(self, host, command: str):
            if host.address == "n1" and "--host-label" in command:
                command = ("cat >/dev/null; i=0; while [ $i -lt 3000 ]; do echo '{\"error\": \"no\"}'; "
                           "echo \"noise $i\" >&2; i=$((i+1)); done; exit 2")
            return self.inner.popen(host, command)

    c.everywhere(monkeypatch, transport=Flood(c.transport))
    assert cli.main(["logs", str(c.spec_path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) < jobmod.MAX_NOTES + jobmod.MAX_SAID + 20, len(err)
    assert any(line.endswith("[clusterctl: 2,800 more stderr lines not shown]") for line in err), err[-10:]
    assert "clusterctl: error: n1: 2,995 more error messages" in err, err[-10:]


def test_a_status_reply_over_the_control_limit_is_dropped_as_it_comes_and_said(tmp_path, monkeypatch):
    # a control reply is parsed only up to MAX_CONTROL_REPLY (16 MiB): a host that sends more has it dropped as it
    # comes (Remote.run's max_output), not kept whole (256 MiB a host before) and only then refused
    from clusterctl.ops.control import MAX_CONTROL_REPLY
    from clusterctl.ops.job import start, status, stop
    from clusterctl.transport.base import LineSplitter

    kept: list[int] = []
    close = LineSplitter.close
    monkeypatch.setattr(LineSplitter, "close", lambda self: kept.append(len(text := close(self))) or text)
    c = FakeCluster(tmp_path, files={"train.py": "import time; time.sleep(30)\n"})
    with c.session() as s:
        dispatch(s)
        start(s)

    class Flood(FaultyTransport):  # n1 answers status with 20 MiB of noise, then the reply an honest host prints
        def popen(self, host, command: str):
            if host.address == "n1" and "progress" in command:
                command = ("cat >/dev/null; head -c 20971520 /dev/zero | tr '\\0' y; "
                           "echo '{\"state\": \"running\", \"processes\": []}'")
            return self.inner.popen(host, command)

    try:
        with c.session(transport=Flood(c.transport)) as s:
            st = status(s)
        assert st.unreachable["n1"].startswith("no status: a reply over the 16 MiB"), st.unreachable
        assert "n0" not in st.unreachable, st.unreachable
        assert max(kept) <= MAX_CONTROL_REPLY + 200, max(kept)
    finally:
        with c.session() as s:
            stop(s)
