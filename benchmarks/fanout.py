#!/usr/bin/env python3
"""`exec true` fan-out on N = 1, 2, 4, 8, 16 test-cluster nodes: clusterctl vs pdsh vs a serial ssh loop.

All use the same key, the same pinned known_hosts and strict host-key checking. pdsh runs twice: with
ssh's defaults, and with ssh given what clusterctl's OpenSSH client has (the same key exchange,
connections kept open between runs). Runs are interleaved (ours, pdsh, pdsh tuned, serial, ours, ...) so
machine noise hits all of them alike; medians reported.

    .venv/bin/python benchmarks/fanout.py [--nodes 16] [--repeat 7]
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clusterctl import remote as remote_mod  # noqa: E402
from clusterctl import testcluster as tc  # noqa: E402


def timed(argv: list[str], env: dict | None = None) -> float:
    t0 = time.perf_counter()
    res = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, stdin=subprocess.DEVNULL)
    dt = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{argv[:3]}... failed: {res.stderr.decode()[-500:]}")
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--name", default="clusterctl-bench")
    args = ap.parse_args()

    info = tc.up(args.nodes, name=args.name)
    base = yaml.safe_load(Path(info.spec_path).read_text())
    ips = [n.ip for n in info.nodes]
    ssh_opts = [
        "-i", str(info.key_path), "-o", f"UserKnownHostsFile={info.known_hosts_path}",
        "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10",
    ]
    env = {**os.environ, "PDSH_SSH_ARGS_APPEND": " ".join(ssh_opts)}
    control = tempfile.mkdtemp(prefix="pd", dir="/tmp")  # short: socket paths
    tuned = ssh_opts + ["-o", f"KexAlgorithms={remote_mod._KEX}", "-o", "ControlMaster=auto",
                        "-o", f"ControlPath={control}/%C", "-o", "ControlPersist=60"]
    if remote_mod._CIPHERS:
        tuned += ["-o", f"Ciphers={remote_mod._CIPHERS}"]
    env_tuned = {**os.environ, "PDSH_SSH_ARGS_APPEND": " ".join(tuned)}
    rows = []
    for n in [k for k in (1, 2, 4, 8, 16) if k <= args.nodes]:
        spec = Path(info.state_dir) / f"fanout-{n}.yaml"
        spec.write_text(yaml.safe_dump({**base, "hosts": base["hosts"][:n], "name": f"fanout{n}"}))
        ours = [sys.executable, "-m", "clusterctl.cli", "exec", str(spec), "--", "true"]
        pdsh = ["pdsh", "-R", "ssh", "-l", "root", "-f", "64", "-w", ",".join(ips[:n]), "true"]
        serial = ["bash", "-c", " ; ".join(f"ssh {' '.join(ssh_opts)} root@{ip} true" for ip in ips[:n])]
        times: dict[str, list[float]] = {"ours": [], "pdsh": [], "tuned": [], "serial": []}
        timed(ours), timed(pdsh, env), timed(pdsh, env_tuned)  # warm caches (and open the kept connections)
        for _ in range(args.repeat):
            times["ours"].append(timed(ours))
            times["pdsh"].append(timed(pdsh, env))
            times["tuned"].append(timed(pdsh, env_tuned))
            times["serial"].append(timed(serial))
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append((n, med))
        print(f"N={n:2d} ours={med['ours']:.3f}s pdsh={med['pdsh']:.3f}s pdsh-tuned={med['tuned']:.3f}s "
              f"serial={med['serial']:.3f}s", flush=True)

    one = rows[0][1]["ours"]
    print("\n| nodes | clusterctl exec (s) | pdsh (s) | pdsh, ssh as ours (s) | serial ssh (s) | ours ÷ pdsh "
          "| ours ÷ pdsh as ours | ours ÷ ours@1 |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, med in rows:
        print(
            f"| {n} | {med['ours']:.3f} | {med['pdsh']:.3f} | {med['tuned']:.3f} | {med['serial']:.3f} | "
            f"{med['ours'] / med['pdsh']:.2f} | {med['ours'] / med['tuned']:.2f} | {med['ours'] / one:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
