#!/usr/bin/env python3
"""What one refresh of `clusterctl top` costs, on the hosts and on the controller, at N = 8 and 64 test-cluster
nodes, side by side with two peers over the same kept SSH connections.

A job runs on every node (one trainer each that prints a progress line every 0.2 s and sleeps). Each round
asks every node once, three ways, interleaved (ours, the peers, ours, ...) so that machine noise hits all
alike:

- `agent top`: what `clusterctl top` asks each host per refresh (ops/top.py's Top.snapshot): the job's status,
  each process tree's CPU and memory, progress from its log, nvidia-smi where there is one (not here);
- `agent status`: what `clusterctl status` asked each host before (the host package's Python start-up, the
  state file; no sampling);
- `cat /proc/loadavg`: the floor, one command per host over a kept connection.

Host cost: the CPU the nodes' containers used (cgroup cpuacct: sshd, the shell, the tool), less what they use
idle over the same time (measured between rounds), per request. Controller cost: this process's CPU (the
threads that run the requests), its ssh clients' (children) and the ssh connection masters'. Medians of the
rounds. Also reported: the sampling alone as the agent measures it (reply's sample.cpu_s).

    .venv/bin/python benchmarks/top.py --nodes 8 --rounds 9 [--name clusterctl-bench-top] [--keep]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clusterctl import testcluster as tc  # noqa: E402

TRAIN = """\
import time
step = 0
while True:
    print("step=%d loss=%.4f time=%.3f" % (step, 1.0 / (step + 1), time.time()), flush=True)
    step += 1
    time.sleep(0.2)
