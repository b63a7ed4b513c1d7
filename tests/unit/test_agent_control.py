"""The supervisor's control socket (clusterctl/host/control.py) in this process: the request line, the secret, the
flood limits, and each command's answer (status, top, stop, logs) against a real Supervisor whose processes are
quick python3 one-liners, stepped by the test; and the controller's bash one-liner (clusterctl/ops/control.py)
against it, with the host's `python3` counted: the agent runs only where the supervisor cannot answer."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from clusterctl.host import control, metrics
from clusterctl.host.control import (CONTROL_FILE, MAX_LOG_CLIENTS, MAX_PENDING, MAX_REQUEST, ControlServer,
                                     RequestError, parse_request, read_control)
from clusterctl.host.jobdir import describe
from clusterctl.ops.control import NEEDS_PACKAGE, control_command
from clusterctl.ops.hosttools import HOST_PACKAGE, package_dir
from test_agent_supervisor import Clock, quick, run_until, state_file, supervisor

HOST_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "clusterctl",
                        "host")
SLEEP = "import time; time.sleep(60)"
ROUNDS = 3000  # supervisor rounds a test waits at most (each at most its tick, 0.01 s, plus the machine's load)


def served(tmp_path, processes=(("trainer", 0, quick(SLEEP)),), clock=None):
    """A running single-host supervisor in this process with its control socket open."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    sup = supervisor(tmp_path, processes, clock=clock)
    sup._start_attempt()
    sup.control = ControlServer.start(sup)
    assert sup.control.listener is not None
    return sup


def secrets_of(sup):
    pid, port, client, server = read_control(sup.jobdir)
    assert pid == os.getpid() and port == sup.control.port
    return port, client, server


class Client:
    """A raw connection to the control socket, read while the supervisor is stepped."""

    def __init__(self, sup, payload=b""):
        self.sup = sup
        self.sock = socket.create_connection(("127.0.0.1", sup.control.port), timeout=5)
        if payload:
            self.sock.sendall(payload)
        self.sock.setblocking(False)
        self.data = b""
        self.eof = False

    def pump(self):
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    self.eof = True
                    return
                self.data += chunk
        except BlockingIOError:
            return
        except ConnectionResetError:
            self.eof = True

    def until(self, pred, rounds=ROUNDS, step=True):
        for _ in range(rounds):
            if step:
                self.sup.step()
            else:
                time.sleep(0.01)
            self.pump()
            if pred(self):
                return self
        raise AssertionError("no answer: %r (eof %s)" % (self.data[:300], self.eof))

    def close(self):
        self.sock.close()


def ask(sup, line, **kw):
    """Send one request line with the right secret; the whole answer once the supervisor closes."""
    _, client, _ = secrets_of(sup)
    c = Client(sup, client.encode() + b" " + line + b"\n")
    c.until(lambda c: c.eof, **kw)
    c.close()
    return c.data


def header_and_body(sup, data):
    _, _, server = secrets_of(sup)
    head, _, body = data.partition(b"\n")
    assert head == b"ok " + server.encode(), data[:200]
    return body


def plain(st):
    """A status reply without what moves with the clock."""
    st = dict(st)
    st.pop("updated_at", None)
    st["processes"] = [{k: v for k, v in p.items() if k != "uptime_s"} for p in st["processes"]]
    return st


# ------------------------------------------------------------------------------------------------ the request


@pytest.mark.parametrize("rest, expected", [
    (b"status", ("status", {})),
    (b"status {}", ("status", {})),
    (b'top {"progress_only":true,"slice":2.0,"slices":6,"gpu":false}',
     ("top", {"progress_only": True, "slice": 2.0, "slices": 6, "gpu": False})),
    (b'stop {"grace":2.5}', ("stop", {"grace": 2.5})),
    (b'logs {"follow":true,"role":"trainer","id":3,"lines":10,"host_label":"node0"}',
     ("logs", {"follow": True, "role": "trainer", "id": 3, "lines": 10, "host_label": "node0"})),
])
def test_a_request_names_a_command_and_its_arguments(rest, expected):
    assert parse_request(rest) == expected


