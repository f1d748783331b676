"""A checkpoint's copy of the job's device memory into its image, outside the job.

Each chunk goes device-to-host into a slot of one page-locked arena, and a saver thread writes
it to the image's data files, hashing it and scanning it for the addresses of the job's buffers
piece by piece as it writes (pos/image/chunks.c: one pass, without the GIL), then gives its
slot back. The arena may be smaller than the job: the copy then streams at the disk's pace
instead of needing host memory as large as the GPU's (pinning 54 GiB took 23 s on the H100
host before the cut, and the host may not have it); and its parts come as they are locked, the
ring before the cut, the rest while the copy runs (gpucopy.Pinned). The copy starts as soon as
pos has shadowed what fits: in a whole-process checkpoint the buffers pos could not shadow are
copied while the driver and CRIU hold the job, whose memory cannot change then, so that by the
job's release much or all of them is saved; the shadowed ones, safe on the device, wait for the
release (see `Copier.hold_shadowed`).

Order: the buffers pos could not shadow first (the job's calls that may write them wait until
they are saved; what pos shadowed is safe from the start), within each kind in the shadow's
order (`first_needed`). As each buffer is in host memory the handout (pos/concurrent/handout.py)
tells the job's gate which buffers its calls may write again.

The shadow's scan: a call on a shadowed buffer waits too, until the buffers its words point
into are known and saved (handout.py), and the copy reaches the shadowed buffers last. Where
the GPU hashes (POS_HASH_ON), it scans the shadow from the copy's start, on a stream of its
own, the buffers the job's calls wait for first; a scanned shadowed buffer waits only for the
unshadowed ones it points into. The copy then uses these checksums rather than making them
again. (On the H200 the 60% job's calls waited 0.13-0.43 s each, one after another, for five
shadowed buffers of 2-198 MiB after its release: bench/results/2026-11-29.md.)

numpy and the image's chunk module are imported where used, not with this module: every
checkpoint command imports it (arena_bytes), and numpy's import took 0.3 s of the command's
start on the H200 host. A checkpoint imports them beside its pin (saver.import_for_copy).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from pos import host
from pos.agent.control import Buffer
from pos.concurrent import gpucopy
from pos.concurrent.crew import Crew, Spares
from pos.concurrent.handout import Handout
from pos.driver import Driver
from pos.errors import BadInput
from pos.settings import DEFAULT_PIN_RING, Settings

if TYPE_CHECKING:
    from pos.concurrent.gpuhash import Kernel
    from pos.image import gpu as gpuimage

Summed = tuple[int, list[int]]     # a chunk's checksum and the buffers it points into (GPU's)
MIN_ARENA = 1 << 30               # below this a checkpoint is refused: it would crawl
HOST_RESERVE = 2 << 30            # host memory left to everything else


def first_needed(b: Buffer, i: int) -> tuple[int, int]:
    """The order in which the shadow takes buffer i, and the copy within what was shadowed or
    not: the smallest first (most calls use a job's many small buffers, and one big buffer
    does not hold them up)."""
    return (b.size, i)


def threads(streams: int, writers: int) -> int:
    """The threads a Copier runs: its reader, a copy thread per stream, `writers` savers, and
    the scan of the shadow."""
    return 2 + streams + max(1, writers)


def host_spare() -> int:
    """The host memory arenas may take: what it has available less HOST_RESERVE."""
    return host.memory_available() - HOST_RESERVE


def arena_bytes(total: int, chunk: int, cap: Optional[int] = None, shadowed: int = 0,
                ring: int = DEFAULT_PIN_RING, spare: Optional[int] = None,
                held: int = 0) -> int:
    """The page-locked memory to set aside for a checkpoint of `total` bytes of device memory
    of which pos can shadow about `shadowed`: what it cannot shadow (the job's calls that write
    those buffers wait until they are in host memory, which must not wait for the disk), and a
    `ring` (POS_PIN_RING_GIB) for the rest; at most `cap` (POS_PIN_MAX_GIB), at most what the
    host has available less 2 GiB (or `spare`: what a HostRoom left, `held` bytes of the image
    in memory counted); a whole number of chunks. Refused in one sentence when that is under
    1 GiB. An image in memory (`held`: its folder is a tmpfs) takes the arena's chunks as fast
    as the copy fills them, so all of the job streams through the ring: a 97 GB job on an H200
    host, 46 GB of it unshadowed, had its cut 1.39-1.51 s after the command and stalled
    1.15-1.18 s, against 2.72-3.08 s and 1.64-1.69 s with a 31 GB arena locked first
    (bench/results/2026-11-30.md, perf run 22; 1.48-1.63 s and 1.40-1.54 s in run 23)."""
    unshadowed = 0 if held else total - min(shadowed, total)
    need = -(-min(total, unshadowed + ring) // chunk) * chunk
    limit = need if cap is None else cap
    if spare is None:
        spare = host_spare()
    want = min(need, limit, spare) // chunk * chunk
    least = min(MIN_ARENA, need)
    if limit < least:
        raise BadInput(f"POS_PIN_MAX_GIB={limit / 2**30:g} is under the {least / 2**30:.2f} GiB "
                       "of page-locked host memory a checkpoint needs", "raise it, or unset it")
    if want < least:
        image = (f" beside the {held / 2**30:.2f} GiB its image takes in host memory (its "
                 "folder is a tmpfs),") if held else ""
        raise BadInput(f"a checkpoint needs {least / 2**30:.2f} GiB of page-locked host memory"
                       f"{image} and this host has {max(spare + held, 0) / 2**30:.2f} GiB to "
                       f"spare (it keeps {HOST_RESERVE >> 30} GiB for everything else)",
                       ("give -D a folder on disk, or " if held else "") +
                       "free host memory and try again")
    return max(want, chunk)


class HostRoom:
    """The page-locked host memory of one checkpoint, shared by its savers: at most `cap`
    (POS_PIN_MAX_GIB) in all, within what the host can spare, and one ring (POS_PIN_RING_GIB)
    split among the `sharing` processes with device memory to copy. Per saver, the 4 ranks of
    the Llama2-13B-shaped job locked four 8.6 GB arenas, 34 GB, one after another: 6.8 of the
    8.6 s before the cut (bench/results/2026-11-28-multigpu, run23), for one disk they all
    drain to. The savers are prepared side by side: the host's available memory does not drop
    until an arena's pages are faulted in, so each arena is sized from what the ones sized
    before it left. Their locking takes turns (`locking`): it is page-table work in pos's one
    process, which one arena's threads already fill; four arenas locked at once on 4x H200 took
    11.8 s, where one after another they had taken 1.2 s each (run20 and run19, two machines of
    one kind). `held`: the bytes the image takes of the host's memory as it is written, where
    its folder is a tmpfs: the arenas leave room for them (a 60% job's 90 GB image in /dev/shm
    beside its 39 GB arena ran a 126 GiB H200 host out of memory, and the kernel killed pos:
    2026-11-30.md)."""

    def __init__(self, cap: Optional[int] = None, ring: int = DEFAULT_PIN_RING,
                 sharing: int = 1, held: int = 0) -> None:
        self._lock = threading.Lock()
        self.locking = threading.Lock()
        self.held = held
        self.left = host_spare() - held
        self.cap_left = cap
        self.ring = ring // max(1, sharing)

    def arena(self, total: int, chunk: int, shadowed: int, kept: int = 0) -> int:
        """arena_bytes within what is left and the `kept` bytes the arena has in memory
        already (pos/concurrent/kept.py: not in the host's available memory), taken from it."""
        with self._lock:
            size = arena_bytes(total, chunk, self.cap_left, shadowed, self.ring,
                               self.left + kept, self.held)
            self.left -= max(0, size - kept)
            if self.cap_left is not None:
                self.cap_left -= size
            return size


def host_room(settings: Settings, folder: Path, image_bytes: int, sharing: int = 1,
              staged: int = 0) -> HostRoom:
    """The HostRoom of a checkpoint whose image of about `image_bytes` goes into `folder`:
    room left for the image where the folder keeps its files in memory, and for the `staged`
    bytes of it that are first written to a tmpfs of their own (pos/concurrent/staging.py),
    which until they are moved into the image take that memory twice over."""
    in_memory = host.in_memory(folder.absolute().parent)
    return HostRoom(settings.pin_max_bytes, settings.pin_ring_bytes, sharing,
                    image_bytes + staged if in_memory else 0)


@dataclass(frozen=True)
class Copied:
    bytes: int
    d2h_s: float        # from the start until every chunk was in host memory
    disk_s: float       # from the start until every chunk was written


class Copier:
    """Copies `table`'s buffers from `sources` (pos's shadow, or its mapping of the job's own
    memory) through `arena` into `writer`. Two kinds of threads: one per stream copies chunks
    to the arena (gpucopy.run_chunks; the handout learns as each buffer is all in host memory:
    `captured`), the savers write them, hashing and scanning them for addresses as they go
    (the handout learns what each buffer points into, and when it is all known: `came_back`;
    where the GPU hashed and scanned the chunks, the copy's threads tell it instead),
    and give their slot back. start(), then wait_copied() (device memory no longer needed),
    then join() (all written); close() in any case. pause()/resume() hold the copies to the
    arena (the driver's own copies of the job's context go faster alone),
    hold_savers()/release_savers() the savers (CRIU's dump, on the CPU, took 1.1-1.5 s instead
    of 0.5-0.8 beside them on the H100 host), hold_shadowed()/release_shadowed() the copies of
    the shadowed buffers (safe in the shadow, they need not compete with the frozen part for
    the host's memory); lock_rest() lets the arena lock the rest of its memory (the job runs
    again); watch(agent) asks the job's agent what its calls wait for, and copies that
    first."""

    def __init__(self, drv: Driver, table: list[Buffer], sources: list[int], shadowed: set[int],
                 arena: gpucopy.Pinned, chunk: int, streams: int, writer: gpuimage.Writer,
                 handout: Handout, writers: int, frozen_copy: str = "unshadowed",
                 spares: Optional[Spares] = None, kernel: Optional[Kernel] = None) -> None:
        """`frozen_copy`: what the copy takes while the job is frozen (Settings.frozen_copy:
        `unshadowed`, or `all`, the measurement's baseline: on the H200 CRIU wrote the same
        1,042 MiB frozen in 0.62 s beside a 41 GiB copy against 0.41 s beside a 22 GiB one).
        `spares`: threads started before the cut (as many as `threads` says), on which the
        copy's threads run. `kernel`: pos's checksum kernel in this context (POS_HASH_ON):
        each chunk is hashed and scanned on the GPU, and the savers only write it."""
        import numpy as np

        from pos.image import gpu as gpuimage

        if gpucopy.Pinned.PIECE % chunk:
            raise ValueError("a chunk divides the arena's pinned parts")
        self.drv, self.table, self.sources, self.arena = drv, table, sources, arena
        self.writer, self.handout, self.streams = writer, handout, streams
        self.shadowed = frozenset(shadowed)
        self.frozen_copy = frozen_copy
        self.ctx = gpucopy.current(drv)        # the caller's context, for the copy's threads
        rank = {i: k for k, i in enumerate(sorted(range(len(table)), key=lambda i: (
            i in shadowed, *first_needed(table[i], i))))}
        self.work = sorted(gpucopy.grid([b.size for b in table], chunk),
                           key=lambda w: (rank[w[0]], w[1]))
        self.order = gpucopy.Order(self.work)
        # the shadow's scan: in the copy's order too, but first the buffers the job's calls
        # wait for, which wait until their shadow is scanned
        self.scan_order = gpucopy.Order([w for w in self.work if w[0] in self.shadowed])
        self.scan_left = gpucopy.chunks_of(self.work, len(table))
        by_va = sorted(range(len(table)), key=lambda i: table[i].va)
        self.targets = gpuimage.Targets([(table[i].va, table[i].va + table[i].mapped)
                                         for i in by_va])
        self.index_of = np.array(by_va, np.int64)     # a target's buffer
        self.sums = None
        if kernel is not None:
            from pos.concurrent.gpuhash import Sums

            self.sums = Sums(drv, kernel, self.targets, chunk)
        self.summed: dict[tuple[int, int], Summed] = {}     # the shadow's scan's, by chunk
        self.by_va = {b.va: i for i, b in enumerate(table)}
        self.slots: queue.Queue[int] = queue.Queue()
        self.chunk = chunk
        arena.subscribe(self._add_slots)        # its parts as they are locked
        # the chunks in host memory, for the savers: (buffer, offset, length, slot, and the
        # GPU's checksum and hits, or None: the savers make them)
        self.in_host: queue.Queue[Optional[tuple[int, int, int, int, Optional[Summed]]]] = \
            queue.Queue()
        self.go = threading.Event()             # the copies to host memory may go on
        self.go.set()
        self.save_go = threading.Event()        # the savers may go on
        self.save_go.set()
        self.shadow_go = threading.Event()      # the shadowed buffers' copies may go on
        self.shadow_go.set()
        self.copied = threading.Event()
        self.scanned = threading.Event()        # the shadow's scan is over (or never began)
        self.scanned.set()
        self.copied_bytes = 0
        self.saved_bytes = 0                    # written by the savers
        self.lock = threading.Lock()
        self.t0 = 0.0
        self.d2h_s = self.disk_s = 0.0
        self.scan_s = 0.0            # from the start until the shadow was all scanned
        self.d2h_busy_s = 0.0        # the seconds in which at least one chunk was copied
        self.copying, self.busy_since = 0, 0.0
        self.threads = max(1, writers)          # savers
        self.crew = Crew("pos-copy", on_stop=self._wake)
        self.spares = spares
        self.watcher: Optional[threading.Thread] = None

    def _add_slots(self, at: int, n: int) -> None:
        for slot in range(at, at + n, self.chunk):
            self.slots.put(slot)

    def start(self) -> None:
        self.t0 = time.monotonic()
        for i, n in enumerate(self.scan_left):
            if n == 0:                  # an empty buffer: nothing to scan (nor to copy)
                self.handout.came_back(i)
        scan = self.sums is not None and 0 < len(self.shadowed) < len(self.table)
        if scan:
            self.scanned.clear()
        self.crew.start([("reader", self._copy)]
                        + [(f"save-{k}", self._save) for k in range(self.threads)]
                        + ([("scan", self._scan_shadow)] if scan else []),
                        self.spares)

    def pause(self) -> None:
        """Hold the copies to the arena."""
        self.go.clear()

    def resume(self) -> None:
        self.go.set()

    def lock_rest(self) -> None:
        """The job runs again, or is stopped for good: the rest of the arena is locked now."""
        self.arena.lock_rest()

    def hold_savers(self) -> None:
        self.save_go.clear()

    def release_savers(self) -> None:
        self.save_go.set()

    def hold_shadowed(self) -> None:
        """Hold the shadowed buffers' copies, unless the frozen part is to copy them all."""
        if self.frozen_copy == "unshadowed":
            self.shadow_go.clear()

    def release_shadowed(self) -> None:
        self.shadow_go.set()

    def watch(self, agent: Any) -> None:
        """Until every chunk is in host memory, copy and scan first what the job's calls wait
        for."""
        self.watcher = self.order.follow(lambda: agent, self.by_va, self.copied,
                                         self.handout.needed, also=(self.scan_order,))

    def _wake(self) -> None:
        """The copy stopped: nothing of it waits for what will not come."""
        self.go.set()
        self.save_go.set()
        self.shadow_go.set()

    def _slot(self) -> int:
        while True:
            self.crew.check()
            try:
                return self.slots.get(timeout=0.05)
            except queue.Empty:
                continue

    def _copy(self) -> None:
        """One thread per stream copies chunks to the arena, in the order's order (the handout
        learns as each buffer is all there, and, where the GPU scanned its chunks, that it is
        back: the job's calls need not wait for the savers to write it); then the savers are
        told there is no more."""
        def one(stream: Any, i: int, off: int, n: int) -> None:
            self.go.wait()
            if i in self.shadowed:          # taken only once no other buffer's chunk is left
                self.shadow_go.wait()
            slot = self._slot()
            with self.lock:
                if not self.copying:
                    self.busy_since = time.monotonic()
                self.copying += 1
                summed = self.summed.pop((i, off), None)
            try:
                if self.sums is not None and summed is None:
                    self.sums.launch(stream, self.sources[i] + off, n)
                self.drv.cuMemcpyDtoHAsync_v2(self.arena.ptr + slot, self.sources[i] + off, n,
                                              stream)
                self.drv.cuStreamSynchronize(stream)
                if self.sums is not None and summed is None:
                    summed = self._summed(stream, n)
            except BaseException:
                self.slots.put(slot)
                raise
            finally:
                with self.lock:
                    self.copying -= 1
                    if not self.copying:
                        self.d2h_busy_s += time.monotonic() - self.busy_since
            with self.lock:
                self.copied_bytes += n
            self.in_host.put((i, off, n, slot, summed))
            if summed is not None:          # safe in the arena, its words known
                self._known(i, summed[1])

        try:
            self.drv.cuCtxSetCurrent(self.ctx)
            gpucopy.run_chunks(self.drv, self.work, len(self.table), self.streams, one,
                               self.handout.captured, self.order, self.spares)
            self.d2h_s = time.monotonic() - self.t0
        finally:
            self.copied.set()
            for _ in range(self.threads):
                self.in_host.put(None)

    def _summed(self, stream: Any, n: int) -> Summed:
        """The checksum and pointers of the n bytes the kernel took last on `stream`."""
        assert self.sums is not None
        h, hits = self.sums.result(stream, n)
        return h, self.index_of[hits.nonzero()[0]].tolist()

    def _scan_shadow(self) -> None:
        """The shadowed buffers' chunks hashed and scanned on the GPU, those the job's calls
        wait for first, then in the copy's order (scan_order), held with the copy (pause): each
        buffer is back (handout.py) once all its chunks are, its checksums kept for its copy.
        In the copy's order alone, a 60% job's call on a 48 MiB shadowed buffer waited 0.41 s
        past its release on the H200 (bench/results/2026-11-30.md, perf run 8)."""
        left = gpucopy.chunks_of(self.work, len(self.table))
        self.drv.cuCtxSetCurrent(self.ctx)
        stream = gpucopy.stream(self.drv)
        try:
            while self.go.wait() and (w := self.scan_order.take()) is not None:
                i, off, n = w
                self.crew.check()
                if self.copied.is_set():     # the copy took every chunk itself
                    return
                assert self.sums is not None     # started only with the kernel
                self.sums.launch(stream, self.sources[i] + off, n)
                self.drv.cuStreamSynchronize(stream)
                summed = self._summed(stream, n)
                self.handout.points(i, summed[1])
                with self.lock:
                    self.summed[(i, off)] = summed
                left[i] -= 1
                if left[i] == 0:
                    self.handout.came_back(i)
            self.scan_s = time.monotonic() - self.t0
        finally:
            self.drv.raw.cuStreamSynchronize(stream)
            self.drv.raw.cuStreamDestroy_v2(stream)
            self.scanned.set()

    def _known(self, i: int, into: list[int]) -> None:
        """One chunk of buffer i is in host memory, and what its words point into is known:
        the handout learns it, and that the buffer is back once all its chunks are."""
        self.handout.points(i, into)
        with self.lock:
            self.scan_left[i] -= 1
            whole = self.scan_left[i] == 0
        if whole:
            self.handout.came_back(i)     # may tell the agent: its socket may fail

    def _save(self) -> None:
        """Write each chunk copied, hashed and scanned as it goes (unless the GPU did: then
        the handout knew the chunk as it was copied), and give its slot back; the handout
        learns what a chunk the CPU scanned points into, and when its buffer is all known."""
        while self.save_go.wait() and (item := self.in_host.get()) is not None:
            i, off, n, slot, summed = item
            try:
                if self.crew.stopped.is_set():
                    continue
                data = self.arena.view(slot, n)
                if summed is None:
                    hits = self.writer.put_scanned(self.table[i].va, off, data, self.targets)
                    self._known(i, self.index_of[hits.nonzero()[0]].tolist())
                else:
                    self.writer.put(self.table[i].va, off, data, summed[0], "blocks")
                with self.lock:
                    self.saved_bytes += n
            except BaseException as e:
                self.crew.fail(e)
            finally:
                self.slots.put(slot)

    def wait_copied(self) -> None:
        """Every chunk is in host memory (or the copy failed: raised); the agent is no longer
        asked what its calls wait for."""
        self.copied.wait()
        self.scanned.wait()                # the scan reads the shadow too
        if self.watcher is not None:
            self.watcher.join()
        self.crew.raise_failure()

    def join(self) -> Copied:
        """Every chunk is written (or the copy failed: raised)."""
        self.crew.wait()
        self.disk_s = time.monotonic() - self.t0
        self.crew.raise_failure()
        return Copied(sum(n for _i, _o, n in self.work), self.d2h_s, self.disk_s)

    def stop_copying(self) -> None:
        """No chunk is being copied from the device from now on (stopped if it had not ended):
        pos's shadow and its mapping of the job's memory may be freed."""
        if not self.t0:
            return                       # never started
        if not self.copied.is_set():
            self.crew.stop()
        self.copied.wait()
        self.scanned.wait()                # the scan reads the shadow too
        if self.watcher is not None:
            self.watcher.join()

    def close(self) -> None:
        """Stop (after a failure elsewhere) and wait until nothing runs: the arena may be freed
        then. A copy still under way is stopped, whatever is held (scans held with every chunk
        already copied would otherwise keep its threads waiting)."""
        self.crew.stop()
        self.stop_copying()
        self.crew.wait()
        if self.sums is not None:
            self.sums.close()
