"""The stall's floor and the restored job's first step (issue 25), on an NVIDIA GPU with PyTorch
(root):

    python3 bench/floor_gpu.py --out DIR [--gib 16,35+nostw] [--no-stw]

For each size, workloads/train_gpt.py filled to that many GiB of device memory under `pos run`:
  1. the driver's floor, measured alone on the job: the agent cuts, exports and gives its
     memory up (the exported descriptors keep it), then the driver's lock, checkpoint, restore
     and unlock of the hoisted process, then the memory mapped back; no CRIU, no copy;
  2. bench/scale_gpu.py's row on the same job: stop-the-world beside it (unless --no-stw), the
     whole-process concurrent checkpoint from outside at a random step (the stall as the job
     saw it, split by pos's own timings), SIGKILL, `pos restore` into a new process (the first
     step after it, when every buffer was back, the fill's rate) and every loss bit for bit.
A size may carry bench/scale_gpu.py's row flags (`35+nostw`: no stop-the-world beside it;
`+frozenall`: the copy takes every buffer while the job is frozen, the baseline).
Writes DIR/floor.json: a list of rows with the issue's keys, and the raw runs under `runs`;
DIR/<row>-criu-dump.log, and CRIU's restore logs in /var/log/pos.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from concurrent_gpu import kill  # noqa: E402
from scale_gpu import GIB, Spec, one_row, setting, start_job, wait_steps  # noqa: E402

from pos.agent.control import Agent  # noqa: E402
from pos.process import cudackpt  # noqa: E402

SPLIT = ("cut", "export", "import", "shadow", "hoist", "lock", "checkpoint", "dump", "frozen",
         "restore", "unlock", "remap")


def driver_floor(pid: int) -> dict[str, float]:
    """The job held and hoisted as a checkpoint does, then the driver's four calls alone."""
    t: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        t0 = time.monotonic()
        r = fn()
        t[name] = time.monotonic() - t0
        return r

    with Agent(pid) as a:
        t0 = time.monotonic()
        timed("cut", lambda: a.cut(60))
        fds = timed("export", lambda: a.export().fds)
        timed("hoist", lambda: a.hoist(0))
        timed("lock", lambda: cudackpt.lock(pid, 10_000))
        timed("checkpoint", lambda: cudackpt.checkpoint(pid))
        timed("restore", lambda: cudackpt.restore(pid))
        timed("unlock", lambda: cudackpt.unlock(pid))
        timed("remap", lambda: a.remap(fds))
        a.end()
        t["held"] = time.monotonic() - t0
    for fd in fds:
        os.close(fd)
    t["driver_floor"] = t["checkpoint"] + t["restore"]
    return t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--images", default="/var/tmp/pos-floor")
    ap.add_argument("--gib", default="16,35")
    ap.add_argument("--no-stw", action="store_true")
    a = ap.parse_args()
    total, facts, ref = setting(Path(a.out), Path(a.images))
    out, images = Path(a.out), Path(a.images)
    rows, runs = [], []
    for entry in a.gib.split(","):
        size, *flags = entry.split("+")
        gib = float(size)
        spec = Spec("+".join([f"{gib / total:.4f}", *flags]), images, not a.no_stw)
        p, log = start_job(spec, total, out)
        try:
            wait_steps(log, 12, p)
            floor = driver_floor(p.pid)
        finally:
            kill(p)
        run = {"gib": gib, "flags": flags, "driver_floor": floor,
               **one_row(spec, total, out, ref)}
        runs.append(run)
        rep = (run.get("concurrent") or {}).get("report") or {}
        tim = rep.get("timings") or {}
        rst = ((run.get("restore") or {}).get("report") or {})
        rt = rst.get("timings") or {}
        saw, stw = run.get("job_saw") or {}, (run.get("stw") or {}).get("job_saw") or {}
        rows.append({
            "gpu": facts["gpu"], "job_gib": round(rep.get("bytes", 0) / GIB, 2),
            "flags": flags,
            "stall_s": round(saw["worst_step_s"] - saw["median_step_s"], 3)
            if "worst_step_s" in saw else None,
            "release_s": rep.get("release_s"),
            "split": {k: round(tim[k], 3) for k in SPLIT if k in tim},
            "criu_written_mib": tim.get("criu_written_mib"),
            "driver_floor_s": round(floor["driver_floor"], 3),
            "stw_stall_s": round(stw["worst_step_s"] - stw["median_step_s"], 3)
            if "worst_step_s" in stw else None,
            "first_step_s": round(run["first_step_s"], 3) if run.get("first_step_s") else None,
            "all_back_s": round(rt["all_back_at"], 3) if "all_back_at" in rt else None,
            "fill_gbps": rst.get("h2d_gbps"),
            "restore_split": {k: round(rt[k], 3) for k in ("pos_started_s", "criu_restore",
                                                           "verify", "restore",
                                                           "remap", "memory_at", "all_back_at",
                                                           "ended_at") if k in rt},
            "bit_exact": (run.get("exact") or {}).get("bit_exact", False),
            "date": facts["date"], "driver": facts["driver"], "commit": facts["commit"]})
        print("row", json.dumps(rows[-1]), flush=True)
        (out / "floor.json").write_text(json.dumps({"machine": facts, "rows": rows,
                                                    "runs": runs}, indent=1, default=str))


if __name__ == "__main__":
    main()
