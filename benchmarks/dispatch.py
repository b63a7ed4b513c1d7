#!/usr/bin/env python3
"""Dispatch of a 2,000-file, 200 MB workspace to 8 test-cluster nodes: clusterctl vs parallel rsync over ssh.

Both start from empty targets, then re-send after 1% of the files changed (twice: once through the
library call, once through the `clusterctl dispatch` command, imports included). rsync runs one process
per node, all at once, with the same key and pinned known_hosts: once with ssh's defaults, once with ssh
given what clusterctl's OpenSSH client has (the same key exchange, connections kept open between runs).
Bytes: clusterctl's own count of what it streamed per node; rsync's `--stats` "Total bytes sent". CPU:
the controller's (this process's for the library call, plus the ssh/rsync/clusterctl processes it waited
for; not the kept connections' master ssh, which both tools share alike) and the hosts' (the nodes'
containers, from their cgroup's cpuacct: sshd, Python, tar, rsync). Also: time from `start` to all
processes running, 8 nodes × 2 processes.

    .venv/bin/python benchmarks/dispatch.py [--nodes 8] [--repeat 3] [--no-first] [--no-start] [--rt]

`--rt` (root only) runs each timed 1% change under SCHED_FIFO (this process and what it starts: the
`clusterctl dispatch` command, rsync and their ssh): on a shared, loaded machine the controller side then
gets a core whenever it can run, as on an idle one (the hosts' side in the containers does not).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import resource
import secrets
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
from clusterctl.ops import open_session  # noqa: E402
from clusterctl.ops.dispatch import dispatch  # noqa: E402
from clusterctl.ops.job import start, stop  # noqa: E402

FILES, TOTAL = 2000, 200 * 1024 * 1024


def make_workspace(root: Path) -> list[Path]:
    rng = random.Random(0)
    size = TOTAL // FILES
    paths = []
    for i in range(FILES):
        p = root / f"d{i // 100:02d}" / f"f{i:04d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rng.randbytes(size))
        paths.append(p)
    return paths


def touch_one_percent(paths: list[Path], round_: int) -> None:
    rng = random.Random(round_)
    for p in rng.sample(paths, len(paths) // 100):
        data = bytearray(p.read_bytes())
        data[:16] = rng.randbytes(16)
        p.write_bytes(bytes(data))


def _cgroup_usage_files(containers: list[str]) -> list[Path]:
    """Each container's cumulative CPU-time file (ns under cgroup v1's cpuacct, µs under v2's cpu.stat)."""
    out = []
    for name in containers:
        cid = subprocess.run(["docker", "inspect", "-f", "{{.Id}}", name], capture_output=True, text=True).stdout.strip()
        for candidate in (f"/sys/fs/cgroup/cpuacct/docker/{cid}/cpuacct.usage",
                          f"/sys/fs/cgroup/system.slice/docker-{cid}.scope/cpu.stat",
                          f"/sys/fs/cgroup/docker/{cid}/cpu.stat"):
            if os.path.exists(candidate):
                out.append(Path(candidate))
                break
    return out


def _host_cpu(files: list[Path]) -> float:
    """Seconds of CPU the nodes' containers have used so far (0.0 where the cgroup files are not readable)."""
    total = 0.0
    for f in files:
        text = f.read_text()
        if f.name == "cpuacct.usage":
            total += int(text) / 1e9
        else:
            total += int(re.search(r"usage_usec (\d+)", text).group(1)) / 1e6
    return total


RT = [False]  # --rt: the timed 1% changes under SCHED_FIFO


def measured(step, cgroups: list[Path], rt: bool = False):
    """Run step() -> (seconds, bytes); return (seconds, bytes, controller CPU s, hosts' CPU s)."""
    c0, k0, h0 = time.process_time(), resource.getrusage(resource.RUSAGE_CHILDREN), _host_cpu(cgroups)
    if rt and RT[0]:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    try:
        elapsed, sent = step()
    finally:
        if rt and RT[0]:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    k1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    ctl = time.process_time() - c0 + (k1.ru_utime + k1.ru_stime) - (k0.ru_utime + k0.ru_stime)
    return elapsed, sent, ctl, _host_cpu(cgroups) - h0


