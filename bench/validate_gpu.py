#!/usr/bin/env python3
"""validate_gpu: precision and recall of the speculated write sets on the GPU, over the kernel
suite (tests/gpu/kernels) and over PyTorch training and inference of a small transformer and a
CNN (random weights). Writes bench/results/validate-gpu-<gpu>.json.

How the PyTorch part is measured, and why it is sound:
- `pos trace` (a separate process, real uprobes) is attached to this very process before CUDA
  starts, so it sees every allocation (the caching allocator's cuMemAlloc segments) and every
  launch, copy and set with its parameter bytes; `pos analyze`'s speculation then gives each
  launch's predicted write set (allocation bases).
- In this process a TorchDispatchMode wraps every ATen op: torch.cuda.synchronize(), hash every
  live segment of the caching allocator (torch.cuda.memory_snapshot) with the run-time
  validator (pos.analyzer.validate, through the driver: D2H into pinned memory, numba hash),
  run the op, synchronise, hash again. The segments whose bytes changed are exactly what the op's
  GPU work wrote (nothing else runs meanwhile), at the same granularity as the prediction
  (segments are the allocations pos sees). The op's window [t0, t1] (CLOCK_MONOTONIC, the
  clock of the probes' timestamps) gives the launches that belong to it.
- Per op: predicted P = union of its launches' predicted writes, observed O. Over all ops,
  precision = |P∩O| / |P|, recall = |P∩O| / |O|; an op with O ⊄ P marks its kernels unvalidated.
  A write that leaves bytes unchanged is invisible to the hashes; it is also harmless to a
  checkpoint. Memory pos did not see allocated (none, when attached first) is not compared.

USAGE (on the GPU host, as root, bcc available: `source .device/setup.sh`):
  python bench/validate_gpu.py [--out FILE]
"""

import argparse
import bisect
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pos.analyzer.access import speculate  # noqa: E402
from pos.analyzer.load import load_trace  # noqa: E402
from pos.analyzer.ops import OP_LAUNCH, OP_MEMCPY, OP_MEMSET  # noqa: E402
from pos.analyzer.validate import Validator  # noqa: E402
from pos.driver import driver  # noqa: E402
from pos.store.db import open_db  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def scores(pairs: list[tuple[set, set]]) -> dict[str, Any]:
    tp = sum(len(p & o) for p, o in pairs)
    fp = sum(len(p - o) for p, o in pairs)
    fn = sum(len(o - p) for p, o in pairs)
    return {"true_positive": tp, "false_positive": fp, "false_negative": fn,
            "precision": tp / (tp + fp) if tp + fp else None,
            "recall": tp / (tp + fn) if tp + fn else None}


def suite_part(work: Path) -> dict[str, Any]:
    from tests.gpu.kernels.suite import run_suite

    records = run_suite(work)
    visible = [r for r in records if r["declared"]["visible"]]
    hidden = [r for r in records if not r["declared"]["visible"]]
    caught = [r["case"] for r in hidden if not r["validated"]]
    log(f"suite: {len(records)} cases; indirect caught {len(caught)}/{len(hidden)}")
    if len(caught) != len(hidden):
        raise SystemExit(f"validate_gpu: the validator missed indirect writes: {hidden}")
    return {"cases": records,
            "all": scores([(set(r["predicted"]), set(r["observed"])) for r in records]),
            "visible": scores([(set(r["predicted"]), set(r["observed"])) for r in visible]),
            "indirect_caught": caught}


