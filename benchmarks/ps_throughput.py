"""Parameter-server throughput on one machine (loopback), side by side with raw TCP (iperf3).

    python benchmarks/ps_throughput.py                    # everything, defaults below
    python benchmarks/ps_throughput.py --repeats 5 --params 10000000 --steps 10
    python benchmarks/ps_throughput.py --auth-compare --skip-modes --skip-transport   # authentication cost

Part 1, transport: one trainer and one pserver (separate processes, async mode, SGD applied on the
server; the public ``push_pull``, which in async mode is pipelined in wire-chunk pieces). A step pushes a 4*N-byte gradient and pulls the 4*N-byte parameter back; MB/s counts both
directions (2 * 4 * N bytes per step). The peer is ``iperf3`` on 127.0.0.1 (one TCP stream, 3 s),
and bare pyzmq doing the same exchange (DEALER/ROUTER, zero-copy, one copy into the output array, no
optimizer) are run in the same repeat loop, interleaved; ratios are computed per repeat and the
medians reported.

Part 2, modes: 2 pservers and 4 trainers (local processes) on an N-parameter model (two 2-D
tensors, each split in two blocks over the pservers); trainers send ready-made gradients, so the
number is the runtime's steps/s, not a model's. Geo uses k_steps (default 4) and does the local SGD
step on the trainer. Reported: steps/s of the job (steps per trainer / slowest trainer's wall time).

Parts 1 and 2 run as a job does, with a job token (CURVE on every connection, docs/security.md);
``--auth none`` runs them with ``CLUSTERCTL_AUTH=none`` (plain ZMTP, as every figure taken before issue 21).

``--auth-compare``: authentication cost, ours against the code before issue 21 (``--old-ref``, default
d6c8b7f: an HMAC-SHA256 of each header only), extracted from git into a temporary directory. Six
variants, interleaved in each repeat (their order rotating from one repeat to the next): a pserver
process and a trainer process importing the same tree for old without token, old with token (header
MAC), new with ``CLUSTERCTL_AUTH=none``, new with token (CURVE: every frame encrypted and
authenticated); and libzmq alone, bare pyzmq sending the same bytes back and forth in 4 MiB frames
(one message in flight, no pipelining), without and with CURVE: CURVE's own cost. Each reports push+pull MB/s (1 trainer, 1 pserver, async,
``--transport-params`` floats) and the round-trip latency of a push_pull of a 1 KiB model (median and
90th percentile of ``--latency-calls`` calls, after 20 warm-up calls).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import tarfile
import tempfile
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if sys.argv[1:2] != ["_transport"]:  # that one imports the clusterctl its PYTHONPATH names (ours or the old)
    sys.path.insert(0, str(REPO))

from clusterctl.ps import SGD, PSClient  # noqa: E402 (after the sys.path line above)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


TOKEN = "bench-" + os.urandom(16).hex()  # the benchmark job's token (as the supervisor would set one)


def _env(role: str, idx: int, pservers: list[str], trainers: int, mode: str, k_steps: int,
         token: str | None = TOKEN, tree: Path = REPO) -> dict[str, str]:
    """A process's environment; ``token`` None: ``CLUSTERCTL_AUTH=none``; ``tree``: where clusterctl is imported from."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "CLUSTERCTL_", "TRAINING_"))}
    if token:
        env["CLUSTERCTL_JOB_TOKEN"] = token
    else:
        env["CLUSTERCTL_AUTH"] = "none"
    own = pservers[idx] if role == "pserver" else f"127.0.0.1:{40000 + idx}"
    env.update({
        "TRAINING_ROLE": "PSERVER" if role == "pserver" else "TRAINER",
        "PADDLE_PSERVERS_IP_PORT_LIST": ",".join(pservers),
        "PADDLE_CURRENT_ENDPOINT": own,
        "POD_IP": "127.0.0.1",
        "PADDLE_PORT": own.rsplit(":", 1)[1],
        "PADDLE_TRAINERS_NUM": str(trainers),
        "CLUSTERCTL_JOB": "ps-bench",
        "CLUSTERCTL_PS_MODE": mode,
        "CLUSTERCTL_PS_K_STEPS": str(k_steps),
        "PYTHONPATH": str(tree) + os.pathsep + env.get("PYTHONPATH", ""),
    })
    env["PADDLE_PSERVER_ID" if role == "pserver" else "PADDLE_TRAINER_ID"] = str(idx)
    return env


