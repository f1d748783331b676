"""Stop-the-world baseline of full-process checkpoint/restore on the GPU (driver API + CRIU).

Run on the GPU host from the project root, as root, after `source .device/setup.sh`:
    python3 bench/checkpoint_gpu.py --sizes 1,4,16,32 --out bench/results/2026-11-23/checkpoint-h100.json
For each size S (GiB of device memory, random data, in workloads/train_det.py's --ballast-gib):
  1. `pos checkpoint --leave-running`: the stall the job saw (lock -> unlock, from the manifest),
     the time of each step, the wall time of the command and the image size;
  2. the job is killed, `pos restore` from that image: its wall time and steps; the job must run
     on (its heartbeat file grows again);
  3. the image is deleted (a 32 GiB image takes 32+ GB of disk).
Writes JSON (device, driver, date, command, one row per size) and prints a table.
"""

import argparse
import ctypes
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pos import nvml  # noqa: E402
from pos.image import names  # noqa: E402

JOB = ROOT / "workloads" / "train_det.py"


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pos(*args: str) -> tuple[float, str]:
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pos.cli", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=1200)
    wall = time.monotonic() - t
    if r.returncode != 0:
        sys.exit(f"FAILED: pos {' '.join(args)} (exit {r.returncode})\n{r.stdout}{r.stderr}")
    return wall, r.stdout


def heartbeat(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def wait_growing(path: Path, beyond: int, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while heartbeat(path) <= beyond:
        if time.monotonic() > deadline:
            sys.exit(f"FAILED: {what}: {path} stopped at {heartbeat(path)} lines")
        time.sleep(0.05)


def measure(size: float, images: Path, extra: list[str]) -> dict:
    work = images / f"pos-bench-{size:g}g"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    beat, img = work / "beat", work / "img"
    job = subprocess.Popen([sys.executable, str(JOB), str(beat), "--steps", "0", "--sleep",
                            "0.01", "--ballast-gib", str(size)], stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=open(work / "job.stderr", "w"),
                           start_new_session=True)
    try:
        wait_growing(beat, 5, 300, "the job did not start")
        used = nvml.gpus_of([job.pid])
        say(f"{size:g} GiB: job PID {job.pid} uses {sum(used.values()) / 2**30:.2f} GiB; "
            "checkpoint --leave-running")
        ck_wall, _ = pos("checkpoint", str(job.pid), "-D", str(img), "--leave-running",
                         "--db", str(work / "pos.db"), *extra)
        manifest = json.loads((img / names.MANIFEST).read_text())
        wait_growing(beat, heartbeat(beat), 60, "the job did not run on after the checkpoint")
        say(f"{size:g} GiB: checkpoint {ck_wall:.1f} s, stall {manifest['stall_s']:.2f} s, "
            f"image {manifest['size_bytes'] / 2**30:.2f} GiB; kill and restore")
        job.send_signal(signal.SIGKILL)
        job.wait()
        before = heartbeat(beat)
        rs_wall, rs_out = pos("restore", "-D", str(img), "--db", str(work / "pos.db"), "--json")
        wait_growing(beat, before, 120, "the restored job does not run")
        steps = json.loads(rs_out)["timings"]
        say(f"{size:g} GiB: restore {rs_wall:.1f} s ({steps})")
        return {"gib": size, "gpu_bytes_used": sum(used.values()),
                "stall_s": manifest["stall_s"], "checkpoint_wall_s": ck_wall,
                "checkpoint_steps_s": manifest["timings"], "image_bytes": manifest["size_bytes"],
                "restore_wall_s": rs_wall, "restore_steps_s": steps}
    finally:
        for pid in (job.pid,):
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--sizes", default="1,4,16,32", help="GiB of GPU state, comma-separated")
    a.add_argument("--out", type=Path, required=True, help="JSON results file")
    a.add_argument("--images", type=Path, default=Path("/tmp"),
                   help="where the images go (each is deleted after its measurement)")
    a.add_argument("--criu-opt", action="append", default=[],
                   help="extra option for pos checkpoint (e.g. --criu-opt=--shell-job)")
    args = a.parse_args()
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)    # restored jobs come back to us to be reaped
    gpus = nvml.gpus()
    if not gpus:
        sys.exit("FAILED: NVML sees no GPU")
    rows: list[dict] = []
    result = {"device": gpus[0].name, "driver": nvml.driver_version(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "host": platform.node(), "kernel": platform.release(),
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "rows": rows}
    for size in (float(s) for s in args.sizes.split(",")):
        rows.append(measure(size, args.images, args.criu_opt))
        args.out.write_text(json.dumps(result, indent=2) + "\n")   # kept if a later size fails
    print(f"\n{'GiB':>5} {'stall s':>8} {'ckpt s':>8} {'restore s':>9} {'image GiB':>9}")
    for r in rows:
        print(f"{r['gib']:>5g} {r['stall_s']:>8.2f} {r['checkpoint_wall_s']:>8.2f} "
              f"{r['restore_wall_s']:>9.2f} {r['image_bytes'] / 2**30:>9.2f}")
    say(f"wrote {args.out}")


if __name__ == "__main__":
    main()
