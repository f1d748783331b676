"""Where CRIU's frozen dump writes, and what the host's memory holds beside it: CRIU's frozen
dump is the largest part of a concurrent checkpoint's stall (0.34-0.65 s at 30% of an H200,
2026-11-29), and it varies more than the rest. Root, CRIU 4.2:

    python3 bench/criu_dest_probe.py --out DIR [--mib 1400] [--repeat 5] [--fill-gib 60]

A process holding --mib MiB of anonymous memory it wrote (4 KiB pages, as a job's heap) is
dumped with --leave-running, --repeat times into each of:
  shm        a folder in /dev/shm
  staging    a tmpfs mounted as pos's staging for the frozen dump (huge=always:
             pos/concurrent/staging.py)
on the host as it is; then with --fill-gib GiB of files held in /dev/shm beside it (an image in
memory, as a schedule's last one); then once they are removed. Each dump: CRIU's freezing and
frozen time, its memdump and memwrite (its stats-dump), the pages it wrote, the wall time.
Writes DIR/criu-dest.json and prints one line a dump.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pos.image import criustats  # noqa: E402

HOLDER = ("import sys, time\n"
          "b = bytearray(int(sys.argv[1]) << 20)\n"
          "for i in range(0, len(b), 4096):\n"
          "    b[i] = i >> 12 & 255\n"
          "print('ready', flush=True)\n"
          "time.sleep(1e6)\n")


def dump(criu: str, pid: int, folder: Path) -> dict[str, Any]:
    folder.mkdir(mode=0o700)
    t0 = time.monotonic()
    r = subprocess.run([criu, "dump", "-t", str(pid), "-D", str(folder), "-o", "dump.log",
                        "--leave-running"], capture_output=True, text=True)
    wall = time.monotonic() - t0
    stats = criustats.dump_stats(folder)
    shutil.rmtree(folder)
    if r.returncode != 0 or stats is None:
        return {"rc": r.returncode, "wall_s": round(wall, 3), "error": r.stderr[-300:]}
    return {"rc": 0, "wall_s": round(wall, 3),
            "frozen_s": round(stats.freezing_s + stats.frozen_s, 3),
            "memdump_s": round(stats.memdump_s, 3), "memwrite_s": round(stats.memwrite_s, 3),
            "written_mib": round(stats.pages_written * 4096 / 2**20)}


def fill(folder: Path, gib: int) -> float:
    """gib GiB of files in folder, their pages made (fallocate); seconds it took."""
    folder.mkdir(exist_ok=True)
    t0 = time.monotonic()
    for k in range(gib):
        fd = os.open(folder / f"fill-{k}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, 1 << 30)
        finally:
            os.close(fd)
    return time.monotonic() - t0


def meminfo() -> dict[str, int]:
    keep = ("MemFree", "MemAvailable", "Shmem", "ShmemHugePages", "AnonHugePages")
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":")
            if k in keep:
                out[k + "_mib"] = int(v.split()[0]) >> 10
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--mib", type=int, default=1400)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--fill-gib", type=int, default=60)
    a = ap.parse_args()
    criu = os.environ.get("POS_CRIU", "criu")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(a.mib)], stdout=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, start_new_session=True, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
    staging = Path(tempfile.mkdtemp(prefix="pos-criu-dest-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "huge=always,mode=0700", "none",
                    str(staging)], check=True)
    shm = Path(tempfile.mkdtemp(prefix="pos-criu-dest-", dir="/dev/shm"))
    rows: list[dict[str, Any]] = []

    def dumps(phase: str) -> None:
        for i in range(a.repeat):
            for where, root in (("shm", shm), ("staging", staging)):
                r = {"phase": phase, "dest": where, "i": i,
                     **dump(criu, holder.pid, root / f"d{i}")}
                rows.append(r)
                print("row", json.dumps(r), flush=True)

    try:
        info: dict[str, Any] = {"mib": a.mib, "fill_gib": a.fill_gib, "before": meminfo()}
        dumps("as-is")
        info["fill_s"] = round(fill(shm / "held", a.fill_gib), 2)
        info["filled"] = meminfo()
        dumps("beside-held")
        shutil.rmtree(shm / "held")
        info["after"] = meminfo()
        dumps("after-removed")
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
        subprocess.run(["umount", str(staging)])
        staging.rmdir()
        shutil.rmtree(shm, ignore_errors=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "criu-dest.json").write_text(json.dumps({**info, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
