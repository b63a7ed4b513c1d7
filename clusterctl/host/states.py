"""Job, process and host states: string enums, so the JSON on the wire and in state.json stays plain text.

A member is a `str` (``JobState.RUNNING == "running"``, ``json.dumps`` writes ``"running"``), so a state
read back from JSON compares equal to the member. Hosts may run Python 3.9, which has no `enum.StrEnum`:
the same behaviour is built from `str` and `Enum` there.
"""

import enum

try:
    from enum import StrEnum
except ImportError:  # Python < 3.11 on a host

    class StrEnum(str, enum.Enum):
        """`enum.StrEnum` for Python < 3.11: members are strings and print as their value."""

        __str__ = str.__str__
        __format__ = str.__format__


class JobState(StrEnum):
    """A job's state on one host (state.json "state", the controller's JobStatus.state)."""

    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    RESTARTING = "restarting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    LOST = "lost"  # the supervisor is gone and never recorded a terminal state
    UNKNOWN = "unknown"  # no state on the host (never launched there)
    NOT_RUNNING = "not running"  # the controller's fold of every host's state: no state on any host
    PENDING = "pending"  # backend: slurm: the batch job waits for its allocation


class ProcState(StrEnum):
    """One process's state (state.json "processes"[i]["state"])."""

    PENDING = "pending"
    RUNNING = "running"
    EXITED = "exited"  # exit code 0
    FAILED = "failed"
    STOPPED = "stopped"  # ended by a stop (or never started because of one)
    LOST = "lost"  # was running when its supervisor died, and is gone
    NOT_STARTED = "not started"  # backend: slurm: its srun step never began


class HostState(StrEnum):
    """A peer host as its coordinator sees it (state.json "hosts")."""

    CONNECTED = "connected"
    DONE = "done"
    LOST = "lost"
    DISCONNECTED = "disconnected"


TERMINAL_JOB_STATES = (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)
# a job that still holds its hosts
ACTIVE_JOB_STATES = (JobState.STARTING, JobState.RUNNING, JobState.STOPPING, JobState.RESTARTING)
