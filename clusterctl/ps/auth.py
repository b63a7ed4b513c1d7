"""Who may talk to a pserver: CURVE keys derived from the job token, and the client's view of the handshake.

Every connection between a trainer and a pserver runs ZeroMQ's CURVE mechanism (CurveZMQ, RFC 26):
the keys are not exchanged but derived from the job's process token (``CLUSTERCTL_JOB_TOKEN``, set by
the host supervisor), so only the job's processes hold them::

    server secret key = HMAC-SHA256(token, "clusterctl-ps/curve/server/1")     (32 bytes, Curve25519)
    client secret key = HMAC-SHA256(token, "clusterctl-ps/curve/client/1")
    public keys       = crypto_scalarmult_base(secret key)

The client must know the server's public key to start the handshake and proves, inside it, that it holds
the client secret key; the pserver's ZAP handler (door.py) lets in only the client public key of the
same token. The handshake uses fresh ephemeral keys and a cookie on every connection, and every frame
after it is encrypted and authenticated (Poly1305) with a strictly increasing per-connection nonce, so
a recorded connection cannot be replayed and a frame cannot be altered, dropped in or spliced from
another message. libzmq accepts no message frame before the handshake succeeded (docs/security.md).

Without a token a pserver and a trainer refuse to start unless ``CLUSTERCTL_AUTH=none`` says, in so
many words, that the job runs unauthenticated (plain ZMTP; logged loudly once per process).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import zmq
import zmq.utils.z85
from zmq.utils.monitor import parse_monitor_message

from .errors import AuthError, PsConfigError

__all__ = [
    "AUTH_ENV",
    "HANDSHAKE_TIMEOUT_MS",
    "TOKEN_ENV",
    "Credentials",
    "io_threads",
    "HandshakeWatch",
    "resolve",
    "secure_client",
    "secure_server",
]

log = logging.getLogger(__name__)

#: The job's secret for the processes of a job; the host agent sets it (never in argv or logs).
TOKEN_ENV = "CLUSTERCTL_JOB_TOKEN"
#: ``none`` (and only that) lets a pserver or trainer run without a token, unauthenticated.
AUTH_ENV = "CLUSTERCTL_AUTH"
#: A connection must finish its handshake (CURVE and the ZAP check) within this time, or libzmq drops it.
HANDSHAKE_TIMEOUT_MS = 5000

_warned: set[str] = set()


@dataclass(frozen=True)
class Credentials:
    """The job's CURVE key pairs (Z85-encoded, as libzmq's socket options take them)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @property
    def client_public_raw(self) -> bytes:
        """The client public key as 32 raw bytes (what a ZAP request carries)."""
        return zmq.utils.z85.decode(self.client_public)

    @classmethod
    def from_token(cls, token: str) -> Credentials:
        """Both key pairs, derived from the job's process token."""
        pairs = []
        for who in (b"server", b"client"):
            secret = zmq.utils.z85.encode(hmac.new(token.encode(), b"clusterctl-ps/curve/" + who + b"/1",
                                                   hashlib.sha256).digest())
            pairs.append((zmq.curve_public(secret), secret))
        (sp, ss), (cp, cs) = pairs
        return cls(sp, ss, cp, cs)

    def __repr__(self) -> str:  # never print secrets
        return f"Credentials(server_public={self.server_public.decode()!r})"


def resolve(token: str | None, auth: str | None, who: str, env: Mapping[str, str] | None = None) -> Credentials | None:
    """The credentials of this process (None: ``CLUSTERCTL_AUTH=none``); PsConfigError when there are none.

    ``token``/``auth`` None: read ``CLUSTERCTL_JOB_TOKEN``/``CLUSTERCTL_AUTH`` from ``env`` (os.environ).
    ``who`` names the process in the messages ("pserver 0", "trainer 3").
    """
    e = os.environ if env is None else env
    if token is None:
        token = e.get(TOKEN_ENV, "")
    if auth is None:
        auth = e.get(AUTH_ENV, "")
    if auth not in ("", "token", "none"):
        raise PsConfigError(f"{who}: {AUTH_ENV} must be 'token' or 'none', got {auth!r}")
    if auth == "none":
        if who not in _warned:
            _warned.add(who)
            log.warning("%s: %s=none: connections are NOT authenticated and NOT encrypted; anyone who can reach "
                        "the pserver port can read and change the parameters (docs/security.md)", who, AUTH_ENV)
        return None
    if not token:
        raise PsConfigError(f"{who}: no job token: {TOKEN_ENV} is not set (clusterctl's supervisor sets it); "
                            f"set {AUTH_ENV}=none to run unauthenticated")
    return Credentials.from_token(token)


