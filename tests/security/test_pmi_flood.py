"""The PMI server under a flood (issue 21): idle connections, garbage, blank lines and spawn messages before
authentication, file descriptors run out, while a real MPI world starts and finishes.

Before: 1,100 idle sockets (RLIMIT_NOFILE 1024) made accept raise EMFILE, which ended the server and no
rank could join; ``mcmd=`` was handled before the auth check, and 4 connections of blank lines cost 42 s
of CPU. Every attack here runs against the real server process (``python -m clusterctl.collective.pmi``,
as rank 0 starts it) or the real server class, on loopback.
"""

from __future__ import annotations

import os
import random
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import free_port, job_pids

from clusterctl.collective.pmi import PMIServer, format_command, parse_command
from clusterctl.collective.pmiclient import register
from clusterctl.plan import make_plan
from clusterctl.spec import parse_spec

pytest.importorskip("mpi4py")

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "pmi_flood_worker.py"
TOKEN = "f100d" * 13


def _proc_usage(pid: int) -> tuple[float, int] | None:
    """(CPU seconds, peak RSS bytes) of a live process, from /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    hwm = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:"))
    return cpu, hwm


def _server_pid(parent: int) -> int | None:
    """The PMI server child of rank 0 (python -m clusterctl.collective.pmi)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
            cmd = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[1]) == parent and b"clusterctl.collective.pmi" in cmd:
            return int(name)
    return None


class Flood:
    """Idle connections and garbage against ``port``, from threads, until told to stop (or the quota is met)."""

    def __init__(self, port: int, *, idle: int, garbage: int):
        self.port, self.idle_quota, self.garbage_quota = port, idle, garbage
        self.idle: list[socket.socket] = []
        self.idle_connects = 0
        self.garbage_sent = 0
        self.garbage_conns = 0
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._idle, daemon=True)] + [
            threading.Thread(target=self._garbage, args=(i,), daemon=True) for i in range(4)]

    def start(self) -> "Flood":
        for t in self.threads:
            t.start()
        return self

    def _connect(self) -> socket.socket | None:
        try:
            return socket.create_connection(("127.0.0.1", self.port), timeout=2)
        except OSError:
            time.sleep(0.02)    # not listening yet, or the backlog is full
            return None

    def arrived(self) -> bool:
        """Both quotas met (the flood goes on until stopped)."""
        return self.idle_connects >= self.idle_quota and self.garbage_sent >= self.garbage_quota

    def _idle(self) -> None:
        while not self.stop.is_set():
            s = self._connect()
            if s is not None:
                self.idle.append(s)     # held open, never a byte sent
                self.idle_connects += 1
                if len(self.idle) > 4000:               # the server closed the old ones long ago
                    for old in self.idle[:2000]:
                        old.close()
                    del self.idle[:2000]

    def _garbage(self, i: int) -> None:
        rnd = random.Random(i)
        chunks = [b"\n" * 65536,                                       # blank lines
                  b"mcmd=spawn\n" + b"nprocs=1\n" * 7000,              # a spawn message before auth
                  bytes(rnd.getrandbits(8) for _ in range(65536)),      # noise
                  b"cmd=get_maxes" + b"x" * 65536,                       # a line that never ends
                  b"cmd=barrier_in\n" * 4000]
        while not self.stop.is_set():
            s = self._connect()
            if s is None:
                continue
            with self._lock:
                self.garbage_conns += 1
            try:
                while not self.stop.is_set():
                    chunk = rnd.choice(chunks)
                    s.sendall(chunk)
                    with self._lock:
                        self.garbage_sent += len(chunk)
                    if self.garbage_sent >= self.garbage_quota:
                        time.sleep(0.05)    # the quota arrived: a trickle until the world is done
            except OSError:
                pass            # dropped by the server: what it should do
            finally:
                s.close()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)
        for s in self.idle:
            s.close()


def _low_nofile():
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


