#!/usr/bin/env python3
"""image_checksum: how fast an image's checksums are computed, the old way against the new.

old: sha256 of each whole file, files spread over threads (what pos/image did until
     format 2). A CRIU image is one huge pages-*.img and a few small files, so one thread does
     nearly all of it: 21 s for 17.4 GiB on the H100 host.
new: image.checksums(): sha256 of every 64 MiB chunk of every file on a pool of os.cpu_count()
     threads, read with preadv into reusable buffers (the production code, imported).

The synthetic image lives in a temporary folder: one pages-1.img of --gib GiB and 40 small files
(CRIU's core-*, mm-*, ...). Contents are random blocks (sha256's speed does not depend on them).
Rounds alternate old and new; the median of each is reported. Warm by default (the files are in
the page cache, as right after a dump); --cold drops the page cache before every measurement
(root), as a restore from disk sees it.

USAGE: .venv/bin/python bench/image_checksum.py [--gib 4] [--rounds 3] [--cold] [--dir TMPDIR]
       [--out bench/results/image-checksum-<host>.json]
"""

import argparse
import hashlib
import json
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pos import image  # noqa: E402

OLD_READ = 8 << 20


def old_sha256(path: Path) -> str:
    """The format-1 checksum: sha256 of the whole file, read 8 MiB at a time, one thread."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(OLD_READ)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def old_checksums(folder: Path, names: list[str]) -> list[str]:
    """What format 1 did: whole files, in parallel over at most 8 threads."""
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda n: old_sha256(folder / n), names))


def new_checksums(folder: Path, names: list[str]) -> dict:
    return image.checksums(folder, names, image.CHUNK_BYTES)


def make_image(folder: Path, gib: float) -> list[str]:
    """pages-1.img of `gib` GiB plus 40 small files; their names."""
    block = os.urandom(16 << 20)
    size = int(gib * (1 << 30))
    with open(folder / "pages-1.img", "wb", buffering=0) as f:
        left = size
        while left:
            left -= f.write(block[:min(len(block), left)])
    names = ["pages-1.img"]
    for i in range(40):
        name = f"small-{i:02d}.img"
        (folder / name).write_bytes(os.urandom(4096 * (1 + i % 7)))
        names.append(name)
    return names


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


def timed(fn: Callable[[], object], cold: bool) -> float:
    if cold:
        drop_caches()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


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
    p.add_argument("--rounds", type=int, default=3, help="old/new alternations [3]")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each run")
    p.add_argument("--dir", help="where the temporary image goes [the system's temp folder]")
    p.add_argument("--out", default=str(ROOT / f"bench/results/image-checksum-{host}.json"))
    a = p.parse_args()
    if a.gib <= 0 or a.rounds < 1:
        p.error("--gib must be positive and --rounds at least 1")
    if a.cold and os.geteuid() != 0:
        p.error("--cold drops the page cache, which needs root")
    with tempfile.TemporaryDirectory(prefix="pos-bench-image-", dir=a.dir) as tmp:
        folder = Path(tmp)
        names = make_image(folder, a.gib)
        total = sum((folder / n).stat().st_size for n in names)
        new_checksums(folder, names)                   # warm the page cache and the pool
        old_s, new_s = [], []
        for _ in range(a.rounds):
            old_s.append(timed(lambda: old_checksums(folder, names), a.cold))
            new_s.append(timed(lambda: new_checksums(folder, names), a.cold))
    old_m, new_m = statistics.median(old_s), statistics.median(new_s)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip() or "n/a"
    out = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python bench/image_checksum.py " + " ".join(sys.argv[1:]),
        "commit": commit,
        "machine": {"host": host, "cpu": cpu_model(), "cores": os.cpu_count(),
                    "kernel": platform.release(), "python": platform.python_version()},
        "image": {"bytes": total, "files": len(names), "largest": "pages-1.img"},
        "page_cache": "cold" if a.cold else "warm",
        "old": {"what": "whole-file sha256, one thread per file", "seconds": old_s,
                "median_s": old_m, "gb_per_s": total / old_m / 1e9},
        "new": {"what": "sha256 per chunk on a thread pool", "chunk_bytes": image.CHUNK_BYTES,
                "read_bytes": image.READ_BYTES, "workers": image.workers(), "seconds": new_s,
                "median_s": new_m, "gb_per_s": total / new_m / 1e9},
        "speedup": old_m / new_m,
    }
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"{total / 2**30:.2f} GiB in {len(names)} files, {os.cpu_count()} cores, page cache "
          f"{out['page_cache']}: old {out['old']['gb_per_s']:.2f} GB/s, new "
          f"{out['new']['gb_per_s']:.2f} GB/s ({image.workers()} workers), x{out['speedup']:.2f}"
          f" -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
