"""The concurrent engine: checkpoint and restore a `pos run` job while it runs, from outside it.

Checkpoint (GPU state only, `gpu_only=True`, or the whole process):
 1. before the cut: page-locked host memory (as much as the job, where the host can spare it)
    and a device shadow (what is free) are set aside;
 2. the cut (the agent holds the job's calls, drains those inside the driver, synchronises);
 3. the agent exports its allocations; pos imports them and copies what fits device-to-device
    into its shadow (milliseconds at HBM speed), then starts copying everything to host memory
    and the image's files (pos/scheduler/copier.py) on threads of its own;
 4. whole process: the job gives its physical memory up (pos holds it), the driver checkpoints
    the now small CUDA context, CRIU dumps the process (into pos's huge-page tmpfs,
    pos/scheduler/staging.py), the driver restores and unlocks it, and the job maps its memory
    again at the same addresses; without --leave-running CRIU leaves the job stopped instead,
    and pos ends it once the image is sealed (until then a failure lets it run on). The copy
    of what pos could not shadow goes on meanwhile (the job's memory cannot change while it is
    held); the shadowed buffers follow once the frozen part is over;
 5. the job is released: a call waits only if it may write a buffer not saved yet, a launch
    for the buffers its parameter words point into (pos/scheduler/handout.py says when each is
    safe to write);
 6. once every buffer is in host memory pos lets go of the job's memory and its shadow, and
    once every chunk is written it seals the image.
Restore into the live job (`restore_gpu`) or into a new process (`restore_full`, after CRIU and
the driver): the job runs as soon as its memory is mapped; a call waits only for the buffers it
may touch that are not back yet, and pos fills them buffer by buffer.

If pos dies, the agent releases a held job when its connection closes; while the job's memory
is pos's (steps 4's hoist to remap) the watchdog holds it too and gives it back.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from pos import image, nvml
from pos.agent.control import Agent, Buffer, Cut, Gate, Refused
from pos.errors import BadInput, PosError
from pos.image import gpuindex
from pos.scheduler import restore, steps
from pos.scheduler.criu import Options
from pos.scheduler.handout import Handout
from pos.scheduler.manifest import new_manifest

if TYPE_CHECKING:     # imported where used: numpy takes 0.15 s to import on the H100 host,
    from pos.scheduler import copier, gpucopy    # and a restore starts CRIU before it
    from pos.scheduler.gpumap import Onto

Echo = Callable[[str], None]
DEFAULT_STREAMS = 8
SHADOW_RESERVE = 1 << 30       # device memory left free for the job when sizing the shadow
SHADOW_MAX_ENV = "POS_SHADOW_MAX_BYTES"   # at most this much device memory for the shadow
STALL_S = 60.0                 # the cut's bound on the calls already inside the driver
HOIST_STACK = 0                # bytes of stack a hoisted context keeps (see hoist_stack)


@dataclass
class Report:
    """What one concurrent checkpoint or restore did, and how long the job was held."""

    path: str
    buffers: int
    bytes: int
    cut: Optional[Cut]
    gate: Optional[Gate]
    shadow_bytes: int = 0
    release_s: float = 0.0         # from the cut to the job's release
    d2h_gbps: Optional[float] = None
    h2d_gbps: Optional[float] = None
    foreign_bytes: int = 0         # device memory the agent could not own: the driver's
                                   # checkpoint saves it in a whole-process image
    timings: dict[str, float] = field(default_factory=dict)
    restored_pid: Optional[int] = None   # a restore into a new process: the job's PID there
    ranks: list[dict[str, Any]] = field(default_factory=list)   # a job of several CUDA
                                   # processes: each one's pid, gpu, bytes, cut and gate

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _gpu_of(pid: int) -> Optional[str]:
    """The UUID of the one GPU the job uses (None: NVML sees none). A job on several is
    refused: pos's concurrent copier shadows and copies one GPU's memory per process."""
    used = list(nvml.gpus_of([pid]))
    if len(used) > 1:
        raise BadInput(f"PID {pid} uses {len(used)} GPUs ({', '.join(used)}): pos's concurrent "
                       "copier shadows and copies one GPU's memory",
                       f"checkpoint it stop-the-world: `pos checkpoint {pid} -D DIR`")
    return used[0] if used else None


def _cuda_device(gpu: Optional[str]) -> int:
    """pos's CUDA number of the GPU named `gpu` (NVML's UUID; the job's own number may differ,
    under CUDA_VISIBLE_DEVICES); None: device 0."""
    from pos.scheduler import gpucopy

    return gpucopy.ordinal(gpu) if gpu else 0


def _device_of(pid: int) -> int:
    """pos's CUDA number of the one GPU the job uses: the shadow and the copies go there."""
    return _cuda_device(_gpu_of(pid))


