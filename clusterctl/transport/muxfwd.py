"""Ask a TCP service on many hosts' loopback through their kept OpenSSH connections, with no process started on
either side: the client side of OpenSSH's stdio forwarding (`ssh -W`) in the multiplexing protocol
(PROTOCOL.mux, MUX_C_NEW_STDIO_FWD), spoken on each master's control socket, every host at once.

For each host the master opens a `direct-tcpip` channel to 127.0.0.1:PORT on the host (sshd connects there
itself: no shell, no fork) and joins it to one end of a socket pair whose other end is ours. We write the
request line, read the first line of the answer, and keep the rest only when that line is the one the caller
expects (the service proving who it is); then the service closes and the master closes the channel.

`ask_many` answers each host with an Outcome:

- `ok`: the body;
- `refused`: the host said no: sshd refused the channel (nothing listens on that port, or forwarding is off),
  or the service closed it without a word;
- `bad`: another first line, an answer cut short;
- `big`: the right first line, then a body over the limit (the service is the one asked: ask it another way);
- `unreachable`: no master, another protocol, or the master went away before the channel opened (the host's
  word is not known);
- `timeout`: no first line within `header_timeout`, or no end by the deadline;
- `cut`: not waited for any more: the caller had what it needed (`stop`).

Whatever is not `ok`, the caller asks another way.
"""

from __future__ import annotations

import selectors
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from .mux import MAX_PACKET, MUX_MSG_HELLO, MUX_S_SESSION_OPENED, PROTOCOL_VERSION, _string

__all__ = ["Forward", "Outcome", "ask_many", "MUX_C_NEW_STDIO_FWD"]

MUX_C_NEW_STDIO_FWD = 0x10000008
CONNECT_TIMEOUT = 1.0  # to a master's control socket: a local one, which a live master accepts at once
STOP_LOOK_S = 0.05  # how often ask_many looks at its `stop` (set by another thread)
_CHUNK = 1 << 16


@dataclass(frozen=True)
class Forward:
    """One host's request: its master's control socket, the loopback port there, the request bytes to send,
    and the first line (without its newline) the answer must start with."""

    control: str
    port: int
    request: bytes
    header: bytes


@dataclass(frozen=True)
class Outcome:
    """`kind`: ok / refused / bad / big / unreachable / timeout; `body`: what followed the first line (ok only)."""

    kind: str
    body: bytes = b""


class _Ask:
    """One host's exchange, driven by ask_many's loop."""

    def __init__(self, fwd: Forward):
        self.fwd = fwd
        self.ctl: socket.socket | None = None
        self.data: socket.socket | None = None
        self.ctl_in = bytearray()
        self.hello = False
        self.opened = False  # the master said the channel is open
        self.answer = bytearray()
        self.header_ok = False

    def close(self) -> None:
        for sock in (self.ctl, self.data):
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass

    def packet(self) -> tuple[int, bytes] | None:
        """The next whole packet the master sent, if one is in; raises ValueError on garbage."""
        if len(self.ctl_in) < 4:
            return None
        size = struct.unpack(">I", self.ctl_in[:4])[0]
        if size < 4 or size > MAX_PACKET:
            raise ValueError("not a master")
        if len(self.ctl_in) < 4 + size:
            return None
        body = bytes(self.ctl_in[4:4 + size])
        del self.ctl_in[:4 + size]
        return struct.unpack(">I", body[:4])[0], body[4:]


def ask_many(forwards: dict, *, header_timeout: float, timeout: float, max_body: int = 16 << 20,
             on_ok: Callable[[object, bytes], None] | None = None, stop: Callable[[], bool] | None = None) -> dict:
    """{key: Outcome} for {key: Forward}: every request in flight at once; each host's first line within
    `header_timeout`, its whole answer within `timeout` (seconds from the call). `on_ok(key, body)` as each answer
    is whole; once `stop()` is true (looked at every STOP_LOOK_S), the hosts still asked are `cut`."""
    start = time.monotonic()
    header_deadline, deadline = start + min(header_timeout, timeout), start + timeout
    sel = selectors.DefaultSelector()
    asks: dict = {}
    out: dict = {}

    def finish(key, a: _Ask, kind: str, body: bytes = b"") -> None:
        for sock in (a.ctl, a.data):
            if sock is not None:
                try:
                    sel.unregister(sock)
                except (KeyError, ValueError):
                    pass
        a.close()
        out[key] = Outcome(kind, body)
        asks.pop(key, None)
        if kind == "ok" and on_ok is not None:
            on_ok(key, body)

    for key, fwd in forwards.items():
        a = _Ask(fwd)
        try:
            a.ctl = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            a.ctl.settimeout(min(CONNECT_TIMEOUT, timeout))  # a hung master's full backlog would block a connect
            a.ctl.connect(fwd.control)
            a.ctl.setblocking(False)
            a.ctl.send(_string(struct.pack(">II", MUX_MSG_HELLO, PROTOCOL_VERSION)))
        except OSError:
            a.close()
            out[key] = Outcome("unreachable")
            continue
        asks[key] = a
        sel.register(a.ctl, selectors.EVENT_READ, (key, "ctl"))

    try:
        while asks:
            now = time.monotonic()
            for key, a in list(asks.items()):
                if now >= deadline or (not a.header_ok and now >= header_deadline):
                    finish(key, a, "timeout")
            if asks and stop is not None and stop():
                for key, a in list(asks.items()):
                    finish(key, a, "cut")
            if not asks:
                break
            wait = min(deadline, header_deadline if any(not a.header_ok for a in asks.values()) else deadline) - now
            for sk, _ in sel.select(max(0.0, wait if stop is None else min(wait, STOP_LOOK_S))):
                key, which = sk.data
                a = asks.get(key)
                if a is None:
                    continue
                try:
                    if which == "ctl":
                        _on_control(key, a, sel, finish)
                    else:
                        _on_data(key, a, sel, finish, max_body)
                except (OSError, ValueError, struct.error):
                    finish(key, a, "bad" if a.answer else "unreachable")
    finally:
        for key, a in list(asks.items()):
            finish(key, a, "timeout")
        sel.close()
    return out


