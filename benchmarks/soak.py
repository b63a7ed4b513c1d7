#!/usr/bin/env python3
"""Fault soak: N cycles of start -> one random fault -> the job's decision -> stop, on a docker test cluster.

Each cycle starts a pserver-mode job (2 pservers, one trainer per node, `restarts: 1`) that would run for
minutes, injects one fault, waits until every host has decided (each host's own state.json, read through
docker so that a cut-off host is seen too), lets a restart begin, then stops the job and checks:

- orphans: processes whose environment carries CLUSTERCTL_JOB=<job>, on every node, after `stop`;
- leaked ports: the job's ports still listening on any node after `stop`;
- lost log lines: in every log of every attempt, the `step=N` lines of a finished process must be
  0, 1, ..., k with no gap and the file must end with a whole line;
- stuck jobs: `stop` that fails or takes longer than 90 s, or a state that is not a verdict after it.

Fault kinds: kill -9 of a trainer, of a pserver, of a peer's supervisor, of the coordinator's supervisor;
`docker pause` of a peer node for longer than the peer timeout; `docker network disconnect` of a peer node
(then reconnect); a full log disk (the job's logs live on the nodes' 2 MiB tmpfs, filled with `dd`); a host
lost for good (`docker kill` of a peer node: its supervisor and processes die with it; it is started again
only for the cycle's `stop`). With `--elastic` the job may go on without one host (`job.min_hosts`: all
nodes but one; docs/lifecycle.md, elastic jobs): a lost host's cycle then also measures the time from the
loss until every other host runs the new attempt and its trainers printed their first step.

    .venv/bin/python benchmarks/soak.py [--cycles 50] [--nodes 8] [--name ct-soak] [--seed 1] [--elastic]
                                        [--kinds host_lost,kill9_trainer]

The short version in the default test tier is tests/integration/test_soak.py (a few cycles, 4 nodes).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from clusterctl import testcluster as tc  # noqa: E402

JOB_DIR = ROOT / "tests" / "integration" / "jobs"  # job.py: pservers listen, trainers print step=N
KINDS = ("kill9_trainer", "kill9_pserver", "kill9_supervisor", "kill9_coordinator_supervisor", "pause_node",
         "disconnect_node", "fill_log_disk", "host_lost")
PEER_TIMEOUT = 5.0  # the agent's default; a pause/disconnect lasts longer than this
DECISION_LIMIT = 60.0  # a job that has not decided by then counts as stuck
LOG_ROOT = "/mnt/small"  # the nodes' 2 MiB tmpfs

# One round trip per node: the job's state on this host, its tagged processes, listening job ports, and the
# step-line check of every log file of the job.
_PROBE = r"""
import json, os, re, sys
job, logdir, ports = sys.argv[1], sys.argv[2], [int(p) for p in sys.argv[3].split(",")]
out = {"state": None, "attempt": 0, "sup_alive": False, "sup_pid": None, "tagged": [], "listening": [],
       "lost_lines": 0, "log_files": 0, "pids": {}, "trainers": 0, "stepping": False}
try:
    st = json.load(open(os.path.expanduser(f"~/.clusterctl/jobs/{job}/state.json")))
except (OSError, ValueError):
    st = None
def alive(pid, ticks):
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except (OSError, TypeError):
        return False
    return f[0] not in "ZXx" and (ticks is None or int(f[19]) == ticks)
if st:
    sup = st.get("supervisor") or {}
    out.update(state=st.get("state"), attempt=st.get("attempt", 0), sup_pid=sup.get("pid"),
               sup_alive=alive(sup.get("pid"), sup.get("start_ticks")))
    out["pids"] = {f"{p['role']}.{p['id']}": p["pid"] for p in st.get("processes", []) if p.get("state") == "running"}
    # this attempt's trainers here, and whether each has printed a step (the attempt's first step)
    mine = [p for p in st.get("processes", []) if p.get("role") == "trainer" and p.get("state") == "running"]
    out["trainers"] = len(mine)
    def stepped(path):
        try:
            return re.search(rb"^step=", open(path, "rb").read(), re.M) is not None
        except OSError:
            return False
    out["stepping"] = bool(mine) and all(stepped(p["log"]) for p in mine)
needle = f"CLUSTERCTL_JOB={job}".encode()
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            if needle in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"):
                out["tagged"].append(int(pid))
        except OSError:
            pass
for name in ("/proc/net/tcp", "/proc/net/tcp6"):
    try:
        for line in open(name).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) in ports:
                out["listening"].append(int(f[1].rsplit(":", 1)[1], 16))
    except OSError:
        pass