class _Saver:
    """Steps 1-3 and 5-6 of a checkpoint, shared by the GPU-only and the whole-process ones."""

    def __init__(self, agent: Agent, streams: int, chunk: int) -> None:
        from pos.scheduler import gpucopy

        self.agent: Optional[Agent] = agent   # None once the job is gone (CRIU ended it)
        self.pid = agent.pid
        self.streams, self.chunk = streams, chunk
        self.gpu = _gpu_of(agent.pid)         # the job's GPU, recorded in its index
        self.drv = gpucopy.context(_cuda_device(self.gpu))
        self.ctx = gpucopy.current(self.drv)  # made current again by each step (`_use`)
        self.rank: Optional[int] = None       # one process of several: its PID (see write)
        self.timings: dict[str, float] = {}
        self.host: Optional[gpucopy.Pinned] = None
        self.shadow: Optional[gpucopy.Shadow] = None
        self.mem: Optional[gpucopy.Imported] = None
        self.copier: Optional[copier.Copier] = None
        self.handout: Optional[Handout] = None
        self.fds: list[int] = []
        self.table: list[Buffer] = []
        self.shadowed: set[int] = set()
        self.shadow_bytes = 0

    def _timed(self, name: str, fn: Callable[[], Any]) -> Any:
        return steps.timed(self.timings, name, fn)

    def _use(self) -> None:
        """pos's context on this job's GPU current on this thread: the objects made here keep
        the context current when they were made, and a job of several processes has one
        saver, and one GPU, per process."""
        self.drv.call("cuCtxSetCurrent", self.ctx)

    def prepare(self, gpu_only: bool) -> int:
        """Before the cut: the page-locked arena (see copier.arena_bytes) and the shadow (the
        device memory free but 1 GiB, at most the job's). The device memory the agent does not
        own is returned."""
        from pos.scheduler import gpucopy

        self._use()
        assert self.agent is not None
        st = self.agent.status()
        if not st.owning:
            raise BadInput(f"the agent of process {self.pid} does not own its memory "
                           "(POS_OWN=0)", "run the job under `pos run` without POS_OWN=0")
        if gpu_only and st.foreign_bytes:
            raise BadInput(f"process {self.pid} holds {st.foreign_bytes} bytes of device memory "
                           f"in {st.foreign_allocs} allocations pos does not own (stream-ordered "
                           "pools, managed or pitched memory, its own VMM mappings such as "
                           "PyTorch's expandable segments): a GPU-only image would lack them",
                           "take a whole-process image (--concurrent without --gpu-only: the "
                           "driver saves them), or run the job without those allocators")
        want = st.owned_bytes
        self.owned_bytes = want
        from pos.scheduler import copier

        arena = copier.arena_bytes(want, self.chunk)
        self.host = self._timed("pin", lambda: gpucopy.Pinned(self.drv, arena))
        self.timings["pinned_peak_bytes"] = self.host.size
        room = max(0, gpucopy.free_device_bytes(self.drv) - SHADOW_RESERVE)
        room = min(room, int(os.environ.get(SHADOW_MAX_ENV, room)))
        self.shadow = self._timed("shadow_alloc", lambda: gpucopy.Shadow(self.drv, min(room, want)))
        return st.foreign_bytes

    def cut(self, at: Optional[int] = None, timeout_s: float = STALL_S) -> Cut:
        """The job held and drained (now, or just before the NCCL launch past `at`: see
        pos/scheduler/collective.py)."""
        assert self.agent is not None
        agent = self.agent
        return self._timed("cut", lambda: agent.cut(timeout_s, at))

    def import_memory(self) -> None:
        """The held job's allocations, exported by it and imported by pos."""
        from pos.scheduler import gpucopy

        self._use()
        assert self.agent is not None and self.shadow is not None
        # what the job and the rest leave free at the cut (pos's own shadow counted as free)
        self.timings["free_at_cut_bytes"] = (gpucopy.free_device_bytes(self.drv)
                                             + self.shadow.size)
        self.table = self.agent.table()
        self.fds = self._timed("export", self._export)
        self.mem = self._timed("import", lambda: gpucopy.Imported(self.drv, self.table, self.fds))

    def _export(self) -> list[int]:
        """The job's descriptors. A buffer the driver would not export is moved into new memory
        first (poshook.c: reseat); where the device has no room for that, pos gives its shadow
        back and asks once more (the buffers are then copied from the running job, the gate
        holding their writers)."""
        from pos.scheduler import gpucopy

        assert self.agent is not None and self.shadow is not None
        try:
            x = self.agent.export()
        except Refused as e:
            if not e.need or not self.shadow.size:
                raise
            self.shadow.close()
            self.shadow = gpucopy.Shadow(self.drv, 0)
            self.timings["shadow_given_back_bytes"] = e.need
            x = self.agent.export()
        if x.reseated or x.leaked:
            self.timings.update(reseat=x.reseat_s, reseated_bytes=x.reseated_bytes,
                                leaked_closed_n=x.leaked)
        return x.fds

    def snapshot(self) -> list[int]:
        """Shadow what fits, the smallest buffers first (most of a job's calls use its many
        small buffers, and a call that may write a buffer not shadowed waits until pos has
        copied it from the job); the source of each buffer's copy (its shadow, or the job's
        memory for a buffer that did not fit)."""
        from pos.scheduler import gpucopy

        self._use()
        assert self.mem is not None and self.shadow is not None
        sources = list(self.mem.local)
        src, dst, sizes, at = [], [], [], 0
        for i in sorted(range(len(self.table)), key=lambda i: (self.table[i].size, i)):
            b = self.table[i]
            if at + b.size <= self.shadow.size:
                sources[i] = self.shadow.ptr + at
                src.append(self.mem.local[i])
                dst.append(sources[i])
                sizes.append(b.size)
                self.shadowed.add(i)
                at += b.size
        self.shadow_bytes = at
        self._timed("shadow", lambda: gpucopy.device_to_device(self.drv, dst, src, sizes))
        return sources

    def start_copy(self, folder: Path, sources: list[int], rank: Optional[int] = None) -> None:
        """The copy to host memory and into the image's data files (`rank`: the PID of one
        process of several, whose files are named after it), on threads of its own from now on
        (the job may still be held)."""
        from pos.image import gpu as gpuimage
        from pos.scheduler import copier

        self._use()
        assert self.host is not None
        self.rank = rank
        self.handout = Handout(self.table, safe=self.shadowed)
        self.writer = gpuimage.Writer(folder, compress=False,
                                      prefix=gpuindex.data_prefix(rank))
        self.copier = copier.Copier(self.drv, self.table, sources, self.shadowed, self.host,
                                    self.chunk, self.streams, self.writer, self.handout,
                                    image.workers())
        self.copier.start()

    def freeze_copy(self) -> None:
        """The job is about to be frozen (the driver's calls, CRIU's dump): the CPU and the
        host's memory are theirs, but for the copy of what pos could not shadow."""
        assert self.copier is not None
        self.copier.hold_scans()
        self.copier.hold_shadowed()

    def thaw_copy(self) -> None:
        """The frozen part is over: every part of the copy goes on."""
        assert self.copier is not None
        self.copier.release_scans()
        self.copier.release_shadowed()

    def release(self) -> None:
        """The job goes on: its calls wait only for the buffers they may write that are not
        saved yet (see pos/scheduler/handout.py)."""
        assert self.agent is not None and self.handout is not None and self.copier is not None
        self.timings["copied_at_release_bytes"] = self.copier.copied_bytes
        self.agent.copy()
        self.handout.attach(self.agent)
        self.copier.watch(self.agent)

    def wait_copied(self) -> None:
        """Every buffer is in host memory: pos lets go of the job's memory and its shadow (the
        job keeps its own mapping)."""
        assert self.copier is not None
        self.copier.wait_copied()
        self.timings["d2h"] = self.copier.d2h_s
        self.drop_device()

    def drop_device(self) -> None:
        self._use()
        if self.copier is not None:
            self.copier.stop_copying()       # nothing may copy from what is freed here
        if self.mem is not None:
            self.mem.close()
            self.mem = None
        if self.shadow is not None:
            self.shadow.close()
            self.shadow = None
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def touched(self) -> set[int]:
        """The buffers the job's calls used once released, by address (a restore fills them
        first); none are known of a job CRIU ended, or one gone since."""
        if self.agent is None:
            return set()
        try:
            return {b.va for b in self.agent.table() if b.touched}
        except PosError:
            return set()

    def write(self, folder: Path) -> copier.Copied:
        """The rest of the data files, then the GPU index."""
        self._use()
        assert self.copier is not None
        hot = self.touched()
        done = self.copier.join()
        self.writer.close()
        self.timings["disk"] = done.disk_s
        buffers = [{"base": f"0x{b.va:x}", "size": b.size, "mapped": b.mapped,
                    "device": b.device, "hot": b.va in hot,
                    "chunks": sorted(self.writer.chunks.get(b.va, []), key=lambda c: c["offset"])}
                   for b in self.table]
        gpuindex.write_index(folder, {"format": gpuindex.FORMAT, "pid": self.pid,
                                      "parent": None, "gpu": self.gpu, "buffers": buffers},
                             self.rank)
        return done

    def close(self) -> None:
        self._use()
        if self.copier is not None:
            self.copier.close()              # nor write from the arena
        self.drop_device()
        if self.host is not None:
            self.host.close()
            self.host = None


