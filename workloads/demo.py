"""The main job, end to end (scripts/demo.sh): start a GPU workload, trace it with `pos trace`
as a user would, and export what was recorded.

Where an NVIDIA GPU and a Python with PyTorch are present, the workload is the PyTorch
training job of workloads/torch_job.py on the GPU. Elsewhere it is the fake-driver workload of
the tests (tests/fakegpu): real eBPF, real probes, a fake libcuda -- that proves the plumbing,
not GPU behaviour, and the demo says so.
"""

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from workloads.harness import ROOT, Job, PosTrace


def torch_python() -> str | None:
    """A Python that imports torch and sees a CUDA GPU, or None."""
    if shutil.which("nvidia-smi") is None:
        return None
    for py in (sys.executable, "/usr/bin/python3", shutil.which("python3")):
        if py and subprocess.run([py, "-c", "import torch, sys; sys.exit(not torch.cuda.is_available())"],
                                 capture_output=True).returncode == 0:
            return py
    return None


def run_gpu(py: str, db: str) -> None:
    print(f"demo: tracing a PyTorch training job on the GPU ({py})", flush=True)
    job = Job([py, str(ROOT / "workloads" / "torch_job.py")])
    trace = PosTrace(job.pid, db)
    print("demo:", json.dumps(job.run("init")), flush=True)
    print("demo:", json.dumps(job.run("train 10")), flush=True)
    job.close()
    print(trace.stop().strip().splitlines()[-1], flush=True)


def run_fake(db: str, out: Path) -> None:
    print("demo: no NVIDIA GPU with PyTorch here: tracing the fake-driver workload of the tests "
          "(real eBPF probes on a fake libcuda.so.1; this proves the plumbing, not GPU behaviour)",
          flush=True)
    sys.path.insert(0, str(ROOT))
    from tests.fakegpu.build import build

    built = build(out / "fakegpu")
    job = Job([str(built["cuda_app"]), "fatbin", str(built["dir"])])
    trace = PosTrace(job.pid, db)
    for phase in ("load", "lookup", "alloc"):
        job.run(phase)
    time.sleep(0.2)     # let the kernels' layouts reach the probes (one drain interval)
    for phase in ("launch", "free"):
        job.run(phase)
    job.close()
    print(trace.stop().strip().splitlines()[-1], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    py = torch_python()
    if py:
        run_gpu(py, args.db)
    else:
        run_fake(args.db, out)
    pos = [sys.executable, "-m", "pos.cli"]
    jsonl, perfetto = out / "trace.jsonl", out / "trace.perfetto.json"
    subprocess.run(pos + ["export", args.db, "--format", "jsonl", "-o", str(jsonl)], check=True)
    subprocess.run(pos + ["export", args.db, "--format", "perfetto", "-o", str(perfetto)], check=True)
    events = [json.loads(line) for line in jsonl.open()]
    kinds = Counter(e["kind"] for e in events)
    kernels = Counter(e["name"] or e["function"] for e in events if e["kind"] == "launch")
    print(f"demo: {len(events):,} events: " + ", ".join(f"{k} {n:,}" for k, n in kinds.most_common()))
    for name, n in kernels.most_common(5):
        print(f"demo: {n:8,}  {name[:100]}")
    print(f"demo: wrote {jsonl} and {perfetto} (open the latter in ui.perfetto.dev)")


if __name__ == "__main__":
    main()