@pytest.mark.parametrize("rest, message", [
    (b"launch", "unknown command 'launch'"),
    (b"", "unknown command ''"),
    (b"status [1]", "arguments are not a JSON object"),
    (b"status {", "arguments are not JSON"),
    (b"top " + b"[" * 3000 + b"]" * 3000, "arguments are not JSON"),
    (b'status {"x":1}', "status: unknown argument(s) x"),
    (b'top {"slices":61}', "top: slices must be 0..60"),
    (b'top {"slice":0.1}', "top: slice must be 0.5..600 seconds"),
    (b'top {"gpu":"yes"}', "top: gpu must be true or false"),
    (b'stop {"grace":-1}', "stop: grace must be 0..86400 seconds"),
    (b'stop {"grace":NaN}', "stop: grace must be 0..86400 seconds"),
    (b'logs {"role":"worker"}', "logs: role must be one of pserver/trainer"),
    (b'logs {"id":true}', "logs: id must be an integer >= 0"),
    (b'logs {"lines":-2}', "logs: lines must be an integer >= 0"),
    (b'logs {"host_label":"a\\nb"}', "logs: host_label must be 1..255 printable characters"),
    (b"status \xff", "request is not UTF-8"),
])
def test_a_request_the_supervisor_does_not_serve_is_named(rest, message):
    with pytest.raises(RequestError) as info:
        parse_request(rest)
    assert str(info.value) == message


# ------------------------------------------------------------------------------------------------ the listener


def test_the_control_file_is_private_and_names_this_supervisor(tmp_path):
    sup = served(tmp_path)
    path = os.path.join(sup.jobdir, CONTROL_FILE)
    assert os.stat(path).st_mode & 0o777 == 0o600
    words = open(path).read().split()
    assert words[:3] == ["1", str(os.getpid()), str(sup.control.port)]
    assert len(words[3]) == len(words[4]) == 64 and words[3] != words[4]
    assert sup.control.listener.getsockname()[0] == "127.0.0.1"
    sup.control.close()
    assert not os.path.exists(path)


def test_status_is_agent_status_reply(tmp_path):
    sup = served(tmp_path)
    body = header_and_body(sup, ask(sup, b"status"))
    assert body.endswith(b"\n") and body.count(b"\n") == 1
    got = json.loads(body)
    sup.write_state()
    assert plain(got) == plain(describe(state_file(sup)))  # what `agent status` prints from state.json
    assert got["state"] == "running" and got["supervisor"] == {"pid": os.getpid(), "alive": True}


def test_a_wrong_secret_or_a_line_too_long_gets_no_answer_and_is_counted(tmp_path):
    sup = served(tmp_path)
    port, client, server = secrets_of(sup)
    wrong = Client(sup, b"0" * 64 + b" status\n").until(lambda c: c.eof)
    prefix = Client(sup, client[:-1].encode() + b" status\n").until(lambda c: c.eof)  # one character short
    long = Client(sup, client.encode() + b" status " + b"x" * MAX_REQUEST + b"\n").until(lambda c: c.eof)
    assert (wrong.data, prefix.data, long.data) == (b"", b"", b"")
    assert sup.control.counts["rejected"] == 3 and sup.control.counts["garbage"] == 1
    # an authenticated request that is not served says why (the client falls back to the agent)
    assert ask(sup, b"launch") == b"error unknown command 'launch'\n"
    assert json.loads(header_and_body(sup, ask(sup, b"status")))["state"] == "running"


def test_a_flood_of_idle_connections_evicts_the_oldest_and_a_client_still_gets_in(tmp_path):
    clock = Clock()
    sup = served(tmp_path, clock=clock)
    idle = [socket.create_connection(("127.0.0.1", sup.control.port)) for _ in range(3 * MAX_PENDING)]
    try:
        for _ in range(20):
            sup.step()
        assert len(sup.control.pending) <= MAX_PENDING
        assert sup.control.counts["evicted"] == 3 * MAX_PENDING - len(sup.control.pending)
        assert json.loads(header_and_body(sup, ask(sup, b"status")))["state"] == "running"
        # the rest are dropped once their time to authenticate is over (the supervisor's clock)
        clock.t += control.AUTH_TIMEOUT + 0.1
        sup.step()
        assert sup.control.pending == {}
    finally:
        for s in idle:
            s.close()


