#!/usr/bin/env python3
"""`exec true` fan-out on N = 1, 2, 4, 8, 16 test-cluster nodes: clusterctl vs pdsh vs a serial ssh loop;
then `status` of a running 8-node job.

All use the same key, the same pinned known_hosts and strict host-key checking. pdsh runs twice: with
ssh's defaults, and with ssh given what clusterctl's OpenSSH client has (the same key exchange,
connections kept open between runs). Runs are interleaved (ours, pdsh, pdsh tuned, serial, ours, ...) so
machine noise hits all of them alike; medians reported, wall time and CPU time (user+sys of the command
and every process it waited for).

`--python PY` runs clusterctl as `PY -m clusterctl.cli` (default: this interpreter); `--compare-python PY`
adds a column, another installation (e.g. a venv with an older commit's wheel) run interleaved with the
rest, for before/after ratios measured side by side. `--rt` runs every timed command (and what it starts)
under `chrt -f 1` (SCHED_FIFO, root only): on a shared, loaded machine, the controller side then gets a
core whenever it can run, as on an idle one (the hosts' sshd in the containers do not). `--sizes` picks
the node counts.

    .venv/bin/python benchmarks/fanout.py [--nodes 16] [--repeat 7] [--python PY] [--compare-python PY] [--status-nodes 8] [--rt] [--sizes 1,16]
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

from clusterctl import remote as remote_mod  # noqa: E402
from clusterctl import testcluster as tc  # noqa: E402


RT: list[str] = []  # ["chrt", "-f", "1"] with --rt


def timed(argv: list[str], env: dict | None = None, cwd: str | None = None) -> tuple[float, float]:
    """Run `argv` to completion; (wall seconds, CPU seconds of it and its waited-for descendants)."""
    argv = RT + argv
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=cwd,
                         stdin=subprocess.DEVNULL)
    dt = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        raise SystemExit(f"{argv[:6]}... failed: {res.stderr.decode()[-500:]}")
    return dt, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def ours_argv(python: str, *args: str) -> tuple[list[str], str | None]:
    """`PY -m clusterctl.cli ARGS`, run from / (so that no checkout on the path shadows PY's clusterctl)."""
    return [python, "-m", "clusterctl.cli", *args], "/"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--name", default="clusterctl-bench")
    ap.add_argument("--python", default=sys.executable, help="the interpreter whose clusterctl is timed")
    ap.add_argument("--compare-python", default=None, help="another interpreter/installation, timed side by side")
    ap.add_argument("--status-nodes", type=int, default=8, help="nodes of the job whose status is timed (0: skip)")
    ap.add_argument("--rt", action="store_true", help="run the timed commands under chrt -f 1 (SCHED_FIFO)")
    ap.add_argument("--sizes", default="1,2,4,8,16", help="node counts to time (default: %(default)s)")
    args = ap.parse_args()
    if args.rt:
        RT[:] = ["chrt", "-f", "1"]
    compare = args.compare_python

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
    print(f"load average at start: {os.getloadavg()[0]:.1f}{' (timed commands under chrt -f 1)' if args.rt else ''}",
          flush=True)
    kinds = ["ours"] + (["before"] if compare else []) + ["pdsh", "tuned", "serial"]
    rows = []
    for n in [k for k in map(int, args.sizes.split(",")) if k <= args.nodes]:
        spec = Path(info.state_dir) / f"fanout-{n}.yaml"
        spec.write_text(yaml.safe_dump({**base, "hosts": base["hosts"][:n], "name": f"fanout{n}"}))
        cmds = {
            "ours": (ours_argv(args.python, "exec", str(spec), "--", "true"), None),
            "before": (ours_argv(compare, "exec", str(spec), "--", "true"), None),
            "pdsh": ((["pdsh", "-R", "ssh", "-l", "root", "-f", "64", "-w", ",".join(ips[:n]), "true"], None), env),
            "tuned": ((["pdsh", "-R", "ssh", "-l", "root", "-f", "64", "-w", ",".join(ips[:n]), "true"], None), env_tuned),
            "serial": ((["bash", "-c", " ; ".join(f"ssh {' '.join(ssh_opts)} root@{ip} true" for ip in ips[:n])], None), None),
        }
        for kind in kinds:  # warm caches (ours: the plan cache) and open the kept connections
            (argv, cwd), e = cmds[kind]
            timed(argv, e, cwd)
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
        for _ in range(args.repeat):
            for kind in kinds:
                (argv, cwd), e = cmds[kind]
                times[kind].append(timed(argv, e, cwd))
        med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
        rows.append((n, med))
        print(f"N={n:2d} " + " ".join(f"{k}={w:.3f}s/{c:.3f}cpu" for k, (w, c) in med.items()), flush=True)
    print(f"load average at end of exec runs: {os.getloadavg()[0]:.1f}")

    one = rows[0][1]["ours"][0]
    head = "| nodes | clusterctl exec (s) | CPU (s) |"
    if compare:
        head += " before (s) | before CPU (s) | ours ÷ before |"
    head += " pdsh (s) | pdsh, ssh as ours (s) | its CPU (s) | serial ssh (s) | ours ÷ pdsh | ours ÷ pdsh as ours | ours ÷ ours@1 |"
    print("\n" + head)
    print("|" + " ---: |" * (head.count("|") - 1))
    for n, med in rows:
        line = f"| {n} | {med['ours'][0]:.3f} | {med['ours'][1]:.3f} |"
        if compare:
            line += f" {med['before'][0]:.3f} | {med['before'][1]:.3f} | {med['ours'][0] / med['before'][0]:.2f} |"
        line += (f" {med['pdsh'][0]:.3f} | {med['tuned'][0]:.3f} | {med['tuned'][1]:.3f} | {med['serial'][0]:.3f} | "
                 f"{med['ours'][0] / med['pdsh'][0]:.2f} | {med['ours'][0] / med['tuned'][0]:.2f} | {med['ours'][0] / one:.2f} |")
        print(line)

    if args.status_nodes:
        status_of_running_job(info, base, min(args.status_nodes, args.nodes), args.repeat, args.python, compare)
    return 0


def status_of_running_job(info, base: dict, n: int, repeat: int, python: str, compare: str | None) -> None:
    """Start a job of one `sleep` per host on `n` nodes, time `clusterctl status` on it, stop it."""
    work = Path(info.state_dir) / "status-ws"
    work.mkdir(exist_ok=True)
    (work / "README").write_text("workspace of benchmarks/fanout.py's status job\n")
    spec = Path(info.state_dir) / f"status-{n}.yaml"
    doc = {**base, "hosts": base["hosts"][:n], "name": f"statusbench{n}",
           "workspace": {"local": str(work), "remote": "/root/statusbench"},
           "job": {"mode": "collective", "entrypoint": ["/bin/sleep", "3600"], "trainers": 1}}
    spec.write_text(yaml.safe_dump(doc))
    cli = [python, "-m", "clusterctl.cli"]
    subprocess.run(cli + ["start", "--dispatch", str(spec)], check=True, stdout=subprocess.DEVNULL)
    try:
        kinds = ["ours"] + (["before"] if compare else [])
        cmds = {"ours": ours_argv(python, "status", str(spec)), "before": ours_argv(compare, "status", str(spec))}
        for kind in kinds:
            timed(cmds[kind][0], None, cmds[kind][1])
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
        for _ in range(repeat):
            for kind in kinds:
                times[kind].append(timed(cmds[kind][0], None, cmds[kind][1]))
        med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
        print(f"\nstatus of a running {n}-node job (load average {os.getloadavg()[0]:.1f}):")
        print("| | wall (s) | CPU (s) |\n| --- | ---: | ---: |")
        for kind in kinds:
            print(f"| {'clusterctl status' if kind == 'ours' else 'before'} | {med[kind][0]:.3f} | {med[kind][1]:.3f} |")
    finally:
        subprocess.run(cli + ["stop", str(spec)], stdout=subprocess.DEVNULL)


if __name__ == "__main__":
    sys.exit(main())
