"""How fast a checkpoint's page-locked ring drains into an image in memory, on this host, while
the GPU copies into it: the copy off the GPU is bound by that drain (11-14 GB/s into /dev/shm on
the H200 host, 2026-11-29), not by the link (about 55 GB/s). Root, on an NVIDIA GPU:

    python3 bench/drain_probe.py --out DIR [--gib 16] [--ring-gib 8] [--dest /dev/shm]
        [--ways WAY,...]

The engine's copy as pos/concurrent/copier.py makes it: 8 streams copy 64 MiB chunks of device
memory (random bytes) into the slots of one ring (gpucopy.Pinned), and threads take each chunk
off the ring; the chunk's slot is free again once they are done with it. Ways, each over --gib
GiB of device memory, the files in a new folder under each --dest, removed after each way:
  d2h          the slot is free as soon as the chunk is in it: the link's rate through the ring
  hash         the chunk hashed and scanned for 256 buffers' addresses (pos_fold_point) only
  write        the chunk written to the thread's data file only
  overwrite    the same into files as large, written just before: their pages are there
  direct       no ring: the GPU copies into the image's files themselves, each 1 GiB of them
               mapped, its pages made and page-locked first (the checksum would be the GPU's)
  two-stage    hashed and scanned by one set of threads, then written by another (the copier
               of 2026-11-29: 16 and 16)
  one-pass     each 1 MiB piece hashed and scanned, then written while it is in the CPU's
               cache, by one set of threads (pos_write_chunk)
  map          no write: the chunk copied (memmove) into one file of the image's size, mapped
               shared, its pages made before the drain (`prepare_s`); on a hugetlbfs folder
               (2 MiB or 1 GiB pages) the kernel has no per-page work left to do
  hash-map     each 1 MiB piece hashed and scanned, then copied into that mapping
and the host's own memory copy (memmove of 256 MiB blocks) by 1, 8 and 16 threads. Writes
DIR/drain.json and prints one line a way.
"""

import argparse
import ctypes as C
import json
import mmap
import os
import queue
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pos.concurrent import gpucopy  # noqa: E402
from pos.driver import CUdeviceptr, driver  # noqa: E402
from pos.image import gpu as gpuimage  # noqa: E402

GIB = 1 << 30
CHUNK = 64 << 20
STREAMS = 8
LIB = gpuimage._lib


def targets(base: int, k: int = 256, size: int = 64 << 20) -> gpuimage.Targets:
    """k buffers' ranges at the device memory's addresses: random bytes seldom point in."""
    return gpuimage.Targets([(base + j * size, base + (j + 1) * size) for j in range(k)])


