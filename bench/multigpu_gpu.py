"""Jobs on several GPUs (issue 27), on a machine with two: one row per case in
bench/results/<date>-multigpu/multigpu.json.

  python3 bench/multigpu_gpu.py --out $OUT [--gib 8] [--parts migrate,split,ddp]

  migrate   a train_det job (--gib of ballast) started on GPU 0 and moved by `pos migrate PID
            --to-gpu 1` at a moment it does not choose: the driver alone (the job runs on:
            `migrate-stw`), and, for a `pos run` job, `--concurrent` (its whole-process image
            restored on GPU 1 in a new process: `migrate-concurrent`);
  split     one process on two GPUs (train_det --split: the model's halves on cuda:0 and
            cuda:1, the ballast on cuda:1): `pos checkpoint --leave-running` from outside,
            SIGKILL, `pos restore --to-gpu 0=1,1=0` into a new process (`two-gpu-process-stw`);
            `pos checkpoint --concurrent` of the same job under `pos run`
            (`two-gpu-process-concurrent`);
  ddp       bench/ddp.py --backend nccl: two ranks under a parent without torchrun and under
            torchrun without io_uring (--ddp-cases), `pos checkpoint ROOT` of the whole tree,
            SIGKILL, `pos restore` (`ddp-stw`); the same job under `pos run` checkpointed with
            `--concurrent` (`ddp-concurrent`: every rank cut before the same collective).

Every job is compared, line by line (each loss as float.hex()), with an uninterrupted run.
stall_s: the job's longest step gap around the operation less its median step before it.
first_step_s: from the restore's start (for `pos migrate --concurrent`, the restore inside it)
to the job's next step; none where no new process starts.
"""

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from concurrent_gpu import (POS, PY, LineTimes, compare_when_done, kill, machine,  # noqa: E402
                            pos_cmd, processes)

from pos import nvml  # noqa: E402

STEPS = 300


def wait_lines(log: Path, n: int, p: subprocess.Popen, timeout: float = 180) -> None:
    """Until the job's log has n lines; a job that died or hangs ends the part."""
    t = time.monotonic()
    while not log.exists() or len(log.read_text().splitlines()) < n:
        if p.poll() is not None or time.monotonic() - t > timeout:
            raise RuntimeError(f"{log.name}: {n} steps not reached (exit {p.poll()}): "
                               f"{processes()[-3000:]}")
        time.sleep(0.05)


def det(log: Path, gib: float, split: str = "") -> list[str]:
    return [PY, "workloads/train_det.py", str(log), "--steps", str(STEPS), "--sleep", "0.05",
            "--ballast-gib", str(gib), *(["--split", split] if split else [])]


def job(argv: list[str], log: Path, pos_run: bool) -> subprocess.Popen:
    """The job in a session of its own, its standard error appended to `log`."""
    return subprocess.Popen([*POS, "run", "--", *argv] if pos_run else argv, cwd=ROOT,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=open(log, "ab"), start_new_session=True)


def reference(images: Path, gib: float, split: str) -> Path:
    ref = images / f"ref-{split or 'one'}.log"
    if ref.exists():        # one uninterrupted run of each job will do
        return ref
    subprocess.run(det(ref, gib, split), cwd=ROOT, timeout=400, capture_output=True)
    return ref


def stall(lines: LineTimes, start: float) -> Optional[float]:
    """The longest step gap after `start` less the median step before it."""
    lines.stop = True
    lines.thread.join()
    gaps = [(a, b - a) for a, b in zip(lines.times, lines.times[1:])]
    before = [g for a, g in gaps if a + g < start]
    during = [g for a, g in gaps if a + g >= start]
    if not before or not during:
        return None
    return round(max(during) - statistics.median(before), 3)


def same_steps(ref: Path, log: Path, res: dict[str, Any], timeout: float) -> None:
    """Once the job has ended (its last line written), every line against the uninterrupted
    run's line for that step: steps run again after a restore (those the job ran between the
    checkpoint and the kill) must give the same line again."""
    want = ref.read_text().splitlines()
    t = time.monotonic()
    while time.monotonic() - t < timeout and not log.read_text().endswith(want[-1] + "\n"):
        time.sleep(0.2)
    got = log.read_text().splitlines()
    by_step = {ln.split()[0]: ln for ln in want}
    wrong = [ln for ln in got if by_step.get(ln.split()[0]) != ln]
    res["lines"] = [len(want), len(got)]
    res["bit_exact"] = not wrong and set(by_step) <= {ln.split()[0] for ln in got}
    res["first_diff"] = wrong[:1] or None


def on_gpus(pid: int) -> dict[str, float]:
    """GPU index -> GiB the process holds there (NVML)."""
    index = {g.uuid: g.index for g in nvml.gpus()}
    return {str(index[u]): round(m / 2**30, 2) for u, m in nvml.gpus_of([pid]).items()}


