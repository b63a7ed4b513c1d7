#!/usr/bin/env python3
"""How late the end of a command with a deadline is seen: Popen.wait(timeout), which looks for the exit in a loop
that sleeps up to 50 ms between looks, against clusterctl.transport.process.wait_until (a pidfd, woken by the
exit). Each row: a local `sleep S` waited for, the milliseconds between its end (S after its start) and the wait
returning, medians / p90 / max over the rounds, the two interleaved.

    .venv/bin/python benchmarks/waits.py [--seconds 0.1 1.03] [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clusterctl.transport.process import wait_until  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, nargs="+", default=[0.1, 1.03])
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    waits = {"Popen.wait(timeout)": lambda p, t0: p.wait(timeout=30),
             "wait_until (pidfd)": lambda p, t0: wait_until(p, t0 + 30)}
    print("| command | wait | late: median (ms) | p90 (ms) | max (ms) |")
    print("| --- | --- | ---: | ---: | ---: |")
    for s in args.seconds:
        late: dict[str, list[float]] = {k: [] for k in waits}
        for _ in range(args.rounds):
            for name, wait in waits.items():
                t0 = time.monotonic()
                wait(subprocess.Popen(["sleep", f"{s:g}"]), t0)
                late[name].append((time.monotonic() - t0 - s) * 1000)
        for name, v in late.items():
            v.sort()
            print(f"| `sleep {s:g}` | {name} | {statistics.median(v):.1f} | {v[int(len(v) * 0.9)]:.1f} | {max(v):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