_CONTROL = tempfile.mkdtemp(prefix="rs", dir="/tmp")  # short: socket paths


def _ssh_command(info, tuned: bool) -> str:
    ssh = (
        f"ssh -i {info.key_path} -o UserKnownHostsFile={info.known_hosts_path} "
        "-o StrictHostKeyChecking=yes -o BatchMode=yes"
    )
    if tuned:
        ssh += (f" -o KexAlgorithms={remote_mod._KEX} -o ControlMaster=auto -o ControlPath={_CONTROL}/%C"
                " -o ControlPersist=60" + (f" -o Ciphers={remote_mod._CIPHERS}" if remote_mod._CIPHERS else ""))
    return ssh


def rsync_all(ws: Path, ips: list[str], info, dest: str, tuned: bool = False, extra: tuple[str, ...] = ()) -> tuple[float, int]:
    """rsync to every node at once. `tuned`: its ssh given what clusterctl's has — the same key exchange
    (no sntrup761 hybrid), cipher order and connections kept open between runs (ControlPersist)."""
    ssh = _ssh_command(info, tuned)
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            ["rsync", "-a", "--delete", "--stats", *extra, "-e", ssh, f"{ws}/", f"root@{ip}:{dest}/"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for ip in ips
    ]
    sent = 0
    for p in procs:
        out, err = p.communicate()
        if p.returncode:
            raise SystemExit(f"rsync failed: {err}")
        sent += int(re.search(r"Total bytes sent: ([\d,]+)", out).group(1).replace(",", ""))
    return time.perf_counter() - t0, sent


_GENERATIONS: dict[str, int] = {}


def rsync_generations(ws: Path, ips: list[str], info, base: str) -> tuple[float, int]:
    """rsync as the engine of our host layout (ssh as ours): each run fills a new directory BASE.d/gN,
    unchanged files hard-linked from the previous generation (--link-dest, which is also the basis of the
    delta transfer), then switches the symlink BASE to it atomically over the same kept connections. No
    drift report, no manifest, no pruning: the least an rsync-based dispatch would cost."""
    k = _GENERATIONS[base] = _GENERATIONS.get(base, -1) + 1
    parent, name = base.rsplit("/", 1)
    t0 = time.perf_counter()
    _, sent = rsync_all(ws, ips, info, f"{base}.d/g{k}", tuned=True,
                        # absolute: a relative --link-dest basis fails verification with the hosts'
                        # rsync 3.2.7 (Debian's CVE fixes; RsyncProject/rsync#928)
                        extra=(*([f"--link-dest=/root/{base}.d/g{k - 1}"] if k else []),
                               f"--rsync-path=mkdir -p {base}.d && rsync"))
    switch = f"cd {parent} && ln -sfn {name}.d/g{k} {name}.tmp && mv -T {name}.tmp {name}"
    procs = [subprocess.Popen([*_ssh_command(info, True).split(), f"root@{ip}", switch]) for ip in ips]
    if any(p.wait() for p in procs):
        raise SystemExit("switching the generation failed")
    return time.perf_counter() - t0, sent


def ours(spec: Path) -> tuple[float, int]:
    """The library call (what `fab` tasks and `start --dispatch` run): session, scan, transfer."""
    t0 = time.perf_counter()
    with open_session(str(spec)) as s:
        res = dispatch(s)
    return time.perf_counter() - t0, sum(r.bytes_sent for r in res)


