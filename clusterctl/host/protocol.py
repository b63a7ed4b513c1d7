"""The coordinator <-> peer protocol: newline-delimited JSON over TCP, mutually authenticated.

The coordinator sends a challenge {type, version, nonce}; the peer checks the version and answers with a
hello {type, job, host, version, nonce, proof, ...}; the coordinator checks the version and the proof and
answers with a welcome {type, job, version, proof}, which the peer checks in turn. Proofs are HMAC-SHA256
over both nonces keyed by the job token (`auth_proof`); the token never travels. See docs/agent.md.
"""

import hmac
import json
import os
import socket
import time

from .common import log

PROTOCOL_VERSION = 2  # 2: mutual challenge-response (HMAC-SHA256 over both nonces), no token on the wire
MAX_MESSAGE = 64 * 1024  # protocol: longest accepted JSON line
MAX_DEPTH = 16  # protocol: deepest accepted JSON nesting (checked before json.loads)
NONCE_BYTES = 32
BACKOFF_MIN, BACKOFF_MAX = 0.1, 1.0  # peer: reconnect back-off (doubles, with jitter, up to the max)
LOG_BURST, LOG_WINDOW = 10, 10.0  # at most LOG_BURST lines per kind about bad connections per window
AUTH_TIMEOUT = 5.0  # protocol: a new connection must say hello within this
MAX_PENDING = 32  # protocol: unauthenticated connections kept at once


def version_mismatch(msg, mine, theirs):
    """None when `msg` carries this agent's protocol version, else a one-line error naming both versions.

    `mine` and `theirs` name the two sides ("coordinator", "peer host-b").
    """
    got = msg.get("version")
    if got == PROTOCOL_VERSION and not isinstance(got, bool):
        return None
    return "protocol version mismatch: %s speaks %d, %s sent %s" % (mine, PROTOCOL_VERSION, theirs, _brief(got, 20))


class PeerProtocolError(Exception):
    """Garbage on a coordinator connection."""


def json_depth_ok(line, limit=MAX_DEPTH):
    """True if the JSON text's bracket nesting (outside strings) stays within limit."""
    depth, in_str, esc = 0, False, False
    for ch in line:
        if in_str:
            if esc:
                esc = False
            elif ch == 0x5C:  # backslash
                esc = True
            elif ch == 0x22:  # quote
                in_str = False
        elif ch == 0x22:
            in_str = True
        elif ch == 0x5B or ch == 0x7B:  # [ {
            depth += 1
            if depth > limit:
                return False
        elif ch == 0x5D or ch == 0x7D:
            depth -= 1
    return True


def auth_proof(token, side, job, host, nonce_c, nonce_p):
    """HMAC-SHA256 (hex) of one side's role, the job, the peer host and both nonces, keyed by the job token."""
    msg = "\0".join(("clusterctl-agent/%d" % PROTOCOL_VERSION, side, job, host, nonce_c, nonce_p))
    return hmac.new(token.encode("utf-8"), msg.encode("utf-8"), "sha256").hexdigest()


def proof_ok(expected, got):
    """Constant-time comparison of a hex proof with whatever the other side sent."""
    return isinstance(got, str) and hmac.compare_digest(expected.encode(), got.encode("utf-8", "replace"))


def _nonce():
    return os.urandom(NONCE_BYTES).hex()


def _brief(value, limit=200):
    """A repr of untrusted data, cut short and free of control characters, for a log line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...(%d chars)" % len(text)


class LogLimiter:
    """Rate-limits log lines per kind: LOG_BURST per LOG_WINDOW, then one line with the count suppressed."""

    def __init__(self, burst=LOG_BURST, window=LOG_WINDOW):
        self.burst, self.window = burst, window
        self.kinds = {}  # kind -> [window start, lines in window, suppressed]

    def __call__(self, kind, msg, now=None):
        """Log msg unless this kind already logged `burst` lines in the current window."""
        now = time.monotonic() if now is None else now
        st = self.kinds.setdefault(kind, [now, 0, 0])
        if now - st[0] >= self.window:
            if st[2]:
                log("(%d more %s message(s) suppressed in the last %.0fs)" % (st[2], kind, now - st[0]))
            st[:] = [now, 0, 0]
        if st[1] < self.burst:
            st[1] += 1
            log(msg)
        else:
            st[2] += 1


class Conn:
    """One newline-delimited-JSON TCP connection (peer <-> coordinator)."""

    def __init__(self, sock, addr, now):
        self.sock = sock
        self.addr = "%s:%s" % (addr[0], addr[1]) if isinstance(addr, tuple) else str(addr)
        self.buf = b""
        self.host = None
        self.authed = False
        self.done = False
        self.last_rx = self.last_tx = now
        self.deadline = now + AUTH_TIMEOUT
        self.nonce = _nonce()  # ours: the coordinator's challenge, or the peer's own nonce
        self.their_nonce = None  # peer side: the coordinator's challenge

    def send(self, msg):
        """Send one message; False if the connection is broken."""
        try:
            self.sock.sendall(json.dumps(msg, sort_keys=True).encode() + b"\n")
        except OSError:
            return False
        self.last_tx = time.monotonic()
        return True

    def receive(self):
        """Read available data; return messages, or None on EOF; raise PeerProtocolError."""
        try:
            data = self.sock.recv(65536)
        except (BlockingIOError, socket.timeout, InterruptedError):
            return []
        except OSError:
            return None
        if not data:
            return None
        self.last_rx = time.monotonic()
        self.buf += data
        msgs = []
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            if len(line) > MAX_MESSAGE:
                raise PeerProtocolError("line longer than %d bytes" % MAX_MESSAGE)
            if not line.strip():
                continue
            if not json_depth_ok(line):
                raise PeerProtocolError("JSON nested deeper than %d" % MAX_DEPTH)
            try:
                msg = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError):
                raise PeerProtocolError("not JSON")
            if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
                raise PeerProtocolError("not a message object")
            msgs.append(msg)
        if len(self.buf) > MAX_MESSAGE:
            raise PeerProtocolError("line longer than %d bytes" % MAX_MESSAGE)
        return msgs

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass
