"""A PyTorch GPU job driven phase by phase over stdin, for the tracer's GPU measurements.

It maps libcuda.so.1 and prints `READY <pid>` before CUDA is initialised (so that a tracer
attached then sees every module and kernel lookup), then for each line on stdin runs one phase
and prints one JSON line:
  init         build the model and warm up (CUDA initialisation, cuBLAS, lazy module loads)
  launch N     N launch-bound `add_` calls; seconds per launch
  train N      N training steps of a small GPT-style transformer; seconds per step
  count N      N training steps between two marker memsets (cuMemsetD32_v2 with MARK_BEGIN /
               MARK_END), under torch.profiler; how many kernels the profiler (CUPTI) saw
  exit
The markers go through libcuda itself, so a tracer sees exactly where the window begins and ends.
"""

import ctypes
import json
import os
import sys
import time
from pathlib import Path

libcuda = ctypes.CDLL("libcuda.so.1")
print(f"READY {os.getpid()}", flush=True)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402  (after READY on purpose: see above)
import torch.nn as nn  # noqa: E402

from workloads.transformer import Block  # noqa: E402

MARK_BEGIN, MARK_END = 0x05EB0001, 0x05EB0002
torch.manual_seed(0)
dev = torch.device("cuda")


class GPT(nn.Module):
    def __init__(self, vocab: int = 8192, d: int = 512, layers: int = 6, heads: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(idx)))


model = opt = data = small = marker = None


def init() -> dict:
    global model, opt, data, small, marker
    model = GPT().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randint(0, 8192, (16, 257), device=dev)
    small = torch.zeros(16, device=dev)
    marker = torch.zeros(4, dtype=torch.int32, device=dev)
    for _ in range(3):
        step()
    small.add_(1.0)
    mark(0)
    return {"phase": "init", "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "gpu_bytes": torch.cuda.memory_allocated()}


def step() -> float:
    logits = model(data[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss


def mark(value: int) -> None:
    torch.cuda.synchronize()
    assert libcuda.cuMemsetD32_v2(ctypes.c_uint64(marker.data_ptr()), ctypes.c_uint(value),
                                  ctypes.c_size_t(1)) == 0
    torch.cuda.synchronize()


def timed(fn, n: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n


def phase(cmd: str, n: int) -> dict:
    if cmd == "init":
        return init()
    if cmd == "launch":
        return {"phase": cmd, "n": n, "s_per_launch": timed(lambda: small.add_(1.0), n)}
    if cmd == "train":
        per = timed(lambda: torch.cuda.synchronize() if step() is None else None, n)
        return {"phase": cmd, "n": n, "s_per_step": per}
    if cmd == "count":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            mark(MARK_BEGIN)
            for _ in range(n):
                step()
            mark(MARK_END)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.startswith(("Memcpy", "Memset", "Memset (Device)"))]
        return {"phase": cmd, "n": n, "profiler_kernels": len(kernels),
                "profiler_names": len({e.name for e in kernels})}
    raise ValueError(cmd)


for line in sys.stdin:
    words = line.split()
    if not words or words[0] == "exit":
        break
    print(json.dumps(phase(words[0], int(words[1]) if len(words) > 1 else 0)), flush=True)
