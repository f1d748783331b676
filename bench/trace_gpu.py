"""The tracer on the GPU: launch counts against the profiler, names/layouts, cost, lost events.

Needs an NVIDIA GPU with PyTorch. Run from the project root, as root, after `source .device/setup.sh`:
    python3 bench/trace_gpu.py --out bench/results/2026-11-23/trace-h100.json
Runs, each on fresh processes:
  count:    workloads/torch_job.py with the tracer attached before CUDA starts; N training steps
            between two marker memsets under torch.profiler: launches recorded == kernels the
            profiler (CUPTI) saw? the share of launches with a kernel name and a known layout;
  launch:   bench/launch_storm.cu, one thread launching an empty kernel through cuLaunchKernel,
            untraced -> traced -> untraced in one process (R rounds, 9 by default), the
            workload on one core and pos on the others; the cost per launch is traced minus
            the mean of the untraced phases around it: median, quartiles and range over the
            rounds, and each traced phase's share of launches with their layout (the common
            path is measured only where that is 1.0); then, in one more traced phase, the probe
            program's own mean run time (the kernel's bpf_stats: without the uprobe trap and the
            phases' noise);
  floor:    the same alternation with an empty BPF program on cuLaunchKernel instead of pos:
            what the kernel's uprobe alone costs a launch, the floor under pos's cost;
  train:    torch_job.py training steps, untraced -> traced -> untraced in one process (the
            tracer attaches to a running job, so its kernels' layouts come from mapped files);
            also its ATen launch-bound loop (`add_` on a small tensor) the same way;
  storm:    launch_storm.cu, T threads launching as fast as the driver takes them: events/s,
            events recorded and lost; once with the kernel's layout known before the first
            launch, once launching right after the lookup (layout late: the first launches
            take the capture path, whose drops are counted).
"""

import argparse
import ctypes
import datetime
import json
import os
import platform
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from workloads.harness import JOB, Job, PosTrace, count_run, q, split_cpus  # noqa: E402

STORM = ROOT / "bench" / "launch_storm.cu"


def build_storm(workdir: str) -> list[str]:
    exe, cubin = os.path.join(workdir, "launch_storm"), os.path.join(workdir, "empty.cubin")
    subprocess.run(["nvcc", "-O2", "-o", exe, str(STORM), "-lcuda"], check=True)
    subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-o", cubin, str(STORM)], check=True)
    return [exe, cubin]


# The kernel's own account of a BPF program's run time (bpf_stats: run_time_ns, run_cnt), which
# isolates the probe's work from the uprobe trap and from the noise of the phases' timing.
_BPF = 321                       # the bpf syscall on x86-64
_PROG_GET_NEXT_ID, _PROG_GET_FD_BY_ID, _OBJ_GET_INFO_BY_FD, _ENABLE_STATS = 11, 13, 15, 32
_libc = ctypes.CDLL(None, use_errno=True)


def _bpf(cmd: int, attr: bytes) -> tuple[int, bytes]:
    buf = ctypes.create_string_buffer(attr, 128)
    return _libc.syscall(_BPF, cmd, buf, 128), buf.raw


def bpf_stats() -> int:
    """An fd that keeps the kernel's BPF run-time statistics on while it is open (-1: cannot;
    kernels before 5.8)."""
    return _bpf(_ENABLE_STATS, struct.pack("<I", 0))[0]


def probe_run_ns(prefix: str = "on_cuLaunchKer") -> Optional[float]:
    """Mean run time in ns of the loaded BPF programs whose name starts with `prefix` (the
    kernel keeps 15 characters of a name), over all their runs; None when none ran."""
    total = runs = 0
    prog_id = 0
    while True:
        rc, raw = _bpf(_PROG_GET_NEXT_ID, struct.pack("<I", prog_id))
        if rc != 0:
            break
        prog_id = struct.unpack_from("<I", raw, 4)[0]
        fd, _ = _bpf(_PROG_GET_FD_BY_ID, struct.pack("<I", prog_id))
        if fd < 0:
            continue
        info = ctypes.create_string_buffer(256)
        rc, _ = _bpf(_OBJ_GET_INFO_BY_FD, struct.pack("<IIQ", fd, 256, ctypes.addressof(info)))
        os.close(fd)
        name = info.raw[64:80].split(b"\0")[0].decode()
        if rc == 0 and name.startswith(prefix):
            t, n = struct.unpack_from("<QQ", info.raw, 192)
            total, runs = total + t, runs + n
    return total / runs if runs else None


