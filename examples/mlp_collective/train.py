"""A NumPy MLP trained data-parallel with clusterctl.collective (collective mode, the allreduce backend).

Every rank holds the same model (broadcast from rank 0), computes gradients on its shard of each
global batch (row i of the batch belongs to rank i % size), and sums them with one fused allreduce of
a GradientBuffer. Each rank's gradient is its rows' share of the mean over the whole batch (its rows'
sum divided by the global batch size), so the sum is the gradient of the whole batch at any number of
ranks, whether or not it divides the batch: training matches single-process training on the whole
batch, and a run at 3 ranks trains the same model as a run at 4 (only the order of the float64
additions differs: the checksums agree to about 1e-12; at one rank count they are identical).

    mpiexec -n 2 python train.py             # or: clusterctl start with launcher: mpi
    python train.py --single                 # the single-process reference

Prints `step=N loss=X trainer=R` lines and a final `done steps=.. loss=.. steps_per_s=.. wall_s=..`.

Resuming: with `--checkpoint-dir DIR` (default: $CHECKPOINT_DIR), rank 0 saves the parameters and the step
to DIR/mlp_collective.npz every `--save-every` steps; when the job was restarted (CLUSTERCTL_RESTART_COUNT > 0,
set by clusterctl's `job.restarts`) rank 0 loads it and every rank continues from that step. A first attempt
never loads. Because every step's batch is a function of the step, a resumed run ends where an
uninterrupted one does, also when it resumes at another rank count (an elastic job that lost a host:
docs/lifecycle.md).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

FEATURES, HIDDEN = 16, 32


def dataset(n: int = 4096, seed: int = 7) -> tuple[np.ndarray, np.ndarray]:
    """A deterministic nonlinear regression problem (no downloads)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, FEATURES))
    w = rng.standard_normal((FEATURES, 1))
    y = np.tanh(x @ w) + 0.1 * np.sin(3 * x[:, :1])
    return x, y


def init_params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w1": rng.standard_normal((FEATURES, HIDDEN)) / np.sqrt(FEATURES),
        "b1": np.zeros(HIDDEN),
        "w2": rng.standard_normal((HIDDEN, 1)) / np.sqrt(HIDDEN),
        "b2": np.zeros(1),
    }


def loss_and_grads(p: dict, x: np.ndarray, y: np.ndarray, rows: int | None = None) -> tuple[float, dict]:
    """Squared error of a one-hidden-layer tanh MLP over `x`'s rows divided by `rows` (default: their number,
    the mean), and its gradients: with `rows` the global batch size, this shard's share of the batch's mean."""
    rows = len(x) if rows is None else rows
    h = np.tanh(x @ p["w1"] + p["b1"])
    out = h @ p["w2"] + p["b2"]
    diff = out - y
    loss = float(np.sum(diff**2) / rows)
    d_out = 2 * diff / rows
    d_h = (d_out @ p["w2"].T) * (1 - h**2)
    return loss, {"w1": x.T @ d_h, "b1": d_h.sum(0), "w2": h.T @ d_out, "b2": d_out.sum(0)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64, help="global batch size (any rank count)")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--single", action="store_true", help="single-process reference, no MPI")
    ap.add_argument("--checkpoint-dir", default=os.environ.get("CHECKPOINT_DIR"),
                    help="save/resume here (default: $CHECKPOINT_DIR)")
    ap.add_argument("--save-every", type=int, default=20, help="rank 0 saves every N steps (with a checkpoint dir)")
    ap.add_argument("--step-delay", type=float, default=0.0, help="sleep per step (tests: kill it mid-run)")
    args = ap.parse_args(argv)

    x, y = dataset()
    params = init_params()
    ckpt = os.path.join(args.checkpoint_dir, "mlp_collective.npz") if args.checkpoint_dir else None
    attempt = int(os.environ.get("CLUSTERCTL_RESTART_COUNT", "0"))
    first = 0
    rank, size = 0, 1
    if not args.single:
        from clusterctl import collective
        from clusterctl.collective.numpy_opt import GradientBuffer

        collective.init()
        rank, size = collective.rank(), collective.size()
        if ckpt and attempt > 0 and rank == 0 and os.path.exists(ckpt):
            with np.load(ckpt) as saved:
                params = {name: saved[name] for name in params}
                first = int(saved["step"])
        first = int(collective.broadcast(np.array([first], dtype=np.int64), root=0)[0])
        if first:
            print(f"resumed step={first} attempt={attempt} trainer={rank} ranks={size}", flush=True)
        for name in sorted(params):  # identical start everywhere
            params[name] = collective.broadcast(params[name], root=0)
        buf = GradientBuffer({k: v.shape for k, v in params.items()}, dtype=np.float64, op="sum")

    t0 = time.perf_counter()
    loss = float("nan")  # a run resumed at its last step trains no further step
    for step in range(first, args.steps):
        start = (step * args.batch) % len(x)
        rows = np.arange(start, start + args.batch) % len(x)
        mine = rows[rank::size]
        loss, grads = loss_and_grads(params, x[mine], y[mine], rows=args.batch)
        if not args.single:
            for name, g in grads.items():
                buf.grads[name][...] = g
            grads = buf.allreduce()  # the sum of the shards' shares = the gradient of the whole batch
            loss = float(collective.allreduce(np.array([loss]), op="sum")[0])
        for name in params:
            params[name] = params[name] - args.lr * grads[name]
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step={step} loss={loss:.6f} trainer={rank}", flush=True)
        if ckpt and rank == 0 and (step + 1) % args.save_every == 0:
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            np.savez(ckpt + ".tmp.npz", step=step + 1, **params)
            os.replace(ckpt + ".tmp.npz", ckpt)  # a kill mid-save leaves the previous checkpoint whole
        if args.step_delay:
            time.sleep(args.step_delay)
    wall = time.perf_counter() - t0
    checksum = float(sum(np.abs(v).sum() for v in params.values()))
    print(f"done steps={args.steps} loss={loss:.6f} steps_per_s={args.steps / wall:.1f} wall_s={wall:.2f} "
          f"trainer={rank} checksum={checksum:.10f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
