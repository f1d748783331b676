"""How fast a file of a tmpfs is read the first time after it was written, against the next
times. pos now hashes the job's own memory as it writes it into the image, so the seal no longer
reads those files back; the restore that follows then reads them first, and its fill measured
slower (bench/results/2026-12-01.md). This shows whether the first read of freshly written tmpfs
pages costs more whoever makes it, and whether waiting between the write and the read changes
that.

    python3 bench/tmpfs_read_probe.py [--dir /dev/shm] [--gib 2] [--rounds 3] [--wait 0,8]
                                      [--out FILE]

Each round, for each wait: a file of GIB written with write() 64 MiB at a time, the wait, then
read with preadv 64 MiB at a time three times over; the GB/s of each read. One JSON document.
"""

import argparse
import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

PIECE = 64 << 20


def written(path: Path, size: int, data: bytes) -> None:
    with open(path, "wb", buffering=0) as f:
        for _ in range(size // PIECE):
            view = memoryview(data)
            while view:
                view = view[f.write(view) or 0:]


def read_gbps(path: Path, size: int, into: bytearray) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        t = time.monotonic()
        for i in range(size // PIECE):
            os.preadv(fd, [into], i * PIECE)
        return size / (time.monotonic() - t) / 1e9
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    ap.add_argument("--gib", type=float, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--wait", default="0,8", help="seconds between the write and the reads")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    size = int(a.gib * (1 << 30)) // PIECE * PIECE
    data, into = os.urandom(PIECE), bytearray(PIECE)
    rows = []
    for r in range(a.rounds):
        for wait in (float(w) for w in a.wait.split(",")):
            path = a.dir / f"pos-tmpfs-read-{os.getpid()}"
            try:
                written(path, size, data)
                time.sleep(wait)
                reads = [round(read_gbps(path, size, into), 2) for _ in range(3)]
            finally:
                path.unlink(missing_ok=True)
            rows.append({"round": r, "wait_s": wait, "reads_gbps": reads})
            print(json.dumps(rows[-1]), flush=True)
    doc = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "host": f"{platform.node()}, {os.cpu_count()} cores", "kernel": platform.release(),
           "dir": str(a.dir), "bytes": size, "rows": rows}
    if a.out:
        a.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
