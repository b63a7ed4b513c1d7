#!/usr/bin/env python3
"""Issue 23 parts 1-2: `start`, `status` and `top` against `exec true`, side by side, on a test cluster.

Three measurements, each a whole `clusterctl` command (a new process) timed for wall and CPU (user+sys of it and
every process it waited for: the controller's Python and its `ssh` clients; the kept connections' masters are
in no column), the commands of a round interleaved so that the machine's noise hits them alike, medians over
the rounds. The load average is printed at the start and end of each.

- `ask` (kept connections): on a job of one `sleep` per node, `exec true`, `status`, `top --once --json`, and,
  with `--compare-python PY` (another installation, e.g. the commit before the control socket), that one's
  `status` and `top` in the same rounds. The nodes' CPU (their containers' cgroups) is reported per command too.
- `start-cold` (new connections, `ssh.persist: 0`): `exec true` and `start` (then an untimed `stop`) of a job of
  one `sleep` per node.
- `start16` (kept connections): `start` of 16 processes on 8 nodes (2 per node), then an untimed `stop`; with
  `exec true` in the same rounds.
- `stop` (kept connections): `stop` of a running job of one `sleep` per node (started, untimed, a second before
  each), with `exec true` in the same rounds; with `--compare-python`, that one's `stop` too.

    .venv/bin/python benchmarks/lifecycle.py ask --nodes 8 --rounds 9 [--compare-python PY] [--python PY]
    .venv/bin/python benchmarks/lifecycle.py start-cold --nodes 16 --bastion --rounds 5 [--connect-timeout 15]
    .venv/bin/python benchmarks/lifecycle.py start16 --rounds 7
    .venv/bin/python benchmarks/lifecycle.py stop --nodes 16 --bastion --rounds 9 [--compare-python PY]
"""

from __future__ import annotations

import argparse
import atexit
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clusterctl import testcluster as tc  # noqa: E402