# The cost runs keep the workload on one core and pos (tracer, sink, parsers) on the others,
# so that what is measured is the probes' cost, not two processes sharing a core (--no-pin).
Pin = tuple[Optional[set[int]], Optional[set[int]]]   # (workload CPUs, pos CPUs)


def alternate(job: Job, db: str, cmd: str, key: str, rounds: int, pos_cpus: Optional[set[int]]
              ) -> dict:
    """untraced, traced, untraced ... (rounds traced phases); the added cost of each traced
    phase against the mean of its two neighbours: median, quartiles and range over rounds, and
    the share of each traced phase's launches that had their layout."""
    seq, logs, known = [], [], []
    for i in range(2 * rounds + 1):
        tr = PosTrace(job.pid, db, pos_cpus) if i % 2 else None
        seq.append(job.run(cmd)[key])
        if tr:
            logs.append(tr.stop().strip().splitlines()[-1])
            n, k = q(db, "select count(*), sum(layout_known) from launches where trace_id = "
                         "(select max(id) from traces)")[0]
            known.append((k or 0) / n if n else 0.0)
    return {**added_cost(cmd, seq), "layout_known_share": known, "trace_logs": logs}


class EmptyProbe:
    """A BPF program that does nothing, on the job's cuLaunchKernel: what the kernel's uprobe
    costs a launch before any work of pos's (the floor under pos trace's cost)."""

    def __init__(self, pid: int) -> None:
        from bcc import BPF

        from pos.tracer.target import find_libraries

        library = next(lib.host_path for lib in find_libraries(pid) if "libcuda" in lib.path)
        self.bpf = BPF(text="int empty(void *ctx) { return 0; }")
        self.bpf.attach_uprobe(name=library, sym="cuLaunchKernel", fn_name="empty", pid=pid)

    def stop(self) -> None:
        self.bpf.cleanup()


def floor_run(storm: list[str], launches: int, rounds: int, pin: Pin) -> dict:
    """untraced, empty uprobe, untraced ...: the uprobe's own cost a launch."""
    job = Job(storm, pin[0])
    job.run("init")
    seq = []
    for i in range(2 * rounds + 1):
        probe = EmptyProbe(job.pid) if i % 2 else None
        seq.append(job.run(f"loop {launches}")["s_per_launch"])
        if probe:
            probe.stop()
    job.close()
    r = added_cost(f"loop {launches}", seq)
    r["added_us_per_launch_median"] = r["added_s_median"] * 1e6
    r["added_us_per_launch_range"] = [x * 1e6 for x in r["added_s_range"]]
    return r


def added_cost(cmd: str, seq: list[float]) -> dict:
    """Each odd phase's cost against the mean of its two neighbours, over the rounds."""
    added = [seq[i] - (seq[i - 1] + seq[i + 1]) / 2 for i in range(1, len(seq), 2)]
    base = statistics.mean(seq[0::2])
    q1, _, q3 = (statistics.quantiles(added, n=4, method="inclusive") if len(added) > 1
                 else (added[0],) * 3)
    return {"command": cmd, "phases_s": seq, "untraced_s": base,
            "added_s_median": statistics.median(added), "added_s_quartiles": [q1, q3],
            "added_s_range": [min(added), max(added)], "added_s": added,
            "added_pct_median": statistics.median(added) / base * 100}


