#!/usr/bin/env python3
"""image_checksum: how fast an image's checksums are computed, sha256 against fold64 on the same
files (the production code, imported: pos/image/filehash.py).

sha256:      format 2's checksum, still read: sha256 of every 64 MiB chunk of every file on a
             pool of os.cpu_count() threads, read with preadv into reusable buffers.
fold64:      format 3's, written since: the same chunks, pool and reads, hashed by pos's 64-bit
             fold (pos/image/chunks.c) seeded with each chunk's length and index.
fold64-mmap: the way of reading not taken: each chunk folded in one call straight from an mmap
             of its file (its pages mapped first with MADV_POPULATE_READ), no copy into a
             buffer. The same digests as fold64 (checked).
(The whole-file sha256 of format 1 against format 2's chunks: bench/results/2026-11-23.)

The synthetic image lives in a temporary folder: one pages-1.img of --gib GiB and 40 small files
(CRIU's core-*, mm-*, ...). Contents are random blocks (neither hash's speed depends on them),
pages-1.img written --write-kib at a time: how a file was written decides how the page cache
holds it, which changes what reading it from an mmap costs.
Rounds alternate the methods; the median of each is reported, and fold64's speed-up over sha256
as the ratio of the medians, in wall-clock seconds and in the CPU seconds of the process (all its
threads: on a machine that other work shares, the cost of the method itself). Warm by default (the files are in the page cache, as right after a
dump); --cold drops the page cache before every measurement (root), as a restore from disk
sees it.

USAGE: .venv/bin/python bench/image_checksum.py [--gib 4] [--rounds 5] [--cold] [--dir TMPDIR]
       [--read-kib N] [--write-kib 16384] [--out bench/results/image-checksum-<host>.json]
"""

import argparse
import json
import mmap
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pos import image  # noqa: E402
from pos.image import filehash  # noqa: E402
from pos.image.checksum import fold  # noqa: E402

Digests = dict[str, list[bytes]]
POPULATE = getattr(mmap, "MADV_POPULATE_READ", 22)      # Linux 5.14


def by(how: filehash.Hash) -> Callable[[Path, list[str]], Digests]:
    """The chunk digests of the files by `how`, as verify computes them."""
    def run(folder: Path, names: list[str]) -> Digests:
        files = {n: ((folder / n).stat().st_size, how) for n in names}
        return filehash.chunk_digests(folder, files, image.CHUNK_BYTES)
    return run


