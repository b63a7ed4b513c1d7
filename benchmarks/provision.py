#!/usr/bin/env python3
"""Provisioning: a first run (its steps have work to do) vs the converged re-run (every step `ok`).

A test cluster of N nodes (root login, no route out). Each repeat provisions a spec with new targets (a
fresh venv with `six` from the wheelhouse, a fresh marker file written by a root command; the wheelhouse
itself is uploaded in the first repeat only), so that its first run installs and its second finds nothing
to do; the two run back to back as whole `clusterctl provision` commands, so the machine's
load hits both alike. Reported: the median wall time of each, and the median of the per-repeat ratio
second / first (ratios measured side by side, docs/benchmarks.md).

    .venv/bin/python benchmarks/provision.py [--nodes 3] [--repeat 3] [--name ct-provbench] [--keep]
    .venv/bin/python benchmarks/provision.py --demo [--repeat 1]   # `clusterctl demo` twice: provision, total

`--demo` runs the README's demo (its own cluster, clusterctl-demo: not while tests/integration/test_demo.py
runs) twice per repeat and reports the two runs' `provision` and `total` times and their ratios.

These figures were once asserted by tests (second provision faster than the first, and below
max(first / 2, 4 s) in tests/provision/test_provision_integration.py; the demo's second provision faster
and its total at most 1.5x the first in tests/integration/test_demo.py); the tests keep the behaviour
(`0 changed, 0 failed`, nothing sent) and the times live here.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from clusterctl import testcluster as tc  # noqa: E402


def clusterctl(*args: str, timeout: float = 900) -> tuple[subprocess.CompletedProcess, float]:
    """Run `clusterctl ARGS` (a new process, stdin closed); return the result and its wall seconds."""
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "clusterctl.cli", *args], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=timeout, env={**os.environ, "COLUMNS": "200"})
    return res, time.monotonic() - t0


def provision_spec(info: tc.ClusterInfo, path: Path, tag: str) -> Path:
    """The cluster's own spec with a provision section whose every target is new (named by `tag`)."""
    spec = yaml.safe_load(info.spec_path.read_text())
    spec["name"] = "provbench"
    spec["job"] = {"entrypoint": ["true"]}
    spec["provision"] = {
        "wheelhouse": True,
        "python": {"venv": f"/opt/provbench-{tag}", "requirements": ["six"]},
        "commands": [{"name": "mark", "run": f"id -un > /etc/provbench-{tag}", "creates": f"/etc/provbench-{tag}",
                      "root": True}],
    }
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def provision_pair(info: tc.ClusterInfo, workdir: Path) -> tuple[float, float]:
    """One repeat: (first run's seconds, converged re-run's seconds); exits on a failed or non-converged run."""
    spec = provision_spec(info, workdir / "provbench.yaml", uuid.uuid4().hex[:8])
    first, t1 = clusterctl("provision", str(spec))
    second, t2 = clusterctl("provision", str(spec))
    for res in (first, second):
        if res.returncode != 0:
            raise SystemExit(f"provision failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-2000:]}")
    if not re.search(r"^0 changed, 0 failed, \d+ ok", second.stdout, re.M):
        raise SystemExit(f"the second run changed something:\n{second.stdout[-3000:]}")
    return t1, t2


def demo_pair() -> dict[str, float]:
    """`clusterctl demo` twice: each run's `provision` and `total` seconds as it prints them."""
    out: dict[str, float] = {}
    for run in ("1", "2"):
        res, _ = clusterctl("demo", timeout=1200)
        if res.returncode != 0:
            raise SystemExit(f"demo failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-2000:]}")
        for what in ("provision", "total"):
            out[what + run] = float(re.search(rf"{what} ([\d.]+)s", res.stdout).group(1))
    return out


def row(name: str, values: list[float], unit: str = " s") -> str:
    """A markdown row: median, min, max."""
    return f"| {name} | {statistics.median(values):.2f}{unit} | {min(values):.2f}{unit} | {max(values):.2f}{unit} |"


def main() -> int:
    """Run the repeats and print a markdown table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--name", default="ct-provbench", help="the test cluster's name (created or reused)")
    ap.add_argument("--keep", action="store_true", help="leave the cluster up")
    ap.add_argument("--demo", action="store_true", help="time `clusterctl demo` twice instead")
    args = ap.parse_args()
    print("| run | median | min | max |\n| --- | ---: | ---: | ---: |")
    if args.demo:
        pairs = [demo_pair() for _ in range(args.repeat)]
        for what in ("provision", "total"):
            print(row(f"demo {what}, first run", [p[what + "1"] for p in pairs]))
            print(row(f"demo {what}, second run", [p[what + "2"] for p in pairs]))
            print(row(f"demo {what}, second / first", [p[what + "2"] / p[what + "1"] for p in pairs], "x"))
        return 0
    info = tc.up(args.nodes, name=args.name, packages=[])
    try:
        workdir = info.spec_path.parent
        pairs = [provision_pair(info, workdir) for _ in range(args.repeat)]
    finally:
        if not args.keep:
            tc.down(args.name)
    print(row(f"first provision ({args.nodes} nodes: venv + six, a root command)", [a for a, _ in pairs]))
    print(row("converged re-run (0 changed)", [b for _, b in pairs]))
    print(row("re-run / first", [b / a for a, b in pairs], "x"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
