"""Asking running supervisors straight through the kept connections (clusterctl/ops/control.py `ask(direct=)`):
the control endpoints `start` keeps (what is kept, what is refused, the file's privacy), and the orchestration
against stand-in masters: who is asked directly, who with the line, who with the agent alone, who is forgotten,
and the caller's deadline. The real path (sshd, a bastion, a non-root login) is in
tests/integration/test_control_socket.py."""

from __future__ import annotations

import json
import os
import stat
import time

import pytest
from test_transport_muxfwd import CLIENT, SERVER, FwdMaster

from clusterctl.ops import control
from clusterctl.ops.control import Direct, ask, forget, recall, remember
from clusterctl.transport.base import Result
from clusterctl.transport.host import Host

JOB = "direct-job"
ENTRY = {"port": 41000, "client": CLIENT, "server": SERVER}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "clusterctl" / "control"


def host(i: int) -> Host:
    return Host(address=f"10.9.0.{i}", port=22, user="u", index=i)


def test_start_keeps_only_valid_endpoints_and_only_their_three_fields(cache):
    remember(JOB, {host(0): {**ENTRY, "extra": "x" * 1000}, host(1): {**ENTRY, "port": True},
                   host(2): {**ENTRY, "port": 70000}, host(3): {**ENTRY, "client": "not hex!" * 4},
                   host(4): {**ENTRY, "server": "ab"}, host(5): "garbage"})
    path = cache / f"{JOB}.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert recall(JOB) == {"u@10.9.0.0:22": ENTRY}
    assert json.loads(path.read_text()) == {"u@10.9.0.0:22": ENTRY}


def test_a_file_others_could_read_or_a_strange_job_name_is_a_miss(cache):
    remember(JOB, {host(0): ENTRY})
    os.chmod(cache / f"{JOB}.json", 0o644)
    assert recall(JOB) == {}
    for name in ("../escape", ".hidden", "a/b", ""):
        remember(name, {host(0): ENTRY})
        assert recall(name) == {}
    assert sorted(os.listdir(cache)) == [f"{JOB}.json"]


def test_a_start_removes_the_files_of_jobs_started_a_month_ago(cache):
    remember("old-job", {host(0): ENTRY})
    remember("recent-job", {host(0): ENTRY})
    month = time.time() - (control.STALE_DAYS + 1) * 86400
    os.utime(cache / "old-job.json", (month, month))
    remember(JOB, {host(0): ENTRY})
    assert sorted(os.listdir(cache)) == [f"{JOB}.json", "recent-job.json"]


def test_forget_drops_the_hosts_named_and_the_file_with_the_last(cache):
    remember(JOB, {host(0): ENTRY, host(1): ENTRY})
    forget(JOB, [host(1)])
    assert list(recall(JOB)) == ["u@10.9.0.0:22"]
    forget(JOB, [host(0)])
    assert not (cache / f"{JOB}.json").exists()
    remember(JOB, {host(0): ENTRY, host(1): ENTRY})
    forget(JOB)
    assert not (cache / f"{JOB}.json").exists()


class StubRemote:
    """The two things ask() needs of a Remote: each host's kept connection, and the line run on some hosts (recorded;
    each host answers with the command it was given)."""

    def __init__(self, hosts, kept):
        self.hosts, self.kept, self.runs = tuple(hosts), kept, []

    def kept_control(self, h):
        return self.kept.get(h)

    def run(self, command, *, hosts, check, timeout, what, on_line, max_output=None, until=None):
        self.runs.append(({h.address: command(h) if callable(command) else command for h in hosts}, timeout))
        return {h: Result(h, "line", 0, json.dumps({"via": command(h) if callable(command) else command}), "", 0.0)
                for h in hosts}


