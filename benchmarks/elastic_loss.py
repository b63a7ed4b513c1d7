#!/usr/bin/env python3
"""What a lost host costs an elastic job: the time from a host stopped hard to the new attempt's first step.

A 4-host job of examples/torch_gloo (stock torch, gloo, env://; one rank per host, a checkpoint every 10 steps
on rank 0's host) with one spare runs on a docker test cluster of five nodes; once rank 0 printed step 20
(after its checkpoint), a member's node is killed (`docker kill`). Every output line of the job is stamped
with the wall clock by a wrapper (stamp.py runs train.py unchanged), and the containers share this machine's
clock, so the timeline reads from one clock:

- stopped: the coordinator's record of attempt 0's end (every process of it stopped, `status --json`);
- spawned: the coordinator's record of attempt 1's start (the spare's part spawned with the others);
- resumed: the last rank's `resumed step=N` line (every rank loaded the checkpoint and starts its first
  step: torch imported, the gloo group formed at the new world);
- first step: the last rank's first `step=` line of attempt 1 (the script prints every 10th step and the
  last, so with a checkpoint every 10 steps the first step it trains is the first line).

With `--kill-coordinator` the first host is killed: rank 0's checkpoint goes with it, so the new attempt
starts from step 0 (no `resumed` line).

    .venv/bin/python benchmarks/elastic_loss.py [--repeats 3] [--name ct-elastic] [--keep] [--kill-coordinator]

docs/benchmarks.md ("Elastic jobs: a lost host") has the results.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from clusterctl import testcluster as tc  # noqa: E402

PACKAGES = ["numpy", "mpi4py", "mpich", "pyzmq", "torch==2.13.0"]  # the integration cluster's: a cached image
STAMP = '''\
import runpy, sys, time


class Stamp:
    """Every output line prefixed with the wall clock (seconds since the epoch)."""

    def __init__(self, out):
        self.out, self.buf = out, ""

    def write(self, text):
        self.buf += text
        while "\\n" in self.buf:
            line, self.buf = self.buf.split("\\n", 1)
            self.out.write("%.3f %s\\n" % (time.time(), line))
        return len(text)

    def flush(self):
        self.out.flush()


sys.stdout = Stamp(sys.stdout)
sys.argv = ["train.py"]
runpy.run_path("train.py", run_name="__main__")
'''


def clusterctl(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "clusterctl.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, cwd=ROOT)


def status(spec):
    return json.loads(clusterctl("status", spec, "--json").stdout)


def logs(spec):
    return clusterctl("logs", spec).stdout


def one(info, work: Path, rep: int, kill_coordinator: bool) -> dict:
    name = f"bench-el-{rep}"
    ckpt = f"{info.home}/ckpt-{name}"
    base = yaml.safe_load(Path(info.spec_path).read_text())
    hosts = base["hosts"][:5]
    hosts[4]["spare"] = True
    port = 7900 + 20 * rep
    spec = {"name": name, "ssh": base["ssh"], "hosts": hosts,
            "workspace": {"local": str(work), "remote": f"clusterctl-bench/{name}"},
            "job": {"mode": "collective", "entrypoint": ["/opt/venv/bin/python", "stamp.py"], "trainers": 1,
                    "restarts": 3, "restart_backoff": 1, "grace": 3,
                    "env": {"STEPS": "60", "STEP_S": "0.5", "SAVE_EVERY": "10", "CHECKPOINT_DIR": ckpt},
                    "ports": {"control": port, "master": port + 1, "trainer": port + 10}}}
    path = work.parent / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    clusterctl("stop", path)
    for cmd in (("dispatch", path), ("start", path)):
        res = clusterctl(*cmd)
        if res.returncode != 0:
            raise SystemExit(f"{cmd[0]} failed: {res.stdout}{res.stderr}")
    victim = info.nodes[0 if kill_coordinator else 2]
    deadline = time.monotonic() + 300
    while not re.search(r"trainer\.0\] \S+ step=20 ", logs(path)):
        if time.monotonic() > deadline:
            raise SystemExit("the job never reached step 20")
        time.sleep(0.5)
    t_kill = time.time()
    subprocess.run(["docker", "kill", victim.container], check=True, capture_output=True)
    deadline = time.monotonic() + 600
    while (st := status(path))["state"] not in ("succeeded", "failed"):
        if time.monotonic() > deadline:
            raise SystemExit(f"the job never ended: {st}")
        time.sleep(1)
    text = logs(path)
    tc.up(5, name=info.name, packages=PACKAGES, user=info.user)  # the killed node back, for stop
    clusterctl("stop", path)
    for n in info.nodes:
        subprocess.run(["docker", "exec", n.container, "rm", "-rf", ckpt], capture_output=True)
    if st["state"] != "succeeded":
        raise SystemExit(f"the job failed: {st['reason']}")
    a0, a1 = st["attempts"][0], st["attempts"][1]
    resumed = [float(t) for t in re.findall(r"#1\] (\S+) resumed step=", text)]
    first = {}
    for rank, t in re.findall(r"trainer\.(\d)#1\] (\S+) step=\d+ ", text):
        first.setdefault(rank, float(t))
    return {"stopped": a0["ended_at"] - t_kill, "spawned": a1["started_at"] - t_kill,
            # with the coordinator's host lost, rank 0's checkpoint went with it: the attempt starts from step 0
            "resumed": max(resumed) - t_kill if resumed else None, "first_step": max(first.values()) - t_kill,
            "ranks": len(resumed), "reason": a0["reason"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default="ct-elastic")
    ap.add_argument("--keep", action="store_true", help="keep the cluster afterwards")
    ap.add_argument("--kill-coordinator", action="store_true", help="kill the first host (the coordinator's)")
    args = ap.parse_args()
    info = tc.up(5, name=args.name, packages=PACKAGES, user="ubuntu")
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp) / "ws"
            work.mkdir()
            shutil.copy(ROOT / "examples" / "torch_gloo" / "train.py", work / "train.py")
            (work / "stamp.py").write_text(STAMP)
            for rep in range(args.repeats):
                info = tc.up(5, name=args.name, packages=PACKAGES, user="ubuntu")
                row = one(info, work, rep, args.kill_coordinator)
                rows.append(row)
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    finally:
        if not args.keep:
            tc.down(args.name)
    print("| from the loss to ... | median (s) | runs (s) |\n|---|---:|---|")
    for key in ("stopped", "spawned", "resumed", "first_step"):
        values = [r[key] for r in rows if r[key] is not None]
        if not values:
            continue
        print(f"| {key} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
