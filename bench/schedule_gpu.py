"""Cron-scheduled snapshots of a PyTorch job on the GPU, then a restore of every kept image.

Run on the GPU host from the project root, as root, after `source .device/setup.sh`:
    python3 bench/schedule_gpu.py --minutes 5 --out bench/results/2026-11-23/schedule-h100.json
  1. starts workloads/train_det.py (heartbeat file, --ballast-gib of device memory);
  2. `pos schedule add --cron '* * * * *' --match <its heartbeat path> --engine auto --keep K
     --leave-running`, then `pos daemon` for --minutes (progress every 30 s; the job must keep
     beating); scrapes the metrics endpoint; SIGTERM, the daemon must exit 0;
  3. every run must be `ok` with engine `driver`; retention must have left K images;
  4. each kept image, one at a time: kill the job, `pos restore`, the job must beat again, kill;
  5. writes JSON (device, driver, date, command, runs, restores, metrics) to --out.
Any failure exits non-zero with FAILED: and what was seen.
"""

import argparse
import ctypes
import datetime
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pos import image  # noqa: E402
from pos import nvml  # noqa: E402
from pos.cron import retention  # noqa: E402
from pos.process import procs  # noqa: E402
from pos.store import schedules  # noqa: E402
from pos.store.db import open_db  # noqa: E402

JOB = ROOT / "workloads" / "train_det.py"


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def fail(msg: str) -> None:
    sys.exit(f"FAILED: {msg}")


def pos(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "pos.cli", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=1200)
    if r.returncode != 0:
        fail(f"pos {' '.join(args)} (exit {r.returncode})\n{r.stdout}{r.stderr}")
    return r.stdout


def beats(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def wait_beating(path: Path, timeout: float, what: str) -> None:
    start = beats(path)
    deadline = time.monotonic() + timeout
    while beats(path) <= start + 3:
        if time.monotonic() > deadline:
            fail(f"{what}: {path} stopped at {beats(path)} lines")
        time.sleep(0.05)


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    procs.wait_gone(pid, 30)
    try:
        os.waitpid(pid, 0)       # ours: the original job, or a restored one (we are subreaper)
    except ChildProcessError:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--minutes", type=int, default=5, help="how long the schedule runs")
    a.add_argument("--keep", type=int, default=3, help="retention: images kept")
    a.add_argument("--ballast-gib", type=float, default=2.0, help="device memory of the job")
    a.add_argument("--work", type=Path, default=Path("/tmp/pos-schedule-bench"),
                   help="images, store and logs (emptied first, deleted at the end)")
    a.add_argument("--out", type=Path, required=True, help="JSON results file")
    args = a.parse_args()
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)    # restored jobs come back to us to be reaped
    gpus = nvml.gpus()
    if not gpus:
        fail("NVML sees no GPU")
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    db, root, beat = args.work / "pos.db", args.work / "images", args.work / "beat"
    job = subprocess.Popen([sys.executable, str(JOB), str(beat), "--steps", "0", "--sleep",
                            "0.01", "--ballast-gib", str(args.ballast_gib)],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=open(args.work / "job.stderr", "w"), start_new_session=True)
    pid = job.pid
    daemon = None
    try:
        wait_beating(beat, 300, "the job did not start")
        say(f"job PID {pid} uses {sum(nvml.gpus_of([pid]).values()) / 2**30:.2f} GiB")
        say(pos("schedule", "add", "--cron", "* * * * *", "--match", re.escape(str(beat)),
                "--engine", "auto", "--keep", str(args.keep), "--leave-running",
                "-D", str(root), "--db", str(db)).splitlines()[0])
        port = free_port()
        daemon = subprocess.Popen([sys.executable, "-m", "pos.cli", "daemon", "--db", str(db),
                                   "--metrics-port", str(port)], cwd=ROOT,
                                  stdout=open(args.work / "daemon.log", "w"),
                                  stderr=subprocess.STDOUT)
        end = time.monotonic() + args.minutes * 60
        while time.monotonic() < end:
            time.sleep(min(30, max(0.0, end - time.monotonic())))
            if daemon.poll() is not None:
                fail(f"the daemon ended (exit {daemon.returncode}); see "
                     f"{args.work / 'daemon.log'}")
            runs = schedules.runs(open_db(str(db)), 1)
            wait_beating(beat, 60, "the job stopped beating under the schedule")
            say(f"{len(runs)} run(s): " + ", ".join(
                f"{r.outcome}{'' if r.stall_s is None else f' stall {r.stall_s:.2f}s'}"
                for r in runs[-4:]))
        deadline = time.monotonic() + 600      # let a snapshot in progress end
        while any(r.outcome == "running" for r in schedules.runs(open_db(str(db)), 1)):
            if time.monotonic() > deadline:
                fail("a snapshot did not end within 10 minutes")
            time.sleep(1)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        metrics_lines = [ln for ln in metrics.decode().splitlines() if ln.startswith("pos_")]
        daemon.send_signal(signal.SIGTERM)
        if daemon.wait(timeout=300) != 0:
            fail(f"the daemon exited {daemon.returncode} on SIGTERM")
        runs = schedules.runs(open_db(str(db)), 1)
        rows = [{"scheduled_for": str(r.scheduled_for), "started": str(r.started_at),
                 "ended": str(r.ended_at), "outcome": r.outcome, "engine": r.engine,
                 "bytes": r.bytes, "stall_s": r.stall_s, "coalesced": r.coalesced,
                 "error": r.error} for r in runs]
        bad = [r for r in rows if r["outcome"] != "ok" or r["engine"] != "driver"]
        if bad or len(rows) < args.minutes - 1:
            fail(f"{len(rows)} runs, not all ok with the driver engine: {bad or rows}")
        kept = retention.images_in(root / "1")
        if len(kept) != min(args.keep, len(rows)):
            fail(f"{len(kept)} images kept, expected {min(args.keep, len(rows))}")
        say(f"{len(rows)} snapshots ok, {len(kept)} kept; restoring each")
        restores = []
        for k in kept:
            kill(pid)
            m = image.load(k.path)
            t = time.monotonic()
            out = pos("restore", "-D", str(k.path), "--db", str(db))
            wall = time.monotonic() - t
            pid = m.pid
            wait_beating(beat, 120, f"the job restored from {k.path} does not run")
            say(f"{k.path.name}: restored in {wall:.1f} s, the job beats")
            restores.append({"image": k.path.name, "bytes": k.size, "restore_wall_s": wall,
                             "steps": out.splitlines()[-2], "runs_on": True})
        result = {"device": gpus[0].name, "driver": nvml.driver_version(),
                  "date": datetime.datetime.now(datetime.timezone.utc)
                  .isoformat(timespec="seconds"),
                  "host": platform.node(), "kernel": platform.release(),
                  "command": " ".join([Path(sys.executable).name, *sys.argv]),
                  "minutes": args.minutes, "keep": args.keep, "ballast_gib": args.ballast_gib,
                  "runs": rows, "restores": restores, "metrics": metrics_lines}
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        say(f"wrote {args.out}")
    finally:
        if daemon is not None and daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=300)
        kill(pid)
        shutil.rmtree(args.work / "images", ignore_errors=True)


if __name__ == "__main__":
    main()
