#!/usr/bin/env python3
"""`exec`, `dispatch`, `start`, `status` and `stop` against an N-node test cluster (default 64), each a
whole `clusterctl` command (a new process), wall and CPU time (user+sys of it and what it waited for).

With `--bastion` the nodes sit behind one bastion on a network this machine is not on: every connection
goes through the bastion's sshd, whose MaxStartups (OpenSSH's default 10:30:100) sheds a burst of new
connections; clusterctl retries a connection shed before the login (clusterctl.remote `_shed`). The first
`exec` opens every connection (cold); the later ones reuse them (`ssh.persist`).

With `--max-startups 10:30:100` the bastion's sshd is set to that (OpenSSH's default) first, and the
connections it dropped past MaxStartups are counted per step (its log); `exec` with `ssh.persist: 0`
(new connections every time) is measured too.

    .venv/bin/python benchmarks/scale.py [--nodes 64] [--bastion] [--repeat 3] [--name ct-scale]
                                         [--max-startups 10:30:100]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clusterctl import testcluster as tc  # noqa: E402


def timed(argv: list[str]) -> tuple[float, float, str]:
    """Run a command; (wall s, CPU s, last stdout line). Exits the benchmark if it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    dt = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(argv[2:5])} failed ({res.returncode}):\n{res.stdout[-1500:]}\n{res.stderr[-1500:]}")
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    return dt, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), lines[-1] if lines else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--bastion", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--name", default="ct-scale")
    ap.add_argument("--max-startups", default="", help="set the bastion's sshd MaxStartups to this first")
    args = ap.parse_args()

    t0 = time.perf_counter()
    info = tc.up(args.nodes, name=args.name, bastion=args.bastion)
    print(f"{args.nodes} nodes{' behind a bastion' if args.bastion else ''} up in {time.perf_counter() - t0:.0f}s; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    state = Path(info.state_dir)
    work = state / "scale-ws"
    work.mkdir(exist_ok=True)
    for i in range(20):
        (work / f"file{i}.py").write_text(f"# {i}\n" + "x = 1\n" * 200)
    doc = yaml.safe_load(Path(info.spec_path).read_text())
    doc.update(name="scalebench", workspace={"local": str(work), "remote": "scalebench"},
               job={"mode": "collective", "entrypoint": ["/bin/sleep", "3600"], "trainers": 1})
    spec = state / "scale.yaml"
    spec.write_text(yaml.safe_dump(doc))
    cold = state / "scale-cold.yaml"
    cold.write_text(yaml.safe_dump({**doc, "ssh": {**doc.get("ssh", {}), "persist": 0}}))
    bastion = f"{args.name}-bastion"
    if args.max_startups:
        subprocess.run(["docker", "exec", bastion, "sh", "-c",
                        f"sed -i 's/^MaxStartups .*/MaxStartups {args.max_startups}/' /etc/ssh/sshd_config && "
                        "kill -HUP $(cat /run/sshd.pid)"], check=True)
        time.sleep(1)
        print(f"bastion MaxStartups {args.max_startups}", flush=True)

    def dropped(since: str) -> int:
        """Connections the bastion dropped past MaxStartups since `since` (docker's log clock)."""
        log = subprocess.run(["docker", "logs", "--since", since, bastion], capture_output=True, text=True)
        return sum("past MaxStartups" in ln for ln in (log.stdout + log.stderr).splitlines())
    cli = [sys.executable, "-m", "clusterctl.cli"]

    rows: list[tuple[str, float, float, str]] = []

    def step(label: str, *cmd: str, repeat: int = 1) -> None:
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 1))
        runs = [timed(cli + list(cmd)) for _ in range(repeat)]
        wall, cpu = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        drops = f"; bastion dropped {dropped(since)}" if args.bastion else ""
        rows.append((label if repeat == 1 else f"{label} (median of {repeat})", wall, cpu, runs[-1][2]))
        print(f"{rows[-1][0]}: {wall:.2f}s wall, {cpu:.2f}s CPU{drops}   {runs[-1][2][:100]}", flush=True)

    step("exec true, first connections", "exec", str(spec), "--", "true")
    step("exec true, new connections every time (persist 0)", "exec", str(cold), "--", "true", repeat=args.repeat)
    step("exec true, kept connections", "exec", str(spec), "--", "true", repeat=args.repeat)
    step("dispatch, first (20 files)", "dispatch", str(spec))
    step("dispatch, nothing changed", "dispatch", str(spec))
    step("start", "start", str(spec))
    try:
        step("status (running)", "status", str(spec), repeat=args.repeat)
    finally:
        step("stop", "stop", str(spec))
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    print(f"\n| {args.nodes} nodes{', behind a bastion' if args.bastion else ''} | wall (s) | CPU (s) |\n| --- | ---: | ---: |")
    for label, wall, cpu, _ in rows:
        print(f"| {label} | {wall:.2f} | {cpu:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