def paused(s: _Saver, call: Callable[[], Any]) -> Any:
    """The driver's checkpoint or restore of the job, with pos's copy to host memory held: the
    driver copies the job's context over the same bus, and it holds the job meanwhile."""
    assert s.copier is not None
    s.copier.pause()
    try:
        return call()
    finally:
        s.copier.resume()


def checkpoint_gpu(pid: int, directory: Path, streams: int = DEFAULT_STREAMS,
                   chunk_mb: int = 64, echo: Echo = lambda _: None) -> Report:
    """The GPU state of `pid` at one instant, taken while it runs (rolls back only into a live
    job: `restore_gpu`)."""
    with Agent(pid) as agent:
        s = _Saver(agent, streams, chunk_mb << 20)
        try:
            foreign = s.prepare(gpu_only=True)
            partial = image.prepare(Path(directory), agent.status().owned_bytes)
            echo(f"checkpointing the GPU state of PID {pid} concurrently: "
                 f"{s.owned_bytes / 2**30:.2f} GiB of device memory")
            try:
                t0 = time.monotonic()
                cut = s.cut()
                s.import_memory()
                s.start_copy(partial, s.snapshot())
                s.release()
                release_s = time.monotonic() - t0
                s.wait_copied()
                gate = agent.end()
                manifest = new_manifest(pid, [pid], [pid], "", Options(), True,
                                               nvml.gpus_of([pid]))
                copy = s.write(partial)
                manifest.timings = s.timings
                manifest.stall_s = gate.held_max_s
                final = image.seal(partial, manifest)
            except BaseException:
                s.close()
                image.discard(partial)
                raise
        finally:
            s.close()
    return Report(str(final), len(s.table), copy.bytes, cut, gate, s.shadow_bytes, release_s,
                  copy.bytes / copy.d2h_s / 1e9 if copy.d2h_s else None, None, foreign,
                  s.timings)


def _checked_by_restore(directory: Path) -> list[str]:
    """The files whose checksums a restore verifies: all but the GPU data, each of whose chunks
    is checked as it is read (a restore does not wait for a sha256 of gigabytes first)."""
    return [n for n in image.load(directory).files if not n.startswith("gpu-data-")]