@pytest.mark.timeout(240)
def test_a_world_starts_and_finishes_under_2000_idle_connections_and_100_mb_of_garbage(tmp_path):
    """Three real ranks (pmi_flood_worker.py: join, allreduce, then, once the flood has arrived in full,
    allreduce, barrier, finalize) with RLIMIT_NOFILE 1024, as in the finding, while 2,000 idle connections
    and 100 MB of garbage arrive; the flood goes on until the ranks have exited."""
    port = free_port()
    spec = parse_spec(f"""
name: pmiflood
hosts: [{{address: 127.0.0.1}}]
job:
  entrypoint: [{sys.executable}, {WORKER}, {tmp_path / "GO"}]
  trainers: 3
  ports: {{trainer: {free_port()}, master: {port}, control: {free_port()}}}
""")
    plan = make_plan(spec)
    flood = Flood(port, idle=2000, garbage=100 * 1024 * 1024).start()
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")}
    procs = []
    peak_cpu = peak_rss = 0.0
    server = None
    arrived_after = None
    t0 = time.monotonic()
    try:
        time.sleep(0.5)   # the flood is under way (connects are refused until rank 0 listens)
        for t in plan.trainers:
            env = {**base, **t.env, "CLUSTERCTL_JOB_TOKEN": TOKEN, "PYTHONPATH": str(ROOT), "UCX_LOG_LEVEL": "error",
                   "CLUSTERCTL_COLLECTIVE_TIMEOUT": "120"}
            procs.append(subprocess.Popen(list(t.argv), env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, preexec_fn=_low_nofile))
        outs: list[str] = [""] * len(procs)
        readers = [threading.Thread(target=lambda i=i: outs.__setitem__(i, procs[i].stdout.read()), daemon=True)
                   for i in range(len(procs))]
        for r in readers:
            r.start()
        deadline = time.monotonic() + 180
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if flood.arrived() and not (tmp_path / "GO").exists():
                (tmp_path / "GO").touch()
                arrived_after = time.monotonic() - t0
            server = server or _server_pid(procs[0].pid)
            usage = _proc_usage(server) if server else None
            if usage:
                peak_cpu, peak_rss = max(peak_cpu, usage[0]), max(peak_rss, usage[1])
            time.sleep(0.1)
        took = time.monotonic() - t0
        for r in readers:
            r.join(30)
    finally:
        flood.finish()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode} after {took:.0f}s:\n{out[-3000:]}"
        assert f"joined rank {r}/3" in out and f"ok rank {r}/3 pid {p.pid} go=True" in out, out[-3000:]
    # the attack happened, in full, while the world ran
    assert flood.idle_connects >= 2000, flood.idle_connects
    assert flood.garbage_sent >= 100 * 1024 * 1024 and flood.garbage_conns >= 4
    assert server is not None and arrived_after is not None
    print(f"flood arrived in {arrived_after:.1f}s; world done in {took:.1f}s; {flood.idle_connects} idle connects, "
          f"{flood.garbage_sent >> 20} MB of garbage over {flood.garbage_conns} connections; server CPU "
          f"{peak_cpu:.1f}s, peak RSS {peak_rss / 2**20:.0f} MiB")
    # bounded: memory of a small Python process, CPU well under the run's wall time
    assert peak_rss < 150 * 1024 * 1024, f"server peak RSS {peak_rss / 2**20:.0f} MiB"
    assert peak_cpu < max(20.0, took / 2), f"server CPU {peak_cpu:.1f}s in {took:.1f}s"
    # ... and its log stays short: warnings are rate-limited (10 per 10 s, the rest counted)
    warnings = [ln for ln in outs[0].splitlines() if ln.startswith("clusterctl.collective PMI server: ")]
    assert len(warnings) <= 10 * (took / 10 + 2) + 5, len(warnings)
    assert any("evicted" in ln or "more warning(s)" in ln for ln in warnings), warnings[:20]
    assert not job_pids("pmiflood")


