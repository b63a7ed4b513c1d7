"""A PMI-1 server (MPICH's "simple PMI" wire protocol) so that processes started without mpiexec join
one MPI world, spawn more processes, finalize and abort as under hydra.

clusterctl's ssh launcher starts every trainer itself (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; GUIDE
§2) and there is no MPI process manager.  Rank 0 runs a :class:`PMIServer` on MASTER_ADDR:MASTER_PORT;
every rank sets ``PMI_PORT``, ``PMI_RANK``, ``PMI_SIZE`` and ``PMI_ID`` before ``MPI_Init``, so MPICH's
PMI-1 client connects to it exactly as it would to hydra's proxy.  What the server answers (observed
with MPICH 5's client, checked against src/pmi/src/pmi_v1.c): ``initack``, ``init``, ``get_maxes``,
``get_appnum``, ``get_my_kvsname``, ``get_universe_size``, ``get``/``put`` (a key-value store per
world, ``PMI_process_mapping`` included), ``barrier_in``, ``finalize``, ``abort``, the name service and
``mcmd=spawn`` (MPI_Comm_spawn / Spawn_multiple).

Before ``MPI_Init`` each rank *registers* over the same port (``cmd=clusterctl_hello``, a command of
ours, carrying an HMAC of the job token) and keeps that connection open: it is the rank's *control
connection* (:mod:`clusterctl.collective.pmiclient`).  The server answers the hello once every rank
has registered (``clusterctl_ready``, MACed over the rank's nonce), and later sends over it, as JSON
lines, the orders only a process on the rank's host can carry out: start the processes a spawn asked
for (on the spawning rank's host, with the job's environment), and end the job's processes after an
``MPI_Abort``.

Worlds: the job's ranks are world 0; every spawn makes a new world (its own KVS name, size, appnums,
barriers and secret ``PMI_ID``s; the spawner's ``PARENT_ROOT_PORT_NAME`` pre-put into its KVS).  A
barrier completes when every rank of its world arrived or *left* (closed its PMI connection without
finalizing), so a rank that crashed does not make the others' ``MPI_Finalize`` fail; a refused or
malformed command gets exactly one error reply, so MPICH's client stays in step.  The server exits
once every process of every world finalized (or left), or, after rank 0 is gone, once no
authenticated connection is left.

Every wait is bounded: registration and each PMI barrier fail after ``timeout`` seconds naming the
ranks that never arrived; a spawn order unanswered for 60 s fails the spawn.

Authentication and floods (docs/security.md): the server refuses to run without the job token unless
``CLUSTERCTL_AUTH=none``.  A connection must begin with an authenticated ``clusterctl_hello`` or with
MPICH's ``initack`` carrying a ``pmiid`` the server gave out; nothing else is parsed before that (the
first line is checked by prefix, ≤ 1 KiB).  Unauthenticated connections are capped (256 in all, 64
per source address; the oldest is evicted once it is 0.25 s old, accepting pauses otherwise), must
authenticate within 10 s, and accept errors (EMFILE) evict one and pause instead of ending the
server.  Lines are split in linear time; blank and malformed lines count as garbage (100 and the
connection is dropped); replies a client does not read, the key-value stores, the name service,
spawn messages and live worlds are bounded.

Why one module of ~1000 lines: the server is one select loop whose handlers share its worlds,
connections and limits; the wire codec lives in :mod:`clusterctl.collective.pmiwire` and the rank
side in :mod:`clusterctl.collective.pmiclient`.
"""

from __future__ import annotations

import collections
import errno
import hmac
import json
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
from .pmiclient import ABORT_FILE, abort_record, join, register, write_private_json
from .pmiwire import (AUTH_ENV, HELLO, NODE_ENV, READY, TOKEN_ENV, format_command, hello_mac, parse_command,
                      parse_spawn, process_mapping, ready_mac)

__all__ = ["PMIServer", "parse_command", "format_command", "process_mapping", "register", "join", "spawn_server",
           "HELLO", "READY", "NODE_ENV", "TOKEN_ENV", "AUTH_ENV", "ABORT_FILE", "refusal"]

log = logging.getLogger("clusterctl.collective")

_KVSNAME_MAX, _KEYLEN_MAX, _VALLEN_MAX = 256, 64, 1024
_MAX_LINE = 16384                     # an authenticated PMI line (MPICH's PMIU_MAXLINE is 1024)
_MAX_UNAUTH_LINE = 1024               # the first line of a connection: a hello or an initack
_MAX_CONTROL_LINE = 65536             # a JSON line from a rank's control connection
_MAX_MCMD = 256 * 1024                # one spawn message (all its lines)
_MAX_WBUF = 1 << 20                   # unsent replies a connection may hold (a reader that never reads)
_MAX_KEYS_BASE, _MAX_KEYS_PER_RANK = 1024, 256   # KVS entries per world: base + per rank; names: base
_MAX_GARBAGE = 100                    # blank or malformed lines an authenticated connection may send
_MAX_UNAUTH = 256                     # unauthenticated connections held at once ...
_MAX_UNAUTH_PER_SOURCE = 64           # ... and from one source address
_EVICT_MIN_AGE = 0.25                 # an unauthenticated connection is not evicted younger than this
_ACCEPTS_PER_ROUND = 16               # accepts per loop round (reads come first)
AUTH_DEADLINE = 10.0                  # seconds a connection has to authenticate
_SPAWN_REPLY_TIMEOUT = 60.0           # a rank's answer to a spawn order
_MAX_WORLDS = 256                     # spawned worlds alive at once
JOBDIR_ENV = "CLUSTERCTL_JOBDIR"
#: The PMI-1 commands an authenticated MPICH connection may send (one line each; spawn is ``mcmd=``).
_COMMANDS = frozenset(("init", "get_maxes", "get_appnum", "get_my_kvsname", "get_universe_size", "put", "get",
                       "barrier_in", "finalize", "abort", "publish_name", "unpublish_name", "lookup_name"))