def test_accept_errors_evict_the_oldest_then_pause_accepting(tmp_path):
    clock = Clock()
    sup = served(tmp_path, clock=clock)
    server = sup.control
    idle = socket.create_connection(("127.0.0.1", server.port))
    try:
        run_until(sup, lambda: len(server.pending) == 1)

        class Exhausted:
            def accept(self):
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

        server._on_accept(Exhausted())  # the first error makes room, the next pauses accepting
        assert server.pending == {} and server.counts["evicted"] == 1 and server.counts["accept_errors"] == 2
        assert server.accept_paused_until == clock.t + control.ACCEPT_PAUSE
        clock.t += control.ACCEPT_PAUSE + 0.01
        sup.step()
        assert server.accept_paused_until is None
        assert json.loads(header_and_body(sup, ask(sup, b"status")))["state"] == "running"
    finally:
        idle.close()


# ------------------------------------------------------------------------------------------------ the commands


def test_stop_answers_once_the_stop_is_done_with_agent_stops_reply_and_reports_the_kills_once(tmp_path):
    sup = served(tmp_path, processes=[("trainer", 0, quick(SLEEP)), ("trainer", 1, quick(SLEEP))])
    pids = set(sup.procs.pids().values())
    _, client, server = secrets_of(sup)
    c = Client(sup, client.encode() + b' stop {"grace":1}\n')
    c.until(lambda c: c.data.endswith(b"\n"))  # the header at once ...
    assert c.data == b"ok " + server.encode() + b"\n" and not c.eof
    c.until(lambda c: c.eof)  # ... the reply once the processes are stopped
    reply = json.loads(header_and_body(sup, c.data))
    assert {k["pid"] for k in reply["killed"]} == pids and len(reply["killed"]) == 2
    assert {(k["role"], k["id"], k["via"], k["signal"]) for k in reply["killed"]} == {
        ("trainer", 0, "killpg", "SIGTERM"), ("trainer", 1, "killpg", "SIGTERM")}
    assert {k: v for k, v in reply.items() if k != "killed"} == {
        "ok": True, "was_running": True, "job": "job-sup", "jobdir": str(tmp_path), "state": "stopped",
        "reason": "stop requested on hA", "supervisor": "answered", "left": []}
    with open(tmp_path / "stop-request.json") as f:
        assert json.load(f)["grace"] == 1
    sup.step()
    assert state_file(sup)["stop"]["reported"] is True  # `agent stop` will not report them again
    again = json.loads(header_and_body(sup, ask(sup, b'stop {"grace":1}')))
    assert again["killed"] == [] and again["ok"] is True and again["was_running"] is False  # nothing left to stop


def test_top_waits_its_baseline_interval_from_when_the_baseline_was_taken(tmp_path, monkeypatch):
    """On a loaded machine the baseline's own scan of /proc may take most of the wait: the answer's sample then came
    within 0.05 s of it, too close to measure, and every CPU % was None (one suite run under two CPU burners)."""
    real, scans = metrics.scan_procs, []

    def slow_first_scan(*a, **kw):
        scans.append(time.monotonic())
        if len(scans) == 1:
            time.sleep(control.TOP_BASELINE_WAIT + 0.05)  # the baseline's scan
        return real(*a, **kw)

    monkeypatch.setattr(metrics, "scan_procs", slow_first_scan)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no nvidia-smi: nothing else to wait for
    sup = served(tmp_path)
    try:
        reply = json.loads(header_and_body(sup, ask(sup, b'top {"slices":6}')))
        assert reply["processes"][0]["resources"]["cpu_pct"] is not None, reply["processes"][0]
        assert scans[1] - scans[0] >= 2 * control.TOP_BASELINE_WAIT  # the slow scan, then the whole wait
    finally:
        sup.control.close()