def _server_process(size: int, *, nofile: int | None = None, token: str = TOKEN):
    """The real server process on a free port; (proc, port)."""
    port = free_port()
    env = {**os.environ, "CLUSTERCTL_JOB_TOKEN": token, "PYTHONPATH": str(ROOT)}
    env.pop("CLUSTERCTL_AUTH", None)
    pre = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None
    proc = subprocess.Popen([sys.executable, "-m", "clusterctl.collective.pmi", "--host", "127.0.0.1", "--port",
                             str(port), "--size", str(size), "--timeout", "60"], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=pre)
    assert proc.stdout.readline().startswith(f"listening 127.0.0.1:{port} ")
    return proc, port


def _register_all(port: int, size: int, timeout: float = 30) -> dict:
    got: dict = {}

    def one(r):
        try:
            got[r] = register("127.0.0.1", port, rank=r, size=size, timeout=timeout)
        except Exception as e:    # noqa: BLE001 - reported by the assertion below
            got[r] = e
    threads = [threading.Thread(target=one, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 15)
    return got


@pytest.mark.timeout(90)
def test_out_of_file_descriptors_is_contained(monkeypatch):
    """RLIMIT_NOFILE 64 and 300 idle connections: accept fails with EMFILE; the server evicts the oldest
    unauthenticated connection and goes on, and ranks still register."""
    monkeypatch.setenv("CLUSTERCTL_JOB_TOKEN", TOKEN)
    proc, port = _server_process(2, nofile=64)
    idle = []
    try:
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.5)
        got = _register_all(port, 2)
        assert all(isinstance(got[r], dict) and got[r]["rc"] == "0" for r in (0, 1)), got
        assert proc.poll() is None
    finally:
        for s in idle:
            s.close()
        proc.stdin.close()
        proc.wait(timeout=20)
        err = proc.stderr.read()
    assert "accept failed: Too many open files" in err, err[-2000:]
    assert proc.returncode == 0, err[-2000:]


def closed_by_peer(sock, timeout=5.0) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("CLUSTERCTL_JOB_TOKEN", TOKEN)
    made = []

    def make(size, **kw):
        s = PMIServer("127.0.0.1", free_port(), size, timeout=30, **kw).start()
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.mark.timeout(90)
def test_caps_evict_the_oldest_unauthenticated_connections(server):
    """64 per source address, 256 in all: older ones are closed as newer ones come (once 0.25 s old); an
    authenticated rank registers while the caps are full."""
    srv = server(1)
    first = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(64)]
    time.sleep(0.5)             # older than the 0.25 s an unauthenticated connection is spared
    later = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(8)]
    assert all(closed_by_peer(s) for s in first[:8])
    assert not any(closed_by_peer(s, timeout=0.3) for s in first[8:12] + later[:4])
    others = []
    for i in range(2, 8):        # other source addresses: 6 x 60 = 360, over the total cap of 256
        for _ in range(60):
            s = socket.socket()
            s.bind((f"127.0.0.{i}", 0))
            s.connect(("127.0.0.1", srv.port))
            others.append(s)
    deadline = time.monotonic() + 30
    while srv.accepted < 432 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.accepted == 432 and len(srv._unauth) <= 256
    # The server's thread counts an eviction just before it forgets the connection, and on a loaded machine the
    # oldest ones also reach the authentication deadline meanwhile: read the two between its operations.
    deadline = time.monotonic() + 10
    while srv.evicted + len(srv._unauth) != 432 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.evicted == 432 - len(srv._unauth) and srv.rejected == 0
    assert max(srv._per_source.values()) <= 64
    assert register("127.0.0.1", srv.port, rank=0, size=1, timeout=20)["rc"] == "0"
    for s in first + later + others:
        s.close()


