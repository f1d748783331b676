"""Where a concurrent checkpoint's and its restore's seconds go, row by row, against the
baseline in the same run (the stall issue's rows). Root, on an NVIDIA GPU with PyTorch:

    python3 bench/perf_gpu.py --out DIR [--cases 0.3+pinall+nostw,0.3+nostw,0.3+ring+nostw]

Each case is a row of bench/scale_gpu.py (its spec: a fraction of the GPU's memory and flags;
`+pinall` is the baseline that locks the whole arena before the cut): the training job under
`pos run`, `pos checkpoint --concurrent --leave-running` from outside at a random step, the job
SIGKILLed a few steps later, `pos restore` into a new process, every loss line compared. Writes
DIR/perf.json: one row per run with the issue's keys (`to_cut_s`: from the command's start to
the cut, as pos timed it; `stall_s`: the job's longest step gap less its median step;
`pos_restore_exit_s`: when `pos restore` returned, from its start; `waited_after_release_s`:
what the job's calls waited in all after the release, and on which kernels or driver calls;
`held_past_release_s`: how long the calls held at the release went on waiting after it;
`waited_for`: each buffer the gate's waits named, its size, whether pos shadowed it, the
buffers its words reach, when its own addresses were known (`back_s`), when all it reaches was
back (`reach_back_s`) and when the job had it (`told_s`), from the cut;
`phases`: the checkpoint's steps in seconds; `restore_phases`: the restore's), the raw runs in
DIR/perf-runs.json.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_gpu import GIB, runs_of, setting, stall  # noqa: E402

from pos.operation.timings import Kind, kind  # noqa: E402

GB = 1e9
LINK_GBPS = 55.0        # pinned device-to-host on these hosts' PCIe 5 x16: the physical limit


def steps_of(timings: dict[str, float]) -> dict[str, float]:
    """A report's timings that are a step's seconds, rounded."""
    return {k: round(v, 4) for k, v in timings.items() if kind(k) is Kind.STEP}


def job_gb(copied: float, timings: dict[str, float]) -> float:
    """The job's device memory in the image: the buffers pos owns and copied, and the job's own
    cuMem memory that pos took at the cut (PyTorch's expandable segments, NCCL's buffers)."""
    return round((copied + timings.get("own_taken_bytes", 0)) / GB, 2)


def perf_row(run: dict[str, Any], facts: dict[str, Any], total_gib: float) -> dict[str, Any]:
    """The issue's keys, from one raw run of scale_gpu.one_row (None where a step did not
    happen: the error says why)."""
    concurrent = run.get("concurrent") or {}
    rep = concurrent.get("report") or {}
    tim = rep.get("timings") or {}
    saw = run.get("job_saw") or {}
    restore = run.get("restore") or {}
    exact = (run.get("exact") or {}).get("bit_exact", False)

    def r(x: Optional[float], n: int = 3) -> Optional[float]:
        return round(x, n) if x is not None else None

    stalled = stall(saw)
    gate = rep.get("gate") or {}
    # the job's calls that began to wait after the release: for buffers pos had neither
    # shadowed nor saved (the gate's account keeps its first 16 waits)
    release = rep.get("release_s")
    waits = gate.get("waits") or [] if release is not None else []
    after = [w for w in waits if w["end_s"] - w["s"] >= release]
    return {
        "case": run["spec"], "gpu": facts["gpu"], "gpu_gb": round(total_gib * GIB / GB, 1),
        "driver": facts["driver"], "commit": facts["commit"], "date": facts["date"],
        "command": facts["command"],
        "job_gb": job_gb(rep["bytes"], tim) if rep else None, "ranks": 1,
        # the job's own cuMem memory (PyTorch's expandable segments) taken at the cut, and of
        # it what was copied into host memory while it was held (no room on the GPU)
        "own_taken_gb": r(tim["own_taken_bytes"] / GB, 2) if "own_taken_bytes" in tim else None,
        "own_host_gb": r(tim["own_host_bytes"] / GB, 2) if "own_host_bytes" in tim else None,
        "one_rank_stall_s": stalled, "bit_exact": exact,
        "to_cut_s": r(tim.get("to_cut")), "stall_s": stalled,
        "pos_held_s": r(rep.get("release_s")),
        "gate_held_max_s": r(gate.get("held_max_s")),
        "waits_after_release": len(after),
        "waited_after_release_s": r(sum(w["s"] for w in after)),
        "waited_after_release_on": sorted({w["what"] for w in after}),
        # how long the calls held at the release went on waiting past it: for a buffer the copy
        # had not saved (or the buffers it points into), waits the ones above leave out
        "held_past_release_s": r(max([0.0] + [w["end_s"] - release for w in waits
                                              if w["end_s"] - w["s"] < release]))
        if release is not None else None,
        "waited_for": rep.get("waited_for") or [],
        "pinned_peak_gb": r(tim["pinned_peak_bytes"] / GB, 2) if "pinned_peak_bytes" in tim
        else None,
        "pin_before_cut_s": r(tim.get("pin")), "pin_all_s": r(tim.get("pin_all")),
        # the arena's memory kept by the checkpoint before (+keep), and that one's wait
        "pin_kept_gb": r(tim["pin_kept_bytes"] / GB, 2) if "pin_kept_bytes" in tim else None,
        "warm_to_cut_s": r((((run.get("warm") or {}).get("report") or {}).get("timings")
                            or {}).get("to_cut")),
        "d2h_gbps": r(rep.get("d2h_gbps"), 2), "link_limit_gbps": LINK_GBPS,
        # the job's own memory (d2h_gbps counts only the buffers pos owns): its copy into host
        # memory while the job was held, and its way into the image after the release
        "own_host_gbps": r(tim["own_host_bytes"] / tim["own_host"] / GB, 2)
        if tim.get("own_host_bytes") and tim.get("own_host") else None,
        "own_write_gbps": r(tim["own_taken_bytes"] / tim["own_write"] / GB, 2)
        if tim.get("own_taken_bytes") and tim.get("own_write") else None,
        # the rate while copying: the bytes over the seconds in which a chunk was copied
        "d2h_busy_gbps": r(rep["bytes"] / tim["d2h_busy"] / GB, 2)
        if rep and tim.get("d2h_busy") else None,
        "sealed_s": r(tim.get("sealed_s"), 2),
        "first_step_s": r(run.get("first_step_s")),
        "pos_restore_exit_s": r(restore.get("s")) if restore.get("rc") == 0 else None,
        # `pos restore` returned this long after the job's first step
        "restore_exit_after_step_s": r(restore["s"] - run["first_step_s"])
        if restore.get("rc") == 0 and run.get("first_step_s") else None,
        # `pos restore` answered once the job ran, the service (+service) or a process of
        # pos's own filling the rest; that process ended this long after the restore began
        "restore_filling": (restore.get("report") or {}).get("filling"),
        "restore_filled_s": r(run.get("filler_ended_s")),
        "disk_write_gbps": facts["disk_write_gbps"],
        "phases": steps_of(tim),
        "restore_phases": steps_of(((restore.get("report") or {}).get("timings")) or {}),
        # the checkpoint's own sentence first (--json prints it on stdout)
        "error": None if exact else (run.get("error") or concurrent.get("err", "")[-400:]
                                     or concurrent.get("out", "").strip()[-400:]
                                     or "not bit-exact"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--images", default="/var/tmp/pos-perf")
    ap.add_argument("--cases", default="0.3+pinall+nostw,0.3+nostw,0.3+shadow8+nostw")
    a = ap.parse_args()
    out, images = Path(a.out), Path(a.images)
    total, facts, ref = setting(out, images)
    rows, runs = [], []
    for run in runs_of(a.cases, images, False, total, out, ref):
        runs.append(run)
        rows.append(perf_row(run, facts, total))
        print("row", json.dumps(rows[-1]), flush=True)
        (out / "perf.json").write_text(json.dumps(rows, indent=1))
        (out / "perf-runs.json").write_text(json.dumps({"machine": facts, "runs": runs},
                                                       indent=1, default=str))


if __name__ == "__main__":
    main()