def ours_cli(spec: Path) -> tuple[float, int]:
    """`clusterctl dispatch SPEC` as a user runs it: a new Python process, imports included."""
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "clusterctl.cli", "dispatch", str(spec)], capture_output=True,
                         text=True, env={**os.environ, "COLUMNS": "200"})
    elapsed = time.perf_counter() - t0
    if res.returncode:
        raise SystemExit(f"clusterctl dispatch failed: {res.stderr}")
    units = {"B": 1, "KiB": 1024, "MiB": 1 << 20, "GiB": 1 << 30}
    sent = 0
    for line in res.stdout.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 5 and cells[1].isdigit():
            number, unit = cells[2].split()
            sent += int(float(number) * units[unit])
    return elapsed, sent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--name", default="clusterctl-bench")
    ap.add_argument("--no-first", action="store_true", help="time only the 1%% changes (one untimed first dispatch)")
    ap.add_argument("--link-dest", action="store_true",
                    help="one more peer: rsync (ssh as ours) into hard-linked generations with an atomic switch")
    ap.add_argument("--no-start", action="store_true", help="skip the start-latency measurement")
    ap.add_argument("--rt", action="store_true", help="time the 1%% changes under SCHED_FIFO (root)")
    args = ap.parse_args()
    RT[0] = args.rt

    # The command is timed as an installed package runs: with its modules' bytecode cached (pip writes it
    # at install; a checkout under PYTHONDONTWRITEBYTECODE=1 would compile every module on every run).
    import compileall

    compileall.compile_dir(str(Path(__file__).resolve().parent.parent / "clusterctl"), quiet=1)
    info = tc.up(args.nodes, name=args.name)
    base = yaml.safe_load(Path(info.spec_path).read_text())
    ips = [n.ip for n in info.nodes][: args.nodes]
    cgroups = _cgroup_usage_files([n.container for n in info.nodes][: args.nodes])
    loads: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        ws = Path(tmp) / "ws"
        paths = make_workspace(ws)
        results: dict[str, list[tuple[float, int, float, float]]] = {
            f"{who}-{case}": [] for case in ("first", "1%", "1% (CLI)") for who in ("ours", "rsync", "tuned", "gens")
        }
        def remove(what: str) -> None:
            subprocess.run(["pdsh", "-R", "ssh", "-l", "root", "-w", ",".join(ips), f"rm -rf {what}"],
                           env={**os.environ, "PDSH_SSH_ARGS_APPEND": f"-i {info.key_path} -o UserKnownHostsFile={info.known_hosts_path}"},
                           capture_output=True)

        remove("bench")
        run = secrets.token_hex(3)  # new targets: a first dispatch knows nothing of them, like rsync
        for r in range(args.repeat):
            t_ = 0 if args.no_first else r  # --no-first: one set of targets, sent once untimed, then changes only
            remote = f"bench/{run}-ws{t_}"
            spec = Path(tmp) / "bench.yaml"
            text = yaml.safe_dump({**base, "name": "bench", "hosts": base["hosts"][: args.nodes],
                                   "workspace": {"local": str(ws), "remote": remote}})
            if not spec.exists() or spec.read_text() != text:
                # written only when it changes, as a user's spec is: a spec file rewritten a moment before a
                # command is planned again (the plan cache keeps nothing made from a file changed within a
                # second), which cost the command a spec load (pydantic) in most rounds
                spec.write_text(text)
            peers = {
                "rsync": lambda: rsync_all(ws, ips, info, f"bench/{run}-rs{t_}"),
                "tuned": lambda: rsync_all(ws, ips, info, f"bench/{run}-rt{t_}", tuned=True),
            }
            if args.link_dest:
                peers["gens"] = lambda: rsync_generations(ws, ips, info, f"bench/{run}-rg{t_}")
            steps = [("ours", lambda: ours(spec)), *peers.items()]
            loads.append(os.getloadavg()[0])
            for name, step in steps if r % 2 == 0 else steps[::-1]:  # alternate who goes first: 1.6 GB of
                os.sync()  # writeback from the previous step would otherwise land on the next one
                if args.no_first:
                    if r == 0:
                        step()
                else:
                    results[f"{name}-first"].append(measured(step, cgroups))
            for i, (case, mine) in enumerate((("1%", lambda: ours(spec)), ("1% (CLI)", lambda: ours_cli(spec))), 1):
                touch_one_percent(paths, 1000 * i + r)  # then every tool sends the same change
                order = [("ours", mine), *peers.items()]
                for name, step in order if (r + i) % 2 == 0 else order[::-1]:
                    os.sync()
                    results[f"{name}-{case}"].append(measured(step, cgroups, rt=True))
            print({k: tuple(round(x, 3) for x in v[-1]) for k, v in results.items() if v}, flush=True)
            if not args.no_first:  # this round's targets (1.6 GB per tool), untimed
                remove(f"bench/{run}-*")

        med = {k: [statistics.median(x[j] for x in v) for j in range(4)] for k, v in results.items() if v}
        print(f"\n{args.nodes} nodes, {FILES} files, {TOTAL >> 20} MiB; medians of {args.repeat}; load average "
              f"(1 min) {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores\n")
        print("| case | clusterctl (s) | rsync ×N (s) | ours ÷ rsync | rsync ×N, ssh as ours (s) | ours ÷ that "
              "| clusterctl bytes | rsync bytes |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        cases = [c for c in ("first", "1%", "1% (CLI)") if f"ours-{c}" in med]
        for case in cases:
            o, r_, t = med[f"ours-{case}"], med[f"rsync-{case}"], med[f"tuned-{case}"]
            print(f"| {case} | {o[0]:.2f} | {r_[0]:.2f} | {o[0] / r_[0]:.2f} | {t[0]:.2f} | {o[0] / t[0]:.2f} "
                  f"| {o[1]:,.0f} | {r_[1]:,.0f} |")
        if args.link_dest:
            print("\n| case | clusterctl (s) | rsync into hard-linked generations + switch, ssh as ours (s) | ours ÷ that |")
            print("| --- | ---: | ---: | ---: |")
            for case in cases:
                o, g = med[f"ours-{case}"], med[f"gens-{case}"]
                print(f"| {case} | {o[0]:.2f} | {g[0]:.2f} | {o[0] / g[0]:.2f} |")
        print("\nCPU seconds, medians (controller / all hosts together):\n")
        print("| case | clusterctl | rsync ×N | rsync ×N, ssh as ours |" + (" rsync generations |" if args.link_dest else ""))
        print("| --- | ---: | ---: | ---: |" + (" ---: |" if args.link_dest else ""))
        for case in cases:
            o, r_, t = med[f"ours-{case}"], med[f"rsync-{case}"], med[f"tuned-{case}"]
            g = med.get(f"gens-{case}")
            print(f"| {case} | {o[2]:.2f} / {o[3]:.2f} | {r_[2]:.2f} / {r_[3]:.2f} | {t[2]:.2f} / {t[3]:.2f} |"
                  + (f" {g[2]:.2f} / {g[3]:.2f} |" if g else ""))
        print("\nPer run (s; ours / rsync / rsync with ssh as ours" + (" / rsync generations" if args.link_dest else "") + "):")
        for case in cases:
            runs = zip(*(results[f"{who}-{case}"] for who in ("ours", "rsync", "tuned", "gens")[: 3 + args.link_dest]),
                       strict=True)
            print(f"- {case}: " + ", ".join("/".join(f"{x[0]:.2f}" for x in triple) for triple in runs))
        if args.no_start:
            return 0

        # start latency: 8 nodes x 2 trainers of a sleeper
        (ws / "sleep.py").write_text("import time; time.sleep(60)\n")
        spec.write_text(yaml.safe_dump({**base, "name": "benchstart", "hosts": base["hosts"][: args.nodes],
                                        "workspace": {"local": str(ws / 'd00'), "remote": "bench/start"},
                                        "job": {"mode": "collective", "entrypoint": ["python3", "-c", "import time; time.sleep(60)"],
                                                "trainers": 2, "grace": 1}}))
        starts = []
        for _ in range(args.repeat):
            with open_session(str(spec)) as s:
                dispatch(s)
                t0 = time.perf_counter()
                st = start(s)
                starts.append(time.perf_counter() - t0)
                assert sum(p.state == "running" for p in st.processes) == 2 * args.nodes, st
                stop(s)
        print(f"\nstart → all {2 * args.nodes} processes running on {args.nodes} nodes: median {statistics.median(starts):.2f}s "
              f"(runs: {', '.join(f'{x:.2f}' for x in starts)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