def refusal() -> str:
    """The one line a server or rank says when it has neither the job token nor CLUSTERCTL_AUTH=none."""
    return (f"{TOKEN_ENV} is not set and {AUTH_ENV} is not 'none': refusing to serve MPI's process manager "
            "unauthenticated (clusterctl's supervisor sets the token; set job.auth: none in the spec to run "
            "without authentication on a trusted network)")


@dataclass(eq=False)
class _World:
    """One MPI_COMM_WORLD: the job's ranks (world 0) or the processes of one spawn."""

    kvsname: str
    size: int
    mapping: str
    executor: int | None = None       # spawned worlds: the job rank whose control connection started them
    parent: str = ""                  # spawned worlds: who spawned them (for messages)
    appnums: list[int] = field(default_factory=list)
    kvs: dict[str, str] = field(default_factory=dict)
    pmiids: dict[int, int] = field(default_factory=dict)      # rank -> secret PMI_ID
    conns: dict[int, "_Conn"] = field(default_factory=dict)   # rank -> its MPICH connection
    pids: dict[int, int] = field(default_factory=dict)        # spawned worlds: rank -> pid (from the executor)
    finalized: set[int] = field(default_factory=set)
    left: set[int] = field(default_factory=set)               # closed PMI without finalizing, or exited
    exited: set[int] = field(default_factory=set)             # spawned worlds: exits the executor reported
    orphaned: bool = False                                    # spawned worlds: the executor's control is gone
    barrier: list["_Conn"] = field(default_factory=list)
    barrier_deadline: float | None = None
    barrier_count: int = 0
    started: bool = False             # spawned worlds: the executor started the processes

    @property
    def root(self) -> bool:
        """True for the job's own ranks (world 0)."""
        return self.executor is None

    def over(self) -> bool:
        """Every rank finalized or left; for a spawned world, every process's exit reported by its executor
        (while the executor can say: an exit code decides whether the job fails)."""
        if not self.root and not self.orphaned:
            return len(self.exited) >= self.size
        return len(self.finalized | self.left) >= self.size


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: str
    source: str
    since: float
    rbuf: bytearray = field(default_factory=bytearray)
    wbuf: bytearray = field(default_factory=bytearray)
    kind: str = ""                    # "" unauthenticated, "control" (a rank's hello) or "pmi" (MPICH)
    world: _World | None = None
    rank: int | None = None
    nonce: str = ""                   # the hello's nonce (the ready answer's MAC covers it)
    finalized: bool = False
    closing: bool = False
    garbage: int = 0
    mcmd: list[str] | None = None     # lines of a spawn message being received
    mcmd_bytes: int = 0
    mcmd_tot: str = ""
    mcmd_sofar: str = ""
    mcmd_error: str | None = None     # the message broke a bound: consume it, then refuse it


@dataclass(eq=False)
class _Spawn:
    id: int
    conn: _Conn                       # the MPICH connection waiting for spawn_result
    world: _World
    deadline: float