def torch_part(db: str, steps: dict[str, Callable[[], None]]) -> dict[str, Any]:
    """Run each workload step under the op watch while `pos trace` records; score per op."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    v = Validator(driver(), chunk=64 << 20)
    records: list[tuple[str, str, int, int, set[int]]] = []
    current = [""]

    def segments() -> list[tuple[int, int]]:
        return [(s["address"], s["total_size"]) for s in torch.cuda.memory_snapshot()]

    class OpWatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            torch.cuda.synchronize()         # also makes the context current on this thread
            before = v.snapshot(segments())
            t0 = time.monotonic_ns()
            out = func(*args, **(kwargs or {}))
            torch.cuda.synchronize()
            t1 = time.monotonic_ns()
            changed = v.changed(before, v.snapshot(segments()))
            records.append((current[0], str(func), t0, t1, changed))
            return out

    for name, step in steps.items():
        step()                                   # warm-up: kernels loaded, layouts pushed
    torch.cuda.synchronize()
    time.sleep(2.0)
    for name, step in steps.items():
        current[0] = name
        t = time.perf_counter()
        with OpWatch():
            step()
        torch.cuda.synchronize()
        log(f"{name}: {sum(r[0] == name for r in records)} ops watched in "
            f"{time.perf_counter() - t:.1f} s")
    v.close()
    return {"records": records}


def score_torch(db: str, records: list, names: list[str]) -> dict[str, Any]:
    _, ops = load_trace(open_db(db, create=False))
    ev = speculate(ops)
    starts = [r[2] for r in records]
    predicted: list[set[int]] = [set() for _ in records]
    kernels: list[set[str]] = [set() for _ in records]
    launches = [0] * len(records)
    known = [0] * len(records)
    for i in range(len(ops.kind)):
        if ops.kind[i] not in (OP_LAUNCH, OP_MEMCPY, OP_MEMSET):
            continue
        j = bisect.bisect_right(starts, int(ops.ts[i])) - 1
        if j < 0 or ops.ts[i] > records[j][3]:
            continue                         # not inside a watched op
        _, writes = ev.sets(i)
        predicted[j] |= {int(ops.alloc_base[w]) for w in writes}
        if ops.kind[i] == OP_LAUNCH:
            s = int(ops.sig[i])
            kernels[j].add(ops.sig_name[s] or "(unnamed)")
            launches[j] += 1
            known[j] += ops.sig_layout_known[s]
        else:
            kernels[j].add(ops.api[i])
    out = {}
    for name in names:
        idx = [j for j, r in enumerate(records) if r[0] == name]
        pairs = [(predicted[j], records[j][4]) for j in idx]
        bad = [j for j in idx if records[j][4] - predicted[j]]
        out[name] = {"ops": len(idx), "ops_with_gpu_work": sum(1 for j in idx if kernels[j]),
                     "launches": sum(launches[j] for j in idx),
                     "layout_known_share": sum(known[j] for j in idx) / max(1, sum(launches[j] for j in idx)),
                     **scores(pairs),
                     "unvalidated_ops": [{"op": records[j][1], "kernels": sorted(kernels[j]),
                                          "unpredicted": [f"0x{b:x}" for b in sorted(records[j][4] - predicted[j])]}
                                         for j in bad]}
        log(f"{name}: precision {out[name]['precision']}, recall {out[name]['recall']}, "
            f"{len(bad)} ops wrote outside their prediction")
    return out


def make_steps() -> dict[str, Callable[[], None]]:
    import torch
    import torch.nn as nn
    import torchvision

    torch.manual_seed(0)
    dev = "cuda"

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(1000, 256)
            layer = nn.TransformerEncoderLayer(256, 4, 512, batch_first=True, dropout=0.0)
            self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(256, 1000)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.enc(self.emb(x)))

    tf = Tiny().to(dev)
    tf_opt = torch.optim.AdamW(tf.parameters(), lr=1e-3)
    tokens = torch.randint(0, 1000, (8, 64), device=dev)
    cnn = torchvision.models.resnet18(weights=None, num_classes=10).to(dev)
    cnn_opt = torch.optim.SGD(cnn.parameters(), lr=0.01, momentum=0.9)
    images = torch.randn(8, 3, 64, 64, device=dev)
    labels = torch.randint(0, 10, (8,), device=dev)

    def tf_train() -> None:
        tf.train()
        loss = nn.functional.cross_entropy(tf(tokens).flatten(0, 1), tokens.flatten())
        tf_opt.zero_grad()
        loss.backward()
        tf_opt.step()

    def tf_infer() -> None:
        tf.eval()
        with torch.no_grad():
            tf(tokens).argmax(-1)

    def cnn_train() -> None:
        cnn.train()
        loss = nn.functional.cross_entropy(cnn(images), labels)
        cnn_opt.zero_grad()
        loss.backward()
        cnn_opt.step()

    def cnn_infer() -> None:
        cnn.eval()
        with torch.no_grad():
            cnn(images).argmax(-1)

    return {"transformer_train": tf_train, "transformer_infer": tf_infer,
            "cnn_train": cnn_train, "cnn_infer": cnn_infer}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="[default: bench/results/validate-gpu-<gpu>.json]")
    args = ap.parse_args()
    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="pos-validate-"))
    drv = driver()                 # libcuda mapped before pos trace looks for it
    log("kernel suite")
    suite = suite_part(work)

    from workloads.harness import PosTrace

    db = str(work / "t.db")
    tr = PosTrace(os.getpid(), db)
    log("pos trace attached; PyTorch workloads")
    try:
        import torch
        steps = make_steps()
        watched = torch_part(db, steps)
    finally:
        trace_log = tr.stop()
    log("trace stopped: " + trace_log.strip().splitlines()[-1])
    workloads = score_torch(db, watched["records"], list(steps))

    gpu = torch.cuda.get_device_name(0)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                 capture_output=True, text=True).stdout.strip(),
        "device": gpu, "driver": smi, "cuda_driver_version": drv.version(),
        "torch": torch.__version__, "kernel": platform.release(),
        "seconds": time.perf_counter() - t_start,
        "suite": suite,
        "workloads": workloads,
        "trace_log_tail": trace_log.strip().splitlines()[-1:],
    }
    out = Path(args.out or ROOT / "bench" / "results" /
               f"validate-gpu-{gpu.split()[1].lower() if len(gpu.split()) > 1 else 'gpu'}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
