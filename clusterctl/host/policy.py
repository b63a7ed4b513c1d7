"""The job's policy and the protocol's timings: one default and one bound each, for every layer.

`Policy` (on_failure, grace, restarts, restart_backoff) travels spec -> plan -> job file -> supervisor:
clusterctl/spec/job.py takes its defaults and bounds from here, the plan carries it (`JobPlan.policy`),
`jobfile.build_job` writes it (`Policy.to_job`) and the host reads it back (`Policy.from_job`), so a
default or a limit is written once. `Timings` are the coordinator protocol's four timeouts (the job file's
``coordinator`` section). Stdlib only, like the rest of the host package.
"""

from .common import InputError
from .record import asdict, dataclass, fields

__all__ = ["Policy", "Timings", "DEFAULT_POLICY", "DEFAULT_TIMINGS", "ON_FAILURE", "GRACE_MAX", "RESTARTS_MAX",
           "RESTART_BACKOFF_MIN", "RESTART_BACKOFF_MAX"]

ON_FAILURE = ("stop", "continue")  # stop: a failure stops the whole job; continue: the others go on
GRACE_MAX = 3600.0  # seconds between SIGTERM and SIGKILL, at most
RESTARTS_MAX = 1000
RESTART_BACKOFF_MIN = 1.0  # a restart loop cannot spin: at least a second before each restart
RESTART_BACKOFF_MAX = 300.0  # the first back-off at most this, and the doubled one capped at it


def _number(where, value, lo, hi=None, integer=False):
    """`value` as a float (or int), or InputError naming `where` and the bounds."""
    kind = "an integer" if integer else "a number"
    ok = not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
    if ok and value == value and value >= lo and (hi is None or value <= hi):  # value == value: not NaN
        return value if integer else float(value)
    bounds = ">= %s" % (lo,) if hi is None else "between %s and %s" % (lo, hi)
    raise InputError("%s: must be %s %s, got %r" % (where, kind, bounds, value))


@dataclass(frozen=True)
class Policy:
    """What the supervisors do about failures: fail fast or go on, the grace of a stop, restarts and back-off."""

    on_failure: str = "stop"
    grace: float = 10.0
    restarts: int = 0
    restart_backoff: float = 1.0

    def __post_init__(self):
        self.check("policy")

    def check(self, source):
        """Raise InputError naming `source` and the key when a value is out of its bounds."""
        if self.on_failure not in ON_FAILURE:
            raise InputError("%s: on_failure: must be 'stop' or 'continue', got %r" % (source, self.on_failure))
        _number("%s: grace" % source, self.grace, 0.0, GRACE_MAX)
        _number("%s: restarts" % source, self.restarts, 0, RESTARTS_MAX, integer=True)
        _number("%s: restart_backoff" % source, self.restart_backoff, RESTART_BACKOFF_MIN, RESTART_BACKOFF_MAX)

    @classmethod
    def from_job(cls, raw, source):
        """The policy of a job file (a dict); absent keys take the defaults; InputError names the bad key."""
        values = {}
        for f in fields(cls):
            value = raw.get(f.name, f.default)
            if f.name == "on_failure":
                if value not in ON_FAILURE:
                    raise InputError("%s: on_failure: must be 'stop' or 'continue', got %r" % (source, value))
            elif f.name == "restarts":
                value = _number("%s: restarts" % source, value, 0, RESTARTS_MAX, integer=True)
            else:
                lo = RESTART_BACKOFF_MIN if f.name == "restart_backoff" else 0.0
                hi = RESTART_BACKOFF_MAX if f.name == "restart_backoff" else GRACE_MAX
                value = _number("%s: %s" % (source, f.name), value, lo, hi)
            values[f.name] = value
        return cls(**values)

    def to_job(self):
        """The job file's keys for this policy."""
        return asdict(self)

    def restart_delay(self, restart):
        """Seconds before restart number `restart` (1 = the first): the back-off doubled per restart, capped."""
        if restart <= 0:
            return 0.0
        return min(self.restart_backoff * 2.0 ** min(restart - 1, 30), RESTART_BACKOFF_MAX)


@dataclass(frozen=True)
class Timings:
    """The coordinator protocol's timeouts, in seconds (the job file's ``coordinator`` section)."""

    connect_timeout: float = 30.0  # peers: the first connection; coordinator: every peer connected
    heartbeat: float = 1.0  # ping interval, both directions
    peer_timeout: float = 5.0  # silence after which a connection is dead
    reconnect_timeout: float = 3.0  # peer: time to get a lost coordinator back

    @classmethod
    def from_job(cls, raw, source):
        """The timings of a job file's coordinator section; absent keys take the defaults."""
        return cls(**{f.name: _number("%s.%s" % (source, f.name), raw.get(f.name, f.default), 0.0)
                      for f in fields(cls)})

    def to_job(self):
        """The coordinator section's keys for these timings."""
        return asdict(self)


DEFAULT_POLICY = Policy()
DEFAULT_TIMINGS = Timings()