class PMIServer:
    """PMI-1 server for one job of ``size`` ranks, served by a daemon thread on ``host:port``."""

    def __init__(self, host: str, port: int, size: int, *, timeout: float, kvsname: str | None = None,
                 token: str | None = None, auth: str | None = None, auth_deadline: float = AUTH_DEADLINE):
        if size < 1:
            raise CollectiveError(f"PMI server: size={size} must be >= 1")
        self.host, self.port, self.size = host, int(port), int(size)
        self.timeout = float(timeout)
        self.auth_deadline = float(auth_deadline)
        self.token = token if token is not None else (os.environ.get(TOKEN_ENV) or None)
        auth = auth if auth is not None else os.environ.get(AUTH_ENV, "").strip()
        if self.token is None and auth != "none":
            raise CollectiveError(f"PMI server: {refusal()}")
        if self.token is None:
            log.warning("PMI server on %s:%d serves WITHOUT authentication (%s=none): anyone who can reach "
                        "the port can join the job's MPI world", host, self.port, AUTH_ENV)
        self.world = _World(kvsname or f"clusterctl_{uuid.uuid4().hex[:12]}", self.size, "")
        self.world.appnums = [0] * self.size
        self.worlds: dict[str, _World] = {self.world.kvsname: self.world}
        self.pmiids: dict[int, tuple[_World, int]] = {}   # secret PMI_ID -> (world, rank)
        self.names: dict[str, str] = {}
        self.accepted = 0                                # connections accepted
        self.rejected = 0                                # connections dropped for breaking the rules
        self.evicted = 0                                 # unauthenticated connections evicted (cap, deadline)
        self.accept_errors = 0                           # accept() failures (EMFILE, ...) contained
        self.spawned = 0                                 # processes started by spawns
        self._log_window = [0.0, 0, 0]
        self.hosts: dict[int, tuple[str, int]] = {}      # rank -> (host, pid) from clusterctl_hello
        self.control: dict[int, _Conn] = {}              # rank -> its control connection
        self.error: str | None = None                    # set when the job failed to assemble
        self.aborted: dict | None = None                 # the first MPI_Abort's record
        self._waiting_hello: list[_Conn] = []
        self._unauth: collections.OrderedDict[_Conn, None] = collections.OrderedDict()  # oldest first
        self._per_source: collections.Counter[str] = collections.Counter()
        self._spawns: dict[int, _Spawn] = {}
        self._next_spawn = 1
        self._accept_paused_until: float | None = None
        self._started = time.monotonic()
        self._sel = selectors.DefaultSelector()
        self._lsock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self.done = threading.Event()                    # every process of every world finalized (or left)

    # -- compatibility views of world 0 ------------------------------------------------------------
    @property
    def kvsname(self) -> str:
        """The job's world's KVS name."""
        return self.world.kvsname

    @property
    def kvs(self) -> dict[str, str]:
        """The job's world's key-value store."""
        return self.world.kvs

    @property
    def mapping(self) -> str | None:
        """``PMI_process_mapping`` of the job's world (once every rank registered)."""
        return self.world.mapping or None

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

    def _conns(self) -> list[_Conn]:
        return [k.data for k in self._sel.get_map().values() if isinstance(k.data, _Conn)]

    def serve(self, *, parent_fd: int | None = None) -> None:
        """Serve until every process finalized, or ``parent_fd`` hit EOF and no authenticated connection is left."""
        if parent_fd is not None:
            self._sel.register(parent_fd, selectors.EVENT_READ, "parent")
        parent_gone = False
        try:
            while not self._stop.is_set():
                events = self._sel.select(timeout=0.2)
                accept = False
                for key, mask in events:    # reads first: a connection accepted last round authenticates
                    if key.data is None:
                        accept = True
                    elif key.data == "wake":
                        self._wake_r.recv(64)
                    elif key.data == "parent":
                        if not os.read(parent_fd, 4096):
                            self._sel.unregister(parent_fd)
                            parent_gone = True
                            log.debug("PMI server: rank 0 closed its pipe (it is exiting)")
                    elif key.fileobj.fileno() >= 0:
                        self._service(key.data, mask)
                if accept:
                    self._accept_some()
                self._check_deadlines()
                conns = self._conns()
                if self.done.is_set() and not any(c.wbuf for c in conns):
                    break
                if parent_gone and not any(c.kind for c in conns):
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

    # -- accepting, under a flood -----------------------------------------------------------------
    def _pause_accept(self, seconds: float) -> None:
        if self._accept_paused_until is None:
            self._sel.unregister(self._lsock)
        self._accept_paused_until = time.monotonic() + seconds

    def _resume_accept(self) -> None:
        if self._accept_paused_until is not None and time.monotonic() >= self._accept_paused_until:
            self._accept_paused_until = None
            self._sel.register(self._lsock, selectors.EVENT_READ, None)

    def _evict(self, conn: _Conn, why: str) -> None:
        self.evicted += 1
        self._note(f"PMI connection {conn.peer}: {why}; closing")
        self._drop(conn)

    def _evict_old(self, source: str | None) -> bool:
        """Evict the oldest unauthenticated connection (from ``source`` if given) once it is old enough to
        have sent its first line; False, and accepting pauses until then, while it is younger."""
        victim = next((c for c in self._unauth if source is None or c.source == source), None)
        if victim is None:
            return True
        age = time.monotonic() - victim.since
        if age < _EVICT_MIN_AGE:
            self._pause_accept(_EVICT_MIN_AGE - age)
            return False
        self._evict(victim, f"evicted: {len(self._unauth)} unauthenticated connections "
                            f"({self._per_source[victim.source]} from {victim.source}) at the cap")
        return True

    def _make_room(self) -> bool:
        """Bring the unauthenticated connections under the caps (a source over its own first); False while
        the candidates are too young to evict (accepting pauses)."""
        for source in [s for s, n in self._per_source.items() if n > _MAX_UNAUTH_PER_SOURCE]:
            while self._per_source.get(source, 0) > _MAX_UNAUTH_PER_SOURCE:
                if not self._evict_old(source):
                    return False
        while len(self._unauth) >= _MAX_UNAUTH:
            if not self._evict_old(None):
                return False
        return True

    def _accept_some(self) -> None:
        for _ in range(_ACCEPTS_PER_ROUND):
            if not self._make_room():
                return
            try:
                sock, addr = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:           # EMFILE, ENFILE, ENOBUFS, ...: never the end of the server
                self.accept_errors += 1
                self._note(f"PMI server: accept failed: {e.strerror or e}; "
                           f"{len(self._unauth)} unauthenticated connection(s) held")
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM) and self._unauth:
                    self._evict(next(iter(self._unauth)), "evicted: out of file descriptors")
                    continue                # a descriptor is free again: the next accept gets it
                self._pause_accept(0.5)
                return
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                sock.close()
                continue
            self.accepted += 1
            conn = _Conn(sock, f"{addr[0]}:{addr[1]}", str(addr[0]), time.monotonic())
            self._sel.register(sock, selectors.EVENT_READ, conn)
            self._unauth[conn] = None
            self._per_source[conn.source] += 1
            self._service(conn, selectors.EVENT_READ)   # its first line is often already here
            if self._per_source.get(conn.source, 0) > _MAX_UNAUTH_PER_SOURCE and not self._evict_old(conn.source):
                return

    def _authenticated(self, conn: _Conn, kind: str) -> None:
        conn.kind = kind
        self._forget_unauth(conn)

    def _forget_unauth(self, conn: _Conn) -> None:
        if self._unauth.pop(conn, False) is None:
            self._per_source[conn.source] -= 1
            if self._per_source[conn.source] <= 0:
                del self._per_source[conn.source]

    # -- reading, writing, dropping -----------------------------------------------------------------
    def _limit(self, conn: _Conn) -> int:
        if not conn.kind:
            return _MAX_UNAUTH_LINE
        return _MAX_CONTROL_LINE if conn.kind == "control" else _MAX_LINE

    def _service(self, conn: _Conn, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(conn)
            if conn.sock.fileno() < 0:
                return
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
        buf = conn.rbuf
        scan = len(buf)              # the bytes before were already searched for a newline
        buf += data
        start = 0
        while True:                  # linear: each byte is searched once, the buffer trimmed once
            nl = buf.find(b"\n", scan)
            if nl < 0:
                break
            if nl - start > self._limit(conn):
                self._reject(conn, f"sent a line of {nl - start} bytes")
                return
            raw = bytes(buf[start:nl])
            start = scan = nl + 1
            self._line(conn, raw)
            if conn.sock.fileno() < 0:
                return
            if len(conn.wbuf) > _MAX_WBUF:
                self._reject(conn, f"{len(conn.wbuf)} bytes of replies unread")
                return
        del buf[:start]
        if len(buf) > self._limit(conn):
            self._reject(conn, f"sent {len(buf)} bytes without a newline")

    def _note(self, message: str) -> None:
        """Log a warning, at most 10 per 10 s (the rest counted)."""
        w, now = self._log_window, time.monotonic()
        if now - w[0] >= 10.0:
            if w[2]:
                log.warning("PMI: %d more warning(s) about connections not logged", w[2])
            w[:] = [now, 0, 0]
        if w[1] < 10:
            w[1] += 1
            log.warning("%s", message)
        else:
            w[2] += 1

    def _reject(self, conn: _Conn, why: str) -> None:
        """Drop a connection that broke the rules; count it; log rate-limited."""
        self.rejected += 1
        self._note(f"PMI connection {conn.peer} (rank {conn.rank}): {why}; closing")
        self._drop(conn)

    def _send(self, conn: _Conn, cmd: str, **attrs) -> None:
        conn.wbuf += format_command(cmd, **attrs)
        self._flush(conn)

    def _send_json(self, conn: _Conn, obj: dict) -> None:
        conn.wbuf += json.dumps(obj, separators=(",", ":")).encode() + b"\n"
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        if conn.sock.fileno() < 0:
            return
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
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.wbuf else 0)
        self._sel.modify(conn.sock, events, conn)
        if conn.closing and not conn.wbuf:
            self._drop(conn)

    def _drop(self, conn: _Conn, *, eof: bool = False) -> None:
        if conn.sock.fileno() < 0:
            return
        self._sel.unregister(conn.sock)
        conn.sock.close()
        self._forget_unauth(conn)
        if conn in self._waiting_hello:
            self._waiting_hello.remove(conn)
        if conn.kind == "control":
            if self.control.get(conn.rank) is conn:
                del self.control[conn.rank]
                for w in self.worlds.values():
                    if w.executor == conn.rank:
                        w.orphaned = True
            for sp in [s for s in self._spawns.values() if s.world.executor == conn.rank]:
                self._spawn_done(sp, f"rank {conn.rank}'s control connection closed before it started the processes")
            return
        world = conn.world
        if conn.kind != "pmi" or world is None:
            return
        if conn in world.barrier:
            world.barrier.remove(conn)
        if world.conns.get(conn.rank) is conn:
            del world.conns[conn.rank]
        if not conn.finalized:
            world.left.add(conn.rank)
            if eof and self.aborted is None:
                log.warning("PMI: %s closed its connection before MPI_Finalize (it exited or crashed)",
                            self._who(world, conn.rank))
            self._barrier_check(world)
        self._check_done()

    # -- lines ---------------------------------------------------------------------------------------
    def _line(self, conn: _Conn, raw: bytes) -> None:
        if not conn.kind:
            # nothing is parsed before authentication: a hello or an initack, by prefix, or the door
            if not (raw.startswith(b"cmd=" + HELLO.encode() + b" ") or raw.startswith(b"cmd=initack ")):
                self._reject(conn, f"{raw[:40]!r} before an authenticated hello or initack")
                return
            try:
                cmd, a = parse_command(raw.decode("ascii"))
            except (UnicodeDecodeError, CollectiveError):
                self._reject(conn, "a malformed first line")
                return
            if cmd == HELLO:
                self._cmd_clusterctl_hello(conn, a)
            else:
                self._cmd_initack(conn, a)
            return
        line = raw.decode("utf-8", errors="replace")
        if conn.kind == "control":
            self._control_line(conn, line)
            return
        if conn.mcmd is not None or line.startswith("mcmd="):
            try:
                self._mcmd_line(conn, line)
            except Exception as e:    # as below: never the end of the server
                log.exception("PMI: a spawn message failed")
                conn.mcmd = None
                if conn.sock.fileno() >= 0:
                    self._send(conn, "spawn_result", rc=1, msg=f"spawn failed in the PMI server: {e!r}")
            return
        if not line.strip():
            self._garbage(conn, "a blank line")
            return
        try:
            cmd, a = parse_command(line)
        except CollectiveError as e:
            self._garbage(conn, str(e))
            return
        log.debug("PMI %s (%s): %s", conn.peer, self._who(conn.world, conn.rank), line)
        if cmd not in _COMMANDS:
            log.warning("PMI: unknown command from %s: %s", self._who(conn.world, conn.rank), line[:200])
            self._send(conn, "error", rc=1, msg=f"unknown PMI command {cmd}")
            return
        try:
            getattr(self, f"_cmd_{cmd}")(conn, a)
        except Exception as e:        # a bug here must not end the server (every rank would hang)
            log.exception("PMI: %s failed", line[:200])
            if conn.sock.fileno() >= 0:
                self._send(conn, "error", rc=1, msg=f"{cmd} failed in the PMI server: {e!r}")

    def _garbage(self, conn: _Conn, what: str) -> None:
        conn.garbage += 1
        if conn.garbage > _MAX_GARBAGE:
            self._reject(conn, f"{conn.garbage} garbage lines (last: {what})")

    def _mcmd_line(self, conn: _Conn, line: str) -> None:
        """Collect a ``mcmd=spawn`` message; it ends at the ``endcmd`` of the segment whose
        spawnssofar equals totspawns (as MPICH's PMIU_check_full_cmd decides). One reply per message."""
        if conn.mcmd is None:
            conn.mcmd, conn.mcmd_bytes, conn.mcmd_tot, conn.mcmd_sofar, conn.mcmd_error = [], 0, "", "", None
        conn.mcmd_bytes += len(line) + 1
        if line.startswith("totspawns="):
            conn.mcmd_tot = line[10:]
        elif line.startswith("spawnssofar="):
            conn.mcmd_sofar = line[12:]
        if conn.mcmd_error is None:
            if conn.mcmd_bytes > _MAX_MCMD:
                conn.mcmd_error = f"the spawn message is longer than {_MAX_MCMD} bytes"
                conn.mcmd = []
            else:
                conn.mcmd.append(line)
        if line == "endcmd" and conn.mcmd_sofar == conn.mcmd_tot:
            lines, error = conn.mcmd, conn.mcmd_error
            conn.mcmd = None
            self._cmd_spawn(conn, lines, error)

    # -- registration and MPICH's handshake ------------------------------------------------------------
    def _ready(self, conn: _Conn, rc: int, *, msg: str = "", kvsname: str = "", mapping: str = "", pmiid="") -> None:
        attrs = {"rc": rc}
        if rc == 0:
            attrs.update(kvsname=kvsname, mapping=mapping, pmiid=pmiid)
        else:
            attrs["msg"] = msg
        if self.token is not None:
            attrs["mac"] = ready_mac(self.token, conn.nonce, rc, kvsname, mapping, pmiid, msg)
        self._send(conn, READY, **attrs)

    def _cmd_clusterctl_hello(self, conn: _Conn, a: dict) -> None:
        if self.token is not None:
            want = hello_mac(self.token, a.get("rank"), a.get("size"), a.get("host"), a.get("pid"), a.get("nonce"))
            if not hmac.compare_digest(want.encode(), a.get("mac", "").encode("utf-8", "replace")):
                self.rejected += 1
                self._note(f"PMI connection {conn.peer}: hello without a valid MAC of the job token; closing")
                conn.closing = True   # one unauthenticated line (no MAC: the rank retries, then names it)
                self._send(conn, READY, rc=1, msg="authentication failed: the hello's MAC does not match "
                                                  "this job's token (a rank of another job?)")
                return
        self._authenticated(conn, "control")
        conn.nonce = a.get("nonce", "")
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
            self._ready(conn, 1, msg=problem)
            return
        conn.rank = rank
        self.hosts[rank] = (a.get("host", conn.peer), self._int(a, "pid", 0))
        self.control[rank] = conn
        self._waiting_hello.append(conn)
        if len(self.hosts) == self.size:
            order: list[str] = []
            for r in range(self.size):
                if self.hosts[r][0] not in order:
                    order.append(self.hosts[r][0])
            self.world.mapping = process_mapping([order.index(self.hosts[r][0]) for r in range(self.size)])
            for r in range(self.size):   # a secret PMI_ID per rank: MPICH's initack must carry it
                self.world.pmiids[r] = self._new_pmiid(self.world, r)
            waiting, self._waiting_hello = self._waiting_hello, []
            for c in waiting:
                self._ready(c, 0, kvsname=self.kvsname, mapping=self.world.mapping, pmiid=self.world.pmiids[c.rank])

    def _new_pmiid(self, world: _World, rank: int) -> int:
        while True:
            pmiid = secrets.randbelow(2**31 - 2**24) + 2**24
            if pmiid not in self.pmiids:
                self.pmiids[pmiid] = (world, rank)
                return pmiid

    def _cmd_initack(self, conn: _Conn, a: dict) -> None:
        found = self.pmiids.get(self._int(a, "pmiid", -1))
        if found is None:
            self._reject(conn, "initack without a PMI_ID this server gave out")
            return
        world, rank = found
        if rank in world.conns or rank in world.finalized or rank in world.left:
            self._reject(conn, f"initack for {self._who(world, rank)}, which already connected")
            return
        self._authenticated(conn, "pmi")
        conn.world, conn.rank = world, rank
        world.conns[rank] = conn
        # The fullinit answer is four lines (MPICH's "v1-initack" wire form, as hydra's proxy sends it).
        conn.wbuf += b"".join([format_command("initack", rc=0), format_command("set", size=world.size),
                               format_command("set", rank=rank), format_command("set", debug=0)])
        self._flush(conn)

    # -- PMI commands ----------------------------------------------------------------------------------
    def _int(self, a: dict, key: str, default: int | None = None) -> int | None:
        try:
            return int(a[key])
        except (KeyError, ValueError):
            return default

    def _who(self, world: _World | None, rank) -> str:
        if world is None or world.root:
            return f"rank {rank}"
        return f"spawned process {rank} of {world.kvsname} ({world.parent})"

    def _cmd_init(self, conn: _Conn, a: dict) -> None:
        self._send(conn, "response_to_init", rc=0, pmi_version=1, pmi_subversion=1)

    def _cmd_get_maxes(self, conn: _Conn, a: dict) -> None:
        self._send(conn, "maxes", rc=0, kvsname_max=_KVSNAME_MAX, keylen_max=_KEYLEN_MAX,
                   vallen_max=_VALLEN_MAX)

    def _cmd_get_appnum(self, conn: _Conn, a: dict) -> None:
        self._send(conn, "appnum", rc=0, appnum=conn.world.appnums[conn.rank])

    def _cmd_get_my_kvsname(self, conn: _Conn, a: dict) -> None:
        self._send(conn, "my_kvsname", rc=0, kvsname=conn.world.kvsname)

    def _cmd_get_universe_size(self, conn: _Conn, a: dict) -> None:
        self._send(conn, "universe_size", rc=0, size=self.size)

    def _cmd_put(self, conn: _Conn, a: dict) -> None:
        world = conn.world
        key, value = a.get("key"), a.get("value", "")
        if key is None or a.get("kvsname", world.kvsname) != world.kvsname:
            self._send(conn, "put_result", rc=1, msg=f"bad put: kvsname={a.get('kvsname')} key={key}")
            return
        if len(key) > _KEYLEN_MAX or len(value) > _VALLEN_MAX:
            self._send(conn, "put_result", rc=1, msg=f"key or value longer than {_KEYLEN_MAX}/{_VALLEN_MAX}")
            return
        if key not in world.kvs and len(world.kvs) >= _MAX_KEYS_BASE + _MAX_KEYS_PER_RANK * world.size:
            self._send(conn, "put_result", rc=1, msg=f"the key-value store is full ({len(world.kvs)} keys)")
            return
        world.kvs[key] = value
        self._send(conn, "put_result", rc=0)

    def _cmd_get(self, conn: _Conn, a: dict) -> None:
        world = self.worlds.get(a.get("kvsname", ""), conn.world)
        key = a.get("key", "")
        value = world.mapping if key == "PMI_process_mapping" else world.kvs.get(key)
        if value is None:
            self._send(conn, "get_result", rc=1)      # like hydra: not found, no value
        else:
            self._send(conn, "get_result", rc=0, value=value)

    def _cmd_barrier_in(self, conn: _Conn, a: dict) -> None:
        world = conn.world
        if conn in world.barrier:
            self._garbage(conn, "a second barrier_in before barrier_out")
            return
        if not world.barrier:
            world.barrier_deadline = time.monotonic() + self.timeout
        world.barrier.append(conn)
        self._barrier_check(world)

    def _barrier_check(self, world: _World) -> None:
        """Release the barrier once every rank arrived or left (a crashed rank does not hold the others)."""
        if not world.barrier:
            return
        arrived = {c.rank for c in world.barrier}
        if len(arrived | world.left) < world.size:
            return
        if world.left - arrived:
            log.warning("PMI: barrier #%d of %s released without %s (closed before MPI_Finalize)",
                        world.barrier_count + 1, world.kvsname, ", ".join(map(str, sorted(world.left - arrived))))
        waiting, world.barrier, world.barrier_deadline = world.barrier, [], None
        world.barrier_count += 1
        for c in waiting:
            self._send(c, "barrier_out", rc=0)

    def _cmd_finalize(self, conn: _Conn, a: dict) -> None:
        conn.finalized = True
        conn.world.finalized.add(conn.rank)
        self._send(conn, "finalize_ack", rc=0)
        self._check_done()

    def _check_done(self) -> None:
        over = [w for w in self.worlds.values() if not w.root and w.started and w.over()]
        for w in over:                            # a spawned world that ended: forget it
            del self.worlds[w.kvsname]
            for pmiid in w.pmiids.values():
                self.pmiids.pop(pmiid, None)
        if (self.world.finalized and self.world.over() and len(self.worlds) == 1 and not self._spawns):
            self.done.set()

    def _cmd_abort(self, conn: _Conn, a: dict) -> None:
        code = self._int(a, "exitcode", 1)
        self._end_job(conn.world, conn.rank, code, f"{self._who(conn.world, conn.rank)} called MPI_Abort with error "
                                                   f"code {code}")

    def _end_job(self, world: _World, rank: int, code: int, message: str) -> None:
        """An MPI_Abort (or a spawned process that failed before MPI_Finalize, as hydra treats it): record it
        in $CLUSTERCTL_JOBDIR/abort.json and tell every rank's control thread to end its rank."""
        if self.aborted is not None:
            log.debug("PMI: %s too; the job is already ending", message)
            return
        if world.root:
            host, pid = self.hosts.get(rank, ("?", 0))
            job_rank, spawned = rank, None
        else:
            host, pid = self.hosts.get(world.executor, ("?", 0))[0], world.pids.get(rank, 0)
            job_rank, spawned = world.executor, {"world": world.kvsname, "rank": rank, "pid": pid}
        self.aborted = rec = abort_record(job_rank, code, message, host=host, pid=pid, spawned=spawned)
        log.error("PMI: %s", rec["message"])
        print(f"clusterctl.collective: {rec['message']}: ending the job", file=sys.stderr, flush=True)
        jobdir = os.environ.get(JOBDIR_ENV, "")
        if jobdir and os.path.isdir(jobdir):
            try:
                write_private_json(os.path.join(jobdir, ABORT_FILE), rec)
            except OSError as e:
                log.error("PMI: cannot write %s: %s", os.path.join(jobdir, ABORT_FILE), e)
        # the aborting rank's own host first, so its exit is the job's first failure
        ctls = sorted(self.control.values(), key=lambda c: c.rank != job_rank)
        for c in ctls:
            self._send_json(c, {"op": "abort", "aborter": c.rank == job_rank and spawned is None, **rec})
        for sp in list(self._spawns.values()):
            self._spawn_done(sp, "the job is aborting")

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

    # -- spawn -------------------------------------------------------------------------------------------
    def _refuse_spawn(self, conn: _Conn, why: str) -> None:
        log.error("PMI: MPI_Comm_spawn by %s refused: %s", self._who(conn.world, conn.rank), why)
        self._send(conn, "spawn_result", rc=1, msg=why)

    def _cmd_spawn(self, conn: _Conn, lines: list[str], error: str | None) -> None:
        if error is not None:
            self._refuse_spawn(conn, error)
            return
        try:
            req = parse_spawn(lines)
        except CollectiveError as e:
            self._refuse_spawn(conn, str(e))
            return
        parent = conn.world
        executor = conn.rank if parent.root else parent.executor
        ctl = self.control.get(executor)
        if self.aborted is not None:
            self._refuse_spawn(conn, "the job is aborting")
            return
        if ctl is None:
            self._refuse_spawn(conn, f"rank {executor}'s clusterctl control connection is gone")
            return
        if len(self.worlds) > _MAX_WORLDS:
            self._refuse_spawn(conn, f"{_MAX_WORLDS} spawned worlds are alive already")
            return
        bad = [k for k in req.preput if len(k) > _KEYLEN_MAX] + [
            k for k, v in req.preput.items() if len(v) > _VALLEN_MAX]
        if bad:
            self._refuse_spawn(conn, f"pre-put key or value too long: {bad[0][:80]!r}")
            return
        world = _World(f"clusterctl_{uuid.uuid4().hex[:12]}", req.total, process_mapping([0] * req.total),
                       executor=executor, parent=f"spawned by {self._who(parent, conn.rank)}")
        world.kvs.update(req.preput)
        cmds = []
        for appnum, c in enumerate(req.commands):
            world.appnums += [appnum] * c.nprocs
            cmds.append({"argv": c.argv, "nprocs": c.nprocs, "info": c.info, "appnum": appnum})
        pmiids = [self._new_pmiid(world, r) for r in range(world.size)]
        world.pmiids = dict(enumerate(pmiids))
        self.worlds[world.kvsname] = world
        sid, self._next_spawn = self._next_spawn, self._next_spawn + 1
        self._spawns[sid] = _Spawn(sid, conn, world, time.monotonic() + _SPAWN_REPLY_TIMEOUT)
        log.debug("PMI: spawn #%d by %s: %d process(es) on rank %d's host", sid, self._who(parent, conn.rank),
                  world.size, executor)
        self._send_json(ctl, {"op": "spawn", "id": sid, "world": world.kvsname, "size": world.size,
                              "pmiids": pmiids, "cmds": cmds,
                              "spawner": {"world": parent.kvsname, "rank": conn.rank, "root": parent.root}})

    def _spawn_done(self, sp: _Spawn, error: str | None, pids: list | None = None) -> None:
        self._spawns.pop(sp.id, None)
        world = sp.world
        if error is None:
            world.started = True
            world.pids = {r: int(p) for r, p in enumerate(pids or []) if isinstance(p, int)}
            self.spawned += world.size
            if sp.conn.sock.fileno() >= 0:
                self._send(sp.conn, "spawn_result", rc=0, errcodes=",".join(["0"] * world.size))
        else:
            self.worlds.pop(world.kvsname, None)
            for pmiid in world.pmiids.values():
                self.pmiids.pop(pmiid, None)
            for c in list(world.conns.values()):
                self._drop(c)
            if sp.conn.sock.fileno() >= 0:
                self._refuse_spawn(sp.conn, error)
        self._check_done()

    def _control_line(self, conn: _Conn, line: str) -> None:
        """A JSON line from a rank's control connection: the outcome of a spawn order, or a child's exit."""
        try:
            msg = json.loads(line)
        except (ValueError, RecursionError):
            self._garbage(conn, "a line that is not JSON")
            return
        if not isinstance(msg, dict):
            self._garbage(conn, "a JSON line that is not an object")
            return
        op = msg.get("op")
        sp = self._spawns.get(msg.get("id")) if isinstance(msg.get("id"), int) else None
        if op in ("spawned", "spawn_failed") and (sp is None or sp.world.executor != conn.rank):
            self._garbage(conn, f"{op} for an unknown spawn {msg.get('id')!r}")
        elif op == "spawned":
            pids = msg.get("pids")
            self._spawn_done(sp, None, pids if isinstance(pids, list) else [])
        elif op == "spawn_failed":
            self._spawn_done(sp, str(msg.get("error", "failed"))[:2000])
        elif op == "exiting":             # the rank's interpreter is exiting: first read what its MPICH
            pmi = self.world.conns.get(conn.rank)   # connection sent (an abort?), then say bye
            if pmi is not None:
                self._service(pmi, selectors.EVENT_READ)
            self._send_json(conn, {"op": "bye"})
        elif op == "exited":
            world = self.worlds.get(msg.get("world"))
            rank, code = msg.get("rank"), msg.get("code")
            if world is None or world.executor != conn.rank or not isinstance(rank, int) or not 0 <= rank < world.size:
                return                    # a world that ended already
            world.exited.add(rank)
            if rank not in world.finalized and code != 0 and isinstance(code, int):
                # hydra ends the job when a process fails; so does a spawned MPI_Abort on a world of one
                # (MPICH exits at once, without telling the process manager)
                self._end_job(world, rank, code, f"{self._who(world, rank)} (pid {world.pids.get(rank, '?')}) "
                                                 f"exited with code {code} before MPI_Finalize")
            if rank not in world.finalized and rank not in world.left:
                world.left.add(rank)
                self._barrier_check(world)
            self._check_done()
        else:
            self._garbage(conn, f"unknown control message {str(op)[:40]!r}")

    # -- deadlines -------------------------------------------------------------------------------
    def _missing(self, present, size: int) -> str:
        """The ranks of 0..size-1 not in `present`: the first 16, and how many in all (one line, whatever the size)."""
        shown = []
        for r in range(size):
            if r not in present:
                shown.append(str(r))
                if len(shown) == 16:
                    break
        count = size - sum(1 for r in present if isinstance(r, int) and 0 <= r < size)
        return ", ".join(shown) + (f", ... ({count:,} in all)" if count > len(shown) else "")

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        self._resume_accept()
        while self._unauth:
            oldest = next(iter(self._unauth))
            if now - oldest.since <= self.auth_deadline:
                break
            self._evict(oldest, f"did not authenticate within {self.auth_deadline:g}s")
        if len(self.hosts) < self.size and self.error is None and now > self._started + self.timeout:
            self.error = (f"rank(s) {self._missing(self.hosts, self.size)} of {self.size} never connected to "
                          f"{self.host}:{self.port} within {self.timeout:g}s")
            log.error("PMI: %s", self.error)
            waiting, self._waiting_hello = self._waiting_hello, []
            for c in waiting:
                c.closing = True
                self._ready(c, 1, msg=self.error)
        for sp in list(self._spawns.values()):
            if now > sp.deadline:
                self._spawn_done(sp, f"rank {sp.world.executor} did not start the processes within "
                                     f"{_SPAWN_REPLY_TIMEOUT:g}s")
        for world in list(self.worlds.values()):
            if world.barrier_deadline is None or now <= world.barrier_deadline:
                continue
            present = {c.rank for c in world.barrier} | world.left
            msg = (f"PMI barrier #{world.barrier_count + 1} timed out after {self.timeout:g}s: "
                   f"rank(s) {self._missing(present, world.size)} never arrived")
            if not world.root:
                msg += f" ({world.kvsname}, {world.parent})"
            log.error("PMI: %s", msg)
            print(f"clusterctl.collective: {msg}", file=sys.stderr, flush=True)
            # MPICH's client treats a closed PMI socket as an error: the waiting ranks fail instead of hanging.
            waiting, world.barrier, world.barrier_deadline = world.barrier, [], None
            for c in waiting:
                self._drop(c)


def spawn_server(host: str, port: int, size: int, *, timeout: float, start_timeout: float = 60.0):
    """Start the PMI server as a child process of rank 0 (``python -m clusterctl.collective.pmi``).

    A child process, not a thread: rank 0's own MPI_Init runs with the GIL held and MPICH sends its PMI
    ``finalize`` from a library destructor after the interpreter has stopped its threads, so a server
    thread inside rank 0 could answer neither.  The child reads its stdin (a pipe from rank 0): at EOF
    rank 0 has gone, and it exits once no authenticated connection is left; it also exits as soon as
    every process has finalized.  It stays in rank 0's process group and environment, so clusterctl's
    stop and orphan sweep cover it.
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
    fmt = "%(asctime)s " if level == logging.DEBUG else ""
    logging.basicConfig(level=level, format=fmt + "clusterctl.collective PMI server: %(message)s")
    try:
        server = PMIServer(args.host, args.port, args.size, timeout=args.timeout)
        server.bind()
    except CollectiveError as e:
        print(f"error: {e}", flush=True)
        return 2
    print(f"listening {args.host}:{args.port} {server.kvsname}", flush=True)
    server.serve(parent_fd=sys.stdin.fileno())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
