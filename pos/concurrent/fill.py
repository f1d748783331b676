"""A restore's fill: the image's chunks read (each checked against its checksum) through pinned
pieces and copied into device memory, in the order the job will want them, while the job runs
(its calls wait only for the buffers not back yet: pos/concurrent/handout.py)."""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from pos.agent.control import Buffer
from pos.driver import Driver
from pos.errors import BadInput
from pos.image.gpuindex import ChunkRecord, Saved

if TYPE_CHECKING:     # imported where used: numpy takes 0.15 s to import on the H100 host
    from pos.concurrent import gpucopy
    from pos.concurrent.handout import Handout

FILL_STREAMS = 16      # a restore's fill threads: host to device memory
FILL_DEPTH = 4         # pieces a fill thread has in flight (their copies overlap its reads)


def fill_order(table: list[Buffer], saved: dict[int, Saved]
               ) -> tuple[dict[tuple[int, int], ChunkRecord], list[tuple[int, int, int]]]:
    """Every chunk by (buffer index, offset), and the fill's work as (buffer index, offset,
    length): first the buffers the job used right after its checkpoint (`touched`: its next
    calls will want them; on the H100 a restored job waited 0.38-0.76 s for such buffers filled
    after others), then the smaller buffers first (a job that used everything while its copy
    ran gets that order alone); a chunk outside its buffer is refused."""
    chunk_of = {(i, c.offset): c for i, b in enumerate(table) for c in saved[b.va].chunks}
    work = sorted(((i, off, c.raw) for (i, off), c in chunk_of.items()),
                  key=lambda w: (not table[w[0]].touched, table[w[0]].size, w[0], w[1]))
    for i, off, n in work:
        if off < 0 or off + n > table[i].mapped:
            raise BadInput(f"a chunk of buffer {table[i].va:#x} lies outside it",
                           "the image is corrupt: take a new checkpoint")
    return chunk_of, work


def fill(drv: Driver, table: list[Buffer], dest: list[int], saved: dict[int, Saved], *,
         streams: int,
         handout: Handout, rings: gpucopy.Rings, mapped: bool = True,
         gate: Callable[[], None] = lambda: None) -> gpucopy.Copy:
    """Read every buffer's chunks through the threads' `rings` of pinned pieces (the data files
    `mapped`, or read) and copy them to device memory at `dest`, in `fill_order`; the handout
    learns which other buffers each buffer's words point into, and then that it is back. Each
    chunk calls `gate()` first (which waits while the fill is paused, and raises to stop it)."""
    import numpy as np

    from pos.concurrent import gpucopy
    from pos.image import gpu as gpuimage

    targets = gpuimage.Targets([(b.va, b.va + b.mapped) for b in table])   # table by address
    chunk_of, work = fill_order(table, saved)
    local = threading.local()
    lock = threading.Lock()
    read_s = [0.0]          # summed over the threads: reading, checking and copying the chunks
    open_files: list[dict[str, int]] = []
    maps = gpuimage.Maps() if mapped else None

    def copy_chunk(stream: Any, i: int, off: int, n: int) -> None:
        gate()
        if not hasattr(local, "fds"):
            local.fds = {}
            with lock:
                open_files.append(local.fds)
        folder, chunk = saved[table[i].va].folder, chunk_of[(i, off)]
        t = time.monotonic()
        if chunk.zstd:        # decompressed in host memory, then copied from there
            data = np.empty(n, np.uint8)
            hits = gpuimage.read_chunk_into(folder, chunk, data, local.fds, targets)
            drv.cuMemcpyHtoD_v2(dest[i] + off, data.ctypes.data, n)
        else:
            hits = gpuimage.fill_chunk(rings.mine(stream), folder, chunk, dest[i] + off,
                                       local.fds, targets, maps)
        with lock:
            read_s[0] += time.monotonic() - t
        handout.points(i, hits)

    order = gpucopy.Order(work)        # what the job's calls wait for first, once it runs
    filled = threading.Event()
    watcher = order.follow(lambda: handout.agent, {b.va: i for i, b in enumerate(table)},
                           filled, handout.needed)
    try:    # the first chunk to fail stops the fill, and is what the user is told
        seconds = gpucopy.run_chunks(drv, work, len(table), streams, copy_chunk,
                                     handout.came_back, order)
    finally:
        filled.set()
        watcher.join()
        for fds in open_files:
            for fd in fds.values():
                os.close(fd)
        if maps is not None:
            maps.close()
    copy = gpucopy.Copy(sum(n for _i, _o, n in work), seconds)
    copy.read_thread_s = read_s[0]
    return copy
