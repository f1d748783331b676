"""One job's side of a concurrent checkpoint, in the order its types allow:

  Saver.prepare(agent, ...)   before the cut: a device shadow and page-locked host memory
                              (its ring; the rest is locked once the job runs again)
  saver.reconnect()           the cut's own connection, made just before it
  saver.cut(...)              the job held, its calls drained
  saver.take(rank)            -> Taken: its memory exported by the job, imported by pos, what
                              fits shadowed device-to-device
  taken.start(folder)         the copy to host memory begins (once every rank's take is done)
  taken.freeze(), thaw()      the frozen part (the driver's calls, CRIU's dump), and its end
  taken.criu_alone()          around CRIU's dump within it: the copy's savers held, if not yet
  taken.release()             the job goes on, its calls gated (pos/concurrent/handout.py)
  taken.wait_copied()         every buffer in host memory: pos lets go of the device memory
  taken.write(folder)         the rest of the data files, then the GPU index
  close() of each, whatever happened (Taken's first)

A job of several CUDA processes (DDP's ranks) has one Saver per process, each on its own GPU,
whose context each step makes current: one thread drives them all, but for their takes, which
run side by side, a thread each.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from pos.agent.control import Agent, Buffer, Cut, Gate, Refused, Status
from pos.concurrent import devices, kept
from pos.concurrent.copier import Copied, HostRoom, first_needed
from pos.concurrent.copier import threads as copier_threads
from pos.concurrent.crew import Spares
from pos.concurrent.handout import Handout
from pos.errors import BadInput, PosError
from pos.image import filehash, gpuindex, names
from pos.operation import steps
from pos.operation.timings import Kind, kind
from pos.process import fdroom
from pos.settings import Settings

if TYPE_CHECKING:     # imported where used: numpy takes 0.15 s to import on the H100 host,
    from pos.concurrent import copier, gpucopy
    from pos.concurrent.gpuhash import Kernel
    from pos.driver import Driver
    from pos.image import gpu as gpuimage             # and a restore starts CRIU before it
    from pos.operation.engine import WaitedFor

SAVE_STREAMS = 8               # a checkpoint's copy threads: device to host memory, then disk
DEFAULT_CHUNK_MB = 64          # a checkpoint's chunk of a buffer (copied, hashed, written)
FD_MARGIN = 64                 # descriptors beyond a job's buffers that the tables make room for
SHADOW_ALIGN = 256             # where each shadowed buffer begins: cuMemAlloc's alignment
STALL_S = 60.0                 # the cut's bound on the calls already inside the driver


class Saver:
    """A job's page-locked arena and device shadow, set aside before its cut."""

    def __init__(self, agent: Agent, settings: Settings, streams: int, chunk: int,
                 ranks: int = 1, status: Optional[Status] = None, take_own: bool = False
                 ) -> None:
        from pos.concurrent import gpucopy

        self.agent: Optional[Agent] = agent   # None once the job is gone (CRIU ended it)
        self.pid = agent.pid
        self.settings, self.streams, self.chunk = settings, streams, chunk
        self.ranks = ranks
        # the host's cores shared among the `ranks` savers that copy at once, in one process:
        # at 4 ranks of 64 cores each had taken all 64 twice (548 threads, one interpreter lock)
        self.writers = max(1, filehash.workers() // max(1, ranks))
        self.gpu, used = devices.gpu_use(agent.pid)   # the job's GPU, recorded in its index
        # the one reading both the ring's split (HostRoom) and the context's choice come from,
        # when the checkpoint read it already
        self.status = status or agent.status()
        self.owned_bytes, self.foreign_bytes = self.status.owned_bytes, self.status.foreign_bytes
        self.timings: dict[str, float] = {"gpu_used_bytes": used, "owned_bytes": self.owned_bytes,
                                          "foreign_bytes": self.foreign_bytes}
        if self.status.own_bytes is not None:    # NCCL's buffers, of those foreign bytes
            self.timings["own_maps_bytes"] = self.status.own_bytes
        # pos's context on it, made current again by each step (`use`), let go by `close`;
        # none for a process that owns no device memory and has none of its own that pos
        # takes (`take_own`, checkpoint.own_plan; torchrun's own process has neither): a
        # context would cost its GPU 0.5 GB and the checkpoint 0.13-0.66 s for nothing to copy
        self.take_own = take_own
        self.context = self.timed("context", lambda: gpucopy.Context(
            devices.cuda_device(self.gpu))) if self.owned_bytes or take_own else None
        self.host: Optional[gpucopy.Pinned] = None
        self.shadow: Optional[gpucopy.Shadow] = None
        self.kernel: Optional[Kernel] = None     # pos's checksum kernel (POS_HASH_ON)
        # the copy's threads, started before this saver's import and pin run beside them
        # (crew.Spares), and its modules, imported beside the pin (`reconnect` waits for them)
        self.spares = Spares(copier_threads(streams, self.writers) if self.context else 0,
                             "pos-copy")
        self._imports = threading.Thread(target=import_for_copy, name="pos-import", daemon=True)
        self._imports.start()

    @classmethod
    def prepare(cls, agent: Agent, settings: Settings, streams: int, chunk: int,
                gpu_only: bool, ranks: int = 1, host_room: Optional[HostRoom] = None,
                status: Optional[Status] = None, take_own: bool = False) -> "Saver":
        """Before the cut: the shadow (the device memory free but 1 GiB, at most the job's) and
        the page-locked arena (copier.arena_bytes: what the shadow cannot hold, and a ring;
        within `host_room`, shared by the savers prepared beside this one). `status`: the
        agent's, if read already; `take_own`: the checkpoint takes the job's own cuMem memory
        (checkpoint.own_plan). Closed again if that fails."""
        saver = cls(agent, settings, streams, chunk, ranks, status, take_own)
        try:
            saver._prepare(gpu_only, host_room)
        except BaseException:
            saver.close()
            raise
        return saver

    def _prepare(self, gpu_only: bool, host_room: Optional[HostRoom]) -> None:
        from pos.concurrent import gpucopy

        self.use()
        st = self.status
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
        if self.context is None:           # nothing to copy: no shadow, no arena
            return
        # the descriptors of the buffers pos owns, and of the job's own memory it takes
        self._make_room(st.buffers + (st.own_maps or 0 if self.take_own else 0) + FD_MARGIN)
        if self.settings.hash_on != "cpu":
            from pos.concurrent.gpuhash import Kernel

            try:
                self.kernel = self.timed("hash_load", lambda: Kernel(self.drv))
            except BadInput:
                if self.settings.hash_on == "gpu":
                    raise            # `auto`: the savers hash on the CPU, as the driver must
        on_device = gpucopy.shadow_room(self.drv)
        if self.settings.shadow_max_bytes is not None:
            on_device = min(on_device, self.settings.shadow_max_bytes)
        self.shadow = self.timed("shadow_alloc", lambda: gpucopy.Shadow(
            self.drv, min(on_device, self.owned_bytes)))
        host_room = host_room or HostRoom(self.settings.pin_max_bytes,
                                          self.settings.pin_ring_bytes)
        keep = kept.take() if self.settings.pin_keep else None
        present = keep.present if keep is not None else 0
        try:
            arena = host_room.arena(self.owned_bytes, self.chunk, self.shadow.size, present)
        except BaseException:
            if keep is not None:
                keep.close()
            raise
        if keep is not None and not keep.fits(arena):
            keep.close()           # no room on the tmpfs: anonymous memory, as without keeping
            keep = None
        if keep is not None:
            self.timings["pin_kept_bytes"] = min(present, arena)
        ahead = self.settings.pin_ahead_bytes
        if ahead is None:
            # before the cut, what the job's writes may wait for (the buffers the shadow cannot
            # hold) and a part for the copy to begin with; the rest of the ring, which only the
            # shadow's copies use, once the job runs again (Taken.thaw, release): locked while
            # the job was held, the driver's registrations slowed the job's export and pos's
            # import 2-4x, its take 0.06-0.16 s to 0.43-0.69 s (H200, 2026-11-29.md). At one
            # rank the 8 GiB ring took 0.6-2.6 s of the 1.3-3.3 s before the cut there
            ahead = self.owned_bytes - self.shadow.size + gpucopy.Pinned.PIECE
        with host_room.locking:
            self.host = self.timed("pin", lambda: gpucopy.Pinned(
                self.drv, arena, ahead=ahead, kept=keep))

    def _make_room(self, n: int) -> None:
        """Room for the descriptors of the export and the remap, `n` a process, in pos's
        table (for every job checkpointed beside this one) and in the job's, made while it runs
        (pos/process/fdroom.py). An agent older than the request leaves its table to grow at
        the export, as before."""
        self.timed("fd_room_pos", lambda: fdroom.make(self.ranks * n))
        try:
            self.timings["fd_room"] = self.connected().room(n).seconds
        except Refused:
            pass

    def timed(self, name: str, fn: Callable[[], Any]) -> Any:
        return steps.timed(self.timings, name, fn)

    @property
    def drv(self) -> "Driver":
        assert self.context is not None     # only a job with device memory is copied
        return self.context.drv

    def use(self) -> None:
        """pos's context on this job's GPU current on this thread: the objects made here keep
        the context current when they were made."""
        if self.context is not None:
            self.context.use()

    def connected(self) -> Agent:
        """The job's agent; its absence (the job ended by CRIU) is pos's own error."""
        if self.agent is None:
            raise PosError(f"process {self.pid} has no agent connection now",
                           "report this: pos asked a job CRIU ended")
        return self.agent

    def reconnect(self) -> Optional[str]:
        """A connection of the operation's own, made just before the cut. The one that asked
        the status sat silent through the pin (as large as the job: 20-55 s for 83-125 GiB on
        the H200, past the agent's POS_AGENT_STALL_S on larger jobs), and one ended meanwhile
        showed only at the cut's request (issue 35). The old one is let go; why it was lost,
        if it was (counted: prepare_connection_lost_n), is returned. The copy's modules are in
        by then (import_for_copy)."""
        self._imports.join()
        old = self.connected()
        lost = None
        try:
            old.status()
        except PosError as e:
            lost = e.message
            self.timings["prepare_connection_lost_n"] = 1
        old.close()
        self.agent = Agent(self.pid)
        return lost

    def cut(self, at: Optional[int] = None, timeout_s: float = STALL_S) -> Cut:
        """The job held and drained (now, or just before the NCCL launch past `at`: see
        pos/concurrent/collective.py)."""
        agent = self.connected()
        return self.timed("cut", lambda: agent.cut(timeout_s, at))

    def take(self, rank: Optional[int] = None) -> "Taken":
        """After the cut: the job's memory imported and shadowed (`rank`: the PID of one
        process of several, whose files are named after it); Taken.start begins its copy."""
        return Taken(self, rank)

    def pinned(self) -> None:
        """What the arena locked in the end, and when all of it was (or, if the locking
        stopped short, how much it lacked)."""
        host = self.host
        if host is None:
            return
        self.timings["pinned_peak_bytes"] = host.pinned_bytes
        if host.all_s is not None:
            self.timings["pin_all"] = host.all_s
        elif host.error is not None:
            self.timings["pin_short_bytes"] = host.size - host.pinned_bytes

    def drop_shadow(self) -> None:
        """The device shadow given back (its copies are done, or the checkpoint ends)."""
        if self.shadow is not None:
            self.shadow.close()
            self.shadow = None

    def close(self) -> None:
        self.spares.close()
        self.use()
        self.drop_shadow()
        if self.kernel is not None:
            self.kernel.close()
            self.kernel = None
        if self.host is not None:
            self.host.close()
            self.host = None
        if self.context is not None:
            self.context.close()


class Taken:
    """A held job's memory in pos's hands: imported, shadowed where it fits, being copied. A
    job that owns no device memory (Saver.context None) has nothing taken nor copied: its
    steps here are the agent's alone, and its GPU index is empty."""

    def __init__(self, saver: Saver, rank: Optional[int]) -> None:
        from pos.concurrent import gpucopy

        self.saver, self.rank = saver, rank
        self.fds: list[int] = []
        self.mem: Optional[gpucopy.Imported] = None
        self.copier: Optional[copier.Copier] = None
        self.sources: list[int] = []      # where each buffer's copy reads: shadow or job
        self.shadowed: set[int] = set()
        self.shadow_bytes = 0
        agent = saver.connected()
        self.table: list[Buffer] = agent.table()
        if saver.context is None:
            if self.table:        # made after its status said it had none
                raise PosError(f"process {saver.pid} allocated device memory while pos "
                               "prepared its checkpoint", "checkpoint it again")
            self.handout = Handout(self.table)
            return
        saver.use()
        # what the job and the rest leave free at the cut (pos's own shadow counted as free)
        saver.timings["free_at_cut_bytes"] = (gpucopy.free_device_bytes(saver.drv)
                                              + (saver.shadow.size if saver.shadow else 0))
        try:
            self.fds = saver.timed("export", lambda: export(saver))
            self.mem = saver.timed("import", lambda: gpucopy.Imported(saver.drv, self.table,
                                                                      self.fds))
            self.sources = self._snapshot()
            self.handout = Handout(self.table, safe=self.shadowed)
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.saver.pid

    def _snapshot(self) -> list[int]:
        """Shadow what fits, in copier.first_needed's order (a call that may write a buffer
        not shadowed waits until pos has copied it from the job); the source of each buffer's
        copy (its shadow, or the job's memory for a buffer that did not fit)."""
        from pos.concurrent import gpucopy

        s, mem = self.saver, self.mem
        assert mem is not None           # made just before, in __init__
        room = s.shadow.size if s.shadow else 0
        base = s.shadow.ptr if s.shadow else 0
        sources = list(mem.local)
        src, dst, sizes, at = [], [], [], 0
        for i in sorted(range(len(self.table)), key=lambda i: first_needed(self.table[i], i)):
            b = self.table[i]
            # each copy at an aligned address, as the job's own allocations are: the GPU's
            # checksum kernel reads 16 bytes at a time (gpuhash.py)
            start = -(-at // SHADOW_ALIGN) * SHADOW_ALIGN
            if start + b.size <= room:
                sources[i] = base + start
                src.append(mem.local[i])
                dst.append(sources[i])
                sizes.append(b.size)
                self.shadowed.add(i)
                self.shadow_bytes += b.size
                at = start + b.size
        s.timed("shadow", lambda: gpucopy.device_to_device(s.drv, dst, src, sizes))
        return sources

    def start(self, folder: Path) -> None:
        """The copy to host memory and into the image's data files, on threads of its own from
        now on (the job may still be held)."""
        if self.saver.context is None:
            return
        self.saver.use()
        self.saver.timed("copy_start", lambda: self._start(folder, self.sources))

    def _start(self, folder: Path, sources: list[int]) -> None:
        from pos.concurrent import copier
        from pos.image import gpu as gpuimage

        s = self.saver
        assert s.host is not None        # Saver.prepare made it
        self.writer: gpuimage.Writer = gpuimage.Writer(
            folder, compress=False, prefix=names.data_prefix(self.rank))
        self.copier = copier.Copier(s.drv, self.table, sources, self.shadowed, s.host, s.chunk,
                                    s.streams, self.writer, self.handout, s.writers,
                                    s.settings.frozen_copy, s.spares, s.kernel)
        self.copier.start()

    def freeze(self) -> None:
        """The job is about to be frozen (the driver's calls, CRIU's dump): the CPU and the
        host's memory are theirs, but for the copy of what pos could not shadow, and its savers
        where they wait only for CRIU (Settings.savers_held: see `criu_alone`). The rest of
        the arena is not locked yet (beside CRIU's dump its locking made the frozen dump 4x
        slower: 0.75 s to 3.3 s, a 97 GB job on the H200)."""
        if self.copier is not None:
            if self.saver.settings.savers_held == "frozen":
                self.copier.hold_savers()
            self.copier.hold_shadowed()

    @contextmanager
    def criu_alone(self) -> Iterator[None]:
        """Around CRIU's dump (or a container runtime's): the copy's savers held where they
        were not held already (POS_SAVERS_HELD=criu). CRIU writes the job's memory on one
        core, and beside the copy's hashing and writing it took 1.1-1.5 s instead of 0.5-0.8
        on the H100 host."""
        if self.copier is None:
            yield
            return
        # what the savers had written when the dump began (POS_SAVERS_HELD's measure)
        self.saver.timings["saved_at_dump_bytes"] = self.copier.saved_bytes
        if self.saver.settings.savers_held != "criu":
            yield
            return
        self.copier.hold_savers()
        try:
            yield
        finally:
            self.copier.release_savers()

    def thaw(self) -> None:
        """The frozen part is over (the job runs again next, or is stopped for good): every
        part of the copy goes on, and the rest of the arena is locked."""
        if self.copier is not None:
            self.copier.release_savers()
            self.copier.release_shadowed()
            self.copier.lock_rest()

    def driver(self, name: str, call: Callable[[], Any]) -> Any:
        """The driver's checkpoint or restore of this job, paused as below and timed in its own
        timings (`name`): beside the step's time over every rank, each rank's own shows whether
        the driver's calls on the ranks overlapped."""
        return self.saver.timed(name, lambda: self.paused(call))

    def paused(self, call: Callable[[], Any]) -> Any:
        """The driver's checkpoint or restore of the job (or the job's hoist or remap), with
        pos's copy to host memory held (the driver copies the job's context over the same bus,
        and holds the job meanwhile; POS_COPY_PAUSED=never: it goes on)."""
        if self.copier is None or self.saver.settings.copy_paused == "never":
            return call()
        self.copier.pause()
        try:
            return call()
        finally:
            self.copier.resume()

    def release(self) -> None:
        """The job goes on: its calls wait only for the buffers they may write that are not
        saved yet (see pos/concurrent/handout.py). The rest of the arena is locked from now
        on, if the frozen part's end did not begin it (thaw)."""
        agent = self.saver.connected()
        self.saver.timings["copied_at_release_bytes"] = \
            self.copier.copied_bytes if self.copier is not None else 0
        self.saver.timings["saved_at_release_bytes"] = \
            self.copier.saved_bytes if self.copier is not None else 0
        agent.copy()
        self.handout.attach(agent)
        if self.copier is not None:
            self.copier.watch(agent)
            self.copier.lock_rest()

    def waited_for(self, gate: Optional[Gate], t0: float) -> list[WaitedFor]:
        """The buffers that the job's waits in `gate` named, and what each waited for, the
        times from t0 (handout.py)."""
        ons = dict.fromkeys(w.on for w in gate.waits if w.on) if gate else {}
        return [x for x in (self.handout.waited_for(va, t0) for va in ons) if x is not None]

    def wait_copied(self) -> None:
        """Every buffer is in host memory: pos lets go of the job's memory and its shadow (the
        job keeps its own mapping)."""
        if self.copier is not None:
            self.copier.wait_copied()
            self.saver.timings["d2h"] = self.copier.d2h_s
            self.saver.timings["shadow_scan"] = self.copier.scan_s
            self.saver.timings["d2h_busy"] = self.copier.d2h_busy_s
        self._drop_device()

    def _drop_device(self) -> None:
        s = self.saver
        s.use()
        if self.copier is not None:
            self.copier.stop_copying()       # nothing may copy from what is freed here
        if self.mem is not None:
            self.mem.close()
            self.mem = None
        s.drop_shadow()
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def touched(self) -> set[int]:
        """The buffers the job's calls used once released, by address (a restore fills them
        first); none are known of a job CRIU ended, or one gone since."""
        if self.saver.agent is None:
            return set()
        try:
            return {b.va for b in self.saver.agent.table() if b.touched}
        except PosError:
            return set()

    def write(self, folder: Path) -> Copied:
        """The rest of the data files, then the GPU index."""
        s = self.saver
        s.use()
        hot = self.touched()
        done = Copied(0, 0.0, 0.0)
        if self.copier is not None:
            done = self.copier.join()
            self.writer.close()
            s.timings["disk"] = done.disk_s
        s.pinned()
        gpuindex.write(folder, gpuindex.GpuIndex(s.pid, s.gpu, tuple(
            gpuindex.BufferRecord(b.va, b.size, b.mapped, b.device, b.va in hot,
                                  self.writer.chunks_of(b.va)) for b in self.table)), self.rank)
        return done

    def close(self) -> None:
        self.saver.use()
        if self.copier is not None:
            self.copier.close()              # nor write from the arena
            self.writer.close()              # its data files (a failed image's are discarded)
        self._drop_device()


def import_for_copy() -> None:
    """The modules the copy starts with, numpy's among them: imported after the cut, they held
    the job 0.2-0.3 s longer on the H200 hosts (bench/results/2026-11-28-perf, run7); before
    the pin, they delayed every command. A failure shows again where they are used."""
    try:
        from pos.concurrent import copier  # noqa: F401
        from pos.image import gpu  # noqa: F401
    except ImportError:
        pass


def reconnected(saver: Saver, echo: steps.Echo) -> Agent:
    """The job's agent on the cut's own connection (Saver.reconnect), a loss of the one before
    said."""
    lost = saver.reconnect()
    if lost:
        echo(f"(the connection that asked the status of PID {saver.pid} was lost during the "
             f"pin: {lost})")
    return saver.connected()


def export(saver: Saver) -> list[int]:
    """The held job's descriptors. A buffer the driver would not export is moved into new
    memory first (agent: export.c, reseat); where the device has no room for that, pos gives
    its shadow back and asks once more (the buffers are then copied from the running job, the
    gate holding their writers)."""
    from pos.concurrent import gpucopy

    agent = saver.connected()
    try:
        x = agent.export()
    except Refused as e:
        if not e.need or saver.shadow is None or not saver.shadow.size:
            raise
        saver.shadow.close()
        saver.shadow = gpucopy.Shadow(saver.drv, 0)
        saver.timings["shadow_given_back_bytes"] = e.need
        x = agent.export()
    if x.reseated or x.leaked:
        saver.timings.update(reseat=x.reseat_s, reseated_bytes=x.reseated_bytes,
                             leaked_closed_n=x.leaked)
    saver.timings.update(export_lock=x.lock_s, export_loop=x.loop_s, export_answer=x.answer_s,
                         export_passage=x.passage_s)
    return x.fds


def timings_of(savers: list[Saver]) -> dict[str, float]:
    """The copy's timings: of several jobs, the longest of each (their copies run side by
    side), and the sizes in bytes (the pinned memory) summed; of one, its own."""
    out: dict[str, float] = {}
    for s in savers:
        for k, v in s.timings.items():
            out[k] = out.get(k, 0.0) + v if kind(k) is Kind.BYTES else max(out.get(k, v), v)
    return out
