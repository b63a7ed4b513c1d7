"""A trainer that keeps GPU 0 busy and prints progress lines (benchmarks/gpu_check.sh, part "top")."""

import time

import torch

dev = "cuda" if torch.cuda.is_available() else "cpu"
x = torch.randn(4096, 4096, device=dev)
for step in range(100000):
    for _ in range(20):
        y = x @ x
    if dev == "cuda":
        torch.cuda.synchronize()
    print(f"step={step} loss={float(y[0, 0]):.3f}", flush=True)
    time.sleep(0.05)
