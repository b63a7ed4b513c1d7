"""The coordinator <-> peer protocol: newline-delimited JSON over TCP, mutually authenticated.

The coordinator sends a challenge {type, version, nonce}; the peer checks the version and answers with a
hello {type, job, host, version, nonce, proof, ...}; the coordinator checks the version and the proof and
answers with a welcome {type, job, proof}, which the peer checks in turn. Proofs are HMAC-SHA256 over both
nonces keyed by the job token (`auth_proof`); the token never travels. See docs/agent.md.

Every message type is a member of `Msg`, built by its constructor below (`challenge`, `hello`, ... `ping`)
and checked on receipt by `parse_message`, which returns the message with each field validated (a
`ProtocolError` naming the field otherwise). Lines are split by `LineReader` in linear time; a line that
is blank, does not start with ``{``, is longer than MAX_MESSAGE or nested deeper than MAX_DEPTH is garbage.
"""

import hmac
import json
import os
import socket
import time

from .common import log
from .jobfile import ROLES
from .states import TERMINAL_JOB_STATES, StrEnum

PROTOCOL_VERSION = 2  # 2: mutual challenge-response (HMAC-SHA256 over both nonces), no token on the wire
MAX_MESSAGE = 64 * 1024  # protocol: longest accepted JSON line
MAX_DEPTH = 16  # protocol: deepest accepted JSON nesting
NONCE_BYTES = 32
MAX_HOST_LABEL = 255
BACKOFF_MIN, BACKOFF_MAX = 0.1, 1.0  # peer: reconnect back-off (doubles, with jitter, up to the max)
LOG_BURST, LOG_WINDOW = 10, 10.0  # at most LOG_BURST lines per kind about bad connections per window
AUTH_TIMEOUT = 3.0  # protocol: a new connection must authenticate within this (both sides)
SEND_TIMEOUT = 2.0  # a send that blocks this long (the other end reads nothing): the connection is dead


class ProtocolError(Exception):
    """Garbage on a connection, or a message whose fields are not what its type requires."""


PeerProtocolError = ProtocolError  # the older name


class Msg(StrEnum):
    """The message types, in the order of a connection's life."""

    CHALLENGE = "challenge"  # coordinator -> peer, on accept
    HELLO = "hello"  # peer -> coordinator: its proof, and what the coordinator may have missed
    WELCOME = "welcome"  # coordinator -> peer: its own proof
    ERROR = "error"  # coordinator -> peer, unauthenticated, then close
    EXIT = "exit"  # peer -> coordinator: a local process ended on its own
    STOPPING = "stopping"  # peer -> coordinator: a stop was requested on that host
    STOP = "stop"  # coordinator -> peer: the verdict
    DONE = "done"  # peer -> coordinator: the local stop finished
    RESTART = "restart"  # coordinator -> peer: start attempt K (an elastic job: on the hosts of its view)
    GO = "go"  # coordinator -> peer: every host joined; start the first attempt's processes (the start barrier)
    PING = "ping"  # both ways, every heartbeat


# -- constructors ---------------------------------------------------------------------------------------------


def challenge(nonce):
    """coordinator -> peer, on accept: the protocol version and the coordinator's nonce."""
    return {"type": Msg.CHALLENGE, "version": PROTOCOL_VERSION, "nonce": nonce}


def hello(job, host, nonce, proof, exits=(), stopping=None, attempt=0, idle=False, failed=None, index=None,
          ps=None):
    """peer -> coordinator: the answer to a challenge, and what the coordinator may have missed; an elastic
    job's host adds its `index` (its position in the spec's hosts) and `ps`, its pserver checkpoint shards
    ({pserver id: [steps, newest first]}, host/elastic.py ps_inventory), or null."""
    return {"type": Msg.HELLO, "version": PROTOCOL_VERSION, "job": job, "host": host, "nonce": nonce,
            "proof": proof, "exits": list(exits), "stopping": stopping, "attempt": attempt, "idle": bool(idle),
            "failed": failed, "index": index, "ps": _ps_json(ps)}


def welcome(job, proof):
    """coordinator -> peer: the peer is in; the coordinator's proof."""
    return {"type": Msg.WELCOME, "job": job, "proof": proof}


def error(text):
    """coordinator -> an unauthenticated peer, before it closes the connection."""
    return {"type": Msg.ERROR, "error": text, "version": PROTOCOL_VERSION}


def exit_event(role, id, code, error, host, attempt, note=None):
    """peer -> coordinator: a local process of `attempt` ended on its own (`error`: it failed to start; `note`:
    why, when its host knows, e.g. MPI_Abort)."""
    return {"type": Msg.EXIT, "role": role, "id": id, "code": code, "error": error, "host": host,
            "attempt": attempt, "note": note}


