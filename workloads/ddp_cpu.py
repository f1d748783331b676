"""A deterministic DDP training job on the CPU (gloo), one rank per process under torchrun, for
checkpointing a whole torchrun tree without a GPU.

  torchrun --nproc_per_node=2 workloads/ddp_cpu.py OUTDIR --steps 40 [--sleep 0.2]

Each rank appends `STEP LOSS` (float.hex(), exact to the bit) to OUTDIR/rank-R.txt, opened
O_APPEND so that a restored rank appends where it left off. Same seed and data on every run and
one thread per rank: two runs give the same lines, so a checkpointed-and-restored run must too.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("outdir")
    a.add_argument("--steps", type=int, default=40)
    a.add_argument("--sleep", type=float, default=0.2)
    args = a.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)               # the same initial weights on every rank
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)    # each rank its own shard of the data
    x, y = torch.randn(64, 32, generator=g), torch.randint(0, 4, (64,), generator=g)
    fd = os.open(os.path.join(args.outdir, f"rank-{rank}.txt"),
                 os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for step in range(1, args.steps + 1):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()                # the gradients' all-reduce over gloo (TCP)
        opt.step()
        os.write(fd, f"{step} {loss.item().hex()}\n".encode())
        time.sleep(args.sleep)
    os.close(fd)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
