"""A small PMI-1 server (MPICH's "simple PMI" wire protocol) so that processes started without mpiexec
join one MPI world.

clusterctl's ssh launcher starts every trainer itself (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; GUIDE
§2) and there is no MPI process manager.  Rank 0 runs a :class:`PMIServer` on MASTER_ADDR:MASTER_PORT;
every rank sets ``PMI_PORT``, ``PMI_RANK``, ``PMI_SIZE`` and ``PMI_ID`` before ``MPI_Init``, so MPICH's
PMI-1 client connects to it exactly as it would to hydra's proxy.  The server answers what MPICH 5's
client sends (observed with ``mpiexec -v``): ``initack``, ``init``, ``get_maxes``, ``get_appnum``,
``get_my_kvsname``, ``get_universe_size``, ``get``/``put`` (the KVS, including ``PMI_process_mapping``),
``barrier_in``, ``finalize``, ``abort`` and the name service; ``spawn`` is refused.

Before ``MPI_Init`` each rank also *registers* over the same port (``cmd=clusterctl_hello``, a command of
ours) with its rank, host and pid.  The server answers once every rank has registered (or names the
ranks that did not within the timeout), so MPICH's own client, which does not retry, only connects when
the server is known to be up, and the node layout for ``PMI_process_mapping`` is known.

Every wait is bounded: registration and each PMI barrier fail after ``timeout`` seconds with a message
naming the ranks that never arrived.

Authentication (docs/security.md): a connection must begin with an authenticated ``clusterctl_hello``
(an HMAC-SHA256 of the job token ``CLUSTERCTL_JOB_TOKEN`` over rank, size, host, pid and a nonce) or
with MPICH's ``initack`` carrying the random ``pmiid`` the server gave that rank in its ready answer
(the rank puts it in ``PMI_ID``); anything else first, and every later command on such a connection,
is dropped. Each connection's unsent replies, the key-value store and the name service are bounded.

Why one module of ~650 lines: the PMI wire codec (about 120 lines) and the server that speaks it are one
protocol, read and reviewed together; the server class is one select loop whose handlers share its
key-value store and barrier state.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import selectors
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Sequence

from .errors import CollectiveError

__all__ = ["PMIServer", "parse_command", "format_command", "process_mapping", "register", "spawn_server",
           "HELLO", "READY", "NODE_ENV"]

log = logging.getLogger("clusterctl.collective")

HELLO = "clusterctl_hello"
#: Overrides the node name a rank registers with (tests: several fake nodes on one host).
NODE_ENV = "CLUSTERCTL_COLLECTIVE_PMI_NODE"
READY = "clusterctl_ready"

_KVSNAME_MAX, _KEYLEN_MAX, _VALLEN_MAX = 256, 64, 1024
_MAXLINE = 4096                       # PMIU_MAXLINE in MPICH's client
_MAX_WBUF = 1 << 20                   # unsent replies a connection may hold (a reader that never reads)
_MAX_KEYS_BASE, _MAX_KEYS_PER_RANK = 1024, 256   # KVS entries: base + per rank; names: base
#: The job's shared secret for its processes (set by the host agent; never in argv or logs).
TOKEN_ENV = "CLUSTERCTL_JOB_TOKEN"


def hello_mac(token: str, rank, size, host, pid, nonce) -> str:
    """HMAC-SHA256 (hex) of a clusterctl_hello's fields, keyed by the job token."""
    msg = "\0".join(("clusterctl-pmi-hello/1", str(rank), str(size), str(host), str(pid), str(nonce)))
    return hmac.new(token.encode(), msg.encode(), hashlib.sha256).hexdigest()


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    out, i = [], 0
    while i < len(value):
        if value[i] == "\\" and i + 1 < len(value):
            out.append(value[i + 1])
            i += 2
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace(" ", "\\ ").replace("\n", " ")


