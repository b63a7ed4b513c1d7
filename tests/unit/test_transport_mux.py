"""The client side of OpenSSH's multiplexing protocol (clusterctl.transport.mux) against a stand-in master
on a real Unix socket (file descriptors really passed): a session's output, stdin and exit status; a master
that refuses, speaks another version or goes away; and the OpenSSH transport falling back to `ssh` when no
session can be had. The real master is exercised in tests/integration/test_remote.py."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

from clusterctl.transport import mux
from clusterctl.transport.base import SshOptions
from clusterctl.transport.host import Host
from clusterctl.transport.openssh import OpenSshTransport
from clusterctl.transport.process import ProcessRun


def _packet(sock) -> bytes:
    size = struct.unpack(">I", _recv(sock, 4))[0]
    return _recv(sock, size)


def _recv(sock, n) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "client closed"
        data += chunk
    return data


def _send(sock, *words: int, tail: bytes = b"") -> None:
    payload = b"".join(struct.pack(">I", w) for w in words) + tail
    sock.sendall(struct.pack(">I", len(payload)) + payload)


class FakeMaster:
    """Serves one client the way an OpenSSH master does, or misbehaves as told (`mode`)."""

    def __init__(self, path: str, mode: str = "ok", exit_code: int = 7):
        self.path, self.mode, self.exit_code = path, mode, exit_code
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        self.server.listen(1)
        self.seen: dict = {}
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        with conn:
            _send(conn, mux.MUX_MSG_HELLO, 3 if self.mode == "version" else mux.PROTOCOL_VERSION)
            self.seen["hello"] = struct.unpack(">II", _packet(conn))
            if self.mode == "version":
                return
            request = _packet(conn)
            fds = []
            for _ in range(3):
                _, got, _, _ = socket.recv_fds(conn, 1, 1)
                fds += got
            self.seen["request"] = request
            if self.mode == "refuse":
                _send(conn, mux.MUX_S_FAILURE, 1, tail=struct.pack(">I", 4) + b"nope")
                for fd in fds:
                    os.close(fd)
                return
            _send(conn, mux.MUX_S_SESSION_OPENED, 1, 5)
            stdin, stdout, stderr = fds
            if self.mode == "hold":  # a quiet command: nothing sent; after the client left, the host's side of the
                self.seen["client gone"] = conn.recv(1) == b""  # session takes a while to end (a keepalive)
                time.sleep(6)
                for fd in fds:
                    os.close(fd)
                return
            data = b""
            while chunk := os.read(stdin, 65536):
                data += chunk
            try:
                os.write(stdout, b"got %d bytes\n" % len(data))
                os.write(stderr, b"a warning\n")
                if self.mode == "ok":
                    _send(conn, mux.MUX_S_EXIT_MESSAGE, 5, self.exit_code)
            except (BrokenPipeError, ConnectionResetError):
                self.seen["client gone"] = True  # as a master whose client ended the session
            for fd in fds:
                os.close(fd)


def _fields(request: bytes) -> tuple:
    """MUX_C_NEW_SESSION's fields: (type, request id, reserved, tty, x11, agent, subsystem, escape, term,
    command, [environment strings])."""
    def string(at):
        n = struct.unpack(">I", request[at:at + 4])[0]
        return request[at + 4:at + 4 + n], at + 4 + n

    kind, rid = struct.unpack(">II", request[:8])
    reserved, at = string(8)
    flags = struct.unpack(">IIIII", request[at:at + 20])
    term, at = string(at + 20)
    command, at = string(at)
    env = []
    while at < len(request):
        item, at = string(at)
        env.append(item)
    return (kind, rid, reserved, *flags, term, command, env)


@pytest.fixture
def sock_path(tmp_path):
    return str(tmp_path / "ctl")


def test_a_session_runs_the_command_with_our_stdin_and_reports_its_exit(sock_path, monkeypatch):
    monkeypatch.setenv("CLUSTERCTL_MUX_TEST", "x=y")
    master = FakeMaster(sock_path)
    proc = mux.open_session(sock_path, "echo 'hi there'", forward_agent=True)
    assert isinstance(proc, mux.MuxProcess)
    run = ProcessRun(None, Host("h", 22, "u", 0), "echo 'hi there'", proc=proc)
    res = run.finish(lambda: [b"x" * 100_000, b"y"], 10, None)
    assert (res.exit_code, res.stdout, res.stderr) == (7, "got 100001 bytes\n", "a warning\n")
    master.thread.join(5)
    assert master.seen["hello"] == (mux.MUX_MSG_HELLO, 4)
    kind, rid, reserved, tty, x11, agent, subsystem, escape, term, command, env = _fields(master.seen["request"])
    assert (kind, rid, reserved, tty, x11, agent, subsystem, escape, term, command) == (
        mux.MUX_C_NEW_SESSION, 1, b"", 0, 0, 1, 0, 0xFFFFFFFF, b"", b"echo 'hi there'")
    assert b"CLUSTERCTL_MUX_TEST=x=y" in env  # the whole environment: the master keeps what SendEnv allows


@pytest.mark.parametrize("said, code", [(256, 0), (257, 1), (0xFFFFFFFF, 255)])
def test_an_exit_status_past_a_byte_is_its_low_byte_as_over_ssh(sock_path, said, code):
    # a host's sshd can send any 32-bit exit status: 256 was the worst code of every host (`exec` kept it over a
    # real failure elsewhere), then 0 at the command's exit
    master = FakeMaster(sock_path, exit_code=said)
    proc = mux.open_session(sock_path, "true")
    res = ProcessRun(None, Host("h", 22, "u", 0), "true", proc=proc).finish(lambda: [], 10, None)
    assert res.exit_code == code
    master.thread.join(5)


def test_a_master_gone_without_an_exit_status_is_255(sock_path):
    master = FakeMaster(sock_path, mode="no-exit")
    proc = mux.open_session(sock_path, "true")
    res = ProcessRun(None, Host("h", 22, "u", 0), "true", proc=proc).finish(lambda: [], 10, None)
    assert res.exit_code == 255 and res.stdout == "got 0 bytes\n"
    master.thread.join(5)


@pytest.mark.parametrize("mode", ["refuse", "version"])
def test_no_session_from_a_master_that_refuses_or_speaks_another_version(sock_path, mode):
    master = FakeMaster(sock_path, mode=mode)
    assert mux.open_session(sock_path, "true") is None
    master.thread.join(5)


def test_no_master_no_session(sock_path):
    assert mux.open_session(sock_path, "true") is None  # no socket
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(sock_path)  # a socket nobody listens on (a master that died)
    assert mux.open_session(sock_path, "true") is None
    stale.close()


def test_the_transport_runs_ssh_when_the_kept_connection_gives_no_session(tmp_path, monkeypatch):
    """A control socket that exists but gives no session (a dying master): ssh runs as before."""
    transport = OpenSshTransport(SshOptions(persist=60))
    host = Host("10.0.0.7", 22, "u", 0)
    monkeypatch.setattr(transport, "kept", lambda h: str(tmp_path / "ctl"))
    started = []
    monkeypatch.setattr(transport, "popen", lambda h, c: started.append((h, c)) or "the ssh process")
    assert transport.spawn(host, "true", wait=False) is None  # the caller goes on; opened in the background
    assert transport.spawn(host, "true", wait=True) == "the ssh process"
    assert started == [(host, "true")]
    master = FakeMaster(str(tmp_path / "ctl"))
    proc = transport.spawn(host, "true", wait=True)
    assert isinstance(proc, mux.MuxProcess) and started == [(host, "true")]  # no second ssh
    proc.stdin.close()
    assert proc.wait(10) == 7
    master.thread.join(5)


def test_kill_ends_a_session_and_wait_returns(sock_path):
    master = FakeMaster(sock_path)
    proc = mux.open_session(sock_path, "sleep 60")
    with pytest.raises(mux.subprocess.TimeoutExpired):
        proc.wait(0.2)
    assert proc.poll() is None
    proc.kill()
    assert proc.wait(5) == 255 and proc.poll() == 255
    proc.stdin.close()
    master.thread.join(5)
    assert master.seen["client gone"]


def test_kill_wakes_a_thread_waiting_for_the_session(sock_path):
    """Ctrl+C on a followed log: the session's waiting thread is blocked reading the control socket when another
    thread kills the session. Closing the socket alone does not wake a blocked recv (nor tell the master: the
    blocked call keeps the socket alive), so `clusterctl logs -f` hung after saying "interrupted"."""
    master = FakeMaster(sock_path)
    proc = mux.open_session(sock_path, "tail -f log")
    codes = []
    waiter = threading.Thread(target=lambda: codes.append(proc.wait()), daemon=True)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # blocked in the control socket's recv: the master has said nothing yet
    proc.kill()
    waiter.join(5)
    assert not waiter.is_alive() and codes == [255]
    proc.stdin.close()
    master.thread.join(5)


def test_a_killed_run_ends_without_waiting_for_the_master_to_let_go_of_its_output(sock_path):
    """After a kill, a real master keeps our output pipes until the host's side of the session is gone, which a
    quiet command notices only at its next write: the run ends without waiting for that."""
    master = FakeMaster(sock_path, mode="hold")
    proc = mux.open_session(sock_path, "tail -f log")
    transport = type("Transport", (), {"shed": lambda self, err: False, "failure_reason": lambda self, h, err: err})()
    run = ProcessRun(transport, Host("h", 22, "u", 0), "tail -f log", proc=proc)
    results = []
    finisher = threading.Thread(target=lambda: results.append(run.finish(lambda: [], None, None)), daemon=True)
    finisher.start()
    finisher.join(0.3)
    assert finisher.is_alive()
    t0 = time.monotonic()
    run.kill()
    finisher.join(5)
    assert not finisher.is_alive() and time.monotonic() - t0 < 3 and results[0].exit_code == 255
    master.thread.join(10)
    assert master.seen["client gone"]