def _start_pservers(n: int, trainers: int, mode: str, k_steps: int = 1, token: str | None = TOKEN,
                    tree: Path = REPO) -> tuple[list[str], list[subprocess.Popen]]:
    eps = [f"127.0.0.1:{p}" for p in _free_ports(n)]
    procs = [subprocess.Popen([sys.executable, "-m", "clusterctl.ps", "server", "--log-level", "ERROR"],
                              env=_env("pserver", i, eps, trainers, mode, k_steps, token, tree), cwd=tree)
             for i in range(n)]
    return eps, procs


def _model(n: int) -> dict[str, np.ndarray]:
    rows = max(1, int((n // 2) ** 0.5))
    cols = (n // 2) // rows
    rng = np.random.default_rng(0)
    return {"fc1.w": rng.standard_normal((rows, cols), np.float32),
            "fc2.w": rng.standard_normal((cols, rows), np.float32)}


# --------------------------------------------------------------------------- part 1

def iperf3_mbps(seconds: int = 2) -> float:
    """Raw TCP throughput over 127.0.0.1 in MB/s (iperf3, one stream, receiver side)."""
    port = _free_ports(1)[0]
    server = subprocess.Popen(["iperf3", "-s", "-1", "-B", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)  # let it listen (no probe: a probe connection would be its one client)
        out = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", str(seconds), "-J"],
                             capture_output=True, text=True, timeout=seconds + 20, check=True).stdout
        return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 8 / 1e6
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()


def zmq_echo_main(argv: list[str]) -> int:
    """Internal: a bare pyzmq ROUTER that answers each message with an equally large array."""
    import zmq

    port, n = int(argv[0]), int(argv[1])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")
    reply = np.ones(n, np.float32)
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) < 3:
            break
        sock.send_multipart([frames[0], b"h", reply], copy=False)
    sock.close()
    ctx.term()
    return 0


def zmq_raw_mbps(n: int, steps: int) -> float:
    """Bare pyzmq, same pattern as push_pull (N floats out, N floats back, zero-copy), in MB/s."""
    import zmq

    port = _free_ports(1)[0]
    server = subprocess.Popen([sys.executable, __file__, "_zmq_echo", str(port), str(n)], cwd=REPO)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    grad = np.ones(n, np.float32)
    out = np.empty(n, np.float32)

    def one() -> None:
        sock.send_multipart([b"h", grad], copy=False)
        frames = sock.recv_multipart(copy=False)
        np.copyto(out, np.frombuffer(frames[1].buffer, np.float32))  # same one copy as the ps client

    try:
        one()
        t0 = time.perf_counter()
        for _ in range(steps):
            one()
        wall = time.perf_counter() - t0
        sock.send(b"stop")
        server.wait(30)
        return 2 * 4 * n * steps / wall / 1e6
    finally:
        sock.close()
        ctx.term()
        if server.poll() is None:
            server.kill()


def ps_push_pull_mbps(n: int, steps: int, token: str | None = TOKEN) -> float:
    """One trainer <-> one pserver push_pull throughput in MB/s (both directions counted)."""
    eps, procs = _start_pservers(1, 1, "async", token=token)
    try:
        with PSClient(eps, trainer_id=0, num_trainers=1, mode="async", optimizer=SGD(1e-6), timeout=120,
                      token=token or "", auth=None if token else "none") as c:
            params = {"w": np.zeros(n, np.float32)}
            c.init(params)
            grad = {"w": np.ones(n, np.float32)}
            out = {"w": np.empty(n, np.float32)}
            c.push_pull(grad, out=out)  # warm-up: page faults, TCP window
            t0 = time.perf_counter()
            for _ in range(steps):
                c.push_pull(grad, out=out)
            wall = time.perf_counter() - t0
            c.complete()
        for p in procs:
            p.wait(30)
        return 2 * 4 * n * steps / wall / 1e6
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


# --------------------------------------------------------------------------- authentication cost

def old_tree(ref: str) -> Path:
    """``clusterctl/`` as of git ``ref``, extracted into a temporary directory (the code to compare with)."""
    out = subprocess.run(["git", "-C", str(REPO), "archive", ref, "clusterctl"], capture_output=True, check=True).stdout
    tmp = Path(tempfile.mkdtemp(prefix="ps-old-"))
    with tarfile.open(fileobj=io.BytesIO(out)) as tar:
        tar.extractall(tmp, filter="data")
    return tmp


def transport_main(argv: list[str]) -> int:
    """Internal: a trainer of the clusterctl on PYTHONPATH: push+pull MB/s against argv[3], latency against argv[4]."""
    n, steps, calls, big, small = int(argv[0]), int(argv[1]), int(argv[2]), argv[3], argv[4]
    from clusterctl.ps import SGD, PSClient  # the tree on PYTHONPATH: ours or the old one

    with PSClient([big], trainer_id=0, num_trainers=1, mode="async", optimizer=SGD(1e-6), timeout=120) as c:
        c.init({"w": np.zeros(n, np.float32)})
        grad, out = {"w": np.ones(n, np.float32)}, {"w": np.empty(n, np.float32)}
        c.push_pull(grad, out=out)  # warm-up: page faults, TCP window
        t0 = time.perf_counter()
        for _ in range(steps):
            c.push_pull(grad, out=out)
        mbps = 2 * 4 * n * steps / (time.perf_counter() - t0) / 1e6
        c.complete()
    lat = []
    with PSClient([small], trainer_id=0, num_trainers=1, mode="async", optimizer=SGD(1e-6), timeout=120) as c:
        c.init({"w": np.zeros(256, np.float32)})
        grad, out = {"w": np.ones(256, np.float32)}, {"w": np.empty(256, np.float32)}
        for i in range(20 + calls):
            t0 = time.perf_counter()
            c.push_pull(grad, out=out)
            if i >= 20:
                lat.append(time.perf_counter() - t0)
        c.complete()
    lat.sort()
    import clusterctl

    print(json.dumps({"tree": str(Path(clusterctl.__file__).resolve().parents[1]), "MBps": mbps, "lat_us": statistics.median(lat) * 1e6, "lat_p90_us": lat[int(0.9 * len(lat))] * 1e6}))
    return 0


def bare_echo_main(argv: list[str]) -> int:
    """Internal: a bare pyzmq ROUTER (CURVE when argv[1] is "curve") that sends every message back."""
    import zmq

    from clusterctl.ps.auth import Credentials

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    if argv[1] == "curve":  # CURVE without a ZAP handler: any client key is let in
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, Credentials.from_token(os.environ["CLUSTERCTL_JOB_TOKEN"]).server_secret)
    sock.bind(f"tcp://127.0.0.1:{argv[0]}")
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) < 3:
            break
        sock.send_multipart(frames, copy=False)
    sock.close()
    ctx.term()
    return 0


def bare_variant(curve: bool, n: int, steps: int, calls: int) -> dict[str, float]:
    """Bare pyzmq, ``curve`` or not: ``n`` floats out in 4 MiB frames and back (one message in flight), one copy
    into an array, as push_pull (MB/s); and a 1 KiB round trip (latency): what libzmq alone costs."""
    import zmq

    from clusterctl.ps.auth import Credentials, secure_client

    port = _free_ports(1)[0]
    server = subprocess.Popen([sys.executable, __file__, "_bare_echo", str(port), "curve" if curve else "plain"],
                              cwd=REPO, env={**os.environ, "CLUSTERCTL_JOB_TOKEN": TOKEN})
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve:
        secure_client(sock, Credentials.from_token(TOKEN))
    sock.connect(f"tcp://127.0.0.1:{port}")
    chunk = 1 << 20  # floats: 4 MiB frames, as the pserver's
    grad, out = np.ones(n, np.float32), np.empty(n, np.float32)
    parts = [grad[i:i + chunk] for i in range(0, n, chunk)]

    def one(frames: list[Any], into: np.ndarray) -> None:
        sock.send_multipart([b"h", *frames], copy=False)
        off = 0
        for f in sock.recv_multipart(copy=False)[1:]:
            piece = np.frombuffer(f.buffer, np.float32)
            into[off:off + piece.size] = piece
            off += piece.size

    try:
        one(parts, out)
        t0 = time.perf_counter()
        for _ in range(steps):
            one(parts, out)
        mbps = 2 * 4 * n * steps / (time.perf_counter() - t0) / 1e6
        small, small_out, lat = [np.ones(256, np.float32)], np.empty(256, np.float32), []
        for i in range(20 + calls):
            t0 = time.perf_counter()
            one(small, small_out)
            if i >= 20:
                lat.append(time.perf_counter() - t0)
        sock.send(b"stop")
        server.wait(30)
    finally:
        sock.close()
        ctx.term()
        if server.poll() is None:
            server.kill()
    lat.sort()
    return {"MBps": mbps, "lat_us": statistics.median(lat) * 1e6, "lat_p90_us": lat[int(0.9 * len(lat))] * 1e6}


def auth_variant(tree: Path, token: str | None, n: int, steps: int, calls: int) -> dict[str, float]:
    """One variant: 2 pservers (big and small model) and the trainer, all importing clusterctl from ``tree``."""
    eps, procs = _start_pservers(2, 1, "async", token=token, tree=tree)
    env = _env("trainer", 0, eps, 1, "async", 1, token, tree)
    if token is None and tree != REPO:  # the old code knows no CLUSTERCTL_AUTH: it runs tokenless by default
        env.pop("CLUSTERCTL_AUTH")
    env["PYTHONPATH"] = str(tree)
    try:
        out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "_transport", str(n), str(steps), str(calls),
                              *eps], env=env, cwd=tree, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(f"benchmark trainer exited {out.returncode}: {out.stderr[-2000:]}")
        for p in procs:
            if p.wait(60) != 0:
                raise RuntimeError(f"pserver exited {p.returncode}")
        res = json.loads(out.stdout.strip().splitlines()[-1])
        if Path(res.pop("tree")) != tree.resolve():
            raise RuntimeError(f"the trainer imported clusterctl from the wrong tree (want {tree})")
        return res
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def auth_compare(args: argparse.Namespace) -> dict:
    """The four variants, interleaved per repeat; markdown tables of medians and per-repeat ratios."""
    old = old_tree(args.old_ref)
    variants = {"old, no token": (old, None), "old, token (HMAC of each header)": (old, TOKEN),
                "new, CLUSTERCTL_AUTH=none": (REPO, None), "new, token (CURVE, every frame)": (REPO, TOKEN),
                "bare pyzmq, plain (one message at a time)": (None, None),
                "bare pyzmq, CURVE (one message at a time)": (None, TOKEN)}
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in variants}
    try:
        labels = list(variants)
        for r in range(args.repeats):
            for label in labels[r % 6:] + labels[:r % 6]:  # the order rotates: no variant always runs first
                tree, token = variants[label]
                if tree is None:
                    runs[label].append(bare_variant(token is not None, args.transport_params, args.transport_steps,
                                                    args.latency_calls))
                    continue
                runs[label].append(auth_variant(tree, token, args.transport_params, args.transport_steps,
                                                args.latency_calls))
            print("# repeat %d: %s" % (r, "; ".join(f"{k}: {v[-1]['MBps']:.0f} MB/s, {v[-1]['lat_us']:.0f} us"
                                                     for k, v in runs.items())), flush=True)
    finally:
        shutil.rmtree(old, ignore_errors=True)
    med = {k: {m: statistics.median(x[m] for x in v) for m in ("MBps", "lat_us", "lat_p90_us")} for k, v in runs.items()}
    size_mb = args.transport_params * 4 / 1e6
    print()
    print(f"| variant ({args.old_ref} = old) | push+pull MB/s, {size_mb:.0f} MB | push_pull 1 KiB latency µs "
          f"(median / p90) |")
    print("| --- | ---: | ---: |")
    for k, m in med.items():
        print(f"| {k} | {m['MBps']:.0f} | {m['lat_us']:.0f} / {m['lat_p90_us']:.0f} |")
    labels = list(variants)

    def ratio(a: str, b: str, metric: str) -> tuple[float, list[float]]:
        per = [x[metric] / y[metric] for x, y in zip(runs[a], runs[b], strict=True)]
        return statistics.median(per), per

    print()
    print("| ratio (median of per-repeat ratios) | throughput | latency |")
    print("| --- | ---: | ---: |")
    ratios = {}
    for a, b, name in ((labels[3], labels[1], "new token / old token"), (labels[3], labels[2], "new token / new none"),
                       (labels[1], labels[0], "old token / old none"), (labels[2], labels[0], "new none / old none"),
                       (labels[5], labels[4], "bare CURVE / bare plain"), (labels[3], labels[5], "new token / bare CURVE")):
        t, tper = ratio(a, b, "MBps")
        lat, lper = ratio(a, b, "lat_us")
        ratios[name] = {"throughput": t, "latency": lat, "throughput_runs": tper, "latency_runs": lper}
        print(f"| {name} | {t:.2f} ({', '.join(f'{x:.2f}' for x in tper)}) | {lat:.2f} "
              f"({', '.join(f'{x:.2f}' for x in lper)}) |")
    return {"medians": med, "ratios": ratios, "runs": runs}


