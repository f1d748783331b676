"""A deterministic GPT-2-class training job that knows nothing of pos, for whole-process
checkpoint/restore on the GPU (issue 12: bit-exact restore of "the GPT-2-class job", and the
stall of the ~27 GB training job).

  python workloads/train_gpt.py OUT [--steps 40] [--sleep 0] [--layers 24 --d 1024 ...]
                                    [--fill-to GIB | --ballast-gib GIB] [--digest-every 20]

By default GPT-2 medium's shape (24 layers, d=1024, 16 heads, vocabulary 50304, context 1024)
at batch 8, trained with AdamW: about 27 GB of device memory on the H100. Writes one line per
step to OUT, opened O_APPEND so that a restored process appends where it left off: `STEP LOSS`,
the loss as float.hex(), exact to the bit. Batch i comes from a CPU generator seeded with i, and
cuBLAS and cuDNN run deterministically: two runs give the same lines, so a checkpointed, killed
and restored run must too. With --steps 0 it trains until killed.

The jobs that fill a GPU: --ballast-gib adds that much device memory that training never
touches, in 1 GiB tensors of seeded random values (as a model's frozen weights or a KV cache
would be); --fill-to adds as much as brings the process to that many GiB of device memory
after its first step (what the GPU has in use then, the job alone on it; PyTorch's cache,
given back once the ballast is made, grows again at the next step, so that the job ends up
larger by what it caches: 6-9 GiB at the default shape on the H100). Every --digest-every steps a line
`ballast STEP DIGEST` gives an exact sum of the ballast's bits: it must not change, through
any checkpoint and restore. The ballast is made after the first step, so that the loss lines
are those of the same job without it.
"""

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from workloads.transformer import Block  # noqa: E402


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, ctx: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf"), device=idx.device), 1)
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln(x))


def make_ballast(gib: float) -> list[torch.Tensor]:
    """`gib` GiB of seeded random int32 values in 1 GiB tensors (the last one smaller)."""
    pieces, left = [], int(max(gib, 0) * 2**30) // 4
    g = torch.Generator(device="cuda")
    while left > 0:
        n = min(left, 2**28)
        g.manual_seed(7 + len(pieces))
        pieces.append(torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, device="cuda",
                                    generator=g))
        left -= n
    return pieces


def digest(pieces: list[torch.Tensor]) -> str:
    """An exact sum of every piece's values, each weighted by its place (integer sums do not
    depend on the order of the reduction)."""
    total = sum((i + 1) * int(p.sum(dtype=torch.int64).item()) for i, p in enumerate(pieces))
    return f"{total & (2**64 - 1):016x}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ballast-gib", type=float, default=0.0)
    ap.add_argument("--fill-to", type=float, default=0.0)
    ap.add_argument("--digest-every", type=int, default=20)
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    model = GPT(a.vocab, a.d, a.layers, a.heads, a.ctx).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    fd = os.open(a.out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    ballast: list[torch.Tensor] = []
    step = 0
    while a.steps == 0 or step < a.steps:
        step += 1
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randint(0, a.vocab, (a.batch, a.ctx + 1), generator=g).cuda()
        logits = model(x[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        os.write(fd, f"{step} {loss.item().hex()}\n".encode())
        if step == 1 and (a.ballast_gib or a.fill_to):
            free, total = torch.cuda.mem_get_info()     # the context and the allocator's cache
            gib = a.ballast_gib or a.fill_to - (total - free) / 2**30
            ballast = make_ballast(gib)
            torch.cuda.empty_cache()      # the generator's scratch: not the job's to keep
            free, total = torch.cuda.mem_get_info()
            print(f"ballast {len(ballast)} pieces, {gib:.2f} GiB; device memory in use "
                  f"{(total - free) / 2**30:.2f} GiB", file=sys.stderr)
        if ballast and step % a.digest_every == 0:
            os.write(fd, f"ballast {step} {digest(ballast)}\n".encode())
        if a.sleep:
            time.sleep(a.sleep)
    os.close(fd)


if __name__ == "__main__":
    main()