def _verify(directory: Path) -> image.Manifest:
    """Every file of the image checked against its manifest, except the GPU data's contents."""
    return image.verify(directory, _checked_by_restore(directory))


def restore_gpu(pid: int, directory: Path, streams: int = DEFAULT_STREAMS,
                echo: Echo = lambda _: None) -> Report:
    """Put a GPU image back into the live job `pid`, on demand (the chunks as they were
    saved, each through a fill thread's ring)."""
    from pos.scheduler import gpucopy

    directory = Path(directory)
    _verify(directory)
    echo(f"restoring the GPU state of PID {pid} from {directory}")
    index = gpuindex.read_index(directory)
    saved, hot = gpuindex.resolve(directory, index), gpuindex.hot(index)
    with Agent(pid) as agent:
        drv = gpucopy.context(_device_of(pid))
        rings = gpucopy.Rings(drv, streams, fill_piece(), FILL_DEPTH)
        try:
            t0 = time.monotonic()
            cut = agent.cut(STALL_S)
            table = [replace(b, touched=b.va in hot) for b in agent.table()]
            missing = [b for b in table if b.va not in saved or saved[b.va][1] != b.size]
            if missing or len(saved) != len(table):
                agent.end()
                raise BadInput(f"the image {directory} does not hold the buffers process {pid} "
                               f"has now ({len(missing)} of {len(table)} differ)", "restore into "
                               "the job the image was taken of, in the same phase of its work")
            fds = agent.export().fds
            try:
                mem = gpucopy.Imported(drv, table, fds)
            finally:
                for fd in fds:
                    os.close(fd)
            try:
                agent.restore()
                release_s = time.monotonic() - t0
                handout = Handout(table)
                handout.attach(agent)
                copy = _fill(drv, table, mem.local, saved, streams, handout, rings)
                gate = agent.end()
            finally:
                mem.close()   # on failure the agent ends a half-restored job as pos goes
        finally:
            rings.close()
    return Report(str(directory), len(table), copy.bytes, cut, gate, 0, release_s, None,
                  copy.gbps, 0, {"h2d": copy.seconds})


# a fill thread reads, hashes and copies this many KiB at a time: 2 MiB beat 1 MiB on the H100
# and the H200 once each piece was made in one pass (pos/image/chunks.c: pass; session 8's
# measurement, bench/results/2026-11-26.md)
FILL_PIECE_KIB = os.environ.get("POS_FILL_PIECE_KIB", "2048")
FILL_DEPTH = 4         # pieces a fill thread has in flight (their copies overlap its reads)
# copy out of the data files mapped (the default), or read them (POS_FILL_MAPPED=0)
FILL_MAPPED = os.environ.get("POS_FILL_MAPPED", "1") != "0"
# a restore's fill starts once pos's new memory exists, beside CRIU, and pauses for the driver's
# restore, which copies the context back to the device and took twice as long beside it (0.39 s
# against 0.18 s at 16 GiB on the H100); POS_FILL_FROM=start: no pause; =release: the fill
# starts only when the job is released
FILL_FROM = os.environ.get("POS_FILL_FROM", "pause")
FILL_FROMS = ("pause", "start", "release")


def check_fill_settings() -> None:
    """The fill's settings from the environment, checked before anything is touched (by a
    migration, before the job is saved and ended)."""
    if FILL_FROM not in FILL_FROMS:
        raise BadInput(f"POS_FILL_FROM={FILL_FROM} is not one of {', '.join(FILL_FROMS)}",
                       "unset it (the fill then pauses for the driver's restore)")
    fill_piece()


def fill_piece() -> int:
    """The fill's piece in bytes, from POS_FILL_PIECE_KIB: a power of two from 256 to 4096 KiB,
    so that a thread's ring divides the pinned arena's parts."""
    kib = int(FILL_PIECE_KIB) if FILL_PIECE_KIB.isdigit() else 0
    if not 256 <= kib <= 4096 or kib & (kib - 1):
        raise BadInput(f"POS_FILL_PIECE_KIB={FILL_PIECE_KIB} is not a power of two from 256 to "
                       "4096", "unset it (pieces are then 2048 KiB)")
    return kib << 10


def fill_order(table: list[Buffer], saved: dict[int, tuple[Path, int, list[dict[str, Any]]]]
               ) -> tuple[dict[tuple[int, int], dict[str, Any]], list[tuple[int, int, int]]]:
    """Every chunk by (buffer index, offset), and the fill's work as (buffer index, offset,
    length): first the buffers the job used right after its checkpoint (`touched`: its next
    calls will want them; on the H100 a restored job waited 0.38-0.76 s for such buffers filled
    after others), then the smaller buffers first (a job that used everything while its copy
    ran gets that order alone); a chunk outside its buffer is refused."""
    chunk_of = {(i, c["offset"]): c for i, b in enumerate(table) for c in saved[b.va][2]}
    work = sorted(((i, off, c["raw"]) for (i, off), c in chunk_of.items()),
                  key=lambda w: (not table[w[0]].touched, table[w[0]].size, w[0], w[1]))
    for i, off, n in work:
        if off < 0 or off + n > table[i].mapped:
            raise BadInput(f"a chunk of buffer {table[i].va:#x} lies outside it",
                           "the image is corrupt: take a new checkpoint")
    return chunk_of, work