# --------------------------------------------------------------------------- part 2

def trainer_main(argv: list[str]) -> int:
    """Internal: one benchmark trainer (env from the plan contract); prints a JSON result line."""
    n, steps = int(argv[0]), int(argv[1])  # argv[2] (k_steps) reaches the client via the env
    from clusterctl.ps import client_from_env
    model = _model(n)
    c = client_from_env(optimizer=SGD(1e-6))
    params = c.init(model)
    grads = {k: np.full(v.shape, 1e-3, np.float32) for k, v in model.items()}
    scaled = {k: np.float32(1e-6) * g for k, g in grads.items()}  # the local SGD step, precomputed

    def one(step: int) -> None:
        nonlocal params
        if c.mode == "geo":
            for k, s in scaled.items():
                params[k] -= s
            c.geo_step(params, step=step)
        else:
            params = c.push_pull(grads, step=step, out=params)

    one(0)  # warm-up (and, in sync mode, lines the trainers up)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        one(step)
    wall = time.perf_counter() - t0
    c.complete(params if c.mode == "geo" else None)
    c.close()
    print(json.dumps({"trainer": int(os.environ["PADDLE_TRAINER_ID"]), "steps": steps, "wall": wall}), flush=True)
    return 0


def mode_steps_per_s(mode: str, n: int, steps: int, trainers: int = 4, pservers: int = 2, k_steps: int = 4,
                     pipeline: bool = True, token: str | None = TOKEN) -> float:
    """Job steps/s: ``steps`` per trainer divided by the slowest trainer's wall time."""
    eps, procs = _start_pservers(pservers, trainers, mode, k_steps, token)
    extra = {} if pipeline else {"CLUSTERCTL_PS_PIPELINE": "0"}
    tprocs = [subprocess.Popen([sys.executable, __file__, "_trainer", str(n), str(steps), str(k_steps)],
                               env={**_env("trainer", i, eps, trainers, mode, k_steps, token), **extra}, cwd=REPO,
                               stdout=subprocess.PIPE, text=True) for i in range(trainers)]
    try:
        walls = []
        for p in tprocs:
            out, _ = p.communicate(timeout=600)
            if p.returncode != 0:
                raise RuntimeError(f"benchmark trainer exited {p.returncode}")
            walls.append(json.loads(out.strip().splitlines()[-1])["wall"])
        for p in procs:
            if p.wait(60) != 0:
                raise RuntimeError(f"pserver exited {p.returncode}")
        return steps / max(walls)
    finally:
        for p in tprocs + procs:
            if p.poll() is None:
                p.kill()


