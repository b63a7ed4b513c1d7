"""A host's `status` and `top` reply that is well-typed JSON but not what any supervisor sends: a job state of its
own making, a reply that names another job or another host, numbers no process has (a 300-digit pid, exit code or
attempt), a reason of megabytes. Before, the state became the job's (overall_state sorts what it does not know), the
other host's or job's reply was shown as this host's rows, and the numbers widened the status table past any
terminal. Now such a host is named in one line (`no status: ...`, as a reply without a state) and the numbers are
left blank; the other hosts' rows are as they said."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from clusterctl import cli
from clusterctl.ops.job import MAX_WORDS, fold_status
from clusterctl.ops.top import answer_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from fakehosts import FakeCluster, FaultyTransport  # noqa: E402

ADDRESSES = {"A": "a", "B": "b"}
BIG = 10**300


def reply(host: str, state: str = "running", **kw) -> dict:
    proc = {"role": "trainer", "id": 0 if host == "a" else 1, "pid": 7, "state": "running", "exit_code": None,
            "uptime_s": 3.0}
    return {"ok": True, "job": "j", "host": host, "state": state, "processes": [proc], **kw}


@pytest.mark.parametrize("hostile, said", [
    (reply("b", "a-ok"), "no status: a job state clusterctl does not know: 'a-ok'"),
    (reply("b", "run\x1b[2J\u202e"), "no status: a job state clusterctl does not know: 'run\\x1b[2J\\u202e'"),
    (reply("a", "failed", reason="trainer.0 on a exited with code 3"), "no status: a reply for host 'a', not b"),
    (dict(reply("b", "succeeded"), job="other-job"), "no status: a reply for job 'other-job', not j"),
])
def test_a_reply_that_is_not_its_hosts_word_on_this_job_names_that_host(hostile, said):
    st = fold_status("j", {"A": reply("a", "succeeded"), "B": hostile}, {}, ADDRESSES)
    assert st.unreachable == {"B": said}, st.unreachable
    assert (st.state, st.reason) == ("lost", "unreachable: B")  # was 'a-ok', or A's rows and state decided by B
    assert [(p.host, p.role, p.id) for p in st.processes] == [("A", "trainer", 0)]


def test_numbers_no_process_has_are_left_blank_and_words_are_bounded():
    procs = [{"role": "trainer", "id": 1, "pid": BIG, "state": "running", "exit_code": -10**20, "uptime_s": 1e308},
             {"role": "trainer", "id": BIG, "pid": 8, "state": "running"},  # no such process: left out
             {"role": "t" * 5000, "id": 2, "pid": 0, "state": "fine\x1b[2J", "exit_code": 256, "uptime_s": -1.0}]
    hostile = reply("b", "failed", processes=procs, reason="r" * 5_000_000, attempt=BIG, restarts=BIG,
                    attempts_total=BIG, attempts=[{"attempt": BIG, "outcome": "failed"},
                                                  {"attempt": 1, "outcome": "x\x1b", "reason": "y" * 10_000}])
    st = fold_status("j", {"A": reply("a"), "B": hostile}, {}, ADDRESSES)
    rows = [(p.host, p.role, p.id, p.pid, p.state, p.exit_code, p.uptime_s) for p in st.processes]
    assert rows == [("A", "trainer", 0, 7, "running", None, 3.0), ("B", "trainer", 1, None, "running", None, None),
                    ("B", "t" * 32, 2, None, "unknown", None, None)], rows
    assert (st.attempt, st.restarts) == (0, 0)
    assert st.attempts == [{"attempt": 1, "outcome": None, "reason": "y" * MAX_WORDS, "started_at": None,
                            "ended_at": None}], st.attempts
    assert st.reason == "B: " + "r" * MAX_WORDS


def test_top_names_a_host_whose_state_is_of_its_own_making():
    ans = answer_of({"ok": True, "state": "all\x1b[2J good", "processes": []})
    assert (ans.status, ans.error) == ("error", "a job state clusterctl does not know: 'all\\x1b[2J good'")


def _hostile_cli(tmp_path, monkeypatch, capsys, argv: list[str], only: str, hostile: dict) -> tuple[int, str, str]:
    c = FakeCluster(tmp_path)
    text = json.dumps(dict(hostile, job=c.name) if hostile.get("job") == "j" else hostile)
    c.everywhere(monkeypatch, transport=FaultyTransport(c.transport, hostile={"n1": (text, 0)}, only=only))
    code = cli.main([argv[0], str(c.spec_path), *argv[1:]])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    assert all(ch.isprintable() or ch in "\n\t" for ch in out + err), (out + err)[-600:]  # nothing raw reaches the terminal
    return code, out, err


def test_status_names_the_host_in_one_line_and_prints_no_control_characters(tmp_path, monkeypatch, capsys):
    code, out, _ = _hostile_cli(tmp_path, monkeypatch, capsys, ["status"], "progress",
                                reply("n1", "running\x1b]0;pwned\x07\u202e", processes=[]))
    assert code == 1
    assert "n1: no status: a job state clusterctl does not know: 'running\\x1b]0;pwned\\x07\\u202e'" in out, out


def test_status_and_top_do_not_show_a_reply_for_another_host_as_this_hosts(tmp_path, monkeypatch, capsys):
    hostile = reply("n0", "failed", reason="n0 is on fire", job="j")  # n1 answers as n0 would
    code, out, _ = _hostile_cli(tmp_path / "s", monkeypatch, capsys, ["status", "--json"], "progress", hostile)
    doc = json.loads(out)
    assert (code, doc["unreachable"], doc["processes"]) == (1, {"n1": "no status: a reply for host 'n0', not n1"}, [])
    assert doc["reason"] == "unreachable: n1", doc
    code, out, _ = _hostile_cli(tmp_path / "t", monkeypatch, capsys, ["top", "--once", "--json", "--no-gpu"],
                                "--slices", hostile)
    doc = json.loads(out)
    n1 = [h for h in doc["hosts"] if h["host"] == "n1"]
    assert [(h["status"], h["error"]) for h in n1] == [("error", "a reply for host 'n0', not n1")], doc["hosts"]
    assert not [r for r in doc["processes"] if r["host"] == "n1"], doc["processes"]


def test_a_row_of_a_process_the_plan_placed_on_another_host_names_the_sender():
    # B reports, beside its own trainer.1, a trainer.0 (A's) stepping 1,000 times faster: it showed as a second
    # trainer.0, and with its rate A's real one became the job's straggler
    fast = {"role": "trainer", "id": 0, "pid": 9, "state": "running", "progress": {"step": 10**6, "rate": 1e6}}
    hostile = reply("b", processes=[reply("b")["processes"][0], fast])
    placed = {"A": frozenset({("trainer", 0)}), "B": frozenset({("trainer", 1)})}
    st = fold_status("j", {"A": reply("a"), "B": hostile}, {}, ADDRESSES, placed=placed)
    assert st.unreachable == {"B": "no status: a row for trainer.0, which the plan does not place on this host (was "
                                    "the spec changed since the job started?)"}, st.unreachable
    assert [(p.host, p.role, p.id) for p in st.processes] == [("A", "trainer", 0)]
    assert st.stragglers == []
    honest = fold_status("j", {"A": reply("a"), "B": reply("b")}, {}, ADDRESSES, placed=placed)
    assert (honest.unreachable, len(honest.processes)) == ({}, 2)


def test_status_and_top_name_a_host_that_reports_another_hosts_process(tmp_path, monkeypatch, capsys):
    hostile = dict(reply("n1", processes=[{"role": "trainer", "id": 0, "pid": 7, "state": "running"}]), job="j")
    said = "a row for trainer.0, which the plan does not place on this host (was the spec changed since the job started?)"
    code, out, _ = _hostile_cli(tmp_path / "s", monkeypatch, capsys, ["status", "--json"], "progress", hostile)
    doc = json.loads(out)
    assert (code, doc["unreachable"]) == (1, {"n1": "no status: " + said}), doc
    assert not [r for r in doc["processes"] if r["host"] == "n1"], doc["processes"]
    code, out, _ = _hostile_cli(tmp_path / "t", monkeypatch, capsys, ["top", "--once", "--json", "--no-gpu"],
                                "--slices", hostile)
    doc = json.loads(out)
    assert [(h["status"], h["error"]) for h in doc["hosts"] if h["host"] == "n1"] == [("error", said)], doc["hosts"]


@pytest.mark.parametrize("state", [["\x1b"], {"x": 1}])
def test_a_state_of_the_wrong_type_is_no_traceback(state):
    # a process state (or top's job state) that is a list or a dict: `in` a set of states raised TypeError
    st = fold_status("j", {"A": reply("a"), "B": reply("b", processes=[dict(reply("b")["processes"][0], state=state)])},
                     {}, ADDRESSES)
    assert [(p.host, p.state) for p in st.processes] == [("A", "running"), ("B", "unknown")]
    ans = answer_of({"ok": True, "state": state, "processes": []})
    assert ans.status == "error" and ans.error.startswith("a job state clusterctl does not know: "), ans
