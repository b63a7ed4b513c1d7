"""The coordinator's view of the job's peer hosts: who joined, who is done, who was lost. Pure.

One place holds membership (state.json "hosts"): the coordinator link (clusterctl/host/coordinator.py)
says who connected and who went away, the supervisor says who finished its stop, and the rules
(clusterctl/host/rules.py) read who is connected, who is still stopping and who never joined.
"""

from .states import HostState

__all__ = ["Membership"]


class Membership:
    """The peer hosts of a job (all hosts but the coordinator's) and where each stands."""

    def __init__(self, expected):
        self.expected = expected  # peer hosts the job needs (the job's hosts - 1)
        self.records = {}  # label -> {"state": HostState, "since": epoch, ...}: state.json "hosts"
        self.connected = set()
        self.finished = set()  # connected peers whose local stop of this attempt is done
        self.ever = set()  # every peer that joined at least once

    def join(self, host, addr, now, done=False):
        """`host` authenticated (or came back) from `addr`; `done`: its processes are already stopped."""
        self.connected.add(host)
        self.ever.add(host)
        if done:
            self.finished.add(host)
        else:
            self.finished.discard(host)
        self.records[host] = {"state": HostState.DONE if done else HostState.CONNECTED, "since": now, "addr": addr}

    def mark_done(self, host, now):
        """`host` finished its local stop of the current attempt."""
        if host in self.connected:
            self.finished.add(host)
            self.records[host] = {"state": HostState.DONE, "since": now}

    def leave(self, host, why, now, deciding):
        """`host`'s connection is gone. True when that is a lost host for the rules: it had not finished its
        stop and the attempt has no verdict yet (`deciding`); recorded `lost`, else `disconnected`."""
        self.connected.discard(host)
        if host in self.finished:
            return False  # it said `done`: its going away is expected
        self.records[host] = {"state": HostState.LOST if deciding else HostState.DISCONNECTED, "since": now,
                              "why": why}
        return deciding

    def new_attempt(self, now):
        """A new attempt starts: every connected peer is in it, none is done."""
        self.finished.clear()
        for host in self.connected:
            addr = self.records.get(host, {}).get("addr")
            self.records[host] = {"state": HostState.CONNECTED, "since": now, "addr": addr}

    def waiting(self):
        """Connected peers that have not finished their stop, sorted."""
        return sorted(self.connected - self.finished)

    def unjoined(self):
        """How many expected peers never joined."""
        return max(0, self.expected - len(self.ever))

    def to_json(self):
        """state.json "hosts"."""
        return {h: dict(r) for h, r in self.records.items()}