"""


def cgroup_ns(container_ids: list[str]) -> int:
    """CPU nanoseconds used so far by the containers (cgroup v1 cpuacct, or v2 cpu.stat)."""
    total = 0
    for cid in container_ids:
        v1 = Path(f"/sys/fs/cgroup/cpuacct/docker/{cid}/cpuacct.usage")
        if v1.exists():
            total += int(v1.read_text())
            continue
        for v2 in (Path(f"/sys/fs/cgroup/system.slice/docker-{cid}.scope/cpu.stat"), Path(f"/sys/fs/cgroup/docker/{cid}/cpu.stat")):
            if v2.exists():
                usage = next(line for line in v2.read_text().splitlines() if line.startswith("usage_usec"))
                total += int(usage.split()[1]) * 1000
                break
        else:
            raise SystemExit(f"no cgroup CPU accounting found for container {cid[:12]}")
    return total


def mux_ticks(marker: str) -> int:
    """CPU ticks of the ssh connection masters whose command line mentions `marker` (our control directory)."""
    total = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{name}/cmdline").read_bytes()
            if marker.encode() not in cmd or b"ssh" not in cmd:
                continue
            rest = Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        total += int(rest[11]) + int(rest[12])
    return total


def controller_cpu(marker: str) -> float:
    """CPU seconds of this process, its reaped children (ssh clients) and the ssh masters."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime + mux_ticks(marker) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--name", default="clusterctl-bench-top")
    ap.add_argument("--keep", action="store_true", help="leave the cluster up afterwards")
    args = ap.parse_args()

    cache = tempfile.mkdtemp(prefix="ctop", dir="/tmp")  # our ssh masters' sockets live under it: found by it
    os.environ["XDG_CACHE_HOME"] = cache
    from clusterctl.backends import open_backend
    from clusterctl.ops.hosttools import tool_argv
    from clusterctl.ops.top import Top
    from clusterctl.quoting import join

    info = tc.up(args.nodes, name=args.name)
    ids = [subprocess.run(["docker", "inspect", "-f", "{{.Id}}", n.container], capture_output=True, text=True,
                          check=True).stdout.strip() for n in info.nodes]
    work = Path(cache) / "ws"
    work.mkdir()
    (work / "train.py").write_text(TRAIN)
    base = yaml.safe_load(Path(info.spec_path).read_text())
    spec_path = Path(cache) / "bench-top.yaml"
    spec_path.write_text(yaml.safe_dump({
        "name": "bench-top", "ssh": {**base["ssh"], "command_timeout": 60, "connect_timeout": 30}, "hosts": base["hosts"],
        "workspace": {"local": str(work), "remote": "bench-top"},
        "job": {"mode": "collective", "entrypoint": ["python3", "train.py"], "trainers": 1, "grace": 2,
                "ports": {"control": 7700, "master": 7701, "pserver": 7702, "trainer": 7710}},
    }, sort_keys=False))

    with open_backend(str(spec_path)) as backend:
        backend.stop()
        backend.dispatch()
        backend.start()
        session = backend.session
        remote = session.remote
        jobdir = f".clusterctl/jobs/{session.plan.job}"
        status_cmd = join(tool_argv("agent", ["status", jobdir]))
        floor_cmd = "cat /proc/loadavg"
        with Top(session, gpu=False) as top:
            for _ in range(3):  # warms the bytecode caches and the connections (a loaded machine may drop one)
                snap = top.snapshot(None)
                if [h.status for h in snap.hosts] == ["ok"] * args.nodes:
                    break
                print("not every host answered, again:", [(h.host, h.error) for h in snap.hosts if h.status != "ok"])
            else:
                raise SystemExit("not every host answered")
            time.sleep(3)  # let the trainers' history build (rates in the replies), as in a running view

            def ours():
                s = top.snapshot(None)
                bad = [h for h in s.hosts if h.status != "ok"]
                if bad:
                    raise SystemExit(f"{bad[0].host}: {bad[0].status}: {bad[0].error}")
                return [h.sample_cpu_s for h in s.hosts]

            def plain(cmd):
                def run():
                    res = remote.run(cmd, check=True, timeout=60, what="bench")
                    return [r.exit_code for r in res.values()]
                return run

            kinds = {"agent top (ours)": ours, "agent status": plain(status_cmd), "cat /proc/loadavg": plain(floor_cmd)}
            host_cost = {k: [] for k in kinds}
            ctl_cost = {k: [] for k in kinds}
            wall = {k: [] for k in kinds}
            sampling = []
            idle_rates = []
            for _ in range(args.rounds):
                # idle: what the nodes use with nobody asking (the job's trainers and supervisors), per second
                h0, t0 = cgroup_ns(ids), time.perf_counter()
                time.sleep(1.0)
                idle_rates.append((cgroup_ns(ids) - h0) / 1e9 / (time.perf_counter() - t0))
                for kind, fn in kinds.items():
                    h0, c0, t0 = cgroup_ns(ids), controller_cpu(cache), time.perf_counter()
                    got = fn()
                    dt = time.perf_counter() - t0
                    c1, h1 = controller_cpu(cache), cgroup_ns(ids)
                    wall[kind].append(dt)
                    ctl_cost[kind].append(c1 - c0)
                    host_cost[kind].append((h1 - h0) / 1e9)
                    if kind.startswith("agent top"):
                        sampling.extend(x for x in got if x is not None)
        backend.stop()

    idle = statistics.median(idle_rates)
    print(f"\n{args.nodes} nodes, {args.rounds} rounds; nodes' idle CPU {idle * 1000:.1f} ms/s (subtracted)")
    print("| per refresh | wall (s) | controller CPU (ms) | host CPU per host (ms) |")
    print("| --- | ---: | ---: | ---: |")
    med = {}
    for kind in kinds:
        w = statistics.median(wall[kind])
        c = statistics.median(ctl_cost[kind]) * 1000
        h = statistics.median([(x - idle * wt) / args.nodes for x, wt in zip(host_cost[kind], wall[kind])]) * 1000
        med[kind] = (w, c, h)
        print(f"| {kind} | {w:.3f} | {c:.0f} | {h:.1f} |")
    ours_k = "agent top (ours)"
    for peer in ("agent status", "cat /proc/loadavg"):
        print(f"ratios ours / {peer}: wall {med[ours_k][0] / med[peer][0]:.2f}, controller CPU "
              f"{med[ours_k][1] / med[peer][1]:.2f}, host CPU {med[ours_k][2] / med[peer][2]:.2f}")
    print(f"sampling alone on a host (agent's own measure): median {statistics.median(sampling) * 1000:.1f} ms CPU")
    if not args.keep:
        tc.down(args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