def launch_run(db: str, storm: list[str], launches: int, rounds: int, pin: Pin) -> dict:
    job = Job(storm, pin[0])
    job.run("init")
    r = alternate(job, db, f"loop {launches}", "s_per_launch", rounds, pin[1])
    # The probe's own run time, in one more traced phase of its own: the statistics cost two
    # clock reads per program run, which the phases above must not pay.
    stats = bpf_stats()
    tr = PosTrace(job.pid, db, pin[1])
    job.run(f"loop {launches}")
    r["launch_probe_run_ns"] = probe_run_ns() if stats >= 0 else None
    tr.stop()
    if stats >= 0:
        os.close(stats)
    job.close()
    r["added_us_per_launch_median"] = r["added_s_median"] * 1e6
    r["added_us_per_launch_quartiles"] = [x * 1e6 for x in r["added_s_quartiles"]]
    r["added_us_per_launch_range"] = [x * 1e6 for x in r["added_s_range"]]
    r["untraced_us_per_launch"] = r["untraced_s"] * 1e6
    r["layout_known_in_every_phase"] = all(k == 1.0 for k in r["layout_known_share"])
    return r


def train_run(db: str, launches: int, steps: int, rounds: int, pin: Pin) -> dict:
    job = Job([sys.executable, str(JOB)], pin[0])
    job.run("init")
    train = alternate(job, db, f"train {steps}", "s_per_step", rounds, pin[1])
    aten = alternate(job, db, f"launch {launches}", "s_per_launch", rounds, pin[1])
    job.close()
    return {"train_step": train, "aten_launch_loop": aten,
            "train_step_overhead_pct_median": train["added_pct_median"],
            "aten_added_us_per_launch_median": aten["added_s_median"] * 1e6}


def storm_run(db: str, storm: list[str], threads: int, seconds: float, late: bool) -> dict:
    job = Job(storm)
    tr = PosTrace(job.pid, db)
    job.run("init")
    result = job.run(f"storm {threads} {seconds}{' late' if late else ''}")
    job.close()
    log = tr.stop()
    tid = q(db, "select max(id) from traces")[0][0]
    n, known = q(db, "select count(*), sum(layout_known) from launches where trace_id=? and "
                     "api='cuLaunchKernel'", tid)[0]
    lost, dropped = q(db, "select lost_events, captures_dropped from traces where id=?", tid)[0]
    return {**result, "layout": "late" if late else "known", "recorded_launches": n,
            "layout_known": known or 0, "lost_events": lost, "captures_dropped": dropped,
            "events_per_s": result["launches"] / result["seconds"],
            "trace_log": log.strip().splitlines()[-1:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--launches", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=9, help="traced phases of each cost run")
    ap.add_argument("--storm-threads", type=int, nargs="+", default=[4, 8],
                    help="storm runs per thread count (each with the layout known and late)")
    ap.add_argument("--storm-seconds", type=float, default=5.0)
    ap.add_argument("--only", choices=["count", "launch", "floor", "train", "storm"],
                    action="append")
    ap.add_argument("--dbdir", help="keep the runs' stores here [default: a temporary folder]")
    ap.add_argument("--no-pin", action="store_true",
                    help="let the workload and pos share cores in the cost runs")
    args = ap.parse_args()
    pin: Pin = (None, None) if args.no_pin else split_cpus()
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gpu_and_driver": smi, "kernel": platform.release(),
              "command": " ".join([Path(sys.executable).name] + sys.argv),
              "pinning": {"workload": sorted(pin[0] or []), "pos": sorted(pin[1] or [])}}
    with tempfile.TemporaryDirectory() as d:
        storm = build_storm(d)
        for name in args.only or ["count", "launch", "train", "storm"]:
            db = os.path.join(args.dbdir or d, f"{name}.db")
            t = time.time()
            try:
                if name == "count":
                    result[name] = count_run(db, args.steps)
                elif name == "launch":
                    result[name] = launch_run(db, storm, args.launches, args.rounds, pin)
                elif name == "floor":
                    result[name] = floor_run(storm, args.launches, args.rounds, pin)
                elif name == "train":
                    result[name] = train_run(db, args.launches, 10, args.rounds, pin)
                else:
                    result[name] = {
                        f"threads_{n}_{layout}": storm_run(db.replace(".db", f"{n}{layout}.db"),
                                                           storm, n, args.storm_seconds,
                                                           layout == "late")
                        for n in args.storm_threads for layout in ("known", "late")}
            except Exception as e:  # keep the other runs' results
                result[name] = {"error": repr(e)}
            result[name]["wall_s"] = round(time.time() - t, 1)
            print(json.dumps({name: result[name]}, indent=1), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
