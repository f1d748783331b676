"""A deterministic DDP training job, one rank per process: on the CPU over gloo, or one GPU per
rank over NCCL, for checkpointing a whole multi-process job.

  torchrun --nproc_per_node=2 workloads/ddp_train.py OUTDIR --steps 40 [--sleep 0.2]
  torchrun --nproc_per_node=2 workloads/ddp_train.py OUTDIR --backend nccl [--width 4096]
  torchrun --standalone --nproc-per-node 2 workloads/ddp_train.py OUTDIR --backend nccl \
      --parallel fsdp                  # PyTorch's FSDP2 (fully_shard) instead of DDP

Each rank appends `STEP LOSS` (float.hex(), exact to the bit) to OUTDIR/rank-R.txt, opened
O_APPEND so that a restored rank appends where it left off. Same seed and data on every run, one
thread per rank, deterministic kernels: two runs give the same lines, so a checkpointed-and-
restored run must too. With nccl, rank R computes on cuda:LOCAL_RANK; --ballast-gib G gives each
rank G GiB of seeded device memory that training never touches, as a big model's state is, and
its exact integer sum joins every tenth line (`STEP LOSS:SUM`): it must never change.
"""

import argparse
import os
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("outdir")
    a.add_argument("--steps", type=int, default=40)
    a.add_argument("--sleep", type=float, default=0.2)
    a.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    a.add_argument("--width", type=int, default=64, help="the hidden layer's width")
    a.add_argument("--ballast-gib", type=float, default=0.0)
    a.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp",
                   help="DDP, or FSDP2 (each layer's parameters sharded over the ranks: "
                        "all-gathers before each layer, reduce-scatters of its gradients)")
    args = a.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if args.backend == "nccl":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    torch.manual_seed(0)               # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(32, args.width), nn.Tanh(), nn.Linear(args.width, 4)).to(dev)
    if args.parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard   # PyTorch >= 2.6

        for layer in (net[0], net[2], net):
            fully_shard(layer)
        model = net
    else:
        model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)    # each rank its own shard of the data
    x, y = torch.randn(64, 32, generator=g).to(dev), torch.randint(0, 4, (64,), generator=g).to(dev)
    ballast = [torch.randint(-2**62, 2**62, (1 << 27,), dtype=torch.int64, device=dev,
                             generator=torch.Generator(dev).manual_seed(1000 * rank + i))
               for i in range(int(args.ballast_gib))]       # 1 GiB each
    fd = os.open(os.path.join(args.outdir, f"rank-{rank}.txt"),
                 os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for step in range(1, args.steps + 1):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()                # the gradients' all-reduce (gloo over TCP, or NCCL)
        opt.step()
        digest = f":{sum(int(b.sum()) for b in ballast)}" if ballast and step % 10 == 0 else ""
        os.write(fd, f"{step} {loss.item().hex()}{digest}\n".encode())
        time.sleep(args.sleep)
    os.close(fd)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