def row(case: str, res: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"case": case, "gpus": 2, "bit_exact": res.get("bit_exact"), "refused": None,
            "stw_stall_s": None, "first_step_s": None, **kw, "detail": res}


def migrate(out: Path, images: Path, gib: float) -> list[dict[str, Any]]:
    ref = reference(images, gib, "")
    rows = []
    for way in ("stw", "concurrent"):
        log = images / f"migrate-{way}.log"
        log.unlink(missing_ok=True)
        p = job(det(log, gib), out / f"migrate-{way}-job.log", pos_run=way == "concurrent")
        res: dict[str, Any] = {"ballast_gib": gib}
        lines = LineTimes(log)
        try:
            wait_lines(log, 60, p)
            time.sleep(random.uniform(0, 0.5))
            res["before"] = on_gpus(p.pid)
            if way == "concurrent":      # the job ends and comes back with its PID, which its
                threading.Thread(target=p.wait, daemon=True).start()   # zombie would hold
            t = time.monotonic()
            res["migrate"] = pos_cmd("migrate", str(p.pid), "--to-gpu", "1", "--json",
                                     *(["--concurrent"] if way == "concurrent" else []))
            report = res["migrate"].get("report") or {}
            pid = report.get("restored_pid") or p.pid
            time.sleep(1)
            res["after"] = on_gpus(pid)
            compare_when_done(ref, log, res, 120)
            first = None
            if way == "concurrent" and "timings" in report:
                restore_at = t + report["timings"]["checkpoint"]
                first = next((round(x - restore_at, 3) for x in lines.times if x > restore_at),
                             None)
            rows.append(row(f"migrate-{way}", res, stall_s=stall(lines, t), first_step_s=first,
                            moved=res["after"].keys() == {"1"}))
        finally:
            kill(p)
            subprocess.run(["pkill", "-9", "-f", str(log)])
    rows[1]["stw_stall_s"] = rows[0]["stall_s"]
    return rows


def split(out: Path, images: Path, gib: float) -> list[dict[str, Any]]:
    rows = [split_stw(out, images, gib, way) for way in ("host", "p2p")]
    return rows + split_concurrent(out, images, gib, rows[0].get("stall_s"))


def split_stw(out: Path, images: Path, gib: float, way: str) -> dict[str, Any]:
    """Stop-the-world: checkpoint from outside, SIGKILL, restore with the GPUs swapped."""
    ref = reference(images, gib, way)
    log, d = images / f"split-{way}.log", images / f"split-{way}-img"
    log.unlink(missing_ok=True)
    p = job(det(log, gib, way), out / f"split-{way}-job.log", pos_run=False)
    res: dict[str, Any] = {"ballast_gib_on_gpu1": gib, "activations": way}
    lines = LineTimes(log)
    try:
        wait_lines(log, 60, p)
        time.sleep(random.uniform(0, 0.5))
        res["before"] = on_gpus(p.pid)
        t = time.monotonic()
        res["checkpoint"] = pos_cmd("checkpoint", str(p.pid), "-D", str(d), "--leave-running",
                                    "--json", timeout=150)
        if res["checkpoint"]["rc"] == 2:              # refused before the job was touched
            same_steps(ref, log, res, 120)            # it runs on, untouched
            err = res["checkpoint"]["err"].strip().splitlines()
            return row("two-gpu-process-stw", res, stall_s=None, variant=way, bit_exact=None,
                       refused=err[-1].removeprefix("Error: ") if err else "",
                       ran_on_bit_exact=res.get("bit_exact"))
        if res["checkpoint"]["rc"] != 0:
            res["job_state"] = processes()[-1500:]
            return row("two-gpu-process-stw", res, stall_s=None, bit_exact=False, variant=way)
        time.sleep(1)
        held = stall(lines, t)
        kill(p)
        back = LineTimes(log)
        t1 = time.monotonic()
        res["restore"] = pos_cmd("restore", "-D", str(d), "--to-gpu", "0=1,1=0", "--json",
                                 timeout=150)
        first = back.first(timeout=60) if res["restore"]["rc"] == 0 else None
        pid = (res["restore"].get("report") or {}).get("restored_pid")
        res["after"] = on_gpus(int(pid)) if pid else {}
        same_steps(ref, log, res, 60 if first is not None else 1)
        back.stop = True
        return row("two-gpu-process-stw", res, stall_s=held, variant=way,
                   first_step_s=round(first, 3) if first is not None else None,
                   restore_wall_s=round(time.monotonic() - t1, 1),
                   swapped=(res["before"].get("1", 0) > res["before"].get("0", 0)
                            and res["after"].get("0", 0) > res["after"].get("1", 0)))
    finally:
        kill(p)
        subprocess.run(["pkill", "-9", "-f", str(log)])
        subprocess.run(["rm", "-rf", str(d)])