def parse_command(line: str) -> tuple[str, dict[str, str]]:
    """Parse one PMI-1 wire line ``cmd=NAME key=value ...`` (backslash escapes) into (NAME, attrs)."""
    line = line.strip("\n")
    if not line.startswith("cmd="):
        raise CollectiveError(f"malformed PMI command {line[:80]!r}: expected 'cmd=...'")
    tokens, cur, i = [], [], 0
    while i < len(line):
        ch = line[i]
        if ch == "\\" and i + 1 < len(line):
            cur.append(line[i:i + 2])
            i += 2
            continue
        if ch == " ":
            if cur:
                tokens.append("".join(cur))
                cur = []
        else:
            cur.append(ch)
        i += 1
    if cur:
        tokens.append("".join(cur))
    attrs: dict[str, str] = {}
    for tok in tokens:
        key, _, value = tok.partition("=")
        attrs[key] = _unescape(value)
    return attrs.pop("cmd"), attrs


def format_command(cmd: str, **attrs) -> bytes:
    """One PMI-1 wire line ``cmd=NAME key=value ...\\n`` (spaces in values escaped)."""
    parts = [f"cmd={cmd}"] + [f"{k}={_escape(str(v))}" for k, v in attrs.items()]
    return (" ".join(parts) + "\n").encode()


def process_mapping(node_of: Sequence[int]) -> str:
    """MPICH's ``PMI_process_mapping`` for the node index of every rank, e.g. ``(vector,(0,2,4))``."""
    runs: list[list[int]] = []                   # [node, count] of consecutive same-node ranks
    for node in node_of:
        if runs and runs[-1][0] == node:
            runs[-1][1] += 1
        else:
            runs.append([node, 1])
    blocks: list[list[int]] = []                 # [first node, node count, ranks per node]
    for node, count in runs:
        last = blocks[-1] if blocks else None
        if last and last[2] == count and last[0] + last[1] == node:
            last[1] += 1
        else:
            blocks.append([node, 1, count])
    return "(vector," + ",".join(f"({a},{b},{c})" for a, b, c in blocks) + ")"


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: str
    rbuf: bytearray = field(default_factory=bytearray)
    wbuf: bytearray = field(default_factory=bytearray)
    rank: int | None = None       # known after clusterctl_hello or initack
    hello: bool = False
    finalized: bool = False
    closing: bool = False
    in_mcmd: bool = False
    authed: bool = False          # a valid hello or initack came first