def timed(argv: list[str], env: dict | None = None, check: bool = True) -> tuple[float, float]:
    """Run a command to completion from /; (wall s, CPU s of it and its waited-for children). Exits if it fails,
    unless `check` is false (then the CPU figure is negative for a failed run)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, cwd="/",
                         env=env)
    dt = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0 and not check:
        print(f"  ({' '.join(argv[2:4])}: exit {res.returncode}: {res.stderr.decode().strip().splitlines()[-1:]})",
              flush=True)
        return dt, -1.0
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(argv[2:5])} failed ({res.returncode}):\n{res.stdout.decode()[-1500:]}\n"
                         f"{res.stderr.decode()[-1500:]}")
    return dt, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def stop_job(stop: list[str]) -> None:
    """Stop the job between rounds (untimed); a stop that failed (a connection lost on a loaded machine) is tried
    again, at most three times."""
    for _ in range(3):
        if timed(stop, check=False)[1] >= 0:
            return
    raise SystemExit("the job could not be stopped between rounds")


def cgroup_ns(container_ids: list[str]) -> int:
    """CPU nanoseconds used so far by the containers (cgroup v1 cpuacct, or v2 cpu.stat)."""
    total = 0
    for cid in container_ids:
        v1 = Path(f"/sys/fs/cgroup/cpuacct/docker/{cid}/cpuacct.usage")
        if v1.exists():
            total += int(v1.read_text())
            continue
        for v2 in (Path(f"/sys/fs/cgroup/system.slice/docker-{cid}.scope/cpu.stat"),
                   Path(f"/sys/fs/cgroup/docker/{cid}/cpu.stat")):
            if v2.exists():
                usage = next(line for line in v2.read_text().splitlines() if line.startswith("usage_usec"))
                total += int(usage.split()[1]) * 1000
                break
        else:
            raise SystemExit(f"no cgroup CPU accounting found for container {cid[:12]}")
    return total


def container_ids(info) -> list[str]:
    out = subprocess.run(["docker", "inspect", "-f", "{{.Id}}"] + [n.container for n in info.nodes],
                         capture_output=True, text=True, check=True).stdout
    return out.split()


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def rounds(cmds: dict[str, list[str]], n: int, between=None, hosts: list[str] | None = None, env=None) -> dict:
    """Run every command once untimed (warm-up), then `n` rounds of all of them in turn; medians per command:
    {name: (wall, cpu, node CPU per round or None)}. `between(name)` runs (untimed) after each command; `env`:
    {name: environment} of the commands that need their own."""
    env = env or {}
    for name, argv in cmds.items():
        timed(argv, env.get(name), check=False)
        if between:
            between(name)
    idle = 0.0
    if hosts:  # what the nodes use doing nothing (their supervisors' loops, sshd): taken off each command's figure
        h0, t0 = cgroup_ns(hosts), time.perf_counter()
        time.sleep(3.0)
        idle = (cgroup_ns(hosts) - h0) / 1e9 / (time.perf_counter() - t0)
        print(f"nodes' idle CPU: {idle * 1000:.1f} ms/s", flush=True)
    runs: dict[str, list[tuple[float, float, float | None]]] = {k: [] for k in cmds}
    for _ in range(n):
        for name, argv in cmds.items():
            h0 = cgroup_ns(hosts) if hosts else None
            wall, cpu = timed(argv, env.get(name), check=False)
            node = max(0.0, (cgroup_ns(hosts) - h0) / 1e9 - idle * wall) if hosts else None
            runs[name].append((wall, cpu, node))
            if between:
                between(name)
    med = {}
    for name, rs in runs.items():
        failed = sum(1 for r in rs if r[1] < 0)  # a run that failed: its wall counts, its CPU is not known
        ok = [r for r in rs if r[1] >= 0] or rs
        med[name] = (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in ok),
                     statistics.median(r[2] for r in rs) if hosts else None, failed)
    return med


def table(title: str, med: dict, ref: str) -> None:
    print(f"\n{title}\n")
    print("| command | wall (s) | CPU (s) | nodes' CPU (s) | wall ÷ " + ref + " | CPU ÷ " + ref + " | failed runs |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    w0, c0, _, _ = med[ref]
    for name, (w, c, h, failed) in med.items():
        print(f"| {name} | {w:.3f} | {c:.3f} | {'' if h is None else f'{h:.3f}'} | {w / w0:.2f} | {c / c0:.2f} | "
              f"{failed} |")
    sys.stdout.flush()


def with_before(cmds: dict, before: list[str] | None, extra: dict[str, list[str]]) -> dict:
    """Add the other installation's commands (`extra`: name -> its arguments) to `cmds`; their environment: a
    cache of their own (plans, kept connections), as the plan cache keeps one entry per spec path and an entry
    made by another installation is a miss."""
    if not before:
        return {}
    cache = f"/tmp/lcb-{os.getpid()}"
    atexit.register(shutil.rmtree, cache, True)  # its kept connections' masters end on their own (persist)
    other = {**os.environ, "XDG_CACHE_HOME": cache}
    for name, argv in extra.items():
        cmds[name] = before + argv
    return dict.fromkeys(extra, other)


def job_spec(info, name: str, state: Path, *, trainers: int = 1, persist: int | None = None,
             connect_timeout: float | None = None) -> Path:
    doc = yaml.safe_load(Path(info.spec_path).read_text())
    work = state / "lifecycle-ws"
    work.mkdir(exist_ok=True)
    (work / "README").write_text("workspace of benchmarks/lifecycle.py\n")
    doc.update(name=name, workspace={"local": str(work), "remote": "lifecyclebench"},
               job={"mode": "collective", "entrypoint": ["/bin/sleep", "3600"], "trainers": trainers})
    if persist is not None:
        doc["ssh"] = {**doc.get("ssh", {}), "persist": persist}
    if connect_timeout is not None:  # a kept connection is given up after a third of it without keepalive answers
        doc["ssh"] = {**doc.get("ssh", {}), "connect_timeout": connect_timeout}
    path = state / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("ask", "start-cold", "start16", "stop"))
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--bastion", action="store_true")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--name", default=None)
    ap.add_argument("--python", default=sys.executable, help="the interpreter whose clusterctl is timed")
    ap.add_argument("--compare-python", default=None, help="another installation, timed in the same rounds")
    ap.add_argument("--connect-timeout", type=float, default=None,
                    help="the spec's ssh.connect_timeout (the test cluster writes 5 s): 64 nodes on a loaded 2-core "
                         "machine answer keepalives late, and a kept connection is given up after a third of it")
    args = ap.parse_args()
    nodes = 8 if args.what == "start16" else args.nodes
    name = args.name or f"ct-lc{nodes}{'b' if args.bastion else ''}"
    t0 = time.perf_counter()
    info = tc.up(nodes, name=name, bastion=args.bastion)
    print(f"{nodes} nodes{' behind a bastion' if args.bastion else ''} up in {time.perf_counter() - t0:.0f}s; "
          f"load average {load()}", flush=True)
    state = Path(info.state_dir)
    cli = [args.python, "-m", "clusterctl.cli"]
    before = [args.compare_python, "-m", "clusterctl.cli"] if args.compare_python else None
    hosts = container_ids(info)

    if args.what == "ask":
        spec = job_spec(info, "lcask", state, connect_timeout=args.connect_timeout)
        timed(cli + ["stop", str(spec)], check=False)
        timed(cli + ["start", "--dispatch", str(spec)])
        try:
            cmds = {"exec true": cli + ["exec", str(spec), "--", "true"],
                    "status": cli + ["status", str(spec)],
                    "status --json": cli + ["status", str(spec), "--json"],
                    "top --once --json": cli + ["top", str(spec), "--once", "--json", "--no-gpu"],
                    "logs -n 10": cli + ["logs", str(spec), "-n", "10"]}
            env = with_before(cmds, before, {"status, before": ["status", str(spec)],
                                             "top --once --json, before": ["top", str(spec), "--once", "--json",
                                                                           "--no-gpu"],
                                             "logs -n 10, before": ["logs", str(spec), "-n", "10"]})
            print(f"load average before the rounds: {load()}", flush=True)
            med = rounds(cmds, args.rounds, hosts=hosts, env=env)
            print(f"load average after the rounds: {load()}")
            table(f"{nodes} nodes, a running job, kept connections, medians of {args.rounds} rounds", med, "exec true")
        finally:
            subprocess.run(cli + ["stop", str(spec)], stdout=subprocess.DEVNULL, cwd="/")
        return 0

    if args.what == "start-cold":
        spec = job_spec(info, "lccold", state, persist=0, connect_timeout=args.connect_timeout)
        timed(cli + ["stop", str(spec)], check=False)
        timed(cli + ["dispatch", str(spec)])
        stop = cli + ["stop", str(spec)]
        cmds = {"exec true (new connections)": cli + ["exec", str(spec), "--", "true"],
                "start (new connections)": cli + ["start", str(spec)]}
        env = with_before(cmds, before, {"start, before (new connections)": ["start", str(spec)]})
        print(f"load average before the rounds: {load()}", flush=True)
        med = rounds(cmds, args.rounds, between=lambda n: n.startswith("start") and stop_job(stop), hosts=hosts,
                     env=env)
        print(f"load average after the rounds: {load()}")
        table(f"{nodes} nodes{' behind a bastion' if args.bastion else ''}, ssh.persist 0 (a new connection per "
              f"host and command), medians of {args.rounds} rounds", med, "exec true (new connections)")
        return 0

    if args.what == "stop":
        spec = job_spec(info, "lcstop", state, connect_timeout=args.connect_timeout)
        timed(cli + ["stop", str(spec)], check=False)
        timed(cli + ["dispatch", str(spec)])
        start = cli + ["start", str(spec)]
        cmds = {"exec true": cli + ["exec", str(spec), "--", "true"], "stop": cli + ["stop", str(spec)]}
        env = with_before(cmds, before, {"stop, before": ["stop", str(spec)]})

        def started(name: str) -> None:  # every `stop` stops a job that runs
            if name.startswith("stop"):
                timed(start)
                time.sleep(1.0)

        started("stop")

        print(f"load average before the rounds: {load()}", flush=True)
        med = rounds(cmds, args.rounds, between=started, hosts=hosts, env=env)
        print(f"load average after the rounds: {load()}")
        table(f"{nodes} nodes{' behind a bastion' if args.bastion else ''}, a running job, kept connections, "
              f"medians of {args.rounds} rounds", med, "exec true")
        timed(cli + ["stop", str(spec)], check=False)
        return 0

    spec = job_spec(info, "lcstart16", state, trainers=2, connect_timeout=args.connect_timeout)
    timed(cli + ["stop", str(spec)], check=False)
    timed(cli + ["dispatch", str(spec)])
    stop = cli + ["stop", str(spec)]
    cmds = {"exec true": cli + ["exec", str(spec), "--", "true"], "start (16 processes)": cli + ["start", str(spec)]}
    env = with_before(cmds, before, {"start (16 processes), before": ["start", str(spec)]})
    print(f"load average before the rounds: {load()}", flush=True)
    med = rounds(cmds, args.rounds, between=lambda n: n.startswith("start") and stop_job(stop), hosts=hosts, env=env)
    print(f"load average after the rounds: {load()}")
    table(f"16 processes on 8 nodes, kept connections, medians of {args.rounds} rounds", med, "exec true")
    return 0


if __name__ == "__main__":
    sys.exit(main())
