"""The tracer on the GPU: launch counts against the profiler, names/layouts, and overhead.

Run on the lent H100 from the project root, as root, after `source .device/setup.sh`:
    python3 bench/trace_gpu.py --out bench/results/trace-h100.json
Three runs, each of a fresh workloads/torch_job.py process:
  count:    the tracer attached before CUDA starts; N training steps between two marker
            memsets under torch.profiler: launches recorded == kernels the profiler saw?
            and the share of launches with a kernel name and a known parameter layout;
  overhead: in one process, untraced -> traced -> untraced again, a launch-bound loop and a
            training step; the cost is traced minus the mean of the two untraced phases;
  storm:    bench/launch_storm.cu, T threads launching an empty kernel as fast as the driver
            takes them: events/s recorded and events lost.
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from workloads.harness import JOB, Job, PosTrace as Trace, count_run, q  # noqa: E402



def overhead_run(db: str, launches: int, steps: int) -> dict:
    job = Job([sys.executable, str(JOB)])
    job.run("init")
    phases = {}
    for label in ("untraced_1", "traced", "untraced_2"):
        tr = Trace(job.pid, db) if label == "traced" else None
        phases[label] = {"launch": job.run(f"launch {launches}")["s_per_launch"],
                         "train": job.run(f"train {steps}")["s_per_step"]}
        if tr:
            phases[label]["trace_log"] = tr.stop().strip().splitlines()[-1:]
    job.close()
    base_l = (phases["untraced_1"]["launch"] + phases["untraced_2"]["launch"]) / 2
    base_s = (phases["untraced_1"]["train"] + phases["untraced_2"]["train"]) / 2
    return {"phases": phases, "launches": launches, "steps": steps,
            "added_us_per_launch": (phases["traced"]["launch"] - base_l) * 1e6,
            "untraced_us_per_launch": base_l * 1e6,
            "train_step_overhead_pct": (phases["traced"]["train"] / base_s - 1) * 100,
            "untraced_ms_per_step": base_s * 1e3}


def storm_run(db: str, threads: int, seconds: float, workdir: str) -> dict:
    exe = os.path.join(workdir, "launch_storm")
    subprocess.run(["nvcc", "-O2", "-o", exe, str(ROOT / "bench" / "launch_storm.cu"), "-lcuda"],
                   check=True)
    job = Job([exe, str(threads), str(seconds)])
    tr = Trace(job.pid, db)
    result = job.run("go")
    job.close()
    log = tr.stop()
    tid = q(db, "select max(id) from traces")[0][0]
    n = q(db, "select count(*) from launches where trace_id=?", tid)[0][0]
    lost = q(db, "select lost_events from traces where id=?", tid)[0][0]
    return {**result, "recorded_launches": n, "lost_events": lost,
            "events_per_s": result["launches"] / result["seconds"],
            "trace_log": log.strip().splitlines()[-1:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--launches", type=int, default=20000)
    ap.add_argument("--only", choices=["count", "overhead", "storm"], action="append")
    args = ap.parse_args()
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gpu_and_driver": smi, "kernel": platform.release(),
              "command": " ".join([Path(sys.executable).name] + sys.argv)}
    with tempfile.TemporaryDirectory() as d:
        for name in args.only or ["count", "overhead", "storm"]:
            db = os.path.join(d, f"{name}.db")
            t = time.time()
            try:
                if name == "count":
                    result[name] = count_run(db, args.steps)
                elif name == "overhead":
                    result[name] = overhead_run(db, args.launches, 30)
                else:
                    result[name] = storm_run(db, 4, 5.0, d)
            except Exception as e:  # keep the other runs' results
                result[name] = {"error": repr(e)}
            result[name]["wall_s"] = round(time.time() - t, 1)
            print(json.dumps({name: result[name]}, indent=1), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
