"""A stock PyTorch data-parallel script: everything comes from env:// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

Nothing here knows about clusterctl. Run it with `clusterctl start` in collective mode, or by hand.

Resuming, torchrun-style: with CHECKPOINT_DIR set, rank 0 saves model, optimizer and step to
CHECKPOINT_DIR/torch_gloo.pt every SAVE_EVERY steps (default 10); when the job was restarted
(TORCHELASTIC_RESTART_COUNT > 0, set by torchrun and by clusterctl's `job.restarts`) rank 0 loads it and
every rank continues from that step. A first attempt never loads (a stale file of an older run is ignored).
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
    model = torch.nn.Linear(4, 1)
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
        print(f"resumed step={start} attempt={attempt} trainer={rank}", flush=True)
    gen = torch.Generator().manual_seed(100 + rank)
    true_w = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
    for _ in range(start):  # the batches of the steps already done
        torch.randn(32, 4, generator=gen)
    steps = int(os.environ.get("STEPS", "50"))
    for step in range(start, steps):
        x = torch.randn(32, 4, generator=gen)
        y = x @ true_w.T + 0.3
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world
        opt.step()
        if step % 10 == 0 or step == steps - 1:
            print(f"step={step} loss={loss.item():.4f} trainer={rank}", flush=True)
        if ckpt and rank == 0 and (step + 1) % save_every == 0:
            os.makedirs(ckpt_dir, exist_ok=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)  # a kill mid-save leaves the previous checkpoint whole
        if os.environ.get("STEP_S"):
            time.sleep(float(os.environ["STEP_S"]))
    check = torch.tensor([float(rank + 1)])
    dist.all_reduce(check)
    print(f"done rank={rank} world={world} allreduce={check.item():g} loss={loss.item():.4f}", flush=True)
    dist.barrier()  # every rank is done with the group
    # torch 2.13's gloo teardown races across hosts: when rank 0 (the TCP store's host) exits first, a
    # peer still destroying its group can hit std::terminate ("terminate called without an active
    # exception", SIGABRT) after training succeeded. Past the barrier there is nothing left to tear down
    # that the OS does not: exit without running the native destructors.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