def main() -> int:
    """Run both parts and print markdown tables plus one JSON summary line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--params", type=int, default=10_000_000, help="model size in float32 parameters")
    ap.add_argument("--transport-params", type=int, default=10_000_000, help="tensor size for part 1")
    ap.add_argument("--transport-steps", type=int, default=20)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per trainer in part 2")
    ap.add_argument("--k-steps", type=int, default=4)
    ap.add_argument("--skip-modes", action="store_true")
    ap.add_argument("--skip-transport", action="store_true")
    ap.add_argument("--modes", default="sync,async,geo",
                    help="part 2 modes, interleaved per repeat; sync-1msg = sync with CLUSTERCTL_PS_PIPELINE=0")
    ap.add_argument("--auth-compare", action="store_true",
                    help="authentication cost: old code (--old-ref) vs ours, without and with the job token")
    ap.add_argument("--old-ref", default="d6c8b7f", help="git ref of the code to compare with (before issue 21)")
    ap.add_argument("--latency-calls", type=int, default=300)
    ap.add_argument("--auth", choices=("token", "none"), default="token",
                    help="parts 1 and 2: with the job token (CURVE, as a job runs) or CLUSTERCTL_AUTH=none "
                         "(as the figures taken before issue 21)")
    args = ap.parse_args()
    if shutil.which("iperf3") is None:
        print("iperf3 is not installed (apt-get install iperf3)", file=sys.stderr)
        return 2

    token = TOKEN if args.auth == "token" else None
    rows = []
    for r in range(0 if args.skip_transport else args.repeats):
        raw = iperf3_mbps()
        zq = zmq_raw_mbps(args.transport_params, args.transport_steps)
        ps = ps_push_pull_mbps(args.transport_params, args.transport_steps, token)
        rows.append((raw, zq, ps, ps / raw, ps / zq))
        print(f"# repeat {r}: iperf3 {raw:.0f} MB/s, bare pyzmq {zq:.0f} MB/s, ps push+pull {ps:.0f} MB/s, "
              f"ps/iperf3 {ps / raw:.2f}, ps/pyzmq {ps / zq:.2f}", flush=True)
    med = [statistics.median(c) for c in zip(*rows, strict=True)] if rows else []
    if rows:
        print()
        size_mb = args.transport_params * 4 / 1e6
        print(f"| transport (1 trainer, 1 pserver, {size_mb:.0f} MB tensor) | MB/s (median of {args.repeats}) |")
        print("| --- | ---: |")
        print(f"| iperf3, 1 TCP stream, 127.0.0.1 | {med[0]:.0f} |")
        print(f"| bare pyzmq DEALER/ROUTER, same exchange (both directions counted) | {med[1]:.0f} |")
        print(f"| clusterctl.ps push+pull, SGD applied (both directions counted) | {med[2]:.0f} |")
        print(f"| ratio ps / iperf3 (median of per-repeat ratios) | {med[3]:.2f} |")
        print(f"| ratio ps / bare pyzmq (median of per-repeat ratios) | {med[4]:.2f} |")

    result = {"iperf3_MBps": med[0], "pyzmq_MBps": med[1], "ps_push_pull_MBps": med[2],
              "ratio_iperf3": med[3], "ratio_pyzmq": med[4], "repeats": rows} if rows else {}
    if args.auth_compare:
        result["auth"] = auth_compare(args)
    if not args.skip_modes:
        print()
        title = f"mode (2 pservers, 4 trainers, {args.params / 1e6:.0f}M params)"
        print(f"| {title} | steps/s (median of {args.repeats}) |")
        print("| --- | ---: |")
        modes = args.modes.split(",")
        runs: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(args.repeats):  # modes interleaved, so load changes hit them alike
            for mode in modes:
                base = "sync" if mode == "sync-1msg" else mode
                v = mode_steps_per_s(base, args.params, args.steps, k_steps=args.k_steps, token=token,
                                     pipeline=mode != "sync-1msg")
                runs[mode].append(v)
            print("# repeat %d: %s" % (r, ", ".join(f"{m} {runs[m][-1]:.2f}" for m in modes)), flush=True)
        for mode in modes:
            vals = runs[mode]
            label = {"geo": f"geo (k_steps={args.k_steps})", "sync-1msg": "sync, one message per push (PIPELINE=0)",
                     "sync": "sync (pipelined)", "async": "async (pipelined)"}.get(mode, mode)
            print(f"| {label} | {statistics.median(vals):.2f} |", flush=True)
            result[f"{mode}_steps_per_s"] = statistics.median(vals)
            result[f"{mode}_runs"] = vals
        if "sync" in runs and "async" in runs:
            ratios = [a / b for a, b in zip(runs["sync"], runs["async"], strict=True)]
            print(f"| ratio sync / async (median of per-repeat ratios: "
                  f"{', '.join(f'{x:.2f}' for x in ratios)}) | {statistics.median(ratios):.2f} |")
            result["sync_over_async"] = statistics.median(ratios)
    print()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_trainer":
        sys.exit(trainer_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "_bare_echo":
        sys.exit(bare_echo_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "_transport":
        sys.exit(transport_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "_zmq_echo":
        sys.exit(zmq_echo_main(sys.argv[2:]))
    sys.exit(main())