def test_each_host_is_asked_the_fastest_way_that_works_and_the_failed_ones_are_forgotten(tmp_path, monkeypatch):
    monkeypatch.setattr(control, "CLIENT_HEADER_TIMEOUT", 0.5)
    hosts = [host(i) for i in range(6)]
    modes = {0: "ok", 1: "refuse", 2: "wrong", 3: "silent", 5: "gone"}  # host 4: no kept endpoint
    masters = {i: FwdMaster(str(tmp_path / f"m{i}"), mode, body=b'{"via": "direct"}\n') for i, mode in modes.items()}
    try:
        remember(JOB, {hosts[i]: ENTRY for i in modes})
        remote = StubRemote(hosts, {hosts[i]: m.path for i, m in masters.items()})
        t0 = time.monotonic()
        out = ask(remote, "LINE", timeout=30, what="status", direct=Direct(JOB, "top", {"progress_only": True},
                                                                             ["top", "JOBDIR"]))
        took = time.monotonic() - t0
    finally:
        for m in masters.values():
            m.close()
    assert list(out) == hosts
    via = {h.address: json.loads(r.stdout)["via"] for h, r in out.items()}
    assert via["10.9.0.0"] == "direct" and masters[0].seen["request"] == (
        f'{CLIENT} top {{"progress_only":true}}\n'.encode())
    # refused, a stranger's answer, no entry, the master gone: the line
    assert via["10.9.0.1"] == via["10.9.0.2"] == via["10.9.0.4"] == via["10.9.0.5"] == "LINE"
    assert via["10.9.0.3"].endswith("agent top JOBDIR") and "exec " in via["10.9.0.3"]  # too slow: the agent alone
    # refused or not ours: forgotten; slow, or the master's trouble: kept
    assert sorted(recall(JOB)) == ["u@10.9.0.0:22", "u@10.9.0.3:22", "u@10.9.0.5:22"]
    (beside, t_beside), (again, t_again) = sorted(remote.runs, key=lambda r: len(r[0]))
    assert list(beside) == ["10.9.0.4"] and t_beside == 30  # asked with the line while the others were asked directly
    assert sorted(again) == ["10.9.0.1", "10.9.0.2", "10.9.0.3", "10.9.0.5"] and t_again < 30 - 0.4  # the time left
    assert took < 5


def test_without_kept_connections_or_entries_or_a_deadline_everything_goes_by_the_line(tmp_path):
    hosts = [host(0), host(1)]
    d = Direct(JOB, "status", None, ["status", "JOBDIR"])
    remote = StubRemote(hosts, {})
    remember(JOB, {h: ENTRY for h in hosts})
    ask(remote, "LINE", timeout=10, what="status", direct=d)  # no kept connection
    remote.kept = {h: str(tmp_path / "nothing") for h in hosts}
    ask(remote, "LINE", timeout=None, what="logs", direct=d)  # no deadline (a follow)
    forget(JOB)
    ask(remote, "LINE", timeout=10, what="status", direct=d)  # no entries
    assert [list(r[0].values()) for r in remote.runs] == [["LINE", "LINE"]] * 3


def test_a_callers_line_callback_gets_a_direct_answers_lines_and_an_answer_too_long_goes_by_the_line(tmp_path,
                                                                                                 monkeypatch):
    # `logs -n N`: a request that names its host; the lines passed on as the line would have streamed them
    monkeypatch.setattr(control, "DIRECT_MAX_BODY", 1 << 20)
    hosts = [host(0), host(1)]
    masters = [FwdMaster(str(tmp_path / "m0"), body=b"[a trainer.0] one\r\n[a trainer.0] tw\ro\n"),
               FwdMaster(str(tmp_path / "m1"), "huge")]
    seen: list = []
    try:
        remember(JOB, {h: ENTRY for h in hosts})
        remote = StubRemote(hosts, {h: m.path for h, m in zip(hosts, masters)})
        direct = Direct(JOB, "logs", lambda h: {"host_label": h.address, "lines": 2}, lambda h: ["logs", h.address])
        out = ask(remote, lambda h: f"LINE {h.address}", timeout=30, what="logs", direct=direct,
                  on_line=lambda h, stream, text: seen.append((h.address, stream, text)))
    finally:
        for m in masters:
            m.close()
    assert masters[0].seen["request"] == f'{CLIENT} logs {{"host_label":"10.9.0.0","lines":2}}\n'.encode()
    # split as the line's output is (LineSplitter: at each LF, one CR before it dropped, a lone CR kept)
    assert seen == [("10.9.0.0", "out", "[a trainer.0] one"), ("10.9.0.0", "out", "[a trainer.0] tw\ro")]
    assert out[hosts[0]].exit_code == 0
    assert [r[0] for r in remote.runs] == [{"10.9.0.1": "LINE 10.9.0.1"}]  # over the limit: asked again by the line
    assert sorted(recall(JOB)) == ["u@10.9.0.0:22", "u@10.9.0.1:22"]  # the supervisor that said too much is kept