def stopping(reason):
    """peer -> coordinator: a stop was requested on the peer's host."""
    return {"type": Msg.STOPPING, "reason": reason}


def stop(state, reason, failure, attempt, restart):
    """coordinator -> peer: the verdict of `attempt`; with `restart`, another attempt follows."""
    return {"type": Msg.STOP, "state": state, "reason": reason, "failure": failure, "attempt": attempt,
            "restart": bool(restart)}


def done(host, attempt, ps=None):
    """peer -> coordinator: the peer's local stop of `attempt` finished (`ps`: as in the hello)."""
    return {"type": Msg.DONE, "host": host, "attempt": attempt, "ps": _ps_json(ps)}


def restart(attempt, view=None):
    """coordinator -> peer: start attempt `attempt`; an elastic job's `view` says on which hosts (host/elastic.py:
    the receiver checks it against its own section, then runs its part of it, or nothing)."""
    return {"type": Msg.RESTART, "attempt": attempt, "view": view}


def go(attempt):
    """coordinator -> peer: every host of the job joined: start `attempt`'s processes (the start barrier)."""
    return {"type": Msg.GO, "attempt": attempt}


def ping():
    """Either way, every heartbeat."""
    return {"type": Msg.PING}


# -- validation -----------------------------------------------------------------------------------------------


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _count(v):
    if not _is_int(v) or v < 0:
        raise ValueError("must be an integer >= 0")
    return v


def _text(v):
    if not isinstance(v, str):
        raise ValueError("must be a string")
    return v


def _opt_text(v):
    return None if v is None else _text(v)


def _label(v):
    if not isinstance(v, str) or not v or len(v) > MAX_HOST_LABEL:
        raise ValueError("must be a host label of 1-%d characters" % MAX_HOST_LABEL)
    return v


def _nonce_field(v):
    if not isinstance(v, str) or len(v) != 2 * NONCE_BYTES:
        raise ValueError("must be %d hex digits" % (2 * NONCE_BYTES))
    return v


def _flag(v):
    if not isinstance(v, bool):
        raise ValueError("must be true or false")
    return v


def _opt_dict(v):
    if v is not None and not isinstance(v, dict):
        raise ValueError("must be an object or null")
    return v


def _verdict_state(v):
    if v not in TERMINAL_JOB_STATES:
        raise ValueError("must be one of %s" % "/".join(TERMINAL_JOB_STATES))
    return v


def _exit_fields(v):
    """An exit event's fields (an `exit` message, or an item of a hello's `exits`)."""
    if not isinstance(v, dict):
        raise ValueError("must be an object")
    out = {}
    for name, check, default in _EXIT:
        try:
            out[name] = check(v.get(name, default))
        except ValueError as e:
            raise ValueError("%s: %s" % (name, e))
    if out["code"] is None and out["error"] is None:
        raise ValueError("needs a code or an error")
    return out


def _role(v):
    if v not in ROLES:
        raise ValueError("must be one of %s" % "/".join(ROLES))
    return v


def _opt_code(v):
    if v is not None and not _is_int(v):
        raise ValueError("must be an integer or null")
    return v


def _opt_index(v):
    if v is not None and (not _is_int(v) or v < 0):
        raise ValueError("must be an integer >= 0 or null")
    return v


MAX_PS_STEPS = 16  # a checkpoint inventory lists at most this many steps per pserver (two are kept on disk)
MAX_PSERVERS = 4096


def _ps_json(ps):
    """An inventory for the wire: JSON object keys are strings."""
    return None if ps is None else {str(k): list(v) for k, v in ps.items()}


def _inventory(v):
    """A pserver checkpoint inventory ({"id": [steps]}) as {id: [steps]}, or null."""
    if v is None:
        return None
    if not isinstance(v, dict) or len(v) > MAX_PSERVERS:
        raise ValueError("must be an object of pserver id to steps, or null")
    out = {}
    for k, steps in v.items():
        if not isinstance(k, str) or not k.isdigit() or len(k) > 6:
            raise ValueError("must be an object of pserver id to steps, or null")
        if (not isinstance(steps, list) or len(steps) > MAX_PS_STEPS
                or not all(_is_int(s) and s >= 0 for s in steps)):
            raise ValueError("%s: must be a list of at most %d steps" % (k, MAX_PS_STEPS))
        out[int(k)] = list(steps)
    return out


def _exits(v):
    if not isinstance(v, list):
        raise ValueError("must be a list")
    return [_exit_fields(e) for e in v]


_REQUIRED = object()
_EXIT = (("role", _role, _REQUIRED), ("id", _count, _REQUIRED), ("code", _opt_code, None),
         ("error", _opt_text, None), ("host", _opt_text, None), ("attempt", _count, 0), ("note", _opt_text, None))

