"""A deterministic DDP training job, one rank per process: on the CPU over gloo, or one GPU per
rank over NCCL, for checkpointing a whole multi-process job.

  torchrun --nproc_per_node=2 workloads/ddp_train.py OUTDIR --steps 40 [--sleep 0.2]
  torchrun --nproc_per_node=2 workloads/ddp_train.py OUTDIR --backend nccl [--width 4096]
  torchrun --standalone --nproc-per-node 2 workloads/ddp_train.py OUTDIR --backend nccl \
      --parallel fsdp                  # PyTorch's FSDP2 (fully_shard) instead of DDP
  torchrun --standalone --nproc-per-node 8 workloads/ddp_train.py OUTDIR --backend nccl \
      --parallel fsdp --model llama13b # Llama2-13B's shape, 5 of its 40 layers a rank

Each rank appends `STEP LOSS` (float.hex(), exact to the bit) to OUTDIR/rank-R.txt, opened
O_APPEND so that a restored rank appends where it left off. Same seed and data on every run, one
thread per rank, deterministic kernels: two runs give the same lines, so a checkpointed-and-
restored run must too. With nccl, rank R computes on cuda:LOCAL_RANK; --ballast-gib G gives each
rank G GiB of seeded device memory that training never touches, as a big model's state is, and
its exact integer sum joins every tenth line (`STEP LOSS:SUM`): it must never change.

--model llama13b trains, in place of the small MLP, a model of Llama2-13B's shape (width 5120,
40 heads, SwiGLU 13824, RMSNorm; random weights, bf16, SGD with momentum: 6 bytes a parameter),
--layers of its blocks (default 5 a rank: the whole 40 on 8 ranks, about 78 GB of state, so that
each rank holds what it would in the 8-rank job, whatever the ranks) on 256 tokens a step.
"""

import argparse
import os
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


VOCAB, TOKENS, WIDTH, HEADS, HIDDEN = 32000, 256, 5120, 40, 13824   # Llama2-13B's shape


class Block(nn.Module):
    """One Llama block: RMSNorm, causal attention (written out: deterministic), SwiGLU."""

    def __init__(self) -> None:
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(WIDTH), nn.RMSNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.o = nn.Linear(WIDTH, WIDTH, bias=False)
        self.up = nn.Linear(WIDTH, 2 * HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, HEADS, -1).transpose(1, 3).unbind(2)
        att = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1),
                              float("-inf")).softmax(-1)
        x = x + self.o((att @ v).transpose(1, 2).reshape(b, t, WIDTH))
        gate, up = self.up(self.n2(x)).chunk(2, -1)
        return x + self.down(nn.functional.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)
        self.blocks, self.norm = nn.ModuleList(Block() for _ in range(layers)), nn.RMSNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("outdir")
    a.add_argument("--steps", type=int, default=40)
    a.add_argument("--sleep", type=float, default=0.2)
    a.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    a.add_argument("--width", type=int, default=64, help="the hidden layer's width")
    a.add_argument("--ballast-gib", type=float, default=0.0)
    a.add_argument("--model", choices=("mlp", "llama13b"), default="mlp")
    a.add_argument("--layers", type=int, default=0, help="llama13b's blocks (0: 5 a rank)")
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
    g = torch.Generator().manual_seed(100 + rank)    # each rank its own shard of the data
    if args.model == "llama13b":
        torch.set_default_dtype(torch.bfloat16)    # built on the GPU, in bf16, at once
        with dev:
            net: nn.Module = Llama(args.layers or 5 * dist.get_world_size())
        torch.set_default_dtype(torch.float32)
        x = torch.randint(0, VOCAB, (1, TOKENS), generator=g).to(dev)
        y = torch.roll(x, -1, 1)
        shards = [*net.blocks, net]
    else:
        net = nn.Sequential(nn.Linear(32, args.width), nn.Tanh(), nn.Linear(args.width, 4)).to(dev)
        x = torch.randn(64, 32, generator=g).to(dev)
        y = torch.randint(0, 4, (64,), generator=g).to(dev)
        shards = [net[0], net[2], net]
    if args.parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard   # PyTorch >= 2.6

        for layer in shards:
            fully_shard(layer)
        model = net
    else:
        model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05 if args.model == "mlp" else 1e-4,
                          momentum=0.9)
    ballast = [torch.randint(-2**62, 2**62, (1 << 27,), dtype=torch.int64, device=dev,
                             generator=torch.Generator(dev).manual_seed(1000 * rank + i))
               for i in range(int(args.ballast_gib))]       # 1 GiB each
    fd = os.open(os.path.join(args.outdir, f"rank-{rank}.txt"),
                 os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for step in range(1, args.steps + 1):
        loss = nn.functional.cross_entropy(model(x).flatten(0, -2).float(), y.flatten())
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
