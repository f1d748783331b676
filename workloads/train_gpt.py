"""A deterministic GPT-2-class training job that knows nothing of pos, for whole-process
checkpoint/restore on the GPU (issue 12: bit-exact restore of "the GPT-2-class job", and the
stall of the ~27 GB training job).

  python workloads/train_gpt.py OUT [--steps 40] [--sleep 0] [--layers 24 --d 1024 ...]

By default GPT-2 medium's shape (24 layers, d=1024, 16 heads, vocabulary 50304, context 1024)
at batch 8, trained with AdamW: about 27 GB of device memory on the H100. Writes one line per
step to OUT, opened O_APPEND so that a restored process appends where it left off: `STEP LOSS`,
the loss as float.hex(), exact to the bit. Batch i comes from a CPU generator seeded with i, and
cuBLAS and cuDNN run deterministically: two runs give the same lines, so a checkpointed, killed
and restored run must too. With --steps 0 it trains until killed.
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
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    model = GPT(a.vocab, a.d, a.layers, a.heads, a.ctx).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    fd = os.open(a.out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
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
        if a.sleep:
            time.sleep(a.sleep)
    os.close(fd)


if __name__ == "__main__":
    main()