class Drain:
    """One way of taking chunks off the ring (`consume(slot, n)` in `threads` threads, or in two
    stages), timed from the first copy to the last chunk taken off."""

    def __init__(self, drv: Any, src: int, total: int, ring: gpucopy.Pinned, folder: Path,
                 tg: gpuimage.Targets) -> None:
        self.drv, self.src, self.total, self.ring, self.folder, self.tg = \
            drv, src, total, ring, folder, tg
        self.ctx = gpucopy.current(drv)

    def run(self, way: str, threads: int, keep: bool = False) -> dict[str, Any]:
        slots: queue.Queue[int] = queue.Queue()
        for k in range(self.ring.size // CHUNK):
            slots.put(k * CHUNK)
        first: queue.Queue[Optional[tuple[int, int, int]]] = queue.Queue()
        second: queue.Queue[Optional[tuple[int, int, int]]] = queue.Queue()
        self.folder.mkdir(parents=True, exist_ok=True)
        errors: list[BaseException] = []
        lock = threading.Lock()
        local = threading.local()
        fds: list[int] = []
        mapped = self.mapping() if way in ("map", "hash-map") else None
        prepare_s = 0.0 if mapped is None else mapped[1]

        def fd() -> int:
            if not hasattr(local, "fd"):
                with lock:
                    local.fd = os.open(self.folder / f"data-{len(fds)}", os.O_WRONLY | os.O_CREAT
                                       | (0 if way == "overwrite" else os.O_TRUNC), 0o600)
                    fds.append(local.fd)
            return int(local.fd)

        def write_all(slot: int, n: int) -> None:
            view = self.ring.view(slot, n).data.cast("B")
            done = 0
            while done < n:
                done += os.write(fd(), view[done:])

        def scan(slot: int, n: int) -> int:
            h, _hits = gpuimage.checksum_points(self.ring.view(slot, n), self.tg)
            return h

        def one_pass(slot: int, n: int) -> None:
            hits, h = self.tg.hits(), C.c_uint64()
            r = LIB.pos_write_chunk(fd(), self.ring.ptr + slot, n, gpuimage.PIECE,
                                    self.tg.starts.ctypes.data, self.tg.ends.ctypes.data,
                                    self.tg.starts.shape[0], hits.ctypes.data, C.byref(h))
            if r != 0:
                raise OSError(-r, os.strerror(-r))

        def to_map(slot: int, n: int, off: int, hashed: bool) -> None:
            assert mapped is not None
            for p in range(0, n, gpuimage.PIECE):
                k = min(gpuimage.PIECE, n - p)
                if hashed:
                    LIB.pos_fold_point(self.ring.ptr + slot + p, k, self.tg.starts.ctypes.data,
                                       self.tg.ends.ctypes.data, self.tg.starts.shape[0],
                                       self.tg.hits().ctypes.data)
                C.memmove(mapped[0] + off + p, self.ring.ptr + slot + p, k)

        single: dict[str, Callable[[int, int, int], Any]] = {
            "hash": lambda s, n, _o: scan(s, n), "write": lambda s, n, _o: write_all(s, n),
            "overwrite": lambda s, n, _o: write_all(s, n),
            "one-pass": lambda s, n, _o: one_pass(s, n),
            "map": lambda s, n, o: to_map(s, n, o, False),
            "hash-map": lambda s, n, o: to_map(s, n, o, True)}

        def take() -> None:      # the first (or only) stage
            try:
                while (item := first.get()) is not None:
                    slot, n, off = item
                    if way == "two-stage":
                        second.put((slot, n, scan(slot, n)))
                        continue
                    single[way](slot, n, off)
                    slots.put(slot)
            except BaseException as e:
                errors.append(e)

        def put() -> None:       # the second stage of two-stage
            try:
                while (item := second.get()) is not None:
                    slot, n, _h = item
                    write_all(slot, n)
                    slots.put(slot)
            except BaseException as e:
                errors.append(e)

        offsets = list(range(0, self.total, CHUNK))

        def copy() -> None:
            self.drv.cuCtxSetCurrent(self.ctx)
            stream = C.c_void_p()
            self.drv.cuStreamCreate(C.byref(stream), 1)
            try:
                while True:
                    with lock:
                        if not offsets:
                            return
                        off = offsets.pop(0)
                    n = min(CHUNK, self.total - off)
                    slot = -1
                    while slot < 0 and not errors:
                        try:
                            slot = slots.get(timeout=0.1)
                        except queue.Empty:
                            pass
                    if errors:
                        return
                    self.drv.cuMemcpyDtoHAsync_v2(self.ring.ptr + slot, self.src + off, n,
                                                  stream)
                    self.drv.cuStreamSynchronize(stream)
                    if way == "d2h":
                        slots.put(slot)
                    else:
                        first.put((slot, n, off))
            finally:
                self.drv.cuStreamDestroy_v2(stream)

        takers = [threading.Thread(target=take) for _ in range(threads if way != "d2h" else 0)]
        putters = [threading.Thread(target=put) for _ in range(threads if way == "two-stage"
                                                              else 0)]
        copiers = [threading.Thread(target=copy) for _ in range(STREAMS)]
        t0 = time.monotonic()
        for t in takers + putters + copiers:
            t.start()
        for t in copiers:
            t.join()
        for _ in takers:
            first.put(None)
        for t in takers:
            t.join()
        for _ in putters:
            second.put(None)
        for t in putters:
            t.join()
        s = time.monotonic() - t0
        written = sum(f.stat().st_size for f in self.folder.iterdir())
        for f in fds:
            os.close(f)
        if mapped is not None:
            mapped[2].close()
        if not keep:
            shutil.rmtree(self.folder)
        if errors:
            raise errors[0]
        return {"way": way, "threads": threads, "seconds": round(s, 3),
                "gbps": round(self.total / s / 1e9, 2), "written_gb": round(written / 1e9, 2),
                "prepare_s": round(prepare_s, 3)}

    def mapping(self) -> tuple[int, float, mmap.mmap]:
        """One file of the image's size in the folder, mapped shared and its pages made by 16
        threads: its address, the seconds that took, the mapping."""
        t0 = time.monotonic()
        fd = os.open(self.folder / "data", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, self.total)
            m = mmap.mmap(fd, self.total, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        at = C.addressof(C.c_char.from_buffer(m))
        parts = list(range(0, self.total, GIB))
        lock = threading.Lock()
        errors: list[int] = []

        def populate() -> None:
            while True:
                with lock:
                    if not parts:
                        return
                    off = parts.pop()
                if _libc.madvise(at + off, min(GIB, self.total - off), MADV_POPULATE_WRITE):
                    errors.append(C.get_errno())

        timed_threads(populate, 16)
        if errors:
            m.close()
            raise OSError(errors[0], f"making the pages of {self.folder / 'data'}: "
                          f"{os.strerror(errors[0])}")
        return at, time.monotonic() - t0, m


def timed_threads(fn: Callable[[], None], threads: int) -> float:
    """Seconds for `threads` threads each running fn, from the first start to the last end."""
    ts = [threading.Thread(target=fn) for _ in range(threads)]
    t0 = time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.monotonic() - t0


_libc = C.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [C.c_void_p, C.c_size_t, C.c_int]
MADV_POPULATE_WRITE = 23


def direct(drv: Any, src: int, total: int, folder: Path, threads: int) -> dict[str, Any]:
    """No ring and no write: each 1 GiB of the image is a file mapped shared, its pages made
    (MADV_POPULATE_WRITE) and page-locked (cuMemHostRegister), the GPU copying into them (one
    stream a thread); what a copy with its checksum made on the GPU could reach."""
    folder.mkdir(parents=True, exist_ok=True)
    ctx = gpucopy.current(drv)
    parts = list(range(total // GIB))
    lock = threading.Lock()
    errors: list[BaseException] = []

    def run() -> None:
        drv.cuCtxSetCurrent(ctx)
        stream = C.c_void_p()
        drv.cuStreamCreate(C.byref(stream), 1)
        try:
            while True:
                with lock:
                    if not parts or errors:
                        return
                    k = parts.pop(0)
                fd = os.open(folder / f"data-{k}", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    os.ftruncate(fd, GIB)
                    m = mmap.mmap(fd, GIB, flags=mmap.MAP_SHARED)
                    at = C.addressof(C.c_char.from_buffer(m))
                    if _libc.madvise(at, GIB, MADV_POPULATE_WRITE) != 0:
                        raise OSError(C.get_errno(), "madvise")
                    drv.cuMemHostRegister_v2(at, GIB, 0)
                    for off in range(0, GIB, CHUNK):
                        drv.cuMemcpyDtoHAsync_v2(at + off, src + k * GIB + off, CHUNK, stream)
                    drv.cuStreamSynchronize(stream)
                    drv.cuMemHostUnregister(at)
                    del at
                    m.close()
                finally:
                    os.close(fd)
        except BaseException as e:
            errors.append(e)
        finally:
            drv.cuStreamDestroy_v2(stream)

    s = timed_threads(run, threads)
    written = sum(f.stat().st_size for f in folder.iterdir())
    shutil.rmtree(folder)
    if errors:
        raise errors[0]
    return {"way": "direct", "threads": threads, "seconds": round(s, 3),
            "gbps": round(total / s / 1e9, 2), "written_gb": round(written / 1e9, 2)}


def memcpy(gib: int, threads: int) -> dict[str, Any]:
    """The host's memory copy: `threads` threads memmove 256 MiB blocks, --gib GiB in all."""
    a = np.ones(gib * GIB, np.uint8)
    b = np.ones(gib * GIB, np.uint8)
    block = 256 << 20
    todo = list(range(0, gib * GIB, block))
    lock = threading.Lock()

    def run() -> None:
        while True:
            with lock:
                if not todo:
                    return
                off = todo.pop()
            C.memmove(b.ctypes.data + off, a.ctypes.data + off, block)

    s = timed_threads(run, threads)
    return {"way": "memcpy", "threads": threads, "seconds": round(s, 3),
            "gbps": round(gib * GIB / s / 1e9, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--gib", type=int, default=16)
    ap.add_argument("--ring-gib", type=int, default=8)
    ap.add_argument("--dest", default="/dev/shm", help="folders, comma-separated")
    ap.add_argument("--threads", default="16,8")
    ap.add_argument("--ways", default="", help="only these ways (and d2h, memcpy), in order; "
                    "default: every way but map and hash-map")
    a = ap.parse_args()
    drv = driver()
    drv.init()
    ctx = gpucopy.Context(0)
    total = a.gib * GIB
    src = CUdeviceptr()
    drv.cuMemAlloc_v2(C.byref(src), total)
    noise = np.random.default_rng(1).integers(0, 256, CHUNK, np.uint8)
    for off in range(0, total, CHUNK):
        drv.cuMemcpyHtoD_v2(src.value + off, noise.ctypes.data, CHUNK)
    ring = gpucopy.Pinned(drv, a.ring_gib * GIB)
    rows: list[dict[str, Any]] = []

    def row(r: dict[str, Any], dest: str = "") -> None:
        rows.append({"dest": dest, **r})
        print("row", json.dumps(rows[-1]), flush=True)

    folders = [Path(dest) / f"pos-drain-probe-{os.getpid()}" for dest in a.dest.split(",")]
    try:
        link = Drain(drv, src.value, total, ring, folders[0], targets(src.value))
        row(link.run("d2h", 0))
        for folder in folders:
            d = Drain(drv, src.value, total, ring, folder, targets(src.value))
            for threads in (int(t) for t in a.threads.split(",")):
                if a.ways:
                    for way in a.ways.split(","):
                        try:
                            row(direct(drv, src.value, total, folder, threads) if way == "direct"
                                else d.run(way, threads), str(folder.parent))
                        except OSError as e:   # hugetlbfs has no write(): the way's row says so
                            shutil.rmtree(folder, ignore_errors=True)
                            row({"way": way, "threads": threads, "error": str(e)},
                                str(folder.parent))
                    continue
                for way in ("hash", "write", "two-stage", "one-pass", "two-stage", "one-pass"):
                    row(d.run(way, threads), str(folder.parent))
                row(d.run("write", threads, keep=True), str(folder.parent))
                row(d.run("overwrite", threads), str(folder.parent))
                row(direct(drv, src.value, total, folder, threads), str(folder.parent))
        row(link.run("d2h", 0))
        for threads in (1, 8, 16):
            row(memcpy(4, threads))
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        ring.close()
        drv.cuMemFree_v2(src)
        ctx.close()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "drain.json").write_text(json.dumps(
        {"gib": a.gib, "ring_gib": a.ring_gib, "dest": a.dest, "chunk": CHUNK,
         "streams": STREAMS, "cpus": os.cpu_count(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
