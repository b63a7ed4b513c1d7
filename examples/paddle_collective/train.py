"""A stock PaddlePaddle collective script: `paddle.distributed.init_parallel_env()` reads the env contract.

Nothing here knows about clusterctl; on CPU, Paddle uses gloo. Run it with `clusterctl start`
(collective mode), or by hand with the PADDLE_* variables set.
"""

import paddle
import paddle.distributed as dist


def main() -> None:
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    x = paddle.to_tensor([float(rank + 1)])
    dist.all_reduce(x)
    print(f"done rank={rank} world={world} allreduce={x.numpy()[0]:g}", flush=True)


if __name__ == "__main__":
    main()
