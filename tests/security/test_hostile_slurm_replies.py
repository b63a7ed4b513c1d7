"""A compromised Slurm login node (or node) answers `clusterctl status|logs|stop|top` under backend: slurm with
JSON of any shape: `slurmctl login query|stop|top` replies without `record`, with `slurm.state` a number, node
names that climb out of the job directory (`../../x`) or carry terminal escapes, `replies` or `addresses` of
another type, `killed` lists of lists, a logs line nested 50,000 deep. Each fails in one line naming the field
(`unexpected reply from the login node: ...`) or is ignored safely; before, they ended the command in a
KeyError/TypeError/AttributeError/ValueError traceback, printed the escapes, or (logs) lost a host's failure in
a RecursionError on the reader thread.

The real controller code runs against fake hosts (tests/unit/fakehosts.py): the login node's command is replaced
by the hostile reply (FaultyTransport's `hostile`); the nodes the controller reaches over ssh are fake hosts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from clusterctl import cli

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from fakehosts import FakeCluster, FaultyTransport  # noqa: E402

SJ = {"id": "42", "state": "COMPLETED", "exit_code": "0:0", "nodes": ["node1"]}
REC = {"slurm_job": "42"}
ESC = "node\x1b]0;pwned\x07\x1b[2J"


def slurm_cluster(tmp_path: Path) -> FakeCluster:
    """Two fake hosts' spec turned into backend: slurm, the login node `login` with a shared workspace."""
    c = FakeCluster(tmp_path, hosts=2)
    data = yaml.safe_load(c.spec_path.read_text())
    data.pop("hosts")
    data.update(backend="slurm", slurm={"login": "login", "nodes": 2, "partition": "debug", "workspace": "shared"})
    data["workspace"]["remote"] = str(c.root / "login" / c.remote_dir)
    c.spec_path.write_text(yaml.safe_dump(data, sort_keys=False))
    return c


def run(tmp_path, monkeypatch, capsys, argv: list[str], login_reply: dict, **nodes) -> tuple[int, str, str]:
    """`clusterctl ARGV` with the login node answering `login_reply` to its `slurmctl` commands, and each of
    `nodes`' addresses its (stdout, exit code) to `agent logs`."""
    c = slurm_cluster(tmp_path)
    login = FaultyTransport(c.transport, hostile={"login": (json.dumps(login_reply), 0)}, only="slurmctl")
    c.everywhere(monkeypatch, transport=FaultyTransport(login, hostile=nodes, only="--host-label"))
    code = cli.main([argv[0], str(c.spec_path), *argv[1:]])
    out, err = capsys.readouterr()
    return code, out, err


REFUSED = [  # (command, the login node's reply, what the one line says)
    ("status", {"ok": True}, "'record' is not a job record with a Slurm job id"),
    ("status", {"ok": True, "record": REC, "slurm": {"id": "42"}}, "'slurm.state' is not one line of text"),
    ("status", {"ok": True, "record": REC, "slurm": dict(SJ, state=5), "addresses": {}, "replies": {"node1": {}}},
     "'slurm.state' is not one line of text"),
    ("status", {"ok": True, "record": REC, "slurm": dict(SJ, state="RUNNING"), "addresses": {}, "replies": "abc"},
     "'replies' is not a map of node name to reply"),
    ("status", {"ok": True, "record": REC, "slurm": dict(SJ, nodes=[1]), "addresses": {}, "replies": {}},
     "'slurm.nodes' is not a list of node names"),
    ("status", {"ok": True, "record": REC, "slurm": dict(SJ, nodes=["../../x"]), "addresses": {}, "replies": {}},
     "'slurm.nodes' is not a list of node names"),
    ("status", {"ok": True, "record": REC, "slurm": dict(SJ, nodes=[ESC]), "addresses": {}, "replies": {}},
     "'slurm.nodes' is not a list of node names"),
    ("status", {"ok": True, "record": REC, "slurm": SJ, "addresses": [], "replies": {}},
     "'addresses' is not a map of node name to address"),
    ("stop", {"ok": True}, "'record' is not a job record with a Slurm job id"),
    ("stop", {"ok": True, "record": ["x"], "slurm": None, "was_running": False},
     "'record' is not a job record with a Slurm job id"),
    ("logs", {"ok": True, "record": REC, "slurm": dict(SJ, nodes=["../../x"]), "addresses": {}},
     "'slurm.nodes' is not a list of node names"),
    ("logs", {"ok": True, "record": REC, "slurm": {"id": "42"}, "addresses": {}}, "'slurm.state' is not one line of text"),
]


@pytest.mark.parametrize("command, reply, said", REFUSED)
def test_a_login_reply_of_the_wrong_shape_fails_in_one_line(tmp_path, monkeypatch, capsys, command, reply, said):
    code, out, err = run(tmp_path, monkeypatch, capsys, [command], reply)  # was a KeyError, TypeError, ... traceback
    assert (code, out, err) == (1, "", f"clusterctl: error: unexpected reply from the login node: {said}\n")


