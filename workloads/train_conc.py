"""A deterministic GPT-2-class training job that checkpoints itself through its pos agent.

Run under `pos run` on the GPU host. At the boundary of step --at it asks its own agent for a
GPU image and waits only for the cut (the agent reports cut_done), then trains on to --steps
while the image is copied, writing one line per step: "step loss step_seconds". With
--verify it then restores the image into itself *on demand* (the restore runs in a thread; the
loop is set back to step --at and trains again as soon as the agent has started the restore,
its calls held only while they touch buffers not back yet): the re-run losses must equal the
first ones bit for bit (printed as RERUN lines and checked; exit 3 on a mismatch). The restore's
report is one RESTORE line (JSON: release_s, first_call_s, held, throughput_gbps, ...). With --quiescent DIR it first takes an image while idle at the
same cut (a stop-the-world image of that instant) for the image comparison.

  pos run -- python workloads/train_conc.py --layers 4 --d 512 --steps 30 --at 10 -D /tmp/img --verify
"""

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from pos.scheduler import concurrent  # noqa: E402
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


def batch(step: int, args: argparse.Namespace) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(1000 + step)
    return torch.randint(0, args.vocab, (args.batch, args.ctx + 1), device="cuda", generator=g)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--at", type=int, default=15)
    ap.add_argument("-D", "--dir", required=True)
    ap.add_argument("--quiescent", help="also take an idle image at the same cut here")
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--quick-verify", action="store_true",
                    help="restore checking chunk checksums as read, not every file's sha256 first")
    ap.add_argument("--infer", action="store_true", help="inference steps instead of training")
    args = ap.parse_args()
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = GPT(args.vocab, args.d, args.layers, args.heads, args.ctx).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step(i: int) -> float:
        x = batch(i, args)
        if args.infer:
            with torch.no_grad():
                return float(model(x[:, :-1]).float().logsumexp(-1).mean())
        logits = model(x[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        return float(loss)

    losses: dict[int, float] = {}
    result: dict = {}
    worker = None
    cpu_state = None
    for i in range(args.steps):
        if i == args.at:
            torch.cuda.synchronize()
            cpu_state = [(p, {k: v.clone() for k, v in s.items() if not v.is_cuda})
                         for p, s in opt.state.items()]
            if args.quiescent:
                q = concurrent.checkpoint_concurrent(os.getpid(), args.quiescent)
                print(f"QUIESCENT {q['bytes']} {q['duration_s']:.3f}", flush=True)
            worker = threading.Thread(target=lambda: result.update(
                concurrent.checkpoint_concurrent(os.getpid(), args.dir)))
            worker.start()
            while not concurrent.status(os.getpid())["cut_done"] and worker.is_alive():
                time.sleep(0.0005)
            print(f"CUT {time.time():.6f}", flush=True)
        t = time.monotonic()
        losses[i] = step(i)
        torch.cuda.synchronize()
        print(f"STEP {i} {losses[i]!r} {time.monotonic() - t:.6f}", flush=True)
    if worker is not None:
        worker.join()
        print(f"REPORT {json.dumps(result)}", flush=True)
    if not args.verify:
        return 0
    torch.cuda.synchronize()
    for p, s in cpu_state or []:
        opt.state[p].update({k: v.clone() for k, v in s.items()})
    back: dict = {}
    failed: list[BaseException] = []

    def restore() -> None:
        try:
            back.update(concurrent.restore_gpu_only(os.getpid(), args.dir,
                                                    quick_verify=args.quick_verify))
        except BaseException as e:         # reported below; the job must not hang
            failed.append(e)

    t_cmd = time.monotonic()
    restorer = threading.Thread(target=restore)
    restorer.start()
    # run on as soon as the agent is in its restore phase (phase 2): from then on every call
    # that touches a buffer not back yet is held by the agent
    while restorer.is_alive() and concurrent.status(os.getpid())["phase"] != 2:
        time.sleep(0.0002)
    print(f"RESTORE_STARTED {time.monotonic() - t_cmd:.6f}", flush=True)
    bad = 0
    first_step_s = None
    for i in range(args.at, args.steps):
        loss = step(i)
        if first_step_s is None:
            first_step_s = time.monotonic() - t_cmd
        same = loss == losses[i]
        bad += not same
        print(f"RERUN {i} {loss!r} {'same' if same else 'DIFFERENT'}", flush=True)
    restorer.join()
    if failed:
        print(f"RESTORE_FAILED {failed[0]}", flush=True)
        return 4
    print(f"RESTORE {json.dumps({**back, 'first_step_s': first_step_s})}", flush=True)
    return 3 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
