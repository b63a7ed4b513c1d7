"""Deadline-bounded completion of MPI requests, and naming the ranks that never showed up.

Every wait in the package goes through :meth:`Progress.wait`: requests are polled with ``Testall`` until
a deadline.  While polling, the process also answers *pings* on a private duplicate of the communicator,
so a rank that times out can ask every other rank "are you inside a collective?".  Ranks that do not
answer within a grace period are the missing ones (dead, stopped, or busy outside the library); the
timeout message names them with their host and pid.  Then the process raises or aborts the job.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import numpy as np

from .errors import CollectiveError, CollectiveTimeout

__all__ = ["RequestPoller"]

log = logging.getLogger("clusterctl.collective")

TAG_PING = 7301
TAG_PONG = 7302


class RequestPoller:
    """Polls requests until done or a deadline, serving and sending liveness pings on ``ctl``."""

    def __init__(self, ctl, topo, MPI, *, timeout: float, on_timeout: str):
        self.ctl = ctl
        self.topo = topo
        self.MPI = MPI
        self.timeout = float(timeout)
        self.on_timeout = on_timeout
        # Oversubscribed nodes (more local ranks than cores): never busy-spin, yield the core at once.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.spin = 0.0 if topo.local_size > cores else 1e-3
        self.seq = 0                      # number of collectives started by this process
        self.what = "idle"
        self.broken: CollectiveError | None = None
        self._ping_buf = np.zeros(2, dtype=np.int64)
        self._serving = True
        self._status = MPI.Status()
        self._replies: list = []          # (request, buffer) of in-flight pong sends

    # -- liveness service ------------------------------------------------------------------------
    def _serve(self) -> None:
        """Answer pending pings (non-blocking); called from every poll loop.

        A ping is found with ``Iprobe(ANY_SOURCE)`` and received from its sender by rank: no any-source receive
        is ever posted, because MPICH 5.0.2's ch4:ucx never completes one posted while a message from another
        node is already in (docs/benchmarks.md, "testDistgraphcomm"): a standing ``Irecv(ANY_SOURCE)`` re-posted
        after a ping would miss the next one, and a live rank would be named missing."""
        while self._serving and self.ctl.Iprobe(source=self.MPI.ANY_SOURCE, tag=TAG_PING, status=self._status):
            src = self._status.Get_source()
            self.ctl.Recv(self._ping_buf, source=src, tag=TAG_PING)
            out = np.array([self.topo.rank, self.seq], dtype=np.int64)
            self._replies.append((self.ctl.Isend(out, dest=src, tag=TAG_PONG), out))
        if self._replies:
            self._replies = [(r, b) for r, b in self._replies if not r.Test()]

    def close(self) -> None:
        """Stop answering pings (before the communicator is freed)."""
        self._serving = False

    # -- waiting ---------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise the stored error if an earlier collective failed on this communicator."""
        if self.broken is not None:
            raise CollectiveError(f"communicator unusable after an earlier failure: {self.broken}")

    def wait(self, requests, what: str | None = None) -> None:
        """Complete ``requests`` (a Request or list) or fail once the deadline passes."""
        reqs = requests if isinstance(requests, list) else [requests]
        if what is not None:
            self.what = what
        MPI = self.MPI
        if MPI.Request.Testall(reqs):
            return
        start = time.monotonic()
        deadline = start + self.timeout
        spins = 0
        pause = 0.0
        while True:
            if MPI.Request.Testall(reqs):
                return
            spins += 1
            if spins & 63 == 0 or self.spin == 0.0:
                self._serve()
                now = time.monotonic()
                if now > deadline:
                    self._expire(reqs, now - start)
                # Spin for the first millisecond, then back off so oversubscribed ranks yield the core.
                if now - start > self.spin:
                    pause = min(max(pause * 2, 2e-5), 1e-3)
                    time.sleep(pause)

    def wait_for(self, ready, what: str | None = None) -> None:
        """Poll ``ready()`` (e.g. shared-memory flags) until true, with the same deadline and pings as wait()."""
        if ready():
            return
        if what is not None:
            self.what = what
        start = time.monotonic()
        deadline = start + self.timeout
        spins = 0
        pause = 0.0
        while not ready():
            spins += 1
            if spins < 200 and self.spin:
                continue                      # a peer is usually microseconds away
            if spins & 15 == 0:
                self._serve()
                now = time.monotonic()
                if now > deadline:
                    self._expire([], now - start)
                if now - start > self.spin:
                    pause = min(max(pause * 2, 1e-5), 5e-4)
                    time.sleep(pause)
                    continue
            os.sched_yield()

    # -- diagnosis -------------------------------------------------------------------------------
    def _probe_peers(self, grace: float) -> dict[int, int]:
        """Ping every other rank; return {rank: its collective count} for those that answered."""
        me, size = self.topo.rank, self.topo.size
        bufs, recvs, sends = {}, {}, []
        ping = np.array([me, self.seq], dtype=np.int64)
        for r in range(size):
            if r == me:
                continue
            bufs[r] = np.zeros(2, dtype=np.int64)
            recvs[r] = self.ctl.Irecv(bufs[r], source=r, tag=TAG_PONG)
            sends.append(self.ctl.Isend(ping, dest=r, tag=TAG_PING))
        answered: dict[int, int] = {}
        end = time.monotonic() + grace
        while time.monotonic() < end and len(answered) < len(recvs):
            self._serve()
            for r, req in recvs.items():
                if r not in answered and req.Test():
                    answered[r] = int(bufs[r][1])
            time.sleep(1e-3)
        for r, req in recvs.items():
            if r not in answered:
                req.Cancel()
        del sends  # eager-sized; to a stopped peer they may never complete, and that is fine
        return answered

    def _expire(self, reqs, waited: float) -> None:
        topo = self.topo
        grace = min(max(1.0, 0.25 * self.timeout), 10.0)
        answered = self._probe_peers(grace)
        missing = tuple(r for r in range(topo.size) if r != topo.rank and r not in answered)
        op = f"{self.what} (collective #{self.seq})"
        if missing:
            who = ", ".join(topo.describe(r) for r in missing)
            hosts = tuple(sorted({topo.hosts[r] for r in missing}))
            msg = (f"collective timeout after {waited:.1f}s in {op} on {topo.describe(topo.rank)}: "
                   f"missing {who}")
        else:
            behind = {r: c for r, c in answered.items() if c != self.seq}
            detail = (", ".join(f"rank {r} at collective #{c}" for r, c in sorted(behind.items()))
                      or "every rank is inside the same collective")
            hosts = ()
            msg = (f"collective timeout after {waited:.1f}s in {op} on {topo.describe(topo.rank)}: "
                   f"all ranks answered but the collective did not complete ({detail}); "
                   f"the ranks probably issued different collectives")
        err = CollectiveTimeout(msg, missing=missing, hosts=hosts, operation=op, seconds=waited)
        self.broken = err
        log.error("%s", msg)
        if self.on_timeout == "abort":
            # logging may not be configured; the message must reach the job's stderr before the abort.
            print(f"clusterctl.collective: {msg}; aborting the job", file=sys.stderr, flush=True)
            try:
                self.ctl.Abort(124)
            finally:
                os._exit(124)
        for req in reqs:
            try:
                req.Cancel()
            except self.MPI.Exception:
                log.debug("could not cancel a request after a timeout", exc_info=True)
        raise err
