"""A stock PyTorch data-parallel script: everything comes from env:// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

Nothing here knows about clusterctl. Run it with `clusterctl start` in collective mode, or by hand.

The global batch does not depend on the world size: step s trains on GLOBAL_BATCH rows (default 48) drawn
from a generator seeded with s, and rank r takes rows r, r + WORLD_SIZE, ...; each rank's loss is its rows'
squared errors divided by GLOBAL_BATCH, and the gradients are summed over the ranks (all_reduce SUM), which
gives the gradient of the mean over the whole batch at any world size. So a run at 3 ranks trains the same
model as a run at 4; only the order of the floating-point additions differs (float64: the final weights
agree to about 1e-12; at one world size they are identical bit for bit).

Resuming, torchrun-style: with CHECKPOINT_DIR set, rank 0 saves model, optimizer and step to
CHECKPOINT_DIR/torch_gloo.pt every SAVE_EVERY steps (default 10); when the job was restarted
(TORCHELASTIC_RESTART_COUNT > 0, set by torchrun and by clusterctl's `job.restarts`) rank 0 loads it and
every rank continues from that step, at whatever WORLD_SIZE the new attempt has (an elastic job that lost a
host: docs/lifecycle.md). A first attempt never loads (a stale file of an older run is ignored).
Prints `step=N loss=X trainer=R` lines, `checksum=C trainer=R world=W` (the sum of the final weights'
absolute values) and `done rank=R world=W allreduce=A loss=X`.
"""

import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")  # reads the env:// contract
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    for p in model.parameters():  # start identical everywhere
        dist.broadcast(p.data, src=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt_dir = os.environ.get("CHECKPOINT_DIR")
    ckpt = os.path.join(ckpt_dir, "torch_gloo.pt") if ckpt_dir else None
    save_every = int(os.environ.get("SAVE_EVERY", "10"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    start = torch.zeros(1, dtype=torch.int64)
    if ckpt and attempt > 0 and rank == 0 and os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start[0] = state["step"]
    dist.broadcast(start, src=0)
    start = int(start.item())
    if start:
        for p in model.parameters():  # rank 0's loaded weights everywhere
            dist.broadcast(p.data, src=0)
        print(f"resumed step={start} attempt={attempt} trainer={rank} world={world}", flush=True)
    true_w = torch.tensor([[1.0, -2.0, 3.0, 0.5]], dtype=torch.float64)
    batch = int(os.environ.get("GLOBAL_BATCH", "48"))
    steps = int(os.environ.get("STEPS", "50"))
    total = torch.zeros((), dtype=torch.float64)
    for step in range(start, steps):
        gen = torch.Generator().manual_seed(1000 + step)  # the step's global batch, the same at any world size
        x = torch.randn(batch, 4, generator=gen, dtype=torch.float64)[rank::world]
        y = x @ true_w.T + 0.3
        loss = ((model(x) - y) ** 2).sum() / batch  # this rank's share of the mean over the global batch
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)  # the gradient of the whole batch's mean
        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        opt.step()
        if step % 10 == 0 or step == steps - 1:
            print(f"step={step} loss={total.item():.6f} trainer={rank}", flush=True)
        if ckpt and rank == 0 and (step + 1) % save_every == 0:
            os.makedirs(ckpt_dir, exist_ok=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)  # a kill mid-save leaves the previous checkpoint whole
        if os.environ.get("STEP_S"):
            time.sleep(float(os.environ["STEP_S"]))
    checksum = sum(float(p.detach().abs().sum()) for p in model.parameters())
    check = torch.tensor([float(rank + 1)])
    dist.all_reduce(check)
    print(f"checksum={checksum:.15f} trainer={rank} world={world}", flush=True)
    print(f"done rank={rank} world={world} allreduce={check.item():g} loss={total.item():.6f}", flush=True)
    dist.barrier()  # every rank is done with the group
    # torch 2.13's gloo teardown races across hosts: when rank 0 (the TCP store's host) exits first, a
    # peer still destroying its group can hit std::terminate ("terminate called without an active
    # exception", SIGABRT) after training succeeded. Past the barrier there is nothing left to tear down
    # that the OS does not: exit without running the native destructors.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