OUTSIDE = [  # the login node speaks for a node the job does not have (it may be compromised)
    ("status", {"ok": True, "record": REC, "slurm": dict(SJ, state="RUNNING"), "addresses": {},
                "replies": {"node1": {}, "node9": {"ok": True, "state": "running"}}}, "'replies' names node9"),
    ("status", {"ok": True, "record": REC, "slurm": None, "addresses": {}, "replies": {"node1": {}}},
     "'replies' names node1"),
    ("stop", {"ok": True, "record": REC, "slurm": dict(SJ, state="RUNNING"), "was_running": True,
              "addresses": {"node1": "n1", "evil": "10.0.0.9"}, "replies": {"node1": {"killed": [7]}}},
     "'addresses' names evil"),
    ("logs", {"ok": True, "record": REC, "slurm": SJ, "addresses": {f"n{i}": "n1" for i in range(5)}},
     "'addresses' names n0, n1, n2 ..."),
]


@pytest.mark.parametrize("command, reply, said", OUTSIDE)
def test_a_login_reply_naming_a_node_outside_the_job_fails_in_one_line(tmp_path, monkeypatch, capsys, command,
                                                                       reply, said):
    code, out, err = run(tmp_path, monkeypatch, capsys, [command], reply)  # was folded in: a host it never had
    assert (code, out, err) == (1, "", f"clusterctl: error: unexpected reply from the login node: {said}, "
                                       "not a node of the job\n")


@pytest.mark.parametrize("replies", [{"node1": 5}, {"node1": "x"}, {"node1": [1]}])
def test_a_nodes_reply_that_is_not_an_object_counts_as_no_answer(tmp_path, monkeypatch, capsys, replies):
    reply = {"ok": True, "record": REC, "slurm": dict(SJ, state="RUNNING"), "addresses": {}, "replies": replies}
    code, out, err = run(tmp_path, monkeypatch, capsys, ["status"], reply)  # was an AttributeError
    assert (code, err) == (0, "") and "starting the supervisors" in out, out


@pytest.mark.parametrize("replies, shown", [
    ({"node1": {"killed": 5}}, "stopped on 1 host(s) (Slurm job 42 CANCELLED)\n"),
    ({"node1": {"killed": [[1]]}}, "stopped on 1 host(s) (Slurm job 42 CANCELLED)\n"),
    ({"node1": {"killed": [7, {"pid": 7, "via": "killpg"}, {"pid": 7, "via": "kill"}, {"pid": 8}, True, "9", [10],
                           {"pid": [11]}]}},
     "stopped on 1 host(s) (Slurm job 42 CANCELLED), 2 process(es) killed\n"),
])
def test_a_stop_reply_of_the_wrong_shape_counts_only_what_is_well_typed(tmp_path, monkeypatch, capsys, replies, shown):
    reply = {"ok": True, "record": REC, "slurm": dict(SJ, state="CANCELLED"), "was_running": True, "replies": replies}
    code, out, err = run(tmp_path, monkeypatch, capsys, ["stop"], reply)  # was a TypeError or AttributeError
    assert (code, err) == (0, "") and out.endswith(shown), out


DEEP = '{"a": ' + "[" * 50000 + "]" * 50000 + "}"
RUNNING = {"ok": True, "record": REC, "slurm": dict(SJ, state="RUNNING", nodes=["node1", "node2"]),
           "addresses": {"node1": "n7", "node2": "n8"}}


def test_a_logs_line_nested_too_deep_is_a_log_line(tmp_path, monkeypatch, capsys):
    code, out, err = run(tmp_path, monkeypatch, capsys, ["logs"], RUNNING, n7=(DEEP, 0), n8=("[node2 trainer.1] hi", 0))
    assert code == 0 and DEEP in out and "[node2 trainer.1] hi" in out, err  # was lost with its reader thread


def test_a_hosts_failure_after_a_line_nested_too_deep_is_not_lost(tmp_path, monkeypatch, capsys):
    failed = DEEP + "\n" + json.dumps({"ok": False, "error": "disk full"})
    code, out, err = run(tmp_path, monkeypatch, capsys, ["logs"], RUNNING, n7=(failed, 2), n8=("[node2 trainer.1] hi", 0))
    assert code == 1 and "logs incomplete:" in err and "node1: disk full" in err, err  # was not said: the thread died (said under the node's name)


@pytest.mark.parametrize("reply", [
    {"ok": True, "record": REC, "slurm": {"id": "42"}},
    {"ok": True, "record": REC, "slurm": dict(SJ, state="RUNNING", nodes=[ESC, "node2"]),
     "replies": {ESC: {"ok": True, "state": "running", "processes": [{"role": "trainer", "id": 0, "state": "running"}]}}},
])
def test_top_shows_a_login_reply_of_the_wrong_shape_as_the_login_nodes_row(tmp_path, monkeypatch, capsys, reply):
    code, out, err = run(tmp_path, monkeypatch, capsys, ["top", "--once"], reply)
    text = " ".join((out + err).split())  # the row's error is wrapped to the screen's width
    assert "\x1b" not in out + err and "Traceback" not in err, (out + err)[-600:]  # was KeyError: 'state'; escapes
    assert "unexpected reply from the login node: 'slurm." in text, text


@pytest.mark.parametrize("command", ["status", "stop", "logs"])
def test_a_login_reply_without_a_slurm_key_is_a_job_slurm_no_longer_knows(tmp_path, monkeypatch, capsys, command):
    # a KeyError 'slurm' traceback: the check let the key be left out, and then it was read as q["slurm"]
    code, out, err = run(tmp_path, monkeypatch, capsys, [command], {"ok": True, "record": REC})
    assert "Traceback" not in err and "KeyError" not in err
    if command == "logs":
        assert code == 1 and err.endswith(" (Slurm job 42) has not started: no logs yet\n"), (code, out, err)
    else:
        assert (code, err) == (0, ""), (code, out, err)