def test_top_waits_for_a_cpu_baseline_without_blocking_and_runs_nvidia_smi_off_the_loop(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text("#!/bin/sh\ncase \"$1\" in\n  --query-gpu=*) printf '0, GPU-aaaa, 7, 100, 16000\\n';;\n"
                    "  --query-compute-apps=*) ;;\nesac\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", "%s:%s" % (bin_dir, os.environ["PATH"]))
    threads = []
    real = metrics.query_gpus

    def query(exe, timeout=metrics.GPU_TIMEOUT_S):
        threads.append(threading.current_thread().name)
        return real(exe, timeout)

    monkeypatch.setattr(metrics, "query_gpus", query)
    sup = served(tmp_path)
    try:
        t0 = time.monotonic()
        reply = json.loads(header_and_body(sup, ask(sup, b'top {"slices":6}')))
        assert time.monotonic() - t0 >= control.TOP_BASELINE_WAIT
        (p,) = reply["processes"]
        assert p["resources"]["cpu_pct"] is not None and p["resources"]["procs"] == 1
        assert [g["index"] for g in reply["host_figures"]["gpus"]] == [0]
        assert threads and set(threads) == {"gpu-watch"}  # never on the loop's thread
        # a refresh: the last sample is the baseline, the latest nvidia-smi answer is used at once
        reply = json.loads(header_and_body(sup, ask(sup, b'top {"slices":6,"gpu":false}')))
        assert "gpus" not in reply["host_figures"] and reply["processes"][0]["resources"]["rss_bytes"] > 0
        # what status asks: progress only, no sampling
        reply = json.loads(header_and_body(sup, ask(sup, b'top {"progress_only":true}')))
        assert "resources" not in reply["processes"][0] and "host_figures" not in reply
    finally:
        sup.control.close()


def test_logs_are_streamed_with_the_agents_prefixes_and_a_follow_ends_with_the_job(tmp_path):
    code = "import time\nfor i in range(3): print('line', i, flush=True)\ntime.sleep(60)\n"
    sup = served(tmp_path, processes=[("trainer", 0, quick(code)), ("trainer", 1, quick(SLEEP))])
    log0 = tmp_path / "trainer.0.log"
    run_until(sup, lambda: log0.exists() and log0.read_bytes().count(b"\n") == 3)
    body = header_and_body(sup, ask(sup, b'logs {"host_label":"node7","role":"trainer","id":0}'))
    assert body == b"[node7 trainer.0] line 0\n[node7 trainer.0] line 1\n[node7 trainer.0] line 2\n"
    body = header_and_body(sup, ask(sup, b'logs {"lines":1}'))
    assert body == b"[hA trainer.0] line 2\n"
    body = header_and_body(sup, ask(sup, b'logs {"id":9}'))
    assert json.loads(body) == {"ok": False, "error": "no process matches role=None id=9 in %s" % tmp_path}
    # --follow: until the job is over; at most MAX_LOG_CLIENTS at once
    _, client, _ = secrets_of(sup)
    followers = [Client(sup, client.encode() + b' logs {"follow":true,"id":0}\n') for _ in range(MAX_LOG_CLIENTS)]
    for f in followers:
        f.until(lambda c: c.data.count(b"\n") == 4)
    assert ask(sup, b'logs {"follow":true}') == b"error busy: %d log clients\n" % MAX_LOG_CLIENTS
    assert not any(f.eof for f in followers)
    stopper = Client(sup, client.encode() + b' stop {"grace":1}\n')
    stopper.until(lambda c: c.eof)
    for f in followers:
        f.until(lambda c: c.eof, step=False)
        assert header_and_body(sup, f.data) == b"[hA trainer.0] line 0\n[hA trainer.0] line 1\n[hA trainer.0] line 2\n"
    for t in sup.control.log_threads:
        t.join(10)
        assert not t.is_alive()


def test_closing_answers_a_waiting_stop_and_removes_the_control_file(tmp_path):
    sup = served(tmp_path)
    _, client, _ = secrets_of(sup)
    c = Client(sup, client.encode() + b' stop {"grace":0}\n')
    assert run_until(sup, lambda: sup.core.stop_done)
    sup.control.close()  # as at the supervisor's exit: whatever waits is answered first
    c.until(lambda c: c.eof, step=False)
    assert json.loads(header_and_body_after_close(c.data))["state"] == "stopped"
    assert not os.path.exists(os.path.join(sup.jobdir, CONTROL_FILE))


def test_closing_serves_the_requests_of_clients_that_connected_before_it_and_drops_the_silent_ones(tmp_path):
    """A `stop` that reaches a host just after the job ended there (the coordinator's broadcast came first) is
    answered by the closing supervisor, not refused: refused, the host would start Python for `agent stop`."""
    sup = served(tmp_path)
    sup.term_requested = True  # the job ends here before the clients below come
    assert run_until(sup, lambda: sup.core.stop_done)
    _, client, _ = secrets_of(sup)
    stop = Client(sup, client.encode() + b' stop {"grace":0}\n')  # in the listener's backlog: never accepted
    status = Client(sup, client.encode() + b" status\n")
    silent = Client(sup)  # connects, says nothing
    t0 = time.monotonic()
    sup.control.close()
    assert time.monotonic() - t0 < control.LAST_REQUEST_S + 5
    stop.until(lambda c: c.eof, step=False)
    assert json.loads(header_and_body_after_close(stop.data))["state"] == "stopped"
    status.until(lambda c: c.eof, step=False)
    assert json.loads(header_and_body_after_close(status.data))["state"] == "stopped"
    silent.until(lambda c: c.eof, step=False)
    assert silent.data == b""
    assert sup.control.counts["answered"] == 2 and sup.control.counts["rejected"] == 1


def header_and_body_after_close(data):
    head, _, body = data.partition(b"\n")
    assert head.startswith(b"ok ")
    return body


# ------------------------------------------------------------------------------------------------ the bash client


def home_with_package(tmp_path, sup=None):
    """A home directory with this version of the host package (as `agent up` leaves it), and a `python3` that
    counts its starts; the job dir is <home>/.clusterctl/jobs/job-sup (a link to the supervisor's)."""
    home = tmp_path / "home"
    pkg = home / package_dir() / HOST_PACKAGE
    shutil.copytree(HOST_DIR, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    jobs = home / ".clusterctl" / "jobs"
    jobs.mkdir(parents=True)
    if sup is not None:
        os.symlink(sup.jobdir, jobs / "job-sup")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "python3"
    shim.write_text('#!/bin/sh\necho "$*" >> %s/python-starts\nexec %s "$@"\n'
                    % (tmp_path, os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)))
    shim.chmod(0o755)
    return home, {"PATH": "%s:/usr/bin:/bin" % bin_dir, "HOME": str(home)}


def run_client(sup, home, env, command, args, fallback, shell="sh"):
    """The controller's one-liner in `home`, the supervisor stepped meanwhile; (exit code, stdout)."""
    cmd = control_command(".clusterctl/jobs/job-sup", command, args, fallback)
    p = subprocess.Popen([shell, "-c", cmd], cwd=home, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = []
    reader = threading.Thread(target=lambda: out.append(p.stdout.read()))
    reader.start()
    deadline = time.monotonic() + 60
    while p.poll() is None and time.monotonic() < deadline:
        if sup is not None:
            sup.step()
        else:
            time.sleep(0.01)
    reader.join(10)
    assert p.poll() is not None, "the client did not end"
    return p.returncode, out[0], p.stderr.read()


def starts(tmp_path):
    path = tmp_path / "python-starts"
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.parametrize("login", ["sh", "bash"])  # a login shell that is not bash hands the line to bash
def test_the_bash_client_is_answered_by_the_supervisor_with_no_python_start(tmp_path, login):
    sup = served(tmp_path / "job")
    home, env = home_with_package(tmp_path, sup)
    code, out, err = run_client(sup, home, env, "status", None, ["status", ".clusterctl/jobs/job-sup"], shell=login)
    assert (code, err) == (0, b"") and json.loads(out)["state"] == "running"
    code, out, _ = run_client(sup, home, env, "top", {"progress_only": True},
                              ["top", ".clusterctl/jobs/job-sup", "--progress-only"], shell=login)
    assert code == 0 and json.loads(out)["processes"][0]["progress"] is None
    assert starts(tmp_path) == []
    # the secrets are in no argv: the command line carries neither
    _, client, server = secrets_of(sup)
    cmd = control_command(".clusterctl/jobs/job-sup", "status", None, ["status", ".clusterctl/jobs/job-sup"])
    assert client not in cmd and server not in cmd
    code, out, _ = run_client(sup, home, env, "stop", {"grace": 1},
                              ["stop", ".clusterctl/jobs/job-sup", "--grace", "1", "--job", "job-sup"], shell=login)
    reply = json.loads(out)
    assert code == 0 and reply["supervisor"] == "answered" and len(reply["killed"]) == 1
    assert starts(tmp_path) == []


def test_the_bash_client_falls_back_to_the_agent_where_the_supervisor_cannot_answer(tmp_path):
    sup = served(tmp_path / "job")
    home, env = home_with_package(tmp_path, sup)
    sup.write_state()
    fallback = ["status", ".clusterctl/jobs/job-sup"]
    # a request the supervisor refuses: the agent answers (and says what is wrong, as it always did)
    code, out, _ = run_client(sup, home, env, "top", {"slices": 99}, ["top", ".clusterctl/jobs/job-sup", "--slices", "99"])
    assert (code, json.loads(out)) == (2, {"ok": False, "error": "agent.py top: --slices must be 0..60 and --slice "
                                                                 "0.5..600 seconds"})
    assert len(starts(tmp_path)) == 1
    # no bash on the host: the login shell (a POSIX sh) runs the agent
    code, out, _ = run_client(sup, home, dict(env, PATH=str(tmp_path / "bin")), "status", None, fallback,
                              shell="/bin/sh")
    assert code == 0 and json.loads(out)["state"] == "running" and len(starts(tmp_path)) == 2, (code, out, _)
    # an impostor on the port (the supervisor gone, its pid and port taken): no `ok SERVER_SECRET`, the agent runs
    sup.control.close()
    impostor = socket.create_server(("127.0.0.1", 0))
    pid, port, client, server = os.getpid(), impostor.getsockname()[1], "c" * 64, "s" * 64
    (tmp_path / "job" / CONTROL_FILE).write_text("1 %d %d %s %s\n" % (pid, port, client, server))
    heard = []

    def answer():
        conn, _ = impostor.accept()
        heard.append(conn.recv(4096))
        conn.sendall(b"ok not-the-secret\n{\"state\": \"succeeded\"}\n")
        conn.close()

    t = threading.Thread(target=answer)
    t.start()
    before = len(starts(tmp_path))
    code, out, _ = run_client(None, home, env, "status", None, fallback)
    t.join(10)
    impostor.close()
    assert heard == [b"c" * 64 + b" status\n"]
    assert code == 0 and json.loads(out)["state"] == "running" and len(starts(tmp_path)) == before + 1
    # a stale control file (a dead pid): no connection at all
    (tmp_path / "job" / CONTROL_FILE).write_text("1 999999999 1 %s %s\n" % (client, server))
    code, out, _ = run_client(None, home, env, "status", None, fallback)
    assert code == 0 and json.loads(out)["job"] == "job-sup" and len(starts(tmp_path)) == before + 2
    # no control file, and no host package: nothing runs, the controller installs it and asks again
    os.unlink(tmp_path / "job" / CONTROL_FILE)
    shutil.rmtree(home / package_dir())
    code, out, _ = run_client(None, home, env, "status", None, fallback)
    assert (code, out) == (NEEDS_PACKAGE, b"") and len(starts(tmp_path)) == before + 2
