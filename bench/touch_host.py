"""Touch most of the host's free memory once, then give it back, before a run that compares two
commits. On freshly started GPU machines, whichever tree ran first copied off the GPU at about
half the rate and was held longer in CRIU's dump (bench/results/2026-11-29.md). One cause this
can show: memory that no one has written since the machine started. A virtual machine's memory
may be backed only when first written, so a first run would pay for that.

    python3 bench/touch_host.py [--gib N] [--keep-gib 8] [--threads 16] [--out FILE]

Writes every page of N GiB (default: all available memory but --keep-gib), in 1 GiB pieces
across the threads, twice (the first pass's rate against the second's is the first touch's
cost), and frees it. Prints and writes one JSON line.
"""

import argparse
import ctypes
import json
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PIECE = 1 << 30


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def write_all(m: mmap.mmap, size: int, threads: int, value: int) -> float:
    """Seconds to write `value` into every byte of the mapping, a piece a task."""
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    t = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda at: ctypes.memset(base + at, value, min(PIECE, size - at)),
                      range(0, size, PIECE)))
    return time.monotonic() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float)
    ap.add_argument("--keep-gib", type=float, default=8.0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    avail = available_bytes()
    size = int(a.gib * 2**30) if a.gib else avail - int(a.keep_gib * 2**30)
    size = max(PIECE, min(size, avail - PIECE)) // PIECE * PIECE
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    first = write_all(m, size, a.threads, 1)
    second = write_all(m, size, a.threads, 2)
    t = time.monotonic()
    m.close()
    freed = time.monotonic() - t
    row = {"gib": size / 2**30, "available_gib": round(avail / 2**30, 2), "threads": a.threads,
           "first_s": round(first, 3), "first_gbps": round(size / first / 1e9, 2),
           "second_s": round(second, 3), "second_gbps": round(size / second / 1e9, 2),
           "free_s": round(freed, 3)}
    text = json.dumps(row)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