if os.path.isdir(logdir):
    for name in sorted(os.listdir(logdir)):
        if not (name.startswith("trainer.") and name.endswith(".log")):  # this run's files, every attempt
            continue
        out["log_files"] += 1
        data = open(os.path.join(logdir, name), "rb").read()
        if data and not data.endswith(b"\n"):
            out["lost_lines"] += 1
        steps = [int(m) for m in re.findall(rb"^step=(\d+) ", data, re.M)]
        if steps:
            out["lost_lines"] += (steps[-1] + 1) - len(steps) + (steps[0] - 0)
print(json.dumps(out))
"""


def docker(*args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run the docker CLI."""
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check, timeout=timeout)


def clusterctl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the real CLI."""
    return subprocess.run([sys.executable, "-m", "clusterctl.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, cwd=ROOT)


@dataclass
class Soak:
    """The cluster, the spec and the job one soak runs."""

    info: tc.ClusterInfo
    spec: Path
    job: str
    ports: list[int]
    logdir: str
    net: str
    paused: set = field(default_factory=set)
    lost: set = field(default_factory=set)  # nodes killed for good (started again only for the cycle's stop)

    def probe(self, node) -> dict | None:
        """The node's own view of the job (None while the node is paused)."""
        # as the login user: its ~ holds the job's state (root reads another home's ~ as /root)
        res = docker("exec", "-u", self.info.user, node.container, "python3", "-c", _PROBE, self.job, self.logdir,
                     ",".join(map(str, self.ports)), check=False, timeout=30)
        if res.returncode != 0:
            return None
        return json.loads(res.stdout)

    def probe_all(self) -> dict:
        """{container: probe} for every node, in parallel."""
        nodes = self.info.nodes
        with ThreadPoolExecutor(len(nodes)) as ex:
            return dict(zip((n.container for n in nodes), ex.map(self.probe, nodes)))


def make_soak(info: tc.ClusterInfo, workdir: Path, job: str = "soak", base_port: int = 7600,
              elastic: bool = False) -> Soak:
    """Write the soak's spec for `info`'s nodes (pserver mode, restarts: 1; `elastic`: min_hosts all nodes but
    one) and dispatch the workspace."""
    base = yaml.safe_load(Path(info.spec_path).read_text())
    ports = {"control": base_port, "master": base_port + 1, "pserver": base_port + 2, "trainer": base_port + 10}
    spec = {
        "name": job, "ssh": base["ssh"], "hosts": base["hosts"][: len(info.nodes)],
        "workspace": {"local": str(JOB_DIR), "remote": f"clusterctl-soak/{job}"},
        "job": {"mode": "pserver", "entrypoint": ["python3", "job.py"], "args": ["{role}", "{id}"], "pservers": 2,
                "trainers": 1, "grace": 2, "restarts": 1, "restart_backoff": 1, "ports": ports,
                "log_dir": f"{LOG_ROOT}/{job}", "env": {"STEPS": "100000", "STEP_S": "0.1"}},
    }
    if elastic:
        spec["job"]["min_hosts"] = len(info.nodes) - 1
    path = workdir / f"{job}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    clusterctl("stop", path)
    res = clusterctl("dispatch", path, timeout=300)
    if res.returncode != 0:
        raise SystemExit(f"dispatch failed: {res.stderr}")
    net = next(iter(json.loads(docker("inspect", info.nodes[0].container, "--format",
                                      "{{json .NetworkSettings.Networks}}").stdout)))
    used = [base_port, base_port + 2, base_port + 3, base_port + 10]
    return Soak(info, path, job, used, f"{LOG_ROOT}/{job}", net)


def _node_by_ip(s: Soak, ip: str):
    return next(n for n in s.info.nodes if n.ip == ip)


