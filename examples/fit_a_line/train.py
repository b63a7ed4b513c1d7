"""Fit-a-line (seed 001) on clusterctl.ps: linear regression on 13 housing features, pserver mode.

The same script is every process of the job; the environment clusterctl's plan provides decides
its role (GUIDE section 2), so it needs no arguments:

    TRAINING_ROLE=PSERVER  -> runs one pserver until every trainer has completed (exit 0)
    TRAINING_ROLE=TRAINER  -> trains on its data shard, prints progress, exits 0 iff final loss < 10

Output of a trainer (one line per step, then one summary line; ``key=value`` pairs, stable order):

    step=12 loss=8.3100 trainer=0 pass=1 mode=sync
    done steps=180 loss=6.2001 steps_per_s=412.5 wall_s=0.44 trainer=0 mode=sync

or, if the job breaks (a pserver error, a sync barrier that timed out because a trainer died):

    failed trainer=0 error=sync barrier for step 41 timed out after 2s; missing trainer id(s): 1

Data: the CSV parts in ``data/`` (a deterministic synthetic stand-in for UCI housing, see data.py).
If CLUSTERCTL_DATA_FILES is set (os.pathsep-separated paths) only those files are read; otherwise
all parts are read and row ``i`` belongs to trainer ``i % PADDLE_TRAINERS_NUM``.

Mode: CLUSTERCTL_PS_MODE (sync | async | geo) and CLUSTERCTL_PS_K_STEPS (geo). Checkpoints: with
CLUSTERCTL_PS_CHECKPOINT=DIR and ``--save-every N``, trainer 0 saves every N steps; pservers started
with the same variable resume from DIR, and trainers continue from the saved step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data

from clusterctl.ps import SGD, PsError, client_from_env, from_env
from clusterctl.ps.__main__ import main as pserver_main

LOSS_TARGET = 10.0  # the seed: "if avg cost less than 10.0, we think our code is good"


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="fit-a-line on clusterctl.ps")
    p.add_argument("--passes", type=int, default=int(os.environ.get("FIT_A_LINE_PASSES", "20")))
    p.add_argument("--batch-size", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--save-every", type=int, default=0, help="trainer 0 checkpoints every N steps (0: never)")
    p.add_argument("--stop-after", type=int, default=0, help="exit(3) after N steps, without completing (tests)")
    p.add_argument("--step-delay", type=float, default=0.0, help="sleep per step (demos: watch it live)")
    return p.parse_args(argv)


def _shard(tid: int, trainers: int) -> tuple[np.ndarray, np.ndarray]:
    listed = os.environ.get("CLUSTERCTL_DATA_FILES")
    if listed:
        return data.load([f for f in listed.split(os.pathsep) if f])
    x, y = data.load(data.default_files())
    keep = np.arange(len(x)) % trainers == tid
    return x[keep], y[keep]


def _loss_and_grads(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray):
    err = x @ w + b - y  # (n, 1)
    n = np.float32(len(x))
    loss = float(np.mean(err * err))
    return loss, {"fc_0.w_0": (np.float32(2) / n) * (x.T @ err), "fc_0.b_0": (np.float32(2) / n) * err.sum(axis=0)}


def train(args: argparse.Namespace) -> int:
    """Run one trainer; return its exit code."""
    env = from_env()
    client = client_from_env(optimizer=SGD(args.lr))
    x, y = _shard(env.trainer_id, env.num_trainers)
    rng = np.random.default_rng(7)  # same initial values on every trainer (the first init wins anyway)
    init = {"fc_0.w_0": (rng.normal(size=(13, 1)) * 0.01).astype(np.float32), "fc_0.b_0": np.zeros(1, np.float32)}
    params = client.init(init)
    batches = max(1, -(-len(x) // args.batch_size))
    total = args.passes * batches
    start = client.start_step
    t0 = time.perf_counter()
    for step in range(start, total):
        pass_id, batch_id = divmod(step, batches)
        order = np.random.default_rng(1000 * pass_id + env.trainer_id).permutation(len(x))
        sel = order[batch_id * args.batch_size:(batch_id + 1) * args.batch_size]
        loss, grads = _loss_and_grads(params["fc_0.w_0"], params["fc_0.b_0"], x[sel], y[sel])
        if env.mode == "geo":
            for name, g in grads.items():
                params[name] -= np.float32(args.lr) * g
            client.geo_step(params, step=step)
        else:
            params = client.push_pull(grads, step=step)
        print(f"step={step} loss={loss:.4f} trainer={env.trainer_id} pass={pass_id} mode={env.mode}", flush=True)
        if args.save_every and env.trainer_id == 0 and (step + 1) % args.save_every == 0:
            ckpt_dir = os.environ.get("CLUSTERCTL_PS_CHECKPOINT")
            if ckpt_dir:
                client.save(ckpt_dir, step + 1)
                print(f"checkpoint step={step + 1} dir={ckpt_dir}", flush=True)
        if args.stop_after and step + 1 - start >= args.stop_after:
            print(f"stopped step={step + 1} trainer={env.trainer_id}", flush=True)
            client.close()
            return 3
        if args.step_delay:
            time.sleep(args.step_delay)
    wall = time.perf_counter() - t0
    client.complete(params if env.mode == "geo" else None)
    client.close()
    final, _ = _loss_and_grads(params["fc_0.w_0"], params["fc_0.b_0"], x, y)
    steps = total - start
    print(f"done steps={steps} loss={final:.4f} steps_per_s={steps / wall if wall > 0 else 0.0:.1f} "
          f"wall_s={wall:.2f} trainer={env.trainer_id} mode={env.mode}", flush=True)
    return 0 if final < LOSS_TARGET else 1


def main(argv: list[str] | None = None) -> int:
    """Dispatch on TRAINING_ROLE."""
    args = _args(argv)
    if os.environ.get("TRAINING_ROLE", "").upper() == "PSERVER":
        return pserver_main(["server"])
    try:
        return train(args)
    except PsError as exc:  # e.g. a sync barrier timed out because another trainer died
        print(f"failed trainer={os.environ.get('PADDLE_TRAINER_ID', '?')} error={exc}", flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
