"""A stock PyTorch data-parallel script: everything comes from env:// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

Nothing here knows about clusterctl. Run it with `clusterctl start` in collective mode, or by hand.
"""

import os
import sys

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
    gen = torch.Generator().manual_seed(100 + rank)
    true_w = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
    steps = int(os.environ.get("STEPS", "50"))
    for step in range(steps):
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
