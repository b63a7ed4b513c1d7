#!/usr/bin/env python3
"""First dispatch through a bastion vs direct: the same workspace, the same node image, login `ubuntu`.

Two test clusters of N nodes: one reached directly, one whose nodes sit on a network this machine has no
address on, reached only through a bastion container (every hop checked against the pinned keys). Each
repeat dispatches the workspace to a fresh remote directory on both, alternating which goes first, with
connections not kept (`persist: 0`), so every dispatch pays its handshakes: through the bastion that is
one more SSH connection per node (the bastion's) and a second encryption layer for the bulk data.

    .venv/bin/python benchmarks/bastion.py [--nodes 4] [--repeat 5] [--mb 100] [--files 1000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clusterctl import testcluster as tc  # noqa: E402


def make_workspace(root: Path, files: int, total: int) -> None:
    """`files` files of pseudo-random bytes, `total` bytes in all, in a few directories."""
    size = total // files
    for i in range(files):
        d = root / f"d{i % 16}"
        d.mkdir(exist_ok=True)
        (d / f"f{i}.bin").write_bytes(os.urandom(size))


def spec_for(info: tc.ClusterInfo, path: Path, ws: Path) -> Path:
    """The cluster's own spec, workspace replaced, connections not kept."""
    spec = yaml.safe_load(info.spec_path.read_text())
    spec["name"] = f"bench-{info.name}"
    spec["ssh"]["persist"] = 0
    spec["workspace"] = {"local": str(ws), "remote": "bench"}
    spec["job"] = {"entrypoint": ["true"]}
    path.write_text(yaml.safe_dump(spec))
    return path


def dispatch_once(spec: Path) -> float:
    """One `clusterctl dispatch` to a fresh remote directory (a first dispatch): wall seconds."""
    data = yaml.safe_load(spec.read_text())
    data["workspace"]["remote"] = f"bench/{uuid.uuid4().hex[:8]}"
    spec.write_text(yaml.safe_dump(data))
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "clusterctl.cli", "dispatch", str(spec)], check=True,
                   capture_output=True, stdin=subprocess.DEVNULL, timeout=600)
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--keep", action="store_true", help="leave both clusters up")
    args = ap.parse_args()

    direct = tc.up(args.nodes, name="bench-direct", user="ubuntu")
    behind = tc.up(args.nodes, name="bench-bastion", user="ubuntu", bastion=True)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            ws = Path(tmp) / "ws"
            ws.mkdir()
            make_workspace(ws, args.files, args.mb * 1024 * 1024)
            specs = {"direct": spec_for(direct, Path(tmp) / "direct.yaml", ws),
                     "bastion": spec_for(behind, Path(tmp) / "bastion.yaml", ws)}
            times: dict[str, list[float]] = {"direct": [], "bastion": []}
            for r in range(args.repeat):
                order = ["direct", "bastion"] if r % 2 == 0 else ["bastion", "direct"]
                for kind in order:
                    times[kind].append(dispatch_once(specs[kind]))
                print(f"repeat {r + 1}: direct {times['direct'][-1]:.2f}s, bastion {times['bastion'][-1]:.2f}s", flush=True)
        d, b = statistics.median(times["direct"]), statistics.median(times["bastion"])
        print(f"\nfirst dispatch of {args.files} files, {args.mb} MB to {args.nodes} nodes (medians of {args.repeat}):")
        print("| path | median | min | max |\n| --- | ---: | ---: | ---: |")
        for kind in ("direct", "bastion"):
            t = times[kind]
            print(f"| {kind} | {statistics.median(t):.2f} s | {min(t):.2f} s | {max(t):.2f} s |")
        print(f"\nbastion / direct: {b / d:.2f}x")
    finally:
        if not args.keep:
            tc.down("bench-direct")
            tc.down("bench-bastion")
    return 0


if __name__ == "__main__":
    sys.exit(main())
