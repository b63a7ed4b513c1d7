"""What a host answers to `status` and `logs` is one host's word: it must not decide another host's state, pass its
lines off as another host's, print megabytes on one status line, or make the controller parse a flood. The real
host side runs on fake hosts (tests/unit/fakehosts.py); one host's command is replaced by a reply."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from clusterctl import cli
from clusterctl.ops.control import MAX_CONTROL_REPLY, agent_reply
from clusterctl.ops.job import fold_status
from clusterctl.transport.base import Result
from clusterctl.transport.host import Host

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from fakehosts import FakeCluster, FaultyTransport, wait_until  # noqa: E402

FAILS = "import os, sys, time\ntime.sleep(0.2)\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n"


def view_reply(host: str, members: list[str]) -> dict:
    """A host's status reply that says the job succeeded and carries an elastic view naming `members` only."""
    return {"ok": True, "job": "j", "host": host, "state": "succeeded", "attempt": 9, "processes": [],
            "elastic": {"lines": ["elastic job: all fine"], "members": members, "view": {"attempt": 9}}}


FAILED = {"ok": True, "job": "j", "host": "b", "state": "failed", "reason": "trainer.1 on b exited with code 3",
          "processes": [{"role": "trainer", "id": 1, "pid": 7, "state": "exited", "exit_code": 3}]}


def test_a_hosts_elastic_view_does_not_decide_a_job_that_is_not_elastic():
    st = fold_status("j", {"A": view_reply("a", ["a"]), "B": FAILED}, {}, {"A": "a", "B": "b"})
    assert (st.state, st.elastic) == ("failed", None) and "trainer.1 on b exited with code 3" in st.reason
    st = fold_status("j", {"A": view_reply("a", ["a"])}, {"B": "No route to host"}, {"A": "a", "B": "b"})
    assert (st.state, st.reason) == ("lost", "unreachable: B")


def test_an_elastic_view_naming_foreign_hosts_or_not_its_sender_is_not_read():
    addresses = {"A": "a", "B": "b"}
    for members in (["a", "x"], ["b"]):  # a host the plan does not have; a view that leaves its sender out
        st = fold_status("j", {"A": view_reply("a", members), "B": FAILED}, {}, addresses, elastic_job=True)
        assert (st.state, st.elastic) == ("failed", None), members
    # a view of the plan's hosts, its sender among them, is read (an elastic job's current attempt: a and its spare)
    st = fold_status("j", {"A": view_reply("a", ["a"]), "B": FAILED}, {}, addresses, elastic_job=True)
    assert st.state == "succeeded" and st.elastic["members"] == ["a"]


def test_status_of_a_failed_job_stays_failed_whatever_another_host_says(tmp_path, monkeypatch, capsys):
    c = FakeCluster(tmp_path, files={"train.py": FAILS}).everywhere(monkeypatch)
    assert cli.main(["dispatch", str(c.spec_path)]) == 0 and cli.main(["start", str(c.spec_path)]) == 0
    capsys.readouterr()
    wait_until(lambda: cli.main(["status", str(c.spec_path), "--json"]) == 0
               and json.loads(capsys.readouterr().out)["state"] == "failed")
    hostile = json.dumps(dict(view_reply("n0", ["n0"]), job=c.name))  # another job's reply is not read at all
    c.everywhere(monkeypatch, transport=FaultyTransport(c.transport, hostile={"n0": (hostile, 0)},
                                                        only="--progress-only"))
    assert cli.main(["status", str(c.spec_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["state"] == "failed" and "exited with code 3" in doc["reason"], doc
    c.everywhere(monkeypatch)
    assert cli.main(["stop", str(c.spec_path)]) == 0


def test_a_host_cannot_pass_its_log_lines_off_as_another_hosts(tmp_path, monkeypatch, capsys):
    lines = "[n0 trainer.0] a line of its own\n[n1 trainer.1] FAILED: rank 1 diverged\nno prefix at all"
    c = FakeCluster(tmp_path)
    c.everywhere(monkeypatch, transport=FaultyTransport(c.transport, hostile={"n0": (lines, 0)}, only="--host-label"))
    assert cli.main(["logs", str(c.spec_path), "--host", "n0"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "[n0 trainer.0] a line of its own", "[n0] [n1 trainer.1] FAILED: rank 1 diverged", "[n0] no prefix at all"]


def test_an_unreachable_hosts_reason_is_its_last_300_characters(tmp_path, monkeypatch, capsys):
    class Loud(FaultyTransport):
        def popen(self, host, command):
            if host.address == "n1" and "--progress-only" in command:
                command = "cat >/dev/null; head -c 5000000 /dev/zero | tr '\\0' 'E' >&2; echo ' the end' >&2; exit 255"
            return self.inner.popen(host, command)

    c = FakeCluster(tmp_path)
    c.everywhere(monkeypatch, transport=Loud(c.transport))
    assert cli.main(["status", str(c.spec_path), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["unreachable"]["n1"]) == 300 and doc["unreachable"]["n1"].endswith("EEE the end")


def test_a_control_reply_over_its_bound_is_that_hosts_error_not_parsed():
    host = Host("n1", 22, "u", 0)
    flood = '{"ok": true, "state": "running", "processes": [' + "{}," * (MAX_CONTROL_REPLY // 3) + "{}]}\n"
    reply = agent_reply(Result(host, "x", 0, flood, "", 0.0))
    assert reply == {"ok": False, "error": "a reply over the 16 MiB a host's control reply may be"}
    fits = '{"ok": true, "state": "running", "processes": [' + "{}," * 1000 + "{}]}\n"
    assert agent_reply(Result(host, "x", 0, fits, "", 0.0))["state"] == "running"


def test_what_a_host_prints_on_stderr_to_logs_is_shown_under_its_label(tmp_path, monkeypatch, capsys):
    class Chatty(FaultyTransport):
        def popen(self, host, command):
            if host.address == "n0" and "--host-label" in command:
                command = "echo '[n1 trainer.1] FAILED: rank 1 diverged' >&2; " + command
            return self.inner.popen(host, command)

    c = FakeCluster(tmp_path, files={"train.py": "print('hello')\n"}).everywhere(monkeypatch)
    assert cli.main(["dispatch", str(c.spec_path)]) == 0 and cli.main(["start", str(c.spec_path), "--follow"]) == 0
    capsys.readouterr()
    c.everywhere(monkeypatch, transport=Chatty(c.transport))
    assert cli.main(["logs", str(c.spec_path)]) == 0
    out, err = capsys.readouterr()
    assert sorted(out.splitlines()) == ["[n0 trainer.0] hello", "[n1 trainer.1] hello"]
    assert err.splitlines() == ["[n0] [n1 trainer.1] FAILED: rank 1 diverged"]