def _fill(drv: Any, table: list[Buffer], dest: list[int],
          saved: dict[int, tuple[Path, int, list[dict[str, Any]]]], streams: int,
          handout: "Handout", rings: gpucopy.Rings, mapped: bool = FILL_MAPPED,
          gate: Callable[[], None] = lambda: None) -> gpucopy.Copy:
    """Read every buffer's chunks (checksums checked) through the threads' `rings` of pinned
    pieces and copy them to device memory at `dest`, the smaller buffers first (most calls'
    buffers come back soon, a big one alone does not hold them up); the handout learns which
    other buffers each buffer's words point into, and then that it is back. Each chunk calls
    `gate()` first (which waits while the fill is paused, and raises to stop it)."""
    import numpy as np

    from pos.image import gpu as gpuimage
    from pos.scheduler import gpucopy

    targets = gpuimage.Targets([(b.va, b.va + b.mapped) for b in table])   # table by address
    chunk_of, work = fill_order(table, saved)
    local = threading.local()
    lock = threading.Lock()
    read_s = [0.0]          # summed over the threads: reading, checking and copying the chunks
    open_files: list[dict[str, int]] = []
    maps = gpuimage.Maps() if mapped else None
    # the chunk failures, the first of which stops the fill (the rest are not copied) and is
    # what the user is told, whichever chunk the caller's wait comes to first
    failures: list[BaseException] = []

    def one(stream: Any, i: int, off: int, n: int) -> None:
        if failures:
            raise _Stopped()
        try:
            copy_chunk(stream, i, off, n)
        except BaseException as e:
            with lock:
                failures.append(e)
            raise

    def copy_chunk(stream: Any, i: int, off: int, n: int) -> None:
        gate()
        if not hasattr(local, "fds"):
            local.fds = {}
            with lock:
                open_files.append(local.fds)
        folder, chunk = saved[table[i].va][0], chunk_of[(i, off)]
        t = time.monotonic()
        if chunk["zstd"]:     # decompressed in host memory, then copied from there
            data = np.empty(n, np.uint8)
            hits = gpuimage.read_chunk_into(folder, chunk, data, local.fds, targets)
            drv.call("cuMemcpyHtoD_v2", gpucopy.U64(dest[i] + off),
                     gpucopy.C.c_void_p(data.ctypes.data), gpucopy.SZ(n))
        else:
            hits = gpuimage.fill_chunk(rings.mine(stream), folder, chunk, dest[i] + off,
                                       local.fds, targets, maps)
        with lock:
            read_s[0] += time.monotonic() - t
        handout.points(i, hits)

    order = gpucopy.Order(work)        # what the job's calls wait for first, once it runs
    filled = threading.Event()
    watcher = order.follow(lambda: handout.agent, {b.va: i for i, b in enumerate(table)},
                           filled)
    try:
        seconds = gpucopy.run_chunks(drv, work, len(table), streams, one, handout.came_back,
                                     order)
    except _Stopped:
        raise failures[0] from None
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


class _Stopped(Exception):
    """A chunk not copied because another one failed first; the caller raises that failure."""


def hoist_stack() -> Optional[int]:
    """The per-thread stack, in bytes, that the job's context keeps while its memory is hoisted
    (POS_HOIST_STACK, default HOIST_STACK; `off`: as it is). The context's local memory is
    that times every thread the GPU holds, and the driver's checkpoint copies it in the stall."""
    v = os.environ.get("POS_HOIST_STACK", str(HOIST_STACK))
    return None if v == "off" else int(v)


