"""The stall issue's rows for jobs of several ranks, from bench/torchrun_gpu.py's multigpu.json
rows: the same keys as bench/perf_gpu.py's, `one_rank_stall_s` from the 1-rank row of the same
job measured in the same run on the same machine. No GPU needed:

    python3 bench/perf_ranks.py --rows RUN/four/multigpu.json --one-rank RUN/one/multigpu.json \
        --raw-rows raw/runN/four --raw-one raw/runN/one --gpu-gb 150.8 \
        --host "4x NVIDIA H200, ..." --into DIR/perf.json

Appends one row per run of --rows (and the 1-rank row itself) to --into. Rows of a run of
several rank counts (`--ranks 8,4,2,1`) carry their own `one_rank_stall_s`: give that one file
alone (`--rows RUN/multigpu.json --raw-rows raw/runN`), and each of its concurrent rows is
appended with it.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from perf_gpu import GB, LINK_GBPS, job_gb, steps_of  # noqa: E402


def row(run: dict[str, Any], one_rank_stall: float, gpu_gb: float, host: str, raw: str
        ) -> dict[str, Any]:
    tim = run.get("checkpoint_timings") or {}
    copied = sum(r.get("bytes") or 0 for r in run.get("ranks_report") or [])

    def r(x: Optional[float], n: int = 3) -> Optional[float]:
        return round(x, n) if x is not None else None

    return {
        "case": run["case"], "workload": run["workload"],
        "gpu": run["gpu"].split(", ")[0].split(": ")[-1], "gpu_gb": gpu_gb,
        "driver": run["driver"], "commit": run["commit"][:7], "date": run["date"],
        "command": run["command"], "job_gb": job_gb(copied, tim), "ranks": run["ranks"],
        "one_rank_stall_s": one_rank_stall, "bit_exact": run["bit_exact"],
        "to_cut_s": r(tim.get("to_cut")), "stall_s": run["stall_s"],
        "pos_held_s": r(run.get("pos_held_s")),
        "pinned_peak_gb": r(tim["pinned_peak_bytes"] / GB, 2) if "pinned_peak_bytes" in tim
        else None,
        "pin_before_cut_s": r(tim.get("pin")),
        "pin_kept_gb": r(tim["pin_kept_bytes"] / GB, 2) if "pin_kept_bytes" in tim else None,
        "warm_to_cut_s": run.get("warm_to_cut_s"),
        "d2h_gbps": r(copied / tim["d2h"] / GB, 2) if tim.get("d2h") else None,
        "link_limit_gbps": LINK_GBPS,
        "sealed_s": r(tim.get("sealed_s"), 2), "first_step_s": run.get("first_step_s"),
        "pos_restore_exit_s": run.get("restore_wall_s") if run.get("restore_exit") == 0
        else None,
        "pos_restore_reported_s": run.get("restore_reported_s"),   # its report printed
        "criu_written_gb": r(run["criu_written_mib"] * 2**20 / GB, 2)
        if run.get("criu_written_mib") else None,
        "phases": steps_of(tim), "restore_phases": steps_of(run.get("restore_timings") or {}),
        "error": None if run["bit_exact"] else "not bit-exact",
        "pos_env": run.get("pos_env"),   # pos's settings in this run (--pos-env), if any
        "raw": raw, "host": host,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=Path, required=True, help="the several-rank multigpu.json")
    ap.add_argument("--one-rank", type=Path,
                    help="the same job's 1-rank multigpu.json, same run and machine (none: "
                    "--rows come from a run of several rank counts, each row with its own)")
    ap.add_argument("--raw-rows", required=True, help="where --rows' raw runs lie, from --into's")
    ap.add_argument("--raw-one", help="where --one-rank's raw run lies")
    ap.add_argument("--gpu-gb", type=float, required=True)
    ap.add_argument("--host", required=True)
    ap.add_argument("--into", type=Path, required=True)
    a = ap.parse_args()
    given = json.loads(a.rows.read_text())
    if a.one_rank is None:        # a run of several counts: each row says its 1-rank stall
        rows = [row(x, x["one_rank_stall_s"], a.gpu_gb, a.host, a.raw_rows) for x in given
                if x.get("engine") == "concurrent" and x.get("one_rank_stall_s") is not None]
        if not rows:
            sys.exit(f"{a.rows} has no concurrent row with one_rank_stall_s: give --one-rank")
    else:
        one = json.loads(a.one_rank.read_text())
        if len(one) != 1 or one[0]["ranks"] != 1 or not a.raw_one:
            sys.exit(f"{a.one_rank} does not hold exactly one 1-rank row, or --raw-one is "
                     "missing")
        base = one[0]["stall_s"]
        rows = [row(one[0], base, a.gpu_gb, a.host, a.raw_one)]
        rows += [row(x, base, a.gpu_gb, a.host, a.raw_rows) for x in given]
    have = json.loads(a.into.read_text()) if a.into.exists() else []
    a.into.write_text(json.dumps(have + rows, indent=1) + "\n")
    for x in rows:
        print(x["case"], x["ranks"], x["stall_s"], x["one_rank_stall_s"], x["to_cut_s"])


if __name__ == "__main__":
    main()
