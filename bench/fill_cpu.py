"""The CPU's part of the restore's fill, without a GPU: one pass per piece against three.

    python3 bench/fill_cpu.py [--gib 1] [--threads 1,2] [--piece-kib 2048] [--out FILE]

A restore's fill thread takes each piece of the mapped image, copies it into a pinned slot,
folds it into the chunk's checksum and checks its words for pointers into other buffers
(pos/image/chunks.c). Here the device copy is a no-op, so what is timed is the CPU's work:
  one_pass     pos_fill_chunk: copy, hash and pointer marks in one loop (chunks.c: pass)
  three_pass   the same library's functions one after another on each piece: memmove into
               the slot, pos_fold over it, pos_point over it (the fill of 2026-11-25's final tree)
  copy         the memmove alone: the floor
GB/s of image bytes, best of three, on a file in /dev/shm (page cache), for each thread count;
the ratio one_pass / three_pass is the figure to compare across machines."""

import argparse
import ctypes as C
import json
import mmap
import os
import platform
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from pos.concurrent.gpucopy import Ring
from pos.image import gpu as gpuimage

LIB = gpuimage._lib
NOOP = C.cast(C.CDLL(None).sched_yield, C.c_void_p).value   # returns 0, ignores its arguments


def ranges(k: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """k buffers' address ranges high in the address space, as the agent places them."""
    starts = np.arange(k, dtype=np.uint64) * np.uint64(1 << 30) + np.uint64(0x7000_0000_0000)
    return starts, starts + np.uint64(1 << 29)


def one_pass(src: int, n: int, piece: int, starts: np.ndarray, ends: np.ndarray) -> None:
    depth = 4
    slots = np.empty(piece * depth, np.uint8)
    events, pending = (C.c_void_p * depth)(), (C.c_ubyte * depth)()
    ring = Ring(slots.ctypes.data, piece, depth, C.addressof(events), C.addressof(pending), None,
                NOOP, NOOP, NOOP, 0, 0)
    hits, h = np.zeros(len(starts), np.uint8), C.c_uint64()
    got = LIB.pos_fill_chunk(C.addressof(ring), -1, src, 0, n, 0, starts.ctypes.data,
                             ends.ctypes.data, len(starts), hits.ctypes.data, C.byref(h))
    assert got == n, got


def three_pass(src: int, n: int, piece: int, starts: np.ndarray, ends: np.ndarray,
               hash_and_point: bool = True) -> None:
    slot = np.empty(piece, np.uint8)
    hits = np.zeros(len(starts), np.uint8)
    h = n
    for at in range(0, n, piece):
        m = min(piece, n - at)
        C.memmove(slot.ctypes.data, src + at, m)
        if hash_and_point:
            h = LIB.pos_fold(slot.ctypes.data, m, h)
            LIB.pos_point(slot.ctypes.data, m // 8, starts.ctypes.data, ends.ctypes.data,
                          len(starts), hits.ctypes.data)


def rate(fn: Callable[..., None], base: int, n: int, threads: int, piece: int) -> float:
    """GB/s of n bytes at base, split between `threads` threads, best of three."""
    starts, ends = ranges()
    share = n // threads // piece * piece
    best = 0.0
    for _ in range(3):
        ts = [threading.Thread(target=fn, args=(base + i * share, share, piece, starts, ends))
              for i in range(threads)]
        t = time.perf_counter()
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        best = max(best, share * threads / (time.perf_counter() - t) / 1e9)
    return round(best, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--piece-kib", type=int, default=2048)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    n, piece = int(a.gib * 2**30) // 32 * 32, a.piece_kib << 10
    path = Path(f"/dev/shm/pos-fill-cpu-{os.getpid()}")
    try:
        with open(path, "wb") as f:       # random words: few read as pointers, as in an image
            for at in range(0, n, 1 << 26):
                f.write(np.random.default_rng(at).bytes(min(1 << 26, n - at)))
        fd = os.open(path, os.O_RDONLY)
        m = mmap.mmap(fd, n, prot=mmap.PROT_READ)
        os.close(fd)
        view = np.frombuffer(m, np.uint8)
        base = view.ctypes.data
        res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
                     "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                     "bytes": n, "piece": piece, "rows": []}
        for threads in (int(t) for t in a.threads.split(",")):
            row = {"threads": threads,
                   "one_pass_gbps": rate(one_pass, base, n, threads, piece),
                   "three_pass_gbps": rate(three_pass, base, n, threads, piece),
                   "copy_gbps": rate(lambda *x: three_pass(*x, hash_and_point=False), base, n,
                                     threads, piece)}
            row["one_over_three"] = round(row["one_pass_gbps"] / row["three_pass_gbps"], 2)
            res["rows"].append(row)
            print(json.dumps(row))
        del view
        m.close()
    finally:
        path.unlink(missing_ok=True)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