def checkpoint_full(pid: int, directory: Path, options: Options, leave_running: bool = True,
                    lock_timeout_ms: int = 10_000, streams: int = DEFAULT_STREAMS,
                    chunk_mb: int = 64, echo: Echo = lambda _: None) -> Report:
    """A whole-process image of the tree of `pid`, whose CUDA processes are `pos run` jobs (CRIU
    + the driver, each job's device memory hoisted out of the driver's checkpoint and copied by
    pos): restorable into new processes by `restore_full`. See the module docstring for the
    steps; a job of several CUDA processes (DDP's ranks) is cut with every process just before
    the same collective (pos/scheduler/collective.py) and each one's memory copied beside the
    others'."""
    from pos.scheduler import copier
    from pos.scheduler import criu as criu_mod
    from pos.scheduler import cudackpt, procs, restorable, staging
    from pos.scheduler.watchdog import Plan

    started = time.monotonic()
    copier.frozen_copy()               # a bad setting is refused before anything is touched
    procs.require_checkpointable(pid)
    procs.require_dumpable(pid)
    criu = criu_mod.find()
    pids = procs.tree(pid)
    options = options.fitted(pids)
    cuda = cudackpt.gpu_pids(pids)
    if not cuda:
        Agent(pid).close()             # no agent: that is the sentence to say
        raise BadInput(f"the tree of PID {pid} has no CUDA state", "checkpoint it with `pos "
                       "checkpoint PID -D DIR` (the concurrent engine saves `pos run` jobs)")
    agents: list[Agent] = []
    try:
        for p in cuda:                 # no agent: one sentence, before anything is touched
            agents.append(Agent(p))
        savers = [_Saver(a, streams, chunk_mb << 20) for a in agents]
    except BaseException:
        for a in agents:
            a.close()
        raise
    several = len(savers) > 1
    try:
        restorable.peer_memory(cuda, {s.pid: s.agent.status() for s in savers})
        foreign = sum(s.prepare(gpu_only=False) for s in savers)
        owned = sum(s.owned_bytes for s in savers)
        resident = procs.resident_bytes(pids)          # what CRIU will write, about
        partial = image.prepare(Path(directory), resident + owned)
        manifest = new_manifest(pid, pids, cuda, criu.version_text, options,
                                leave_running, nvml.gpus_of(cuda))
        plan = Plan("checkpoint", pids, cuda, criu_path=criu.path, images=str(partial),
                    stopped=[p for p in pids if procs.state(p) in ("T", "t")],
                    criu_options=options.to_json())
        echo(f"checkpointing PID {pid} ({manifest.comm}) concurrently: "
             f"{owned / 2**30:.2f} GiB of device memory"
             + (f" in {len(savers)} processes" if several else ""))
        with steps.Guard(plan, echo) as g:
            stage = staging.directory(Path(directory).name, partial, resident)
            dumped = stage or partial      # where CRIU writes
            t0 = time.monotonic()
            g.step("cut", staging=str(stage or ""))
            if several:
                from pos.scheduler import collective

                cuts = collective.cut_together(agents, lambda i, at: savers[i].cut(
                    at, STALL_S if at is None else collective.REACH_S))
            else:
                cuts = [savers[0].cut()]
            # held now, every rank: nothing maps a peer's memory until they go on
            restorable.peer_memory(cuda, {s.pid: s.agent.status() for s in savers})
            for s in savers:
                s.import_memory()
                s.start_copy(partial, s.snapshot(), s.pid if several else None)
                g.hold(s.pid, s.fds)       # while the job is held, its memory still
            g.step("hoist", hoisted=True)
            for s in savers:
                h = g.timed("hoist", lambda s=s: s.agent.hoist(hoist_stack()))
                g.timings["stack_was_bytes"], g.timings["stack_rc"] = h.stack, h.stack_rc
            for s in savers:
                s.agent.close()            # CRIU dumps no socket connected to pos
                s.freeze_copy()
            by_pid = {s.pid: s for s in savers}
            g.each("lock", cuda, lambda p: cudackpt.lock(p, lock_timeout_ms))
            g.each("checkpoint", cuda,
                   lambda p: paused(by_pid[p], lambda: cudackpt.checkpoint(p)))
            g.step("dump")
            argv = criu.dump_argv(pid, dumped, options, leave_running)
            g.dump(criu, argv, dumped)
            if leave_running:
                g.each("restore", cuda,
                       lambda p: paused(by_pid[p], lambda: cudackpt.restore(p)))
                g.each("unlock", cuda, cudackpt.unlock)
                for s in savers:
                    s.agent = Agent(s.pid)
                    back = g.timed("remap", lambda s=s: s.agent.remap(s.fds))
                    g.timings["stack_back"] = back.stack_s
                g.step("copy", hoisted=False)
                for s in savers:
                    s.thaw_copy()
                for s in savers:
                    s.release()
            else:
                # CRIU left the job stopped, its memory pos's: should anything fail before the
                # image is sealed the undo lets it run on; after, it ends
                for s in savers:
                    s.agent = None
                    s.thaw_copy()
                g.step("copy")
            release_s = time.monotonic() - t0
            if stage is not None:
                g.timed("move", lambda: staging.move_into(stage, partial))
                g.step(g.plan.step, staging="")
            for s in savers:
                s.wait_copied()
            gates = [s.agent.end() if s.agent is not None else None for s in savers]
            g.step("seal")
            copies = [s.write(partial) for s in savers]
            manifest.timings = {**_saver_timings(savers), **g.timings}
            manifest.stall_s = release_s if leave_running else None
            final = g.timed("checksum", lambda: image.seal(partial, manifest))
            g.timings["sealed_s"] = time.monotonic() - started
            if not leave_running:
                g.end(hoisted=False)       # the image holds the job now
        manifest.timings = {**_saver_timings(savers), **g.timings}
        image.write_manifest(final, manifest)
    finally:
        for s in savers:
            s.close()
            if s.agent is not None:
                s.agent.close()
    copied = sum(c.bytes for c in copies)
    d2h_s = max(c.d2h_s for c in copies)
    worst = max((x for x in gates if x is not None), key=lambda x: x.held_max_s, default=None)
    ranks = ([{"pid": s.pid, "gpu": s.gpu, "bytes": c.bytes, "cut": asdict(k),
               "gate": asdict(x) if x is not None else None}
              for s, c, k, x in zip(savers, copies, cuts, gates)] if several else [])
    return Report(str(final), sum(len(s.table) for s in savers), copied, cuts[0], worst,
                  sum(s.shadow_bytes for s in savers), release_s,
                  copied / d2h_s / 1e9 if d2h_s else None, None, foreign, manifest.timings,
                  ranks=ranks)


def _saver_timings(savers: list[_Saver]) -> dict[str, float]:
    """The copy's timings: of several jobs, the longest of each (their copies run side by
    side), and the pinned memory summed; of one, its own."""
    out: dict[str, float] = {}
    for s in savers:
        for k, v in s.timings.items():
            out[k] = out.get(k, 0.0) + v if k.endswith("_bytes") else max(out.get(k, v), v)
    return out


