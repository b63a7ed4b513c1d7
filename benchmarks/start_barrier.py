#!/usr/bin/env python3
"""`start` with the start barrier against `exec true` and against a checkout without the barrier, side by side.

A job of tests/integration/jobs/job.py (one trainer per node, pserver mode with 2 pservers) on the first N
nodes of a test cluster (the integration tests' shape: login `ubuntu`, a bastion, kept connections). Each
round runs, for every checkout given, `clusterctl exec SPEC -- true`, then `clusterctl start SPEC` (timed: the
command, a new process, until it printed the status table), then `clusterctl stop SPEC`; rounds interleave
the checkouts so that the machine's load falls on all of them alike. Each checkout's `start` uploads its own
host package once (a warm-up round, not counted). Prints the medians and each run, and whether `start`'s reply
showed every process running or some still pending.

    .venv/bin/python benchmarks/start_barrier.py --spec SPEC_OF_A_TEST_CLUSTER --nodes 4 --repeat 5 \\
        --checkout after=. --checkout before=/tmp/clusterctl-main
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
JOB_DIR = ROOT / "tests" / "integration" / "jobs"


def run(checkout: Path, *args, timeout=300) -> tuple[float, subprocess.CompletedProcess]:
    env = dict(os.environ, PYTHONPATH=str(checkout), COLUMNS="200", PYTHONDONTWRITEBYTECODE="1")
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "clusterctl.cli", *map(str, args)], capture_output=True, text=True,
                         timeout=timeout, stdin=subprocess.DEVNULL, cwd=checkout, env=env)
    return time.monotonic() - t0, res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True, type=Path, help="a test cluster's spec (its ssh section and hosts)")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--checkout", action="append", required=True, help="LABEL=PATH of a clusterctl checkout")
    args = ap.parse_args()
    checkouts = [(c.split("=", 1)[0], Path(c.split("=", 1)[1]).resolve()) for c in args.checkout]
    base = yaml.safe_load(args.spec.read_text())
    times: dict[str, dict[str, list[float]]] = {label: {"exec": [], "start": []} for label, _ in checkouts}
    pending: dict[str, int] = {label: 0 for label, _ in checkouts}
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "barrier.yaml"
        spec.write_text(yaml.safe_dump({
            "name": "bench-barrier", "ssh": base["ssh"], "hosts": base["hosts"][: args.nodes],
            "workspace": {"local": str(JOB_DIR), "remote": "clusterctl-bench/barrier"},
            "job": {"mode": "pserver", "entrypoint": ["python3", "job.py"], "args": ["{role}", "{id}"],
                    "pservers": 2, "trainers": 1, "grace": 2, "env": {"STEPS": "100000", "STEP_S": "0.5"},
                    "ports": {"control": 7860, "master": 7861, "pserver": 7862, "trainer": 7870}}},
            sort_keys=False))
        label0, first = checkouts[0]
        _, res = run(first, "dispatch", spec)
        if res.returncode != 0:
            raise SystemExit(f"dispatch failed: {res.stderr}")
        for rnd in range(args.repeat + 1):  # round 0 warms up (each checkout's host package uploaded once)
            for label, checkout in checkouts:
                t_exec, res = run(checkout, "exec", spec, "--", "true")
                if res.returncode != 0:
                    raise SystemExit(f"{label}: exec failed: {res.stderr}")
                t_start, res = run(checkout, "start", spec)
                if res.returncode != 0:
                    raise SystemExit(f"{label}: start failed: {res.stdout}{res.stderr}")
                _, stop = run(checkout, "stop", spec)
                if stop.returncode != 0:
                    raise SystemExit(f"{label}: stop failed: {stop.stderr}")
                if rnd:
                    times[label]["exec"].append(t_exec)
                    times[label]["start"].append(t_start)
                    pending[label] += " pending " in res.stdout
                print(f"round {rnd} {label}: exec true {t_exec:.2f}s, start {t_start:.2f}s"
                      + (" (some processes pending)" if " pending " in res.stdout else ""), flush=True)
    print("\n| checkout | exec true, median (s) | start, median (s) | start / exec true | starts showing pending |")
    print("|---|---:|---:|---:|---:|")
    for label, _ in checkouts:
        e, s = statistics.median(times[label]["exec"]), statistics.median(times[label]["start"])
        print(f"| {label} | {e:.2f} | {s:.2f} | {s / e:.2f} | {pending[label]} of {args.repeat} |")
        print(f"|   runs | {', '.join(f'{x:.2f}' for x in times[label]['exec'])} | "
              f"{', '.join(f'{x:.2f}' for x in times[label]['start'])} | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
