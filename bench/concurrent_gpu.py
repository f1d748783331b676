"""Concurrent vs stop-the-world checkpoint of one running job, side by side (GPU host, root).

    python3 bench/concurrent_gpu.py --out bench/results/concurrent-h100.json
    python3 bench/concurrent_gpu.py --infer --out bench/results/concurrent-infer-h100.json

The job (workloads/train_conc.py, GPT-2-class, random weights; default 24 layers, d=1024,
batch 8x1024: >= 16 GB of GPU state) runs under `pos run`. At step --at it takes a concurrent
GPU image of itself (the agent's report: bytes, copy throughput vs the 53 GB/s PCIe limit,
intercepted, copied-on-write, waited, fallbacks); at step --stw this script locks, checkpoints,
restores and unlocks it through the driver API (stop-the-world). Stall of each = the sum of
step-time excess over the median step of the steps before --at, over the steps from the
trigger until the step time is back to normal (and the worst step). After the last step the
job restores the concurrent image into itself on demand and trains again from step --at
(bit-exact losses checked by the job): the restore's time to release the job, time to its
first call and first step, calls held, and throughput (target >= 40 GB/s); it checks the
chunks' checksums as it reads them (--quick-verify) so that the release is not behind a sha256
of the whole image. The job runs with
`pos run --track-dirty` (copy order from the agent's history; --no-history: by size).
POS_TRUST_SPECULATION=1 in the environment runs the job trusting every kernel's speculation
(measurement only). Writes JSON with device, driver, date and command; exits non-zero, with
the reason, when the job fails, a re-run loss differs or a report is missing. About 4-6 min
on the H100 with the defaults (--timeout bounds it).
"""

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pos import nvml  # noqa: E402
from pos.scheduler import cudackpt  # noqa: E402

PCIE_LIMIT_GBPS = 53.0


def stall(times: dict[int, float], start: int, base: float, window: int) -> dict:
    excess = [max(0.0, times[i] - base) for i in range(start, start + window) if i in times]
    return {"stall_s": sum(excess), "worst_step_s": max((times[i] for i in range(
        start, start + window) if i in times), default=None), "steps": len(excess)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dir", default="/var/tmp/pos-bench-conc")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--at", type=int, default=20)
    ap.add_argument("--stw", type=int, default=40)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--infer", action="store_true")
    ap.add_argument("--no-history", action="store_true", help="run without --track-dirty")
    ap.add_argument("--timeout", type=float, default=450.0, help="seconds before the job is "
                    "killed and the bench fails")
    ap.add_argument("job_args", nargs="*", help="extra arguments of train_conc.py")
    a = ap.parse_args()
    img = Path(a.dir)
    subprocess.run(["rm", "-rf", str(img)], check=True)
    cmd = [sys.executable, "-m", "pos.cli", "run", *([] if a.no_history else ["--track-dirty"]),
           "--", sys.executable,
           str(ROOT / "workloads" / "train_conc.py"), "--steps", str(a.steps), "--at", str(a.at),
           "-D", str(img), "--verify", "--quick-verify", *(["--infer"] if a.infer else []),
           *a.job_args]
    print(f"bench: starting {' '.join(cmd)}", flush=True)
    t_start = time.monotonic()
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killer = threading.Timer(a.timeout, p.kill)
    killer.start()
    times: dict[int, float] = {}
    report, restore, stw = None, None, {}
    reruns, different = 0, 0
    assert p.stdout is not None
    for line in p.stdout:
        print(f"[{time.monotonic() - t_start:6.1f}s] {line}", end="", flush=True)
        parts = line.split()
        if parts[:1] == ["STEP"]:
            times[int(parts[1])] = float(parts[3])
            if int(parts[1]) == a.stw - 1:
                print("bench: stop-the-world lock/checkpoint/restore/unlock ...", flush=True)
                t = time.monotonic()
                try:
                    cudackpt.lock(p.pid, 60000)
                    t_lock = time.monotonic()
                    cudackpt.checkpoint(p.pid)
                    t_ck = time.monotonic()
                    cudackpt.restore(p.pid)
                    t_rs = time.monotonic()
                    cudackpt.unlock(p.pid)
                    stw = {"lock_s": t_lock - t, "checkpoint_s": t_ck - t_lock,
                           "restore_s": t_rs - t_ck, "unlock_s": time.monotonic() - t_rs,
                           "total_s": time.monotonic() - t}
                except Exception as e:      # never leave the job locked
                    print(f"bench: stop-the-world failed: {e}", file=sys.stderr, flush=True)
                    for undo in (cudackpt.restore, cudackpt.unlock):
                        try:
                            undo(p.pid)
                        except Exception:
                            pass
        elif parts[:1] == ["REPORT"]:
            report = json.loads(line[len("REPORT "):])
        elif parts[:1] == ["RESTORE"]:
            restore = json.loads(line[len("RESTORE "):])
        elif parts[:1] == ["RERUN"]:
            reruns += 1
            different += parts[-1] != "same"
    p.wait()
    killer.cancel()
    problems = []
    if p.returncode != 0:
        problems.append(f"the job exited with {p.returncode}"
                        + (" (killed by --timeout)" if p.returncode == -9 else ""))
    if report is None:
        problems.append("no REPORT line: the concurrent checkpoint did not report")
    if restore is None:
        problems.append("no RESTORE line: the on-demand restore did not report")
    if different or reruns != a.steps - a.at:
        problems.append(f"{different} of {reruns} re-run steps differ (want {a.steps - a.at} "
                        "identical)")
    if not stw:
        problems.append("the stop-the-world measurement did not run")
    if len([i for i in range(3, a.at) if i in times]) < 2:
        print("bench: FAILED: " + "; ".join(problems + ["too few steps before --at"]),
              file=sys.stderr)
        return 1
    base = statistics.median(times[i] for i in range(3, a.at) if i in times)
    conc = stall(times, a.at, base, a.window)
    stop = stall(times, a.stw, base, a.window)
    out = {"device": [dataclasses.asdict(g) for g in nvml.gpus()],
           "driver": nvml.driver_version(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "command": " ".join(sys.argv), "job": cmd, "exit": p.returncode,
           "median_step_s": base, "concurrent": {**conc, "report": report,
                                                 "pcie_limit_gbps": PCIE_LIMIT_GBPS},
           "on_demand_restore": {**(restore or {}), "target_gbps": 40.0},
           "problems": problems,
           "stop_the_world": {**stop, **stw},
           "trust_speculation": os.environ.get("POS_TRUST_SPECULATION") == "1",
           "step_times": times}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("median_step_s", "concurrent", "stop_the_world",
                                          "on_demand_restore")}, indent=1, default=str))
    r = report or {}
    print(f"bench: concurrent checkpoint {r.get('bytes', 0) / 1e9:.1f} GB, stall "
          f"{conc['stall_s']:.3f} s, copy {r.get('throughput_gbps') or 0:.1f} GB/s (device to "
          f"host {r.get('d2h_gbps') or 0:.1f}), order {r.get('order_source')}; stop-the-world "
          f"stall {stop['stall_s']:.3f} s; on-demand restore: released after "
          f"{(restore or {}).get('release_s', float('nan')):.3f} s, first step after "
          f"{(restore or {}).get('first_step_s') or float('nan'):.3f} s, "
          f"{(restore or {}).get('throughput_gbps') or 0:.1f} GB/s", flush=True)
    if problems:
        print("bench: FAILED: " + "; ".join(problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