def io_threads(connections: int) -> int:
    """libzmq I/O threads for ``connections`` CURVE connections: each runs its crypto in one I/O thread;
    at most 4, at most half the CPUs."""
    return max(1, min(connections, 4, (os.cpu_count() or 2) // 2))


def secure_server(sock: zmq.Socket, creds: Credentials | None, domain: bytes) -> None:
    """Make ``sock`` a CURVE server whose clients the ZAP handler of ``domain`` vets (no-op without credentials)."""
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_TIMEOUT_MS)
    if creds is None:
        return
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, creds.server_secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain)
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler answering: nobody gets in


def secure_client(sock: zmq.Socket, creds: Credentials | None) -> None:
    """Make ``sock`` a CURVE client of the job's pservers (no-op without credentials)."""
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_TIMEOUT_MS)
    if creds is None:
        return
    sock.setsockopt(zmq.CURVE_SERVERKEY, creds.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, creds.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, creds.client_secret)


_WATCHED = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


NULL_CLOSED_MEANS_MISMATCH = 3  # handshakes of a NULL (auth none) client closed by the pserver: a mismatch


class HandshakeWatch:
    """A client's view of its handshakes with each pserver (monitor sockets on its DEALERs).

    A definitive answer (the pserver's ZAP handler refused this trainer's key; one side runs CURVE and
    the other does not) raises AuthError at once; other failures (the pserver closed the connection in
    the middle of the handshake: it holds another token, or evicted the connection under a flood) are
    counted, and named in the timeout error if no reply ever comes. A socket's monitor is switched off
    after its first successful handshake: libzmq 4.3 leaves errno at EAGAIN after emitting
    HANDSHAKE_FAILED_PROTOCOL for a frame that fails its MAC, and the connection then stalls instead of
    being dropped (door.py does not watch that event at all).
    """

    def __init__(self, socks: Sequence[zmq.Socket], endpoints: Sequence[str]):
        self.endpoints = tuple(endpoints)
        self.socks = list(socks)
        self.monitors = [s.get_monitor_socket(_WATCHED) for s in socks]
        self.failures = [0] * len(self.monitors)
        self.last = [""] * len(self.monitors)
        self.succeeded = [False] * len(self.monitors)

    def index(self, sock: zmq.Socket) -> int | None:
        """The pserver index of a monitor socket, or None for another socket."""
        for i, m in enumerate(self.monitors):
            if m is sock:
                return i
        return None

    def check(self, i: int) -> None:
        """Read pserver ``i``'s pending handshake events; raise AuthError on a definitive refusal."""
        mon = self.monitors[i]
        while mon.poll(0):
            try:
                ev = parse_monitor_message(mon.recv_multipart())
            except (zmq.ZMQError, ValueError):  # pragma: no cover - libzmq sends well-formed events
                continue
            event, value = ev["event"], ev["value"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.failures[i] = 0
                if not self.succeeded[i]:
                    self.succeeded[i] = True
                    self.socks[i].disable_monitor()
                continue
            self.failures[i] += 1
            ep = self.endpoints[i]
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                raise AuthError(f"pserver {ep} refused this trainer's key (ZAP status {value}): trainer and pserver "
                                f"do not hold the same {TOKEN_ENV}")
            if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                raise AuthError(f"pserver {ep} and this trainer disagree on authentication: one runs with "
                                f"{TOKEN_ENV} (CURVE), the other with {AUTH_ENV}=none")
            self.last[i] = (f"protocol error 0x{value:08x}" if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                            else f"connection closed during the handshake ({os.strerror(value) if value else 'EOF'})")
            # A NULL handshake (this trainer runs with auth none) has nothing to refuse: against a CURVE pserver
            # libzmq reports the mismatch, or, when the pserver hung up first (a loaded machine), a closed
            # connection. Closed every time, a few times over: the same disagreement.
            if self.failures[i] >= NULL_CLOSED_MEANS_MISMATCH and self.socks[i].getsockopt(zmq.MECHANISM) == zmq.NULL:
                raise AuthError(f"pserver {ep} and this trainer disagree on authentication: one runs with "
                                f"{TOKEN_ENV} (CURVE), the other with {AUTH_ENV}=none")

    def hint(self, i: int) -> str:
        """Why pserver ``i`` may not have answered, for a timeout message ("" when nothing is known)."""
        self.check_quietly(i)
        if self.failures[i] and not self.succeeded[i]:
            return (f" (the authenticated handshake with it failed {self.failures[i]} time(s), last: {self.last[i]}: "
                    f"does it hold this job's {TOKEN_ENV}?)")
        return ""

    def check_quietly(self, i: int) -> None:
        """:meth:`check`, with definitive refusals turned into the hint."""
        try:
            self.check(i)
        except AuthError as exc:
            self.last[i] = str(exc)

    def close(self) -> None:
        """Switch the monitors off and close them (before the watched sockets close)."""
        if not self.monitors:
            return
        for s, ok in zip(self.socks, self.succeeded, strict=True):
            if not ok:
                s.disable_monitor()
        for m in self.monitors:
            m.close(0)
        self.monitors = []