def restore_full(directory: Path, inherit_fds: tuple[str, ...] = (), streams: int = 16,
                 echo: Echo = lambda _: None, to_gpu: Optional[Onto] = None) -> Report:
    """Start the job of a whole-process concurrent image again, in a new process: CRIU, the
    driver's restore of its small context, then new device memory at the same addresses, filled
    from the image while the job runs (its calls wait only for the buffers not back yet). A job
    of several CUDA processes gets each one's memory back beside the others'. `to_gpu`: onto
    that GPU of this host (NVML's index), or that map of GPUs, rather than where it was taken."""
    from pos.scheduler import procs

    check_fill_settings()
    directory = Path(directory).absolute()
    t0 = time.monotonic()
    started = procs.age(os.getpid())     # pos's own start-up, before the restore's clock
    check = _checked_by_restore(directory)
    pairs: list[tuple[str, str]] = []
    where: list[str] = []         # the UUIDs of the GPUs it moves to
    if to_gpu is not None:
        from pos.scheduler import gpumap

        pairs, where = gpumap.onto(directory, to_gpu)
    ranks = _ranks(directory)
    moved = dict(pairs)
    pres = [_Prefetch(directory, streams, where[0] if where else None)] if ranks == [None] else \
        [_Prefetch(directory, streams, None, rank, moved) for rank in ranks]
    out: dict[str, Any] = {}

    def fill(g: Any, _root: int) -> None:
        g.step("remap")
        for pre in pres:      # pos's new device memory (made during CRIU's part)
            g.timed("memory", pre.ready.wait)
            if pre.error is not None:
                raise pre.error
        agents: list[Agent] = []
        try:
            for pre in pres:
                agents.append(Agent(pre.pid))
                table = agents[-1].table()
                if [(b.va, b.size) for b in table] != [(b.va, b.size) for b in pre.table]:
                    raise PosError(f"the restored job's allocations do not match {directory}'s "
                                   "GPU index", "take a new checkpoint")
            for pre, agent in zip(pres, agents):
                back = g.timed("remap", lambda: agent.remap(pre.fds, restore=True))
                g.timings["stack_back"] = back.stack_s
            out["release_s"] = time.monotonic() - t0
            for pre, agent in zip(pres, agents):
                pre.handout.attach(agent)
                pre.resume()
            g.step("fill")
            out["copies"] = [pre.join() for pre in pres]
            out["gates"] = [agent.end() for agent in agents]
            out["ended_at"] = time.monotonic() - t0
            g.step("done", hoisted=False)
        finally:
            for agent in agents:
                agent.close()

    try:
        result = restore.restore_tree(directory, inherit_fds, echo, gpu_pairs=pairs, check=check,
                                      hoisted=True, finish=fill,
                                      before_driver=lambda: [pre.pause() for pre in pres])
    finally:
        t1 = time.monotonic()
        for pre in pres:
            pre.close()
        out["let_go"] = time.monotonic() - t1
    paused = [pre.paused_s() for pre in pres]     # the fill's own time and rate leave its pause
    own = [c.seconds - p for c, p in zip(out["copies"], paused)]    # out; side by side
    from pos.scheduler import gpucopy     # imported by the fill by now

    copy = gpucopy.Copy(sum(c.bytes for c in out["copies"]), max(own),
                        sum(c.read_thread_s for c in out["copies"]))

    def last(at: Callable[[_Prefetch], float]) -> float:
        return max(at(pre) for pre in pres) - t0

    rest = [pre.handout.rest_at(t0) for pre in pres]
    timings = {**result.timings, "pos_started_s": started, "h2d": copy.seconds,
               "read_threads": copy.read_thread_s, "fill_paused": max(paused),
               # from the restore's start: the new memory made, all of it back, the job's gate
               # ended; and pos's own mapping of the memory let go of
               "imported_at": last(lambda p: p.imported_at),
               "context_at": last(lambda p: p.context_at),
               "memory_at": last(lambda p: p.memory_at), "pinned_at": last(lambda p: p.pinned_at),
               "filled_at": last(lambda p: p.filled_at),
               **{k: max(r[k] for r in rest) for k in rest[0]},
               "ended_at": out["ended_at"], "let_go": out["let_go"]}
    worst = max(out["gates"], key=lambda x: x.held_max_s)
    several = [{"pid": pre.rank, "gpu": pre.onto, "bytes": c.bytes, "gate": asdict(x)}
               for pre, c, x in zip(pres, out["copies"], out["gates"])] if len(pres) > 1 else []
    return Report(str(directory), sum(len(pre.table) for pre in pres), copy.bytes, None, worst,
                  0, out["release_s"], None, copy.gbps, 0, timings, result.restored_pid,
                  ranks=several)


def _ranks(directory: Path) -> list[Optional[int]]:
    """The jobs of a whole-process image (gpuindex.jobs); none is refused."""
    found = gpuindex.jobs(directory)
    if not found:
        raise BadInput(f"{directory} holds no GPU index", "give the -D of a `pos checkpoint "
                       "--concurrent`")
    return found


def _home(directory: Path) -> Optional[str]:
    """The UUID of the GPU an image was taken on, when this host has it (None: CUDA's device 0):
    pos's own device numbering need not be the job's (CUDA_VISIBLE_DEVICES)."""
    here = {g.uuid for g in nvml.gpus()}
    return next((g["uuid"] for g in image.load(directory).gpus if g["uuid"] in here), None)