def _on_control(key, a: _Ask, sel, finish) -> None:
    """The master's messages: its hello (then our request and the socket pair's end), then whether the channel
    opened. Its closing the control socket after the channel ended is not news."""
    chunk = a.ctl.recv(4096)
    if not chunk:  # after the channel opened, the master closes this when the channel ends: the data says how
        sel.unregister(a.ctl)
        if not a.opened:
            finish(key, a, "unreachable")
        return
    a.ctl_in += chunk
    while (p := a.packet()) is not None:
        kind, rest = p
        if not a.hello:
            if kind != MUX_MSG_HELLO or struct.unpack(">I", rest[:4])[0] != PROTOCOL_VERSION:
                raise ValueError("another protocol")
            a.hello = True
            ours, theirs = socket.socketpair()
            try:
                a.data = ours
                request = struct.pack(">II", MUX_C_NEW_STDIO_FWD, 1) + _string(b"")
                request += _string(b"127.0.0.1") + struct.pack(">I", a.fwd.port)
                a.ctl.setblocking(True)  # a few bytes and two descriptors to a local master
                a.ctl.settimeout(2.0)
                a.ctl.sendall(_string(request))
                socket.send_fds(a.ctl, [b"\0"], [theirs.fileno()])  # the channel's input ...
                socket.send_fds(a.ctl, [b"\0"], [theirs.fileno()])  # ... and output: one socket
                a.ctl.setblocking(False)
            finally:
                theirs.close()  # the master has its copies: EOF on ours when it closes them
            ours.setblocking(False)
            try:
                ours.sendall(a.fwd.request)  # buffered in the pair until the channel opens
            except OSError:  # the master closed its end already: its verdict on the control socket decides
                ours.close()
                a.data = None
                continue
            sel.register(ours, selectors.EVENT_READ, (key, "data"))
        elif kind == MUX_S_SESSION_OPENED:
            a.opened = True
            if a.data is None:  # the socket pair's end closed before: the service said nothing
                finish(key, a, "refused")
                return
        else:  # MUX_S_FAILURE / PERMISSION_DENIED: nothing listens there, or sshd forwards nothing
            finish(key, a, "refused")
            return


def _on_data(key, a: _Ask, sel, finish, max_body: int) -> None:
    """The answer as it comes: its first line checked as soon as it is whole, the rest kept up to `max_body`."""
    try:
        chunk = a.data.recv(_CHUNK)
    except ConnectionResetError:  # the master closed its end with our request unread (a refused channel)
        if a.header_ok or a.answer:
            raise
        chunk = b""
    if not chunk:
        if a.header_ok:
            finish(key, a, "ok", bytes(a.answer))
        elif a.answer:
            finish(key, a, "bad")
        elif a.opened:  # the channel opened and the service closed it without a word (a wrong secret)
            finish(key, a, "refused")
        else:  # closed before the master said why: its verdict on the control socket decides
            sel.unregister(a.data)
            a.data.close()
            a.data = None
        return
    a.answer += chunk
    if not a.header_ok:
        line, nl, rest = a.answer.partition(b"\n")
        if not nl:
            if len(a.answer) > len(a.fwd.header) + 1:
                finish(key, a, "bad")
            return
        if not _same(bytes(line), a.fwd.header):
            finish(key, a, "bad")
            return
        a.header_ok = True
        a.answer = bytearray(rest)
    if len(a.answer) > max_body:
        finish(key, a, "big")


def _same(a: bytes, b: bytes) -> bool:
    import hmac

    return hmac.compare_digest(a, b)