# type -> ((field, check, default), ...); _REQUIRED: no default
_FIELDS = {
    Msg.CHALLENGE: (("version", None, None), ("nonce", _nonce_field, _REQUIRED)),
    Msg.HELLO: (("version", None, None), ("job", _text, _REQUIRED), ("host", _label, _REQUIRED),
                ("nonce", _nonce_field, _REQUIRED), ("proof", _text, _REQUIRED), ("exits", _exits, []),
                ("stopping", _opt_text, None), ("attempt", _count, 0), ("idle", _flag, False),
                ("failed", _opt_text, None), ("index", _opt_index, None), ("ps", _inventory, None)),
    Msg.WELCOME: (("job", _text, _REQUIRED), ("proof", _text, _REQUIRED)),
    Msg.ERROR: (("error", lambda v: str(v)[:200], None), ("version", None, None)),
    Msg.EXIT: _EXIT,
    Msg.STOPPING: (("reason", _opt_text, None),),
    Msg.STOP: (("state", _verdict_state, _REQUIRED), ("reason", _text, _REQUIRED), ("failure", _opt_dict, None),
               ("attempt", _count, _REQUIRED), ("restart", _flag, False)),
    Msg.DONE: (("host", _opt_text, None), ("attempt", _count, _REQUIRED), ("ps", _inventory, None)),
    # the view is checked by the receiver against its own job file (host/elastic.py check_view)
    Msg.RESTART: (("attempt", _count, _REQUIRED), ("view", _opt_dict, None)),
    Msg.GO: (("attempt", _count, _REQUIRED),),
    Msg.PING: (),
}


def parse_message(obj):
    """A received JSON object as a message: {"type": Msg, field: checked value, ...}; raise ProtocolError.

    Unknown fields are dropped; a missing optional field gets its default; `version` is passed through
    unchecked (version_mismatch reports it, naming both versions)."""
    if not isinstance(obj, dict):
        raise ProtocolError("not a message object")
    try:
        kind = Msg(obj.get("type"))
    except ValueError:
        raise ProtocolError("unknown message type %s" % _brief(obj.get("type"), 40))
    out = {"type": kind}
    for name, check, default in _FIELDS[kind]:
        if name not in obj and default is _REQUIRED:
            raise ProtocolError("malformed %s: %s missing" % (kind, name))
        value = obj.get(name, None if default is _REQUIRED else default)
        if check is not None:
            try:
                value = check(value)
            except ValueError as e:
                raise ProtocolError("malformed %s: %s: %s" % (kind, name, e))
        out[name] = value
    if kind == Msg.EXIT and out["code"] is None and out["error"] is None:
        raise ProtocolError("malformed exit: needs a code or an error")
    return out


def version_mismatch(msg, mine, theirs):
    """None when `msg` carries this agent's protocol version, else a one-line error naming both versions.

    `mine` and `theirs` name the two sides ("coordinator", "peer host-b").
    """
    got = msg.get("version")
    if got == PROTOCOL_VERSION and not isinstance(got, bool):
        return None
    return "protocol version mismatch: %s speaks %d, %s sent %s" % (mine, PROTOCOL_VERSION, theirs, _brief(got, 20))


def json_depth_ok(line, limit=MAX_DEPTH):
    """True if the JSON text's bracket nesting (outside strings) stays within limit.

    Linear; a line with at most `limit` brackets in all is accepted without scanning it."""
    if line.count(b"[") + line.count(b"{") <= limit:
        return True
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


def decode_line(line):
    """One line (bytes, no newline) as a JSON object; raise ProtocolError."""
    if not json_depth_ok(line):
        raise ProtocolError("JSON nested deeper than %d" % MAX_DEPTH)
    try:
        obj = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ProtocolError("not JSON")
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise ProtocolError("not a message object")
    return obj


class LineReader:
    """Splits received bytes into lines in linear time; rejects garbage as soon as it shows.

    Every protocol line is one JSON object, so a line that is blank or does not start with ``{`` is
    garbage at its first byte, and one longer than `limit` at its limit (before its end arrives)."""

    def __init__(self, limit=MAX_MESSAGE):
        self.limit = limit
        self.buf = bytearray()
        self.scanned = 0  # bytes of buf known to hold no newline

    def feed(self, data):
        """Add received bytes; return the complete lines (bytes); raise ProtocolError on garbage."""
        buf = self.buf
        buf += data
        lines = []
        start = 0
        while True:
            end = buf.find(b"\n", max(start, self.scanned))
            if end < 0:
                break
            if end == start:
                raise ProtocolError("blank line")
            if buf[start] != 0x7B:
                raise ProtocolError("not a JSON object")
            if end - start > self.limit:
                raise ProtocolError("line longer than %d bytes" % self.limit)
            lines.append(bytes(buf[start:end]))
            start = end + 1
        if start:
            del buf[:start]
        self.scanned = len(buf)
        if buf and buf[0] != 0x7B:
            raise ProtocolError("not a JSON object" if buf[0] != 0x0A else "blank line")
        if len(buf) > self.limit:
            raise ProtocolError("line longer than %d bytes" % self.limit)
        return lines


