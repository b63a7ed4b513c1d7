"""An elastic job as one host's supervisor holds it: the view, this host's part in it, the successor search.

clusterctl/host/elastic.py decides (pure): the next view once members are lost, what a host runs in a view,
who succeeds a lost coordinator, whether the pservers' checkpoint shards are where the new placement needs
them. `ElasticHost` keeps what the supervisor (clusterctl/host/supervisor.py) needs between those decisions:

- `view`: the current attempt's membership. The coordinator's is authoritative (it sends it with every
  `restart`); a peer keeps the last one it received (checked with elastic.check_view first);
- on the coordinator: the members lost during the attempt (`lost`), each connected host's index (checked
  against its hello's label: `refuse`) and pserver checkpoint inventory (from hellos and `done`s);
- on a peer that lost its coordinator: the host it now tries (`target`, since `target_since`) and the
  successors that did not answer (`skip`); on a host that took over: since when and from whom.

Nothing here touches a socket or a process; `inventory` reads this host's checkpoint manifests.
Stdlib only, Python 3.9 (it runs on the hosts).
"""

from . import elastic

__all__ = ["ElasticHost"]

MAX_LINE = 500  # status lines are cut at this many characters


class ElasticHost:
    """One supervisor's share of an elastic job (the job file's "elastic" section, host/jobfile.py)."""

    def __init__(self, section, home, pserver_wait=120.0):
        self.section = section
        self.me = section["index"]
        self.home = home
        self.pserver_wait = pserver_wait
        self.view = elastic.initial_view(section)
        self.lost = set()  # coordinator: members lost during the current attempt (indices)
        self.index_of = {}  # coordinator: connected host label -> its index (checked)
        self.inventories = {}  # coordinator: index -> pserver checkpoint inventory, from hellos and dones
        self.target = self.view["coordinator"]  # peer: the host whose control endpoint it connects to
        self.target_since = None
        self.skip = set()  # peer: successors that did not answer, or were lost in their turn
        self.takeover_since = None  # a host that took over as coordinator: when (monotonic)
        self.replaced = None  # ... and the coordinator it replaced

    # -- who is who --------------------------------------------------------------------------------------

    @property
    def member(self):
        """Whether this host runs a part of the current view's attempt."""
        return self.me in self.view["members"]

    def label(self, index):
        """The host label (the spec's address) of host `index`."""
        return elastic.host_name(self.section, index)

    def peer_labels(self, exclude=()):
        """The labels of the view's members other than this host (and `exclude`)."""
        return [self.label(i) for i in self.view["members"] if i != self.me and i not in exclude]

    def refuse(self, host, index):
        """Coordinator: why a hello from `host` that says it is host `index` is refused, or None."""
        if index is None:
            return "elastic job: the hello of %s has no host index (an older agent?)" % host
        known = {h["index"] for h in self.section["hosts"]}
        if index not in known or self.label(index) != host:
            return "elastic job: host index %s is not %s" % (index, host)
        return None

    # -- views ----------------------------------------------------------------------------------------

    def check(self, raw):
        """A view received from the coordinator, checked against this host's section (ValueError)."""
        return elastic.check_view(raw, self.section)

    def part(self, view=None):
        """This host's part of `view`'s attempt (elastic.attempt_part)."""
        return elastic.attempt_part(self.section, self.view if view is None else view, self.me, self.home,
                                    pserver_wait=self.pserver_wait)

    def adopt(self, view):
        """`view` is the current attempt's: start afresh on who is lost and whom to look for."""
        self.view = view
        self.lost = set()
        self.target, self.target_since = view["coordinator"], None
        self.skip = set()
        self.takeover_since = self.replaced = None

    def plan_next(self, connected, idle_since, now, inventory):
        """Coordinator: the next attempt's (view, change) (elastic.next_view), the members not `connected`
        (labels) and those lost during the attempt counted as lost, the connected hosts that run nothing
        (`idle_since`: label -> since, wall clock) as the spares; then the pserver checkpoint check, with this
        host's own `inventory`. Raise elastic.CannotContinue with the one line that ends the job."""
        indices = set(self.index_of[h] for h in connected if h in self.index_of)
        lost = set(elastic.missing(self.view, indices, self.me)) | self.lost
        available = dict((self.index_of[h], since) for h, since in idle_since.items() if h in self.index_of)
        view, change = elastic.next_view(self.section, self.view, sorted(lost), available, now)
        if change is not None and view["coordinator"] != self.me:
            # the host that took over runs the attempt it plans, also when a successor before it answered late
            view = dict(view, coordinator=self.me)
            change = dict(change, coordinator=[self.view["coordinator"], self.me])
            view["changes"] = view["changes"][:-1] + [change]
        inventories = dict(self.inventories)
        if inventory is not None:
            inventories[self.me] = inventory
        problem = elastic.shard_problem(self.section, self.view, view, inventories)
        if problem is not None:
            raise elastic.CannotContinue(problem)
        return view, change

    def describe_change(self, change):
        """The log line of a change of hosts."""
        return elastic.describe_change(self.section, change)

    # -- the coordinator's successor ----------------------------------------------------------------------

    def next_candidate(self):
        """The host to turn to now that `target` is lost or silent (None: nobody is left)."""
        self.skip.add(self.target)
        return elastic.successor(self.view, self.skip)

    def endpoint(self, index):
        """(address, port) of host `index`'s control endpoint."""
        return elastic.control_endpoint(self.section, index)

    # -- pserver checkpoints --------------------------------------------------------------------------

    def inventory(self):
        """This host's pserver checkpoint shards (elastic.ps_inventory), or None: not a pserver job that
        checkpoints."""
        root = elastic.checkpoint_dir(self.section, self.home)
        if root is None:
            return None
        return elastic.ps_inventory(root, len(self.view["pservers"]))

    # -- state.json -----------------------------------------------------------------------------------

    def to_json(self, idle_since=None, now=None):
        """state.json "elastic": this host's index, whether it is a member, the view (and its members' labels),
        the idle hosts connected to this coordinator, and the status lines
        (elastic.describe_view; the coordinator passes the idle hosts connected now, label -> since)."""
        connected = None
        if idle_since is not None:
            connected = dict((self.index_of[h], since) for h, since in idle_since.items() if h in self.index_of)
        lines = elastic.describe_view(self.section, self.view, connected, now)
        return {"index": self.me, "member": self.member, "view": self.view,
                "members": [self.label(i) for i in self.view["members"]],
                "lines": [line[:MAX_LINE] for line in lines],
                "idle": sorted(self.label(i) for i in (connected or {}))}
