"""A command over a kept OpenSSH connection without starting an `ssh` process: the client side of OpenSSH's
connection-multiplexing protocol (PROTOCOL.mux, version 4), spoken directly on the master's control socket.

A `ssh` client that reuses a kept connection (ControlMaster) does nothing but this: say hello on the control
socket, ask for a session (the command, the environment), hand the master its stdin, stdout and stderr as
file descriptors, and wait for the exit message. Doing it here spares a process per host and command
(fork, exec, ssh's start-up: ~10 ms of CPU each; 16 hosts, 0.15 s), which is most of what `exec` on many
hosts cost beside pdsh. The master is the `ssh` that made the connection, with our options: it checked
the host key, it keeps the connection alive, and it filters the environment we pass through its own
SendEnv and adds its SetEnv, as it does for its `ssh` clients.

`open_session` returns a Popen-like object (stdin, stdout, stderr, wait, poll, kill, returncode) for
clusterctl.transport.process, or None when the master cannot give a session (no master, another protocol,
a refusal): the caller then runs `ssh` as before, which makes a new connection.
"""

from __future__ import annotations

import os
import struct
import subprocess
import threading
import time

__all__ = ["MuxProcess", "open_session", "PROTOCOL_VERSION"]

PROTOCOL_VERSION = 4
MUX_MSG_HELLO = 0x00000001
MUX_C_NEW_SESSION = 0x10000002
MUX_S_PERMISSION_DENIED = 0x80000002
MUX_S_FAILURE = 0x80000003
MUX_S_EXIT_MESSAGE = 0x80000004
MUX_S_SESSION_OPENED = 0x80000006
MUX_S_TTY_ALLOC_FAIL = 0x80000008
NO_ESCAPE = 0xFFFFFFFF
MAX_PACKET = 256 * 1024  # the master's messages are a few words; anything larger is not a master
UNREACHABLE = 255  # as `ssh` exits when the master goes away without an exit status


class _Closed(Exception):
    """The master closed the control socket."""


def _string(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


class _Socket:
    """Length-prefixed packets on the control socket, read with an overall deadline."""

    def __init__(self, sock):
        self.sock, self.buf = sock, b""

    def send(self, payload: bytes) -> None:
        self.sock.sendall(_string(payload))

    def _fill(self, n: int, deadline: float | None) -> None:
        while len(self.buf) < n:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError
            self.sock.settimeout(left)
            chunk = self.sock.recv(65536)
            if not chunk:
                raise _Closed
            self.buf += chunk

    def packet(self, deadline: float | None) -> tuple[int, bytes]:
        """(message type, the rest) of the next packet; TimeoutError past `deadline`, _Closed at EOF."""
        self._fill(4, deadline)
        (size,) = struct.unpack(">I", self.buf[:4])
        if not 4 <= size <= MAX_PACKET:
            raise _Closed
        self._fill(4 + size, deadline)
        payload, self.buf = self.buf[4:4 + size], self.buf[4 + size:]
        return struct.unpack(">I", payload[:4])[0], payload[4:]


class MuxProcess:
    """A command running in a session of a kept connection, shaped as subprocess.Popen for the process
    transports: `stdin` (write, then close: EOF to the command), `stdout`/`stderr` (read to EOF),
    `wait(timeout)`, `poll()`, `kill()` (ends the session), `returncode` (255 when the master went away
    without the command's exit status, as `ssh` exits then)."""

    def __init__(self, conn: _Socket, stdin, stdout, stderr, session: int):
        self._conn, self._session = conn, session
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None
        self.killed = False  # kill() was called: the output may never reach EOF (process.collect_once)
        self._exit: int | None = None
        self._lock = threading.Lock()
        self.args = ("<mux session>",)

    def wait(self, timeout: float | None = None) -> int:
        """The exit code, once the master closed the session (it has written all output by then)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            if self.returncode is not None:
                return self.returncode
            raise subprocess.TimeoutExpired(self.args, timeout)
        try:
            while self.returncode is None:
                try:
                    kind, rest = self._conn.packet(deadline)
                except TimeoutError:
                    raise subprocess.TimeoutExpired(self.args, timeout) from None
                except (_Closed, OSError):
                    self._close(UNREACHABLE if self._exit is None else self._exit)
                    break
                if kind == MUX_S_EXIT_MESSAGE and len(rest) >= 8:
                    # as ssh's own exit gives it (its process exits with the low byte): a host that says 256 was
                    # the worst code of every host, then 0 at the command's exit
                    self._exit = struct.unpack(">I", rest[4:8])[0] & 0xFF
                elif kind != MUX_S_TTY_ALLOC_FAIL:  # an error from the master: the session is over
                    self._close(UNREACHABLE)
            return self.returncode
        finally:
            self._lock.release()

    def poll(self) -> int | None:
        """The exit code if the session is over, else None (never blocks)."""
        if self.returncode is None:
            try:
                self.wait(0)
            except subprocess.TimeoutExpired:
                pass
        return self.returncode

    def kill(self) -> None:
        """End the session: closing the control socket makes the master close its channel."""
        self.killed = True
        if self.returncode is None:
            self._close(UNREACHABLE)

    def _close(self, code: int) -> None:
        import socket

        self.returncode = code
        try:  # wakes a thread blocked reading the socket (close alone does not) and ends the session at the master
            self._conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._conn.sock.close()
        except OSError:
            pass


def open_session(path: str, command: str, *, forward_agent: bool = False, timeout: float = 10.0) -> MuxProcess | None:
    """`command` in a new session of the kept connection whose control socket is `path`; None when there
    is no master there, it speaks another protocol, or it refuses or fails the session within `timeout`."""
    import socket  # here: a command that reuses no connection never pays for it

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    pipes: list[int] = []
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        conn = _Socket(sock)
        deadline = time.monotonic() + timeout
        conn.send(struct.pack(">II", MUX_MSG_HELLO, PROTOCOL_VERSION))
        kind, rest = conn.packet(deadline)
        if kind != MUX_MSG_HELLO or struct.unpack(">I", rest[:4])[0] != PROTOCOL_VERSION:
            raise _Closed
        request = struct.pack(">II", MUX_C_NEW_SESSION, 1) + _string(b"")  # request id 1, reserved
        request += struct.pack(">IIIII", 0, 0, int(forward_agent), 0, NO_ESCAPE)  # tty, X11, agent, subsystem
        request += _string(b"") + _string(command.encode())  # no terminal type; the command
        for name, value in os.environb.items():  # the master keeps what its SendEnv allows, as for ssh
            request += _string(name + b"=" + value)
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pipes = [in_r, in_w, out_r, out_w, err_r, err_w]
        conn.send(request)
        for fd in (in_r, out_w, err_w):
            socket.send_fds(sock, [b"\0"], [fd])
        for fd in (in_r, out_w, err_w):  # the master has its own copies now: EOF comes when it closes them
            os.close(fd)
            pipes.remove(fd)
        kind, rest = conn.packet(deadline)
        if kind != MUX_S_SESSION_OPENED or len(rest) < 8 or struct.unpack(">I", rest[:4])[0] != 1:
            raise _Closed  # MUX_S_FAILURE / PERMISSION_DENIED: the caller runs ssh instead
        session = struct.unpack(">I", rest[4:8])[0]
    except (OSError, _Closed, TimeoutError, struct.error):
        sock.close()
        for fd in pipes:
            os.close(fd)
        return None
    return MuxProcess(conn, open(in_w, "wb"), open(out_r, "rb"), open(err_r, "rb"), session)