def split_concurrent(out: Path, images: Path, gib: float,
                     stw: Optional[float]) -> list[dict[str, Any]]:
    ref = reference(images, gib, "host")
    # concurrent: a `pos run` job on two GPUs
    log = images / "split-conc.log"
    log.unlink(missing_ok=True)
    p = job(det(log, gib, "host"), out / "split-conc-job.log", pos_run=True)
    res: dict[str, Any] = {}
    try:
        wait_lines(log, 60, p)
        res["checkpoint"] = pos_cmd("checkpoint", str(p.pid), "-D", str(images / "split-c"),
                                    "--concurrent", "--leave-running", "--json", timeout=150)
        compare_when_done(ref, log, res, 120)        # the job runs on, untouched
        err = res["checkpoint"]["err"].strip().splitlines()
        refused = (err[-1].removeprefix("Error: ") if res["checkpoint"]["rc"] == 2 and err
                   else None)
        return [row("two-gpu-process-concurrent", res, stall_s=None, refused=refused,
                    ran_on_bit_exact=res.get("bit_exact"),
                    bit_exact=None if refused else res.get("bit_exact"), stw_stall_s=stw)]
    finally:
        kill(p)
        subprocess.run(["pkill", "-9", "-f", str(log)])


def ddp(out: Path, cases: str, engines: str, gib: float) -> list[dict[str, Any]]:
    """bench/ddp.py on two GPUs: for each launcher case, the job (with `gib` of ballast on each
    rank) checkpointed by each engine (`ddp-stw`, `ddp-concurrent`: under `pos run`), killed
    and restored."""
    target = out / "ddp.json"
    r = subprocess.run([PY, "bench/ddp.py", "--python", PY, "--backend", "nccl", "--width",
                        "4096", "--steps", "150", "--at", "15", "--sleep", "0.1", "--cases",
                        cases, "--engines", engines, "--ballast-gib", str(gib),
                        "--out", str(target)],     # its output straight to a file: a run
                       cwd=ROOT, stdout=open(out / "ddp.log", "w"),   # cut short keeps it
                       stderr=subprocess.STDOUT, timeout=560)
    if r.returncode != 0 or not target.exists():
        return [{"case": "ddp", "gpus": 2, "bit_exact": False, "refused": None,
                 "error": (out / "ddp.log").read_text()[-3000:]}]
    found = json.loads(target.read_text())["rows"]
    stw = {d["variant"]: d.get("stall_s") for d in found if d["case"] == "ddp-stw"}
    return [{"case": d["case"], "gpus": 2, "bit_exact": d.get("bit_exact", False),
             "stall_s": d.get("stall_s"), "stw_stall_s": stw.get(d["variant"]),
             "first_step_s": d.get("first_step_s"), "refused": d.get("refused"),
             "variant": d["variant"], "detail": d} for d in found]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--images", default="/dev/shm/pos-multigpu")
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--parts", default="ddp,split,migrate")
    ap.add_argument("--ddp-cases", default="direct-nolibuv,torchrun-nouring")
    ap.add_argument("--ddp-engines", default="stw,concurrent")
    ap.add_argument("--ddp-gib", type=float, default=0.0, help="ballast on each DDP rank")
    a = ap.parse_args()
    out, images = Path(a.out), Path(a.images)
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(["rm", "-rf", str(images)])
    images.mkdir(parents=True)
    info = machine()
    info["gpus"] = [f"{g.index}: {g.name} {g.uuid}" for g in nvml.gpus()]
    if len(nvml.gpus()) < 2:
        raise SystemExit(f"{len(nvml.gpus())} GPU(s) here: this bench needs two")
    parts = {"migrate": lambda: migrate(out, images, a.gib),
             "split": lambda: split(out, images, a.gib), "ddp": lambda: ddp(out, a.ddp_cases, a.ddp_engines, a.ddp_gib)}
    rows: list[dict[str, Any]] = []
    for name in a.parts.split(","):
        t = time.monotonic()
        try:
            got = parts[name]()
        except Exception as e:       # keep the other parts' rows
            got = [{"case": name, "error": repr(e), "left": processes()}]
        for r in got:
            r.update(date=info["date"], driver=info["driver"], commit=info["commit"],
                     gpu=info["gpu"], part_s=round(time.monotonic() - t, 1))
        rows.extend(got)
        (out / "multigpu.json").write_text(json.dumps(rows, indent=1) + "\n")
        print(json.dumps([{k: r.get(k) for k in ("case", "bit_exact", "stall_s", "stw_stall_s",
                                                 "first_step_s", "refused")} for r in got]),
              flush=True)
    (out / "machine.json").write_text(json.dumps(info, indent=1) + "\n")


if __name__ == "__main__":
    main()
