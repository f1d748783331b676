"""How fast a file of a tmpfs is read back, the first time after it was written and the next
times, two ways. pos hashes the job's own memory as it writes it into the image, so the seal no
longer reads those files back; the restore that follows then reads them first, and its fill
measured slower (bench/results/2026-12-01.md). The restore reads with preadv into page-locked
memory; a mapping of the file copied from instead is the other way.

    python3 bench/tmpfs_read_probe.py [--dir /dev/shm] [--gib 2] [--rounds 3] [--wait 0,8]
                                      [--ways preadv,mmap] [--threads 1] [--out FILE]

Each round, for each way and wait: a file of GIB written with write() 64 MiB at a time, the
wait, then read three times over, 64 MiB at a time on the threads (each its own share of the
file): `preadv` into a buffer of each thread's; `mmap`, the whole file mapped once (shared,
read-only) and each 64 MiB copied out of the mapping into that buffer, its pages faulted in as
the copy reaches them. The GB/s of each read. One JSON document.
"""

import argparse
import json
import mmap
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

PIECE = 64 << 20


def written(path: Path, size: int, data: bytes) -> None:
    with open(path, "wb", buffering=0) as f:
        for _ in range(size // PIECE):
            view = memoryview(data)
            while view:
                view = view[f.write(view) or 0:]


def read_gbps(path: Path, size: int, way: str, threads: int) -> float:
    """The whole file read once, `way`, on `threads` threads; GB/s."""
    fd = os.open(path, os.O_RDONLY)
    mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) if way == "mmap" else None
    whole = np.frombuffer(mapped, np.uint8) if mapped is not None else None
    pieces = list(range(size // PIECE))

    def part(k: int) -> None:
        into = np.empty(PIECE, np.uint8)
        for i in pieces[k::threads]:
            if whole is None:
                os.preadv(fd, [into], i * PIECE)
            else:
                np.copyto(into, whole[i * PIECE:(i + 1) * PIECE])

    try:
        t = time.monotonic()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(part, range(threads)))
        return size / (time.monotonic() - t) / 1e9
    finally:
        del whole
        if mapped is not None:
            mapped.close()
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    ap.add_argument("--gib", type=float, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--wait", default="0,8", help="seconds between the write and the reads")
    ap.add_argument("--ways", default="preadv,mmap")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    size = int(a.gib * (1 << 30)) // PIECE * PIECE
    data = os.urandom(PIECE)
    rows = []
    for r in range(a.rounds):
        for way in a.ways.split(","):
            for wait in (float(w) for w in a.wait.split(",")):
                path = a.dir / f"pos-tmpfs-read-{os.getpid()}"
                try:
                    written(path, size, data)
                    time.sleep(wait)
                    reads = [round(read_gbps(path, size, way, a.threads), 2) for _ in range(3)]
                finally:
                    path.unlink(missing_ok=True)
                rows.append({"round": r, "way": way, "wait_s": wait, "reads_gbps": reads})
                print(json.dumps(rows[-1]), flush=True)
    doc = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "host": f"{platform.node()}, {os.cpu_count()} cores", "kernel": platform.release(),
           "dir": str(a.dir), "bytes": size, "threads": a.threads, "rows": rows}
    if a.out:
        a.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
