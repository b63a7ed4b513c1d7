#!/usr/bin/env python3
"""What `clusterctl ARGS` imports: `PY -X importtime -m clusterctl.cli ARGS`, run N times; prints the
module count, the medians of each top-level package's own import time, and which heavy packages load.

    .venv/bin/python benchmarks/importprofile.py [--python PY] [--repeat 5] -- exec cluster.yaml -- true

The command runs for real (an `exec` reaches the hosts); one untimed run goes first (it fills the plan
cache), unless `--cold`. importtime's own overhead inflates the
figures: compare them with each other, and quote wall times from benchmarks/fanout.py.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys

HEAVY = ("pydantic", "pydantic_core", "yaml", "rich", "paramiko", "fabric", "invoke", "cryptography", "jinja2",
         "numpy", "zmq", "pathspec", "clusterctl.spec")
_LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)", re.M)


def profile(python: str, args: list[str]) -> dict[str, int]:
    """One run: {module: its own import time in µs}."""
    res = subprocess.run([python, "-X", "importtime", "-m", "clusterctl.cli", *args], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, cwd="/")
    if res.returncode != 0:
        raise SystemExit(f"clusterctl {' '.join(args)} failed ({res.returncode}): {res.stderr[-800:]}")
    return {m.group(4): int(m.group(1)) for m in _LINE.finditer(res.stderr)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--cold", action="store_true", help="no untimed first run")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    ns = ap.parse_args()
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    if not ns.cold:
        profile(ns.python, args)
    runs = [profile(ns.python, args) for _ in range(ns.repeat)]
    packages: dict[str, list[int]] = {}
    for run in runs:
        per: dict[str, int] = {}
        for mod, us in run.items():
            per[mod.split(".")[0]] = per.get(mod.split(".")[0], 0) + us
        for pkg, us in per.items():
            packages.setdefault(pkg, []).append(us)
    med = {pkg: statistics.median(v) for pkg, v in packages.items()}
    total = statistics.median(sum(r.values()) for r in runs)
    print(f"clusterctl {' '.join(args)}  ({ns.python}, median of {ns.repeat})")
    print(f"modules imported: {statistics.median(len(r) for r in runs):.0f}; import time (sum of self): {total / 1000:.1f} ms")
    print("top packages (ms): " + ", ".join(f"{p} {t / 1000:.1f}" for p, t in sorted(med.items(), key=lambda x: -x[1])[: ns.top]))
    loaded = [h for h in HEAVY if h in runs[0]]
    print("heavy packages loaded: " + (", ".join(loaded) if loaded else "none of " + ", ".join(HEAVY)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