class PMIServer:
    """PMI-1 server for one job of ``size`` ranks, served by a daemon thread on ``host:port``."""

    def __init__(self, host: str, port: int, size: int, *, timeout: float, kvsname: str | None = None,
                 token: str | None = None):
        if size < 1:
            raise CollectiveError(f"PMI server: size={size} must be >= 1")
        self.host, self.port, self.size = host, int(port), int(size)
        self.timeout = float(timeout)
        self.kvsname = kvsname or f"clusterctl_{uuid.uuid4().hex[:12]}"
        self.kvs: dict[str, str] = {}
        self.names: dict[str, str] = {}
        self.token = token if token is not None else (os.environ.get(TOKEN_ENV) or None)
        self.pmiids: dict[int, int] = {}                 # secret PMI_ID -> rank, given in the ready answer
        self.rejected = 0                                # unauthenticated or over-limit connections dropped
        self._log_window = [0.0, 0, 0]
        self.hosts: dict[int, tuple[str, int]] = {}      # rank -> (host, pid) from clusterctl_hello
        self.error: str | None = None                    # set when the job failed to assemble
        self._waiting_hello: list[_Conn] = []
        self._barrier: list[_Conn] = []
        self._barrier_deadline: float | None = None
        self._barrier_count = 0
        self._finalized: set[int] = set()
        self._started = time.monotonic()
        self._sel = selectors.DefaultSelector()
        self._lsock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self.mapping: str | None = None
        self.done = threading.Event()                    # every rank finalized

    # -- lifecycle -------------------------------------------------------------------------------
    def bind(self) -> "PMIServer":
        """Listen on ``host:port``; raise CollectiveError naming the port if it is taken."""
        try:
            infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise CollectiveError(f"PMI server: cannot resolve MASTER_ADDR={self.host!r}: {e}") from None
        family, _, _, _, addr = infos[0]
        lsock = socket.socket(family, socket.SOCK_STREAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            lsock.bind(addr)
        except OSError as e:
            lsock.close()
            raise CollectiveError(
                f"PMI server: cannot listen on MASTER_ADDR:MASTER_PORT {self.host}:{self.port} ({e.strerror}); "
                "rank 0 serves MPI's process manager there, so nothing else (e.g. torch.distributed) "
                "may use that port in a job that uses clusterctl.collective") from None
        lsock.listen(max(128, self.size))
        lsock.setblocking(False)
        self._lsock = lsock
        self._sel.register(lsock, selectors.EVENT_READ, None)
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        log.debug("PMI server for %d ranks on %s:%d, kvs %s", self.size, self.host, self.port, self.kvsname)
        return self

    def start(self) -> "PMIServer":
        """Bind and serve from a daemon thread (tests; a job's rank 0 uses :func:`spawn_server`)."""
        if self._lsock is None:
            self.bind()
        self._thread = threading.Thread(target=self.serve, name="clusterctl-pmi", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and close every socket."""
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            log.debug("PMI server wake-up failed (already closed)")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def serve(self, *, parent_fd: int | None = None, grace: float = 10.0) -> None:
        """Serve until every rank finalized, or ``parent_fd`` hits EOF and the connections closed (<= grace s)."""
        if parent_fd is not None:
            self._sel.register(parent_fd, selectors.EVENT_READ, "parent")
        parent_gone_at: float | None = None
        try:
            while not self._stop.is_set():
                for key, mask in self._sel.select(timeout=0.2):
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        self._wake_r.recv(64)
                    elif key.data == "parent":
                        if not os.read(parent_fd, 4096):
                            self._sel.unregister(parent_fd)
                            parent_gone_at = time.monotonic()
                            log.debug("PMI server: rank 0 closed its pipe (it is exiting)")
                    else:
                        self._service(key.data, mask)
                self._check_deadlines()
                conns = [k.data for k in self._sel.get_map().values() if isinstance(k.data, _Conn)]
                if self.done.is_set() and not any(c.wbuf for c in conns):
                    break
                if parent_gone_at is not None and (not conns or time.monotonic() > parent_gone_at + grace):
                    break
        except BaseException as e:       # a dead server hangs every rank: say so loudly, then re-raise
            log.critical("PMI server failed: %r", e)
            print(f"clusterctl.collective: PMI server failed: {e!r}", file=sys.stderr, flush=True)
            raise
        finally:
            for key in list(self._sel.get_map().values()):
                if key.data != "parent":
                    key.fileobj.close()
            self._sel.close()
            self._wake_w.close()

    def _accept(self) -> None:
        try:
            sock, addr = self._lsock.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(sock, f"{addr[0]}:{addr[1]}")
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _service(self, conn: _Conn, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(conn)
        if not mask & selectors.EVENT_READ:
            return
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            data = b""
            log.debug("PMI connection %s: %s", conn.peer, e)
        if not data:
            self._drop(conn, eof=True)
            return
        conn.rbuf += data
        while b"\n" in conn.rbuf:
            raw, _, rest = conn.rbuf.partition(b"\n")
            conn.rbuf = bytearray(rest)
            if len(raw) > _MAXLINE * 4:
                self._reject(conn, f"sent a line of {len(raw)} bytes")
                return
            self._line(conn, raw.decode(errors="replace"))
            if conn.sock.fileno() < 0:
                return
            if len(conn.wbuf) > _MAX_WBUF:
                self._reject(conn, f"{len(conn.wbuf)} bytes of replies unread")
                return
        if len(conn.rbuf) > _MAXLINE * 4:
            self._reject(conn, f"sent {len(conn.rbuf)} bytes without a newline")

    def _reject(self, conn: _Conn, why: str) -> None:
        """Drop a connection that broke the rules; count it; log at most 10 lines per 10 s."""
        self.rejected += 1
        w, now = self._log_window, time.monotonic()
        if now - w[0] >= 10.0:
            if w[2]:
                log.warning("PMI: %d more rejected connection(s) not logged", w[2])
            w[:] = [now, 0, 0]
        if w[1] < 10:
            w[1] += 1
            log.warning("PMI connection %s (rank %s): %s; closing", conn.peer, conn.rank, why)
        else:
            w[2] += 1
        self._drop(conn)

    def _send(self, conn: _Conn, cmd: str, **attrs) -> None:
        conn.wbuf += format_command(cmd, **attrs)
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            while conn.wbuf:
                n = conn.sock.send(conn.wbuf)
                del conn.wbuf[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as e:
            log.debug("PMI connection %s: send failed: %s", conn.peer, e)
            self._drop(conn)
            return
        if conn.sock.fileno() < 0:
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.wbuf else 0)
        self._sel.modify(conn.sock, events, conn)
        if conn.closing and not conn.wbuf:
            self._drop(conn)

    def _drop(self, conn: _Conn, *, eof: bool = False) -> None:
        if conn.sock.fileno() < 0:
            return
        self._sel.unregister(conn.sock)
        conn.sock.close()
        if conn in self._waiting_hello:
            self._waiting_hello.remove(conn)
        if conn in self._barrier:
            self._barrier.remove(conn)
        if eof and conn.rank is not None and not conn.hello and not conn.finalized:
            log.warning("PMI: rank %d closed its connection before MPI_Finalize (it exited or crashed)",
                        conn.rank)

    # -- commands --------------------------------------------------------------------------------
    def _line(self, conn: _Conn, line: str) -> None:
        if conn.in_mcmd or line.startswith("mcmd="):       # spawn (multi-line): refuse
            conn.in_mcmd = line.strip() != "endcmd"
            if not conn.in_mcmd:
                self._send(conn, "spawn_result", rc=1,
                           msg="MPI_Comm_spawn is not supported under clusterctl's PMI server")
            return
        try:
            cmd, a = parse_command(line)
        except CollectiveError as e:
            self._reject(conn, str(e))
            return
        if not conn.authed and cmd not in (HELLO, "initack"):
            self._reject(conn, f"{cmd!r} before an authenticated hello or initack")
            return
        log.debug("PMI %s (rank %s): %s", conn.peer, conn.rank, line)
        handler = getattr(self, f"_cmd_{cmd}", None)
        if handler is None:
            log.warning("PMI: unknown command from rank %s: %s", conn.rank, line)
            self._send(conn, "error", rc=1, msg=f"unknown PMI command {cmd}")
            return
        handler(conn, a)

    def _int(self, a: dict, key: str, default: int | None = None) -> int | None:
        try:
            return int(a[key])
        except (KeyError, ValueError):
            return default

    def _cmd_clusterctl_hello(self, conn: _Conn, a: dict) -> None:
        if conn.authed:
            self._reject(conn, "a second hello")
            return
        if self.token is not None:
            want = hello_mac(self.token, a.get("rank"), a.get("size"), a.get("host"), a.get("pid"), a.get("nonce"))
            if not hmac.compare_digest(want.encode(), a.get("mac", "").encode("utf-8", "replace")):
                self._reject(conn, "hello without a valid MAC of the job token")
                return
        conn.authed = True
        rank, size = self._int(a, "rank"), self._int(a, "size")
        problem = None
        if size != self.size:
            problem = f"WORLD_SIZE mismatch: rank 0 says {self.size}, rank {rank} says {size}"
        elif rank is None or not 0 <= rank < self.size:
            problem = f"RANK={a.get('rank')!r} out of range for WORLD_SIZE={self.size}"
        elif rank in self.hosts:
            h, p = self.hosts[rank]
            problem = f"RANK={rank} registered twice (already {h} pid {p}; now {a.get('host')} pid {a.get('pid')})"
        elif self.error is not None:
            problem = self.error
        if problem:
            log.error("PMI: %s", problem)
            conn.closing = True
            self._send(conn, READY, rc=1, msg=problem)
            return
        conn.rank, conn.hello = rank, True
        self.hosts[rank] = (a.get("host", conn.peer), self._int(a, "pid", 0))
        self._waiting_hello.append(conn)
        if len(self.hosts) == self.size:
            order: list[str] = []
            for r in range(self.size):
                if self.hosts[r][0] not in order:
                    order.append(self.hosts[r][0])
            self.mapping = process_mapping([order.index(self.hosts[r][0]) for r in range(self.size)])
            waiting, self._waiting_hello = self._waiting_hello, []
            while len(self.pmiids) < self.size:  # a secret PMI_ID per rank: MPICH's initack must carry it
                self.pmiids.setdefault(secrets.randbelow(2**31 - 2**24) + 2**24, len(self.pmiids))
            by_rank = {r: i for i, r in self.pmiids.items()}
            for c in waiting:
                c.closing = True
                self._send(c, READY, rc=0, kvsname=self.kvsname, mapping=self.mapping, pmiid=by_rank[c.rank])

    def _cmd_initack(self, conn: _Conn, a: dict) -> None:
        rank = self.pmiids.get(self._int(a, "pmiid", -1))
        if rank is None or conn.authed:
            self._reject(conn, "initack without a PMI_ID this server gave out")
            return
        conn.rank, conn.authed = rank, True
        # The fullinit answer is four lines (MPICH's "v1-initack" wire form, as hydra's proxy sends it).
        conn.wbuf += b"".join([format_command("initack", rc=0), format_command("set", size=self.size),
                               format_command("set", rank=rank), format_command("set", debug=0)])
        self._flush(conn)

    def _cmd_init(self, conn: _Conn, a: dict) -> None:
        self._send(conn, "response_to_init", rc=0, pmi_version=1, pmi_subversion=1)

    def _cmd_get_maxes(self, conn: _Conn, a: dict) -> None:
        self._send(conn, "maxes", rc=0, kvsname_max=_KVSNAME_MAX, keylen_max=_KEYLEN_MAX,
                   vallen_max=_VALLEN_MAX)

    def _cmd_get_appnum(self, conn: _Conn, a: dict) -> None:
        self._send(conn, "appnum", rc=0, appnum=0)

    def _cmd_get_my_kvsname(self, conn: _Conn, a: dict) -> None:
        self._send(conn, "my_kvsname", rc=0, kvsname=self.kvsname)

    def _cmd_get_universe_size(self, conn: _Conn, a: dict) -> None:
        self._send(conn, "universe_size", rc=0, size=self.size)

    def _cmd_put(self, conn: _Conn, a: dict) -> None:
        key, value = a.get("key"), a.get("value", "")
        if key is None or a.get("kvsname", self.kvsname) != self.kvsname:
            self._send(conn, "put_result", rc=1, msg=f"bad put: kvsname={a.get('kvsname')} key={key}")
            return
        if len(key) > _KEYLEN_MAX or len(value) > _VALLEN_MAX:
            self._send(conn, "put_result", rc=1, msg=f"key or value longer than {_KEYLEN_MAX}/{_VALLEN_MAX}")
            return
        if key not in self.kvs and len(self.kvs) >= _MAX_KEYS_BASE + _MAX_KEYS_PER_RANK * self.size:
            self._send(conn, "put_result", rc=1, msg=f"the key-value store is full ({len(self.kvs)} keys)")
            return
        self.kvs[key] = value
        self._send(conn, "put_result", rc=0)

    def _cmd_get(self, conn: _Conn, a: dict) -> None:
        key = a.get("key", "")
        value = self.mapping if key == "PMI_process_mapping" else self.kvs.get(key)
        if value is None:
            self._send(conn, "get_result", rc=1)      # like hydra: not found, no value
        else:
            self._send(conn, "get_result", rc=0, value=value)

    def _cmd_barrier_in(self, conn: _Conn, a: dict) -> None:
        if not self._barrier:
            self._barrier_deadline = time.monotonic() + self.timeout
        self._barrier.append(conn)
        if len(self._barrier) == self.size:
            waiting, self._barrier, self._barrier_deadline = self._barrier, [], None
            self._barrier_count += 1
            for c in waiting:
                self._send(c, "barrier_out", rc=0)

    def _cmd_finalize(self, conn: _Conn, a: dict) -> None:
        conn.finalized = True
        if conn.rank is not None:
            self._finalized.add(conn.rank)
        self._send(conn, "finalize_ack", rc=0)
        if len(self._finalized) == self.size:
            self.done.set()

    def _cmd_abort(self, conn: _Conn, a: dict) -> None:
        who = f"rank {conn.rank}" if conn.rank is not None else f"process at {conn.peer}"
        msg = f"{who} called MPI_Abort (exit code {a.get('exitcode', '?')}): {a.get('message', '')}".rstrip(": ")
        log.error("PMI: %s", msg)
        print(f"clusterctl.collective: {msg}", file=sys.stderr, flush=True)

    def _cmd_publish_name(self, conn: _Conn, a: dict) -> None:
        service, port = a.get("service", ""), a.get("port", "")
        if len(service) > _KEYLEN_MAX or len(port) > _VALLEN_MAX or (
                service not in self.names and len(self.names) >= _MAX_KEYS_BASE):
            self._send(conn, "publish_result", rc=1, msg="name service full or entry too long")
            return
        self.names[service] = port
        self._send(conn, "publish_result", rc=0)

    def _cmd_unpublish_name(self, conn: _Conn, a: dict) -> None:
        found = self.names.pop(a.get("service", ""), None) is not None
        self._send(conn, "unpublish_result", rc=0 if found else 1)

    def _cmd_lookup_name(self, conn: _Conn, a: dict) -> None:
        port = self.names.get(a.get("service", ""))
        if port is None:
            self._send(conn, "lookup_result", rc=1)
        else:
            self._send(conn, "lookup_result", rc=0, port=port)

    # -- deadlines -------------------------------------------------------------------------------
    def _missing(self, present) -> str:
        absent = [r for r in range(self.size) if r not in present]
        return ", ".join(str(r) for r in absent)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        if len(self.hosts) < self.size and self.error is None and now > self._started + self.timeout:
            self.error = (f"rank(s) {self._missing(self.hosts)} of {self.size} never connected to "
                          f"{self.host}:{self.port} within {self.timeout:g}s")
            log.error("PMI: %s", self.error)
            waiting, self._waiting_hello = self._waiting_hello, []
            for c in waiting:
                c.closing = True
                self._send(c, READY, rc=1, msg=self.error)
        if self._barrier_deadline is not None and now > self._barrier_deadline:
            present = {c.rank for c in self._barrier}
            msg = (f"PMI barrier #{self._barrier_count + 1} timed out after {self.timeout:g}s: "
                   f"rank(s) {self._missing(present)} never arrived")
            log.error("PMI: %s", msg)
            print(f"clusterctl.collective: {msg}", file=sys.stderr, flush=True)
            # MPICH's client treats a closed PMI socket as an error: the waiting ranks fail instead of hanging.
            waiting, self._barrier, self._barrier_deadline = self._barrier, [], None
            for c in waiting:
                self._drop(c)


def register(host: str, port: int, *, rank: int, size: int, timeout: float) -> dict[str, str]:
    """Connect to rank 0's PMI server (retrying until it listens), register, and wait until every rank has."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    last: OSError | None = None
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            break
        except OSError as e:
            last = e
            if time.monotonic() + delay > deadline:
                raise CollectiveError(
                    f"rank {rank}: could not reach rank 0's PMI server at MASTER_ADDR:MASTER_PORT {host}:{port} "
                    f"within {timeout:g}s ({last}); is rank 0 running?") from None
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # The node name decides which ranks MPICH treats as local (shared memory); tests may fake nodes.
        node = os.environ.get(NODE_ENV, "").strip() or socket.gethostname()
        hello = {"rank": rank, "size": size, "host": node, "pid": os.getpid(), "nonce": secrets.token_hex(16)}
        token = os.environ.get(TOKEN_ENV)
        if token:
            hello["mac"] = hello_mac(token, **hello)
        sock.sendall(format_command(HELLO, **hello))
        # The server answers when every rank registered, or at its own deadline; allow for clock skew.
        sock.settimeout(timeout + 10)
        buf = b""
        try:
            while not buf.endswith(b"\n"):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                buf += chunk
        except socket.timeout:
            raise CollectiveError(f"rank {rank}: no answer from the PMI server at {host}:{port} within "
                                  f"{timeout + 10:g}s") from None
    if not buf:
        raise CollectiveError(f"rank {rank}: the PMI server at {host}:{port} closed the connection "
                              "(is another job's rank 0 on that port?)")
    cmd, a = parse_command(buf.decode(errors="replace"))
    if cmd != READY:
        raise CollectiveError(f"rank {rank}: unexpected answer from {host}:{port}: {buf[:200]!r}")
    if a.get("rc") != "0":
        raise CollectiveError(f"rank {rank}: joining the MPI world failed: {a.get('msg', 'unknown error')}")
    return a


def spawn_server(host: str, port: int, size: int, *, timeout: float, start_timeout: float = 60.0):
    """Start the PMI server as a child process of rank 0 (``python -m clusterctl.collective.pmi``).

    A child process, not a thread: rank 0's own MPI_Init runs with the GIL held and MPICH sends its PMI
    ``finalize`` from a library destructor after the interpreter has stopped its threads, so a server
    thread inside rank 0 could answer neither.  The child reads its stdin (a pipe from rank 0): at EOF
    rank 0 has gone, and it exits once the other ranks' connections closed (at most 10 s later); it
    also exits as soon as every rank has finalized.  It stays in rank 0's process group and
    environment, so clusterctl's stop and orphan sweep cover it.
    """
    import subprocess
    cmd = [sys.executable, "-m", "clusterctl.collective.pmi", "--host", host, "--port", str(port),
           "--size", str(size), "--timeout", str(timeout)]
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    ready = sel.select(timeout=start_timeout)
    sel.close()
    line = proc.stdout.readline().strip() if ready else ""
    if not line.startswith("listening "):
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        raise CollectiveError(line.removeprefix("error: ") if line.startswith("error: ") else
                              f"PMI server did not start within {start_timeout:g}s ({' '.join(cmd)}; "
                              f"exit status {proc.returncode})")
    proc.stdout.close()
    return proc


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the PMI server child process (see :func:`spawn_server`)."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m clusterctl.collective.pmi", description=__doc__.splitlines()[0])
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--timeout", type=float, required=True)
    args = ap.parse_args(argv)
    level = logging.DEBUG if os.environ.get("CLUSTERCTL_COLLECTIVE_PMI_DEBUG") == "1" else logging.WARNING
    logging.basicConfig(level=level, format="clusterctl.collective PMI server: %(message)s")
    server = PMIServer(args.host, args.port, args.size, timeout=args.timeout)
    try:
        server.bind()
    except CollectiveError as e:
        print(f"error: {e}", flush=True)
        return 2
    print(f"listening {args.host}:{args.port} {server.kvsname}", flush=True)
    server.serve(parent_fd=sys.stdin.fileno())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