def auth_proof(token, side, job, host, nonce_c, nonce_p):
    """HMAC-SHA256 (hex) of one side's role, the job, the peer host and both nonces, keyed by the job token."""
    msg = "\0".join(("clusterctl-agent/%d" % PROTOCOL_VERSION, side, job, host, nonce_c, nonce_p))
    return hmac.new(token.encode("utf-8"), msg.encode("utf-8"), "sha256").hexdigest()


def proof_ok(expected, got):
    """Constant-time comparison of a hex proof with whatever the other side sent."""
    return isinstance(got, str) and hmac.compare_digest(expected.encode(), got.encode("utf-8", "replace"))


def new_nonce():
    """A fresh nonce: NONCE_BYTES random bytes in hex."""
    return os.urandom(NONCE_BYTES).hex()


def _brief(value, limit=200):
    """A repr of untrusted data, cut short and free of control characters, for a log line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...(%d chars)" % len(text)


class LogLimiter:
    """Rate-limits log lines per kind: LOG_BURST per LOG_WINDOW, then one line with the count suppressed."""

    def __init__(self, burst=LOG_BURST, window=LOG_WINDOW, sink=None):
        self.burst, self.window = burst, window
        self.sink = sink or log
        self.kinds = {}  # kind -> [window start, lines in window, suppressed]

    def __call__(self, kind, msg, now=None):
        """Log msg unless this kind already logged `burst` lines in the current window."""
        now = time.monotonic() if now is None else now
        st = self.kinds.setdefault(kind, [now, 0, 0])
        if now - st[0] >= self.window:
            if st[2]:
                self.sink("(%d more %s message(s) suppressed in the last %.0fs)" % (st[2], kind, now - st[0]))
            st[:] = [now, 0, 0]
        if st[1] < self.burst:
            st[1] += 1
            self.sink(msg)
        else:
            st[2] += 1


class Conn:
    """One newline-delimited-JSON TCP connection (peer <-> coordinator), and what its link knows of it."""

    def __init__(self, sock, addr, now, auth_timeout=AUTH_TIMEOUT, clock=time.monotonic):
        self.sock = sock
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # every message is one small write, often right after another (challenge, welcome, go): with Nagle's
            # algorithm a write waits for the ACK of the one before, which the other end delays (~40 ms), and
            # every multi-host start waited that long for its `go`
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.clock = clock
        self.source = addr[0] if isinstance(addr, tuple) else str(addr)
        self.addr = "%s:%s" % (addr[0], addr[1]) if isinstance(addr, tuple) else str(addr)
        self.reader = LineReader()
        self.host = None  # the peer's label, once authenticated
        self.authed = False
        self.opened = now
        self.last_rx = self.last_tx = now
        self.deadline = now + auth_timeout
        self.nonce = new_nonce()  # ours: the coordinator's challenge, or the peer's own nonce
        self.their_nonce = None  # peer side: the coordinator's challenge
        self.closed = False
        self.received = 0  # bytes read

    def send(self, msg):
        """Send one message; False if the connection is broken (or the other end reads nothing)."""
        try:
            self.sock.sendall(json.dumps(msg, sort_keys=True).encode() + b"\n")
        except OSError:
            return False
        self.last_tx = self.clock()
        return True

    def receive(self):
        """Read what already arrived: a list of JSON objects ([] if nothing), or None on EOF; raise
        ProtocolError on garbage. Never waits (a socket with a timeout would first wait up to it, so the read
        is made non-blocking; the timeout stays for sends)."""
        timeout = self.sock.gettimeout()
        try:
            self.sock.setblocking(False)
            data = self.sock.recv(65536)
        except (BlockingIOError, socket.timeout, InterruptedError):
            return []
        except OSError:
            return None
        finally:
            self._restore_timeout(timeout)
        if not data:
            return None
        self.last_rx = self.clock()
        self.received += len(data)
        return [decode_line(line) for line in self.reader.feed(data)]

    def _restore_timeout(self, timeout):
        try:
            self.sock.settimeout(timeout)
        except OSError:
            pass

    def close(self):
        """Close the socket (idempotent)."""
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass

