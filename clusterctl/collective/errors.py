"""Exceptions raised by :mod:`clusterctl.collective`, rooted in :class:`clusterctl.errors.ClusterctlError`."""

from __future__ import annotations

from clusterctl.errors import ClusterctlError

__all__ = ["CollectiveError", "CollectiveTimeout"]


class CollectiveError(ClusterctlError):
    """A collective operation could not be set up or completed."""


class CollectiveTimeout(CollectiveError):
    """A collective did not complete within the deadline; names the ranks (and hosts) that never joined."""

    def __init__(self, message: str, *, missing: tuple[int, ...] = (), hosts: tuple[str, ...] = (),
                 operation: str = "", seconds: float = 0.0):
        self.missing = tuple(missing)
        self.hosts = tuple(hosts)
        self.operation = operation
        self.seconds = seconds
        super().__init__(message)