@pytest.mark.timeout(60)
def test_an_idle_connection_must_authenticate_within_the_deadline(server):
    srv = server(1, auth_deadline=0.5)
    s = socket.create_connection(("127.0.0.1", srv.port))
    t0 = time.monotonic()
    assert closed_by_peer(s, timeout=10)
    assert 0.4 < time.monotonic() - t0 < 5
    assert srv.evicted == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("payload", [b"\n", b"\n" * 1000, b"mcmd=spawn\nnprocs=1\nexecname=/bin/sh\n",
                                     b"mcmd=spawn\n", b"cmd=put key=a value=b\n", b"cmd=clusterctl_hellox\n",
                                     b" cmd=initack pmiid=1\n", b"\xff" * 2000])
def test_nothing_is_parsed_before_authentication(server, payload):
    """Blank lines, a spawn message, a command: the first line decides, by its prefix, and the door closes."""
    srv = server(1)
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(payload)
    assert closed_by_peer(s)
    assert srv.rejected == 1 and srv.spawned == 0 and srv.kvs == {}


@pytest.mark.timeout(60)
def test_blank_lines_after_authentication_are_garbage(server):
    """An authenticated MPICH connection that sends blank lines is dropped after 100 of them, unanswered."""
    srv = server(1)
    info = register("127.0.0.1", srv.port, rank=0, size=1, timeout=10)
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(format_command("initack", pmiid=info["pmiid"]))
    f = s.makefile("rb")
    assert parse_command(f.readline().decode())[0] == "initack"
    for _ in range(3):
        f.readline()
    s.sendall(b"\n" * 100 + format_command("get_maxes"))
    assert parse_command(f.readline().decode())[0] == "maxes"       # 100: still in step, no reply to a blank
    s.sendall(b"\n" * 50)
    assert closed_by_peer(s)
    assert srv.rejected == 1


@pytest.mark.timeout(120)
def test_blank_line_floods_cost_little_cpu(monkeypatch):
    """The finding: 4 connections of blank lines cost 42 s of CPU. Now each is dropped at its first line;
    40 MB through 4 connections at a time cost the real server process well under a few seconds."""
    monkeypatch.setenv("CLUSTERCTL_JOB_TOKEN", TOKEN)
    proc, port = _server_process(2)
    cpu0 = _proc_usage(proc.pid)[0]
    sent = [0]

    def blast():
        while sent[0] < 40 * 1024 * 1024:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                    while sent[0] < 40 * 1024 * 1024:
                        s.sendall(b"\n" * 65536)
                        sent[0] += 65536
            except OSError:
                pass
    threads = [threading.Thread(target=blast) for _ in range(4)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    got = _register_all(port, 2)
    for t in threads:
        t.join(60)
    took = time.monotonic() - t0
    cpu = _proc_usage(proc.pid)[0] - cpu0
    proc.stdin.close()
    proc.wait(timeout=20)
    assert all(isinstance(got[r], dict) and got[r]["rc"] == "0" for r in (0, 1)), got
    assert cpu < 5.0, f"{cpu:.1f}s of CPU for {sent[0] >> 20} MB in {took:.1f}s"


@pytest.mark.timeout(60)
def test_unknown_commands_get_one_error_reply_and_the_server_goes_on(server):
    """An authenticated client's unknown or misplaced command (a one-line spawn, a second initack, our own
    hello) is answered with one error line, so MPICH's client stays in step, and the server keeps serving."""
    srv = server(1)
    info = register("127.0.0.1", srv.port, rank=0, size=1, timeout=10)
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(format_command("initack", pmiid=info["pmiid"]))
    f = s.makefile("rb")
    assert parse_command(f.readline().decode())[0] == "initack"
    for _ in range(3):
        f.readline()
    for cmd in ("spawn", "initack", "clusterctl_hello", "no_such_command"):
        s.sendall(format_command(cmd, x=1))
        assert parse_command(f.readline().decode()) == ("error", {"rc": "1", "msg": f"unknown PMI command {cmd}"})
    s.sendall(format_command("get_maxes"))
    assert parse_command(f.readline().decode())[0] == "maxes"
    s.close()
