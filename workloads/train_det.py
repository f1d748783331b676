"""A deterministic PyTorch training job, for checkpoint/restore tests on the GPU.

  python workloads/train_det.py OUT --steps 60 [--sleep 0.05] [--ballast-gib 4]

Writes one line per step to OUT (opened O_APPEND, so a restored process appends where it left
off): `STEP LOSS` with the loss as float.hex(), exact to the bit. Same seed, same data, cuBLAS
and cuDNN in deterministic mode: two runs give the same lines, so a checkpointed-and-restored
run must too. --ballast-gib adds that much random device memory (GPU state to save).
With --steps 0 it runs until killed, one small step per --sleep (a heartbeat for benchmarks).
--clock FILE appends `STEP PHASE WALLTIME` as each part of a step ends (begin, forward,
backward, step, item, slept): where a slow step spends its time, seen from inside.
--split p2p|host puts the model's first half on cuda:0 and its second, with the ballast, on cuda:1
(a process on two GPUs; the GPUs' memory unlike, so that where each went after a move shows);
the activations cross GPU to GPU (p2p) or through host memory (host).
"""

import argparse
import os
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("out")
    a.add_argument("--steps", type=int, default=60)
    a.add_argument("--sleep", type=float, default=0.05)
    a.add_argument("--ballast-gib", type=float, default=0.0)
    a.add_argument("--clock")
    a.add_argument("--split", choices=("p2p", "host"))
    args = a.parse_args()
    clock = os.open(args.clock, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) if args.clock else -1

    def mark(step: int, phase: str) -> None:
        if clock >= 0:
            os.write(clock, f"{step} {phase} {time.time():.6f}\n".encode())

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    devs = [torch.device("cuda", i) for i in ((0, 1) if args.split else (0,))]
    dev, last = devs[0], devs[-1]
    ballast = None
    if args.ballast_gib:
        n = int(args.ballast_gib * 2**30) // 4
        ballast = torch.empty(n, dtype=torch.float32, device=last).uniform_()
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(),
                          nn.Linear(1024, 10)).to(dev)
    model[2:].to(last)
    if args.split:      # the hand-over between the halves: a hook moves the activations,
        # GPU to GPU (PyTorch enables peer access) or through host memory (it does not)
        hop = (lambda t: t.to(last)) if args.split == "p2p" else (lambda t: t.cpu().to(last))
        model[2].register_forward_pre_hook(lambda _m, x: tuple(hop(t) for t in x))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(512, 256, generator=g).to(dev)
    y = torch.randint(0, 10, (512,), generator=g).to(last)
    fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    step = 0
    while args.steps == 0 or step < args.steps:
        step += 1
        mark(step, "begin")
        loss = nn.functional.cross_entropy(model(x), y)
        mark(step, "forward")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        mark(step, "backward")
        opt.step()
        mark(step, "step")
        os.write(fd, f"{step} {loss.item().hex()}\n".encode())
        mark(step, "item")
        if args.sleep:
            for d in devs:
                torch.cuda.synchronize(d)
            time.sleep(args.sleep)
        mark(step, "slept")
    if ballast is not None:
        os.write(fd, f"ballast {ballast.sum(dtype=torch.float64).item().hex()}\n".encode())
    os.close(fd)


if __name__ == "__main__":
    main()