def fold64_mmap(folder: Path, names: list[str]) -> Digests:
    """fold64's chunk digests, each chunk folded in one call from an mmap of its file."""
    chunk = image.CHUNK_BYTES
    maps = {}
    for n in names:
        with open(folder / n, "rb") as f:
            maps[n] = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)

    def one(task: tuple[str, int, int]) -> bytes:
        name, at, length = task
        maps[name].madvise(POPULATE, at, length)
        view = np.frombuffer(maps[name], np.uint8, length, at)
        return fold(view, filehash.fold_seed(length, at // chunk)).to_bytes(8, "big")

    tasks = [(n, at, min(chunk, len(m) - at)) for n, m in maps.items()
             for at in range(0, len(m), chunk)]
    try:
        with ThreadPoolExecutor(max_workers=filehash.workers()) as pool:
            digests = list(pool.map(one, tasks))
    finally:
        for m in maps.values():
            m.close()
    out: Digests = {n: [] for n in names}
    for (n, _at, _len), d in zip(tasks, digests):
        out[n].append(d)
    return out


METHODS: dict[str, tuple[str, Callable[[Path, list[str]], Digests]]] = {
    "sha256": ("sha256 per chunk, preadv into reusable buffers (format 2)",
               by(filehash.SHA256)),
    "fold64": ("fold64 per chunk, preadv into reusable buffers (format 3)",
               by(filehash.FOLD64)),
    "fold64-mmap": ("fold64 per chunk, one call over an mmap of the file (not taken)",
                    fold64_mmap),
}


def make_image(folder: Path, gib: float, write_bytes: int) -> list[str]:
    """pages-1.img of `gib` GiB, written `write_bytes` at a time, plus 40 small files; their
    names."""
    block = os.urandom(16 << 20)
    size = int(gib * (1 << 30))
    with open(folder / "pages-1.img", "wb", buffering=0) as f:
        left, at = size, 0
        while left:
            n = f.write(block[at:at + min(write_bytes, left, len(block) - at)])
            left, at = left - n, (at + n) % len(block)
    names = ["pages-1.img"]
    for i in range(40):
        name = f"small-{i:02d}.img"
        (folder / name).write_bytes(os.urandom(4096 * (1 + i % 7)))
        names.append(name)
    return names


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


def timed(fn: Callable[[], object], cold: bool) -> tuple[float, float]:
    """fn's wall-clock and CPU seconds (the process's, every thread's)."""
    if cold:
        drop_caches()
    t, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - cpu


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "n/a"


def main() -> int:
    host = socket.gethostname().split(".")[0]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=4.0, help="size of pages-1.img [4]")
    p.add_argument("--rounds", type=int, default=5, help="alternations of the methods [5]")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each run")
    p.add_argument("--dir", help="where the temporary image goes [the system's temp folder]")
    p.add_argument("--read-kib", type=int, default=filehash.READ_BYTES >> 10,
                   help=f"the preadv buffer of a worker [{filehash.READ_BYTES >> 10}]")
    p.add_argument("--write-kib", type=int, default=16 << 10,
                   help="the writes that make pages-1.img [16384]")
    p.add_argument("--out", default=str(ROOT / f"bench/results/image-checksum-{host}.json"))
    a = p.parse_args()
    if a.gib <= 0 or a.rounds < 1 or a.read_kib < 1 or a.read_kib % 4 \
            or not 1 <= a.write_kib <= 16 << 10:
        p.error("--gib must be positive, --rounds at least 1, --read-kib a multiple of 4, "
                "--write-kib 1 to 16384")
    if a.cold and os.geteuid() != 0:
        p.error("--cold drops the page cache, which needs root")
    filehash.READ_BYTES = a.read_kib << 10
    load_before = os.getloadavg()
    seconds: dict[str, list[float]] = {m: [] for m in METHODS}
    cpu: dict[str, list[float]] = {m: [] for m in METHODS}
    with tempfile.TemporaryDirectory(prefix="pos-bench-image-", dir=a.dir) as tmp:
        folder = Path(tmp)
        names = make_image(folder, a.gib, a.write_kib << 10)
        total = sum((folder / n).stat().st_size for n in names)
        first = {m: run(folder, names) for m, (_what, run) in METHODS.items()}   # warm all
        if first["fold64"] != first["fold64-mmap"]:
            raise SystemExit("fold64 from an mmap gave other digests than through preadv")
        for _ in range(a.rounds):
            for m, (_what, run) in METHODS.items():
                wall, used = timed(lambda: run(folder, names), a.cold)
                seconds[m].append(wall)
                cpu[m].append(used)
    medians = {m: statistics.median(s) for m, s in seconds.items()}
    cpu_medians = {m: statistics.median(s) for m, s in cpu.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip() or "n/a"
    out = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python bench/image_checksum.py " + " ".join(sys.argv[1:]),
        "commit": commit,
        "machine": {"host": host, "cpu": cpu_model(), "cores": os.cpu_count(),
                    "kernel": platform.release(), "python": platform.python_version(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "image": {"bytes": total, "files": len(names), "largest": "pages-1.img",
                  "written_bytes_at_a_time": a.write_kib << 10},
        "page_cache": "cold" if a.cold else "warm",
        "chunk_bytes": image.CHUNK_BYTES, "read_bytes": filehash.READ_BYTES,
        "workers": filehash.workers(),
        "methods": {m: {"what": what, "seconds": seconds[m], "median_s": medians[m],
                        "gb_per_s": total / medians[m] / 1e9, "cpu_seconds": cpu[m],
                        "cpu_median_s": cpu_medians[m]}
                    for m, (what, _run) in METHODS.items()},
        "fold64_over_sha256": medians["sha256"] / medians["fold64"],
        "fold64_over_sha256_cpu": cpu_medians["sha256"] / cpu_medians["fold64"],
        "mmap_over_preadv": medians["fold64"] / medians["fold64-mmap"],
        "mmap_over_preadv_cpu": cpu_medians["fold64"] / cpu_medians["fold64-mmap"],
    }
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    speeds = ", ".join(f"{m} {v['gb_per_s']:.2f} GB/s" for m, v in out["methods"].items())
    print(f"{total / 2**30:.2f} GiB in {len(names)} files, {os.cpu_count()} cores, page cache "
          f"{out['page_cache']}: {speeds}; fold64 x{out['fold64_over_sha256']:.2f} sha256 "
          f"(CPU x{out['fold64_over_sha256_cpu']:.2f}), mmap x{out['mmap_over_preadv']:.2f} "
          f"preadv (CPU x{out['mmap_over_preadv_cpu']:.2f}) -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