def inject(s: Soak, kind: str, rng: random.Random, views: dict) -> tuple[str, callable]:
    """Inject one fault; return (what was done, a function that undoes it if needed)."""
    nodes = s.info.nodes
    peers = nodes[1:]

    def kill(node, pid):
        docker("exec", node.container, "kill", "-9", str(pid), check=False)

    if kind in ("kill9_trainer", "kill9_pserver"):
        role = kind.split("_")[1]
        choices = [(n, name, pid) for n in nodes for name, pid in (views[n.container] or {}).get("pids", {}).items()
                   if name.startswith(role)]
        node, name, pid = rng.choice(choices)
        kill(node, pid)
        return f"{name} on {node.ip}", lambda: None
    if kind == "kill9_supervisor":
        node = rng.choice(peers)
        kill(node, views[node.container]["sup_pid"])
        return f"supervisor on {node.ip}", lambda: None
    if kind == "kill9_coordinator_supervisor":
        kill(nodes[0], views[nodes[0].container]["sup_pid"])
        return f"supervisor on {nodes[0].ip} (coordinator)", lambda: None
    if kind == "pause_node":
        node = rng.choice(peers)
        docker("pause", node.container)
        s.paused.add(node.container)

        def unpause():
            if node.container in s.paused:
                docker("unpause", node.container, check=False)
                s.paused.discard(node.container)
        return f"pause {node.ip}", unpause
    if kind == "disconnect_node":
        node = rng.choice(peers)
        docker("network", "disconnect", s.net, node.container)

        def reconnect():
            nets = json.loads(docker("inspect", node.container, "--format", "{{json .NetworkSettings.Networks}}").stdout)
            if s.net not in nets:
                docker("network", "connect", s.net, node.container)
        return f"disconnect {node.ip}", reconnect
    if kind == "host_lost":
        node = rng.choice(peers)
        docker("kill", node.container)
        s.lost.add(node.container)

        def restart():
            if node.container in s.lost:
                bring_back(s, node)
        return f"kill {node.ip} (docker kill)", restart
    if kind == "fill_log_disk":
        node = rng.choice(nodes)
        docker("exec", node.container, "sh", "-c", f"dd if=/dev/zero of={LOG_ROOT}/fill bs=64k 2>/dev/null; true",
               check=False)

        def empty():
            docker("exec", node.container, "rm", "-f", f"{LOG_ROOT}/fill", check=False)
        return f"fill {LOG_ROOT} on {node.ip}", empty
    raise ValueError(kind)


def bring_back(s: Soak, node, timeout: float = 60.0) -> None:
    """Start a node killed for good again (a new boot: no supervisor of the job on it), at its address."""
    docker("start", node.container)
    deadline = time.monotonic() + timeout
    while True:
        nets = json.loads(docker("inspect", node.container, "--format", "{{json .NetworkSettings.Networks}}").stdout)
        ip = (nets.get(s.net) or {}).get("IPAddress")
        up = docker("exec", node.container, "sh", "-c", "pgrep -x sshd >/dev/null", check=False).returncode == 0
        if up and ip:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"{node.container} did not come back within {timeout:.0f}s")
        time.sleep(0.3)
    if ip != node.ip:
        raise SystemExit(f"{node.container} came back at {ip}, not {node.ip}: the spec no longer names it")
    s.lost.discard(node.container)


def new_attempt_running(views: dict, lost: set) -> bool:
    """Every host not lost runs attempt 1 or later, and every trainer of it printed a step."""
    return all(v is not None and v["attempt"] >= 1 and v["state"] == "running" and (v["stepping"] or not v["trainers"])
               for c, v in views.items() if c not in lost)


def decided(view: dict | None) -> bool:
    """The host no longer runs the first attempt as if nothing happened."""
    if view is None:
        return False
    return (view["attempt"] >= 1 or view["state"] in ("failed", "stopped", "succeeded", "restarting")
            or not view["sup_alive"])


def cycle(s: Soak, kind: str, rng: random.Random, log=print, elastic: bool = False) -> dict:
    """One start -> fault -> decision -> stop cycle; return its measurements (`elastic`: the job goes on without
    a lost host: a host_lost cycle also waits for the new attempt's first steps)."""
    row = {"kind": kind, "decision_s": None, "restarts": 0, "orphans": 0, "leaked_ports": 0, "lost_lines": 0,
           "stuck": 0, "what": "", "new_attempt_s": None}
    res = clusterctl("start", s.spec, timeout=180)
    if res.returncode != 0:
        raise SystemExit(f"start failed: {res.stderr[-2000:]}")
    deadline = time.monotonic() + 30
    while True:  # every trainer has written a few lines
        views = s.probe_all()
        if all(v and len(v["pids"]) >= 1 and v["state"] == "running" for v in views.values()):
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"job never ran everywhere: {views}")
        time.sleep(0.3)
    time.sleep(1.0)
    views = s.probe_all()
    t0 = time.monotonic()
    row["what"], undo = inject(s, kind, rng, views)
    # a frozen node is unfrozen after longer than the peer timeout; a cut-off one once it had time to decide alone
    hold = {"pause_node": PEER_TIMEOUT + 3.0, "disconnect_node": PEER_TIMEOUT + 8.0}.get(kind)
    restore_at = t0 + hold if hold else None
    try:
        while True:
            now = time.monotonic()
            if restore_at is not None and now >= restore_at:
                undo()
                restore_at = None
            views = s.probe_all()
            pending = [c for c, v in views.items() if c not in s.paused and c not in s.lost and not decided(v)]
            if not pending and row["decision_s"] is None:  # every host that runs has decided
                row["decision_s"] = round(time.monotonic() - t0, 2)
            if not pending and not s.paused and restore_at is None:  # ... and a frozen one once it ran again
                break
            if now - t0 > DECISION_LIMIT:
                row["stuck"] = 1
                log(f"  no decision within {DECISION_LIMIT}s on {pending}")
                break
            time.sleep(0.2)
        while elastic and kind == "host_lost" and row["stuck"] == 0:  # the job goes on without the lost host
            views = s.probe_all()
            if new_attempt_running(views, s.lost):
                row["new_attempt_s"] = round(time.monotonic() - t0, 2)
                break
            if time.monotonic() - t0 > DECISION_LIMIT + 60:
                row["stuck"] = 1
                log(f"  no new attempt within {DECISION_LIMIT + 60:.0f}s: {views}")
                break
            time.sleep(0.2)
    finally:
        undo()
    time.sleep(3.0)  # let a restart begin
    row["restarts"] = max((v or {}).get("attempt", 0) for v in s.probe_all().values())
    t1 = time.monotonic()
    res = clusterctl("stop", s.spec, timeout=120)
    if res.returncode != 0 or time.monotonic() - t1 > 90:
        row["stuck"] = 1
        log(f"  stop failed: {res.returncode} {res.stderr[-500:]}")
    time.sleep(0.5)
    views = s.probe_all()
    for v in views.values():
        if v is None:
            row["stuck"] = 1
            continue
        row["orphans"] += len(v["tagged"])
        row["leaked_ports"] += len(v["listening"])
        if v["sup_alive"] or v["state"] in ("running", "starting", "stopping", "restarting"):
            row["stuck"] = 1
        if kind != "fill_log_disk":
            row["lost_lines"] += v["lost_lines"]
    if kind == "fill_log_disk":  # a full disk loses what could not be written: counted apart, see the docs
        row["lost_lines_disk_full"] = sum(v["lost_lines"] for v in views.values() if v)
    return row


