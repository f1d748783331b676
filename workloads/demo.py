"""The main job, end to end (scripts/demo.sh): start a GPU workload, trace it with `pos trace`
as a user would, and export what was recorded; then checkpoint a running job with
`pos checkpoint` (which ends it), bring it back with `pos restore`, and show that it goes on.

Where an NVIDIA GPU and a Python with PyTorch are present, the workloads are PyTorch training
jobs on the GPU (workloads/torch_job.py traced, workloads/train_det.py checkpointed). Elsewhere
they are the fake-driver workloads of the tests (tests/fakegpu, and tests/scheduler/counter.py
holding fake CUDA state): real eBPF, real CRIU, a fake libcuda -- that proves the plumbing, not
GPU behaviour, and the demo says so.
"""

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from workloads.harness import ROOT, Job, PosTrace, q


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


def run_fake(db: str, built: dict[str, Path]) -> None:
    print("demo: no NVIDIA GPU with PyTorch here: tracing the fake-driver workload of the tests "
          "(real eBPF probes on a fake libcuda.so.1; this proves the plumbing, not GPU behaviour)",
          flush=True)
    job = Job([str(built["cuda_app"]), "fatbin", str(built["dir"])])
    trace = PosTrace(job.pid, db)
    looked_up = 0
    for phase in ("load", "lookup", "alloc"):
        looked_up = len(job.run(phase).get("functions", {})) or looked_up
    deadline = time.monotonic() + 20   # the module is parsed in a worker: wait for its layouts
    while time.monotonic() < deadline and q(db, "select count(*) from functions where layout "
                                               "is not null")[0][0] < looked_up:
        time.sleep(0.05)
    for phase in ("launch", "free"):
        job.run(phase)
    job.close()
    print(trace.stop().strip().splitlines()[-1], flush=True)


def checkpoint_restore(argv: list[str], progress: Path, image: Path, env: dict[str, str],
                       unit: str) -> None:
    """Start `argv` (it appends a line to `progress` per unit of work), checkpoint it after a
    few units, restore it, and show that it goes on from where it was saved."""
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)   # restored jobs come back to us to be reaped
    progress.unlink(missing_ok=True)
    pos = [sys.executable, "-m", "pos.cli"]
    job = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           start_new_session=True)
    def count() -> int:
        return len(progress.read_text().splitlines()) if progress.exists() else 0

    deadline = time.monotonic() + 300
    while count() < 10:
        if job.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"demo: the job to checkpoint did not start (exit {job.poll()})")
        time.sleep(0.05)
    shutil.rmtree(image, ignore_errors=True)
    print(f"demo: $ pos checkpoint {job.pid} -D {image}", flush=True)
    subprocess.run(pos + ["checkpoint", str(job.pid), "-D", str(image)], env=env, check=True)
    job.wait(timeout=60)
    saved = count()
    print(f"demo: the job was saved after {saved} {unit} and has ended; $ pos restore -D {image}",
          flush=True)
    subprocess.run(pos + ["restore", "-D", str(image)], env=env, check=True)
    deadline = time.monotonic() + 120
    while count() < saved + 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    print(f"demo: the restored job (PID {job.pid}) went on: {count()} {unit} now", flush=True)
    if count() < saved + 5:
        sys.exit("demo: FAILED: the restored job did not go on")
    try:
        os.kill(job.pid, 9)
    except ProcessLookupError:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    py = torch_python()
    built: dict[str, Path] = {}
    if py:
        run_gpu(py, args.db)
    else:
        sys.path.insert(0, str(ROOT))
        from tests.fakegpu.build import build

        built = build(out / "fakegpu")
        run_fake(args.db, built)
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
    env = dict(os.environ, POS_DB=args.db)
    if py:
        print("demo: checkpoint/restore of a PyTorch training job on the GPU", flush=True)
        checkpoint_restore([py, str(ROOT / "workloads" / "train_det.py"), str(out / "losses"),
                            "--steps", "400"], out / "losses", out / "image", env, "steps")
    else:
        lib = str(built["libcuda"])
        print("demo: checkpoint/restore of the tests' counter process holding fake CUDA state "
              "(real CRIU; the driver calls go to the fake libcuda: plumbing, not GPU behaviour)",
              flush=True)
        env.update(POS_LIBCUDA=lib, POS_FAKECUDA_STATE_DIR=str(out / "fakecuda"))
        checkpoint_restore([sys.executable, str(ROOT / "tests" / "scheduler" / "counter.py"),
                            str(out / "count"), "--cuda", lib], out / "count", out / "image",
                           env, "counts")


if __name__ == "__main__":
    main()
