"""Fixtures for the ps tests: in-process pservers on 127.0.0.1, each in its own thread."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from clusterctl.ps import ParameterServer
from clusterctl.ps.auth import AUTH_ENV, TOKEN_ENV

from ps_jobs import TOKEN  # noqa: E402 (after the sys.path line above)


@pytest.fixture(autouse=True)
def job_token(monkeypatch):
    """Every in-process pserver and trainer of these tests holds the job token, as under clusterctl."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    monkeypatch.delenv(AUTH_ENV, raising=False)
    return TOKEN


class ServerGroup:
    """Pservers serving in background threads; ``errors`` collects what ``serve()`` raised."""

    def __init__(self, n: int, **kw):
        self.servers = [ParameterServer("127.0.0.1:0", server_id=i, num_servers=n, **kw) for i in range(n)]
        for s in self.servers:
            s.bind()
        self.endpoints = [s.endpoint for s in self.servers]
        self.errors: dict[int, BaseException] = {}
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        try:
            self.servers[i].serve()
        except BaseException as exc:  # recorded for the test to assert on
            self.errors[i] = exc

    def join(self, timeout: float = 10.0) -> bool:
        """Wait for every server thread; True if all returned."""
        for t in self.threads:
            t.join(timeout)
        return not any(t.is_alive() for t in self.threads)

    def stop(self) -> None:
        """Stop and join every server."""
        for s in self.servers:
            s.stop()
        self.join()


@pytest.fixture
def servers():
    """Factory: ``servers(n, **ParameterServer kwargs)`` -> ServerGroup, stopped at teardown."""
    groups: list[ServerGroup] = []

    def make(n: int = 1, **kw) -> ServerGroup:
        g = ServerGroup(n, **kw)
        groups.append(g)
        return g

    yield make
    for g in groups:
        g.stop()


@contextmanager
def running(fn, *args) -> Iterator[threading.Thread]:
    """Run ``fn(*args)`` in a daemon thread for the duration of the block."""
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    yield t
    t.join(30)
