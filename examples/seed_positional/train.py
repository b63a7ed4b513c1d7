"""Seed 000's positional-argument script, on clusterctl.ps instead of Paddle's transpiler.

    python train.py pserver ENDPOINTS CURRENT_ENDPOINT TRAINER_ID TRAINERS
    python train.py trainer ENDPOINTS CURRENT_ENDPOINT TRAINER_ID TRAINERS

ENDPOINTS is the comma-separated pserver list (``ip:port,ip:port``). For a pserver, CURRENT_ENDPOINT
is the address it binds (its pserver id is its position in ENDPOINTS, as the seed's fabfile derives
it; TRAINER_ID is ignored); for a trainer CURRENT_ENDPOINT is informational. TRAINERS is the trainer
count. CLUSTERCTL_PS_MODE / CLUSTERCTL_PS_K_STEPS pick sync (default), async or geo.

The model is a small linear regression (y = x . w + b on 8 features, synthetic data generated
from a fixed seed; trainer i takes the rows with index % TRAINERS == i).
"""

from __future__ import annotations

import logging
import os
import sys
import time

import numpy as np

from clusterctl.ps import SGD, ParameterServer, PSClient, PsError

USAGE = "usage: train.py pserver|trainer ENDPOINTS CURRENT_ENDPOINT TRAINER_ID TRAINERS"
PASSES, BATCH, LR = 10, 16, 0.05


def _data(tid: int, trainers: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2018)
    x = rng.normal(size=(400, 8)).astype(np.float32)
    w = np.arange(1, 9, dtype=np.float32).reshape(8, 1)
    y = (x @ w + 4 + rng.normal(scale=0.5, size=(400, 1))).astype(np.float32)
    keep = np.arange(400) % trainers == tid
    return x[keep], y[keep]


def run_pserver(endpoints: list[str], current: str, trainers: int, mode: str, k_steps: int) -> int:
    """Serve until every trainer completed."""
    if current not in endpoints:
        print(f"CURRENT_ENDPOINT {current} is not in ENDPOINTS {','.join(endpoints)}", file=sys.stderr)
        return 2
    server = ParameterServer(current, server_id=endpoints.index(current), num_servers=len(endpoints),
                             num_trainers=trainers, mode=mode, k_steps=k_steps)
    try:
        server.serve()
    except PsError as exc:
        print(f"pserver failed: {exc}", file=sys.stderr)
        return 1
    return 0


def run_trainer(endpoints: list[str], tid: int, trainers: int, mode: str, k_steps: int) -> int:
    """Train, print progress, exit 0 iff the final loss is below 1.0."""
    x, y = _data(tid, trainers)
    with PSClient(endpoints, trainer_id=tid, num_trainers=trainers, mode=mode, k_steps=k_steps,
                  optimizer=SGD(LR)) as ps:
        params = ps.init({"w": np.zeros((8, 1), np.float32), "b": np.zeros(1, np.float32)})
        steps_per_pass = -(-len(x) // BATCH)
        t0 = time.perf_counter()
        for step in range(ps.start_step, PASSES * steps_per_pass):
            i = (step % steps_per_pass) * BATCH
            xb, yb = x[i:i + BATCH], y[i:i + BATCH]
            err = xb @ params["w"] + params["b"] - yb
            loss = float(np.mean(err * err))
            grads = {"w": np.float32(2 / len(xb)) * (xb.T @ err), "b": np.float32(2 / len(xb)) * err.sum(axis=0)}
            if mode == "geo":
                for k, g in grads.items():
                    params[k] -= np.float32(LR) * g
                ps.geo_step(params, step=step)
            else:
                params = ps.push_pull(grads, step=step)
            print(f"step={step} loss={loss:.4f} trainer={tid}", flush=True)
        ps.complete(params if mode == "geo" else None)
        wall = time.perf_counter() - t0
    final = float(np.mean((x @ params["w"] + params["b"] - y) ** 2))
    print(f"done steps={PASSES * steps_per_pass} loss={final:.4f} wall_s={wall:.2f} trainer={tid}", flush=True)
    return 0 if final < 1.0 else 1


def main(argv: list[str]) -> int:
    """Parse the seed's five positional arguments and run the role."""
    if len(argv) != 5 or argv[0] not in ("pserver", "trainer"):
        print(USAGE, file=sys.stderr)
        return 2
    role, eps, current, tid, trainers = argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    endpoints = [e for e in eps.split(",") if e]
    mode = os.environ.get("CLUSTERCTL_PS_MODE", "sync")
    k_steps = int(os.environ.get("CLUSTERCTL_PS_K_STEPS", "1"))
    if role == "pserver":
        return run_pserver(endpoints, current, int(trainers), mode, k_steps)
    return run_trainer(endpoints, int(tid), int(trainers), mode, k_steps)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