def summarize(rows: list[dict]) -> str:
    """The markdown table of the soak, one row per fault kind."""
    head = ("| fault | cycles | decision median (s) | decision max (s) | new attempt stepping, median (s) "
            "| restarts taken | orphans | leaked ports | lost log lines | stuck jobs |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    lines = []
    for kind in KINDS:
        rs = [r for r in rows if r["kind"] == kind]
        if not rs:
            continue
        ds = [r["decision_s"] for r in rs if r["decision_s"] is not None]
        ns = [r["new_attempt_s"] for r in rs if r.get("new_attempt_s") is not None]
        lines.append(
            f"| {kind} | {len(rs)} | {statistics.median(ds) if ds else '-'} | {max(ds) if ds else '-'} "
            f"| {statistics.median(ns) if ns else '-'} "
            f"| {sum(r['restarts'] for r in rs)} | {sum(r['orphans'] for r in rs)} "
            f"| {sum(r['leaked_ports'] for r in rs)} | {sum(r['lost_lines'] for r in rs)} "
            f"| {sum(r['stuck'] for r in rs)} |")
    return head + "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=50)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--name", default="ct-soak")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="keep the cluster afterwards")
    ap.add_argument("--json", type=Path, help="also write every cycle's row here")
    ap.add_argument("--elastic", action="store_true", help="the job may go on without one host (min_hosts)")
    ap.add_argument("--kinds", help="comma-separated fault kinds (default: all of %s)" % ", ".join(KINDS))
    args = ap.parse_args()
    import tempfile

    rng = random.Random(args.seed)
    info = tc.up(args.nodes, name=args.name, packages=[])
    rows: list[dict] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            s = make_soak(info, Path(tmp), elastic=args.elastic)
            chosen = args.kinds.split(",") if args.kinds else list(KINDS)
            unknown = [k for k in chosen if k not in KINDS]
            if unknown:
                raise SystemExit(f"unknown fault kind(s) {unknown}; choose from {', '.join(KINDS)}")
            kinds = [chosen[i % len(chosen)] for i in range(args.cycles)]  # every kind equally often, shuffled
            rng.shuffle(kinds)
            for i, kind in enumerate(kinds):
                t0 = time.monotonic()
                row = cycle(s, kind, rng, elastic=args.elastic)
                rows.append(row)
                print(f"cycle {i + 1}/{args.cycles} {kind}: {row['what']}: decision {row['decision_s']}s, "
                      f"restarts {row['restarts']}, orphans {row['orphans']}, ports {row['leaked_ports']}, "
                      f"lost lines {row['lost_lines']}, stuck {row['stuck']} ({time.monotonic() - t0:.0f}s)",
                      flush=True)
                if args.json:
                    args.json.write_text(json.dumps(rows, indent=1))
    finally:
        if not args.keep:
            tc.down(args.name)
    print()
    print(summarize(rows))
    bad = sum(r["orphans"] + r["leaked_ports"] + r["lost_lines"] + r["stuck"] for r in rows)
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
