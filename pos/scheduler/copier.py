"""A checkpoint's copy of the job's device memory into its image, outside the job.

Each chunk goes device-to-host into a slot of one page-locked arena, is hashed and scanned for
the addresses of the job's buffers there (pos/image/chunks.c: one pass, without the GIL), and
is written to the image's data files by writer threads, which give its slot back. The arena
may be smaller than the job: the copy then streams at the disk's pace instead of needing host
memory as large as the GPU's (pinning 54 GiB took 23 s on the H100 host before the cut, and
the host may not have it). The copy starts as soon as pos has shadowed what fits: in a
whole-process checkpoint it runs while the driver and CRIU hold the job, whose memory cannot
change then, so that by the job's release much or all of it is saved.

Order: the buffers pos could not shadow first (the job's calls that may write them wait until
they are saved; what pos shadowed is safe from the start), smallest first within each kind
(most calls use the small buffers, and one big buffer does not hold them up). As each buffer is
in host memory the handout (pos/scheduler/handout.py) tells the job's gate which buffers its
calls may write again.
"""

import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from pos.agent.control import Buffer
from pos.errors import BadInput
from pos.image import gpu as gpuimage
from pos.scheduler import gpucopy
from pos.scheduler.handout import Handout

ARENA_ENV = "POS_PIN_MAX_GIB"     # at most this much page-locked host memory for a checkpoint
MIN_ARENA = 1 << 30               # below this a checkpoint is refused: it would crawl
HOST_RESERVE = 2 << 30            # host memory left to everything else