class _Prefetch:
    """New device memory for an image's buffers, filled from the image on a thread of its own
    while CRIU and the driver bring the process back (they need no GPU copy): by the time the
    job maps the memory much of it is back. `handout.attach(agent)` then lets the job's calls
    through for each buffer usable so far (see `usable`), and for the rest as they come."""

    def __init__(self, directory: Path, streams: int, onto: Optional[str] = None,
                 rank: Optional[int] = None, moved: Optional[dict[str, str]] = None) -> None:
        index = gpuindex.read_index(directory, rank)
        self.directory = directory
        self.rank = rank        # one process of several: its PID (None: the image's one job)
        self.pid = int(index["pid"])    # the job's PID, which CRIU restores it with
        # the UUID of the GPU the job moves to (None: where it was); a process of several goes
        # where the map sends the GPU its index names
        gpu = index.get("gpu")
        self.taken_on = gpu     # the UUID of the GPU the image was taken on
        self.onto = onto if rank is None else (moved or {}).get(gpu or "", gpu)
        self.saved = gpuindex.resolve(directory, index)
        hot = gpuindex.hot(index)
        self.table = sorted((Buffer(int(b["base"], 16), b["size"], b["mapped"], b["device"], False,
                                    int(b["base"], 16) in hot) for b in index["buffers"]),
                            key=lambda b: b.va)
        self.streams = streams
        self.handout = Handout(self.table)
        self.mem: Optional[gpucopy.Imported] = None
        self.rings: Optional[gpucopy.Rings] = None
        self.fds: list[int] = []
        self.copy: Optional[gpucopy.Copy] = None
        self.error: Optional[BaseException] = None
        self.ready = threading.Event()        # the memory exists (or creating it failed)
        self.go = threading.Event()           # the fill may go on
        self.released = False                 # the job was released (its restore succeeded)
        self.cancelled = False                # the restore failed: the fill stops
        if FILL_FROM != "release":
            self.go.set()
        # when (time.monotonic) the copier's modules were imported, the driver's context was
        # up, the memory existed, the staging was pinned, all was back
        self.imported_at = self.context_at = self.memory_at = self.pinned_at = 0.0
        self.started_at = self.filled_at = self.resumed_at = 0.0
        self.blocked_at = 0.0     # when the last fill thread stopped at the pause
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="pos-prefetch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            from pos.scheduler import gpucopy     # here, beside CRIU: see the imports above

            self.imported_at = time.monotonic()
            device = self._device()
            drv = gpucopy.context(device)
            self.context_at = time.monotonic()
            mine = [replace(b, device=device) for b in self.table]
            self.mem, self.fds = gpucopy.Imported.create(drv, mine)
            self.memory_at = time.monotonic()
            self.ready.set()
            # the fill's staging: one arena pinned here, beside CRIU, rather than one per fill
            # thread at its first chunk, after the job's release
            self.rings = gpucopy.Rings(drv, self.streams, fill_piece(), FILL_DEPTH)
            self.pinned_at = time.monotonic()
            self._wait()
            self.started_at = time.monotonic()
            self.copy = _fill(drv, self.table, self.mem.local, self.saved, self.streams,
                              self.handout, self.rings, gate=self._wait)
            self.filled_at = time.monotonic()
        except BaseException as e:      # raised in the caller's thread by join()
            self.error = e
        finally:
            self.ready.set()

    def _device(self) -> int:
        """CUDA's number of the GPU to fill: the one the job moves to, else the one the image
        was taken on (asked of the driver alone: NVML's start-up is not on the way to the
        fill), else, where this host has not that GPU, device 0."""
        from pos.scheduler import gpucopy

        if self.onto:
            return gpucopy.ordinal(self.onto)
        if self.taken_on:
            try:
                return gpucopy.ordinal(self.taken_on)
            except PosError:
                pass            # not seen by CUDA here: NVML says whether the host has it
        return _cuda_device(_home(self.directory))

    def pause(self) -> None:
        """Hold the fill after the chunks it is copying, until `resume`."""
        if FILL_FROM == "pause":
            self.go.clear()

    def resume(self) -> None:
        """The job is released: the fill goes on (or starts)."""
        self.released = True
        if not self.go.is_set():
            self.resumed_at = time.monotonic()
            self.go.set()

    def _wait(self) -> None:
        if not self.go.is_set():
            now = time.monotonic()
            with self.lock:
                self.blocked_at = max(self.blocked_at, now)
        self.go.wait()
        if self.cancelled:
            raise PosError("the restore failed before its fill ended", "see its error")

    def paused_s(self) -> float:
        """How long the pause held the whole fill: from when its last busy thread stopped at
        the pause (the chunks under way go on) until the release, if chunks were left."""
        if not self.blocked_at or not self.filled_at:
            return 0.0
        end = min(self.resumed_at or self.filled_at, self.filled_at)
        return max(0.0, end - max(self.blocked_at, self.started_at))

    def join(self) -> gpucopy.Copy:
        self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.copy is not None
        return self.copy

    def close(self) -> None:
        """Wait for the fill, then let go of pos's mapping and descriptors (the job holds its
        own); after a failure the memory is freed."""
        if not self.released:      # the restore failed: the rest of the fill is not done
            self.cancelled = True
        self.go.set()
        self.thread.join()
        if self.rings is not None:
            self.rings.close()
        if self.mem is not None:
            self.mem.close()
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def is_gpu_only_image(directory: Path) -> bool:
    """A GPU-only concurrent image: a GPU index and no CRIU inventory."""
    d = Path(directory)
    return (d / gpuindex.INDEX).is_file() and not (d / "inventory.img").is_file()


def is_full_image(directory: Path) -> bool:
    """A whole-process concurrent image: CRIU's files and a GPU index (or one per process of a
    job of several) side by side."""
    d = Path(directory)
    return bool(gpuindex.jobs(d)) and (d / "inventory.img").is_file()
