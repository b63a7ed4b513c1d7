"""A workspace file that changes between the scan and its reading for the hosts (removed, cut shorter, replaced
by a FIFO or by a symlink to a file outside the workspace) fails the dispatch at once, naming the file, and
sends no host anything of it (the host's side of a stream cut short: tests/security/test_hostws_atomic.py).

Before: a file removed or cut shorter while its archive was built left every host waiting for the rest of
its stream until the transfer's deadline (ten control deadlines: minutes), then the command ended on an
OSError; a FIFO put in its place hung the command for good (the archive's thread blocked opening it, and
closing the archive waited for that thread); a symlink put in its place had its target's content (a file
outside the workspace, never scanned) sent to every host, where verify found nothing wrong.

The real host side runs on fake hosts (tests/unit/fakehosts.py); the file is changed right after the scan."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from clusterctl.errors import ClusterctlError
from clusterctl.ops import dispatch as d
from clusterctl.ops.dispatch import run as drun
from clusterctl.ops.dispatch import verify

sys.path.insert(0, os.path.dirname(__file__))
from fakehosts import FakeCluster  # noqa: E402

SIZES = {"inline": 4096, "archive": 3 << 20}  # content inside the header, or a tar archive streamed


def change(path: Path, how: str, secret: Path) -> None:
    size = path.stat().st_size
    path.unlink()
    if how == "shorter":
        path.write_bytes(b"x" * (size // 2))
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "symlink":  # a file of the same size outside the workspace
        secret.write_bytes(b"S" * size)
        path.symlink_to(secret)


@pytest.mark.parametrize("transport", ["inline", "archive"])
@pytest.mark.parametrize("how", ["removed", "shorter", "fifo", "symlink"])
def test_a_file_changed_after_the_scan_fails_the_dispatch_at_once_and_sends_nothing_of_it(tmp_path, monkeypatch,
                                                                                         how, transport):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    c = FakeCluster(tmp_path, files={"train.py": "print(1)\n"})
    size = SIZES[transport]
    target = c.write("big.bin", b"1" * size)
    with c.session() as s:
        dispatch = d.dispatch
        dispatch(s)
    c.write("big.bin", b"2" * size)
    c.write("train.py", "print(2)\n")
    scan, secret = drun.scan_workspace, tmp_path / "secret"

    def scan_then_change(root, exclude, **kw):
        files = scan(root, exclude, **kw)
        if Path(root) == c.local:
            change(target, how, secret)
        return files

    monkeypatch.setattr(drun, "scan_workspace", scan_then_change)
    with c.session() as s:
        started = time.monotonic()
        with pytest.raises(ClusterctlError) as info:
            dispatch(s)
        spent = time.monotonic() - started
        timeout = s.remote.control_timeout
    text = str(info.value)
    assert f"{target} changed while being dispatched" in text and "dispatch again" in text, text
    assert spent < timeout, f"took {spent:.1f} s"  # not the transfer's deadline (10 x {timeout} s), nor forever
    for i in range(2):  # each host kept its previous workspace, whole
        assert (c.workspace(i) / "big.bin").read_bytes() == b"1" * size
        assert (c.workspace(i) / "train.py").read_text() == "print(1)\n"
    monkeypatch.setattr(drun, "scan_workspace", scan)
    with c.session() as s:
        assert verify(s) == {h: [] for h in s.plan.hosts}
        target.unlink(missing_ok=True)
        c.write("big.bin", b"3" * size)
        dispatch(s)  # the next dispatch brings every host up to date
    for i in range(2):
        assert (c.workspace(i) / "big.bin").read_bytes() == b"3" * size
        assert (c.workspace(i) / "train.py").read_text() == "print(2)\n"


class _WaitingChannel:
    """A paramiko channel whose command reads its stdin until EOF and prints nothing: `recv` times out (the
    channel's 0.5 s poll) until the channel is closed."""

    def __init__(self):
        self.closed, self.sent, self.eof, self.timeout = False, 0, False, None

    def exec_command(self, cmd):
        pass

    def settimeout(self, t):
        self.timeout = t

    def send(self, data):
        self.sent += len(data)
        return len(data)

    def shutdown_write(self):
        self.eof = True

    def _wait(self, n):  # with a timeout set, paramiko's recv raises socket.timeout; without, it blocks
        import socket
        for _ in range(20):
            if self.closed or self.eof:
                return b""
            time.sleep(0.05)
            if self.timeout is not None:
                raise socket.timeout()
        raise AssertionError("recv blocked for good")  # what a real channel without a timeout does

    recv = recv_stderr = _wait

    def recv_exit_status(self):
        return 0

    def close(self):
        self.closed = True


@pytest.mark.timeout(30)  # before the fix: the 600 s deadline, or for ever without one
@pytest.mark.parametrize("timeout", [600.0, None])
def test_the_paramiko_transport_ends_a_command_whose_stdin_stream_failed_and_raises_its_error(timeout):
    """Before: a stdin stream that failed with anything but OSError (a dispatched file changed: JobError) ended
    the pump thread silently; the command waited for the rest of its stdin until the transfer's deadline."""
    from types import SimpleNamespace

    from clusterctl.errors import JobError
    from clusterctl.sshconn import run_on

    chan = _WaitingChannel()
    conn = SimpleNamespace(transport=SimpleNamespace(open_session=lambda timeout: chan), forward_agent=False,
                           connect_timeout=5)

    def stream(host):
        yield b"header"
        raise JobError("/ws/big.bin changed while being dispatched; dispatch again")

    started = time.monotonic()
    with pytest.raises(JobError, match=r"^/ws/big\.bin changed while being dispatched; dispatch again$"):
        run_on(conn, "h0", "hostws apply", stream, timeout, None)
    assert time.monotonic() - started < 5  # the poll's next turn, not the 600 s deadline
    assert chan.closed and not chan.eof and chan.sent == len(b"header")  # ended without an EOF: no half update


@pytest.mark.timeout(30)  # before the fix: the deadline (600 s), or for ever without one
@pytest.mark.parametrize("timeout", [600.0, None])
def test_an_ssh_process_whose_stdin_stream_failed_is_ended_and_the_error_raised(timeout):
    """The OpenSSH transport's side: `cat` stands for the remote command, which reads its stdin to the end."""
    import subprocess

    from clusterctl.errors import JobError
    from clusterctl.transport.process import collect_once

    proc = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def stream():
        yield b"header"
        raise JobError("/ws/big.bin changed while being dispatched; dispatch again")

    started = time.monotonic()
    with pytest.raises(JobError, match=r"^/ws/big\.bin changed while being dispatched; dispatch again$"):
        collect_once("h0", proc, stream(), timeout, None)
    assert time.monotonic() - started < 10
    assert proc.returncode is not None and proc.returncode < 0  # killed, not ended by an EOF on its stdin