def host_available_bytes() -> int:
    """MemAvailable: what the host can give without swapping or reclaiming what is in use."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def arena_bytes(total: int, chunk: int) -> int:
    """The page-locked memory to set aside for a checkpoint of `total` bytes of device memory:
    all of it where the host can spare it (the copy to host memory then never waits for the
    disk), at most POS_PIN_MAX_GIB, at most what the host has available less 2 GiB; a whole
    number of chunks. Refused in one sentence when that is under 1 GiB."""
    need = -(-total // chunk) * chunk
    cap = os.environ.get(ARENA_ENV)
    try:
        limit = int(float(cap) * 2**30) if cap else need
    except ValueError:
        raise BadInput(f"{ARENA_ENV}={cap} is not a number of GiB",
                       "unset it, or give a number such as 8") from None
    spare = host_available_bytes() - HOST_RESERVE
    want = min(need, limit, spare) // chunk * chunk
    least = min(MIN_ARENA, need)
    if limit < least:
        raise BadInput(f"{ARENA_ENV}={cap} is under the {least / 2**30:.2f} GiB of page-locked "
                       "host memory a checkpoint needs", "raise it, or unset it")
    if want < least:
        raise BadInput(f"a checkpoint needs {least / 2**30:.2f} GiB of page-locked host memory "
                       f"and this host has {max(spare, 0) / 2**30:.2f} GiB to spare (it keeps "
                       f"{HOST_RESERVE >> 30} GiB for everything else)",
                       "free host memory and try again")
    return max(want, chunk)


@dataclass(frozen=True)
class Copied:
    bytes: int
    d2h_s: float        # from the start until every chunk was in host memory
    disk_s: float       # from the start until every chunk was written


class _Stopped(Exception):
    """A chunk not copied because the copy failed elsewhere (that failure is raised)."""


class Copier:
    """Copies `table`'s buffers from `sources` (pos's shadow, or its mapping of the job's own
    memory) through `arena` into `writer`, telling `handout` as each buffer is in host memory.
    start(), then wait_copied() (device memory no longer needed), then join() (all written);
    close() in any case."""

    def __init__(self, drv: Any, table: list[Buffer], sources: list[int], shadowed: set[int],
                 arena: gpucopy.Pinned, chunk: int, streams: int, writer: gpuimage.Writer,
                 handout: Handout, writers: int) -> None:
        if gpucopy.Pinned.PIECE % chunk:
            raise ValueError("a chunk divides the arena's pinned parts")
        self.drv, self.table, self.sources, self.arena = drv, table, sources, arena
        self.writer, self.handout, self.streams = writer, handout, streams
        self.ctx = gpucopy.C.c_void_p()        # the caller's context, for the copy's threads
        drv.call("cuCtxGetCurrent", gpucopy.C.byref(self.ctx))
        order = sorted(range(len(table)), key=lambda i: (i in shadowed, table[i].size, i))
        rank = {i: k for k, i in enumerate(order)}
        self.work = sorted(gpucopy.grid([b.size for b in table], chunk),
                           key=lambda w: (rank[w[0]], w[1]))
        by_va = sorted(range(len(table)), key=lambda i: table[i].va)
        self.targets = gpuimage.Targets([(table[i].va, table[i].va + table[i].mapped)
                                         for i in by_va])
        self.index_of = np.array(by_va, np.int64)     # a target's buffer
        self.slots: queue.Queue[int] = queue.Queue()
        for at in range(0, arena.size // chunk * chunk, chunk):
            self.slots.put(at)
        self.writes: queue.Queue[Optional[tuple[int, int, int, int, int]]] = queue.Queue()
        self.failures: list[BaseException] = []
        self.copied = threading.Event()
        self.copied_bytes = 0
        self.lock = threading.Lock()
        self.t0 = 0.0
        self.d2h_s = self.disk_s = 0.0
        self.threads = [threading.Thread(target=self._write, name=f"pos-write-{k}", daemon=True)
                        for k in range(max(1, writers))]
        self.reader = threading.Thread(target=self._copy, name="pos-copy", daemon=True)

    def start(self) -> None:
        self.t0 = time.monotonic()
        for t in self.threads:
            t.start()
        self.reader.start()

    def _fail(self, e: BaseException) -> None:
        with self.lock:
            self.failures.append(e)

    def _slot(self) -> int:
        while True:
            if self.failures:
                raise _Stopped()
            try:
                return self.slots.get(timeout=0.05)
            except queue.Empty:
                continue

    def _copy(self) -> None:
        def one(stream: Any, i: int, off: int, n: int) -> None:
            slot = self._slot()
            try:
                self.drv.call("cuMemcpyDtoHAsync_v2",
                              gpucopy.C.c_void_p(self.arena.ptr + slot),
                              gpucopy.U64(self.sources[i] + off), gpucopy.SZ(n), stream)
                self.drv.call("cuStreamSynchronize", stream)
                h, hits = gpuimage.checksum_points(self.arena.view(slot, n), self.targets)
            except BaseException as e:
                self.slots.put(slot)
                if not isinstance(e, _Stopped):
                    self._fail(e)
                raise
            self.handout.points(i, self.index_of[np.flatnonzero(hits)].tolist())
            with self.lock:
                self.copied_bytes += n
            self.writes.put((i, off, n, slot, h))

        try:
            self.drv.call("cuCtxSetCurrent", self.ctx)
            gpucopy.run_chunks(self.drv, self.work, len(self.table), self.streams, one,
                               self.handout.came_back)
            self.d2h_s = time.monotonic() - self.t0
        except BaseException as e:
            if not isinstance(e, _Stopped):
                self._fail(e)
        finally:
            self.copied.set()
            for _ in self.threads:
                self.writes.put(None)

    def _write(self) -> None:
        while (item := self.writes.get()) is not None:
            i, off, n, slot, h = item
            try:
                if not self.failures:
                    self.writer.put(self.table[i].va, off, self.arena.view(slot, n), h)
            except BaseException as e:
                self._fail(e)
            finally:
                self.slots.put(slot)

    def _raise(self) -> None:
        if self.failures:
            raise self.failures[0]

    def wait_copied(self) -> None:
        """Every chunk is in host memory (or the copy failed: raised)."""
        self.copied.wait()
        self._raise()

    def join(self) -> Copied:
        """Every chunk is written (or the copy failed: raised)."""
        self.reader.join()
        for t in self.threads:
            t.join()
        self.disk_s = time.monotonic() - self.t0
        self._raise()
        return Copied(sum(n for _i, _o, n in self.work), self.d2h_s, self.disk_s)

    def stop_copying(self) -> None:
        """No chunk is being copied from the device from now on (stopped if it had not ended):
        pos's shadow and its mapping of the job's memory may be freed."""
        if self.reader.ident is None:
            return
        if not self.copied.is_set():
            self._fail(_Stopped())
        self.reader.join()

    def close(self) -> None:
        """Stop (after a failure elsewhere) and wait until nothing runs: the arena may be freed
        then."""
        self.stop_copying()
        for t in self.threads:
            if t.ident is not None:
                t.join()
