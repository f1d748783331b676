"""The concurrent engine: checkpoint and restore a `pos run` job while it runs, from outside it.

Checkpoint (GPU state only, `gpu_only=True`, or the whole process):
 1. before the cut: page-locked host memory and a device shadow are set aside;
 2. the cut (the agent holds the job's calls, drains those inside the driver, synchronises);
 3. the agent exports its allocations; pos imports them and copies them device-to-device into
    its shadow (what fits; milliseconds at HBM speed);
 4. whole process: the job gives its physical memory up (pos holds it), the driver checkpoints
    the now small CUDA context, CRIU dumps the process, the driver restores and unlocks it, and
    the job maps its memory again at the same addresses;
 5. the job is released: a call that may write a buffer that is neither shadowed nor saved
    waits for it (launches, whose accesses the agent does not speculate, wait for all of them);
 6. pos copies to host memory (shadow first, the rest from the job's memory, telling the agent
    each buffer saved), then writes the image and seals it.
Restore into the live job (`restore_gpu`) or into a new process (`restore_full`, after CRIU and
the driver): the job runs as soon as its memory is mapped; a call waits only for the buffers it
may touch that are not back yet, and pos fills them buffer by buffer.

If pos dies, the agent releases a held job when its connection closes; while the job's memory
is pos's (steps 4's hoist to remap) the watchdog holds it too and gives it back.
"""

import os
import platform
import threading
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

from pos import host, nvml
from pos.agent import gpuimage
from pos.agent.control import Agent, Buffer, Cut, Gate
from pos.errors import BadInput, PosError
from pos.scheduler import gpucopy, image
from pos.scheduler.image import Manifest

Echo = Callable[[str], None]
DEFAULT_STREAMS = 8
SHADOW_RESERVE = 1 << 30       # device memory left free for the job when sizing the shadow
STALL_S = 60.0                 # the cut's bound on the calls already inside the driver


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
    foreign_bytes: int = 0         # device memory the agent could not own (not in the image)
    timings: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _manifest(pid: int, gpu_only: bool) -> Manifest:
    comm, cmdline = host.describe(pid)
    return Manifest(pid=pid, pids=[pid], gpu_pids=[pid], comm=comm, cmdline=cmdline,
                    created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    host=socket.gethostname(), kernel=platform.release(),
                    criu_version="" if gpu_only else "", criu_options={},
                    leave_running=True, driver_version=nvml.driver_version())


class _Saver:
    """Steps 1-3 and 5-6 of a checkpoint, shared by the GPU-only and the whole-process ones."""

    def __init__(self, agent: Agent, streams: int, chunk: int, echo: Echo) -> None:
        self.agent, self.streams, self.chunk, self.echo = agent, streams, chunk, echo
        self.drv = gpucopy.context(0)
        self.timings: dict[str, float] = {}
        self.host: Optional[gpucopy.Pinned] = None
        self.shadow: Optional[gpucopy.Shadow] = None
        self.mem: Optional[gpucopy.Imported] = None
        self.fds: list[int] = []
        self.table: list[Buffer] = []

    def _timed(self, name: str, fn: Callable[[], Any]) -> Any:
        t = time.monotonic()
        try:
            return fn()
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.monotonic() - t

    def prepare(self) -> int:
        st = self.agent.status()
        if not st.owning:
            raise BadInput(f"the agent of process {self.agent.pid} does not own its memory "
                           "(POS_OWN=0)", "run the job under `pos run` without POS_OWN=0")
        want = st.owned_bytes
        self.host = self._timed("pin", lambda: gpucopy.Pinned(self.drv, want))
        room = max(0, gpucopy.free_device_bytes(self.drv) - SHADOW_RESERVE)
        self.shadow = self._timed("shadow_alloc", lambda: gpucopy.Shadow(
            self.drv, min(room, want) // (2 << 20) * (2 << 20)))
        return st.foreign_bytes

    def cut_and_import(self) -> Cut:
        cut = self._timed("cut", lambda: self.agent.cut(STALL_S))
        self.table = self.agent.table()
        self.fds = self._timed("export", self.agent.export)
        self.mem = self._timed("import", lambda: gpucopy.Imported(self.drv, self.table, self.fds))
        total = sum(b.size for b in self.table)
        assert self.host is not None
        if total > self.host.size:       # allocations made between the status and the cut
            self.host.close()
            self.host = self._timed("pin", lambda: gpucopy.Pinned(self.drv, total))
        return cut

    def snapshot(self) -> list[int]:
        """Shadow the buffers that fit, in table order; the source of each buffer's copy."""
        assert self.mem is not None and self.shadow is not None
        src, dst, sizes, at = [], [], [], 0
        for b, va in zip(self.table, self.mem.local):
            if at + b.size <= self.shadow.size:
                dst.append(self.shadow.ptr + at)
                src.append(va)
                sizes.append(b.size)
                at += b.size
        self.shadowed = len(sizes)
        self.shadow_bytes = at
        self._timed("shadow", lambda: gpucopy.device_to_device(self.drv, dst, src, sizes))
        return dst + self.mem.local[len(dst):]

    def release(self) -> None:
        """The job goes on: the shadowed buffers are saved as far as it is concerned."""
        self.agent.copy()
        self.agent.done([b.va for b in self.table[:self.shadowed]])

    def to_host(self, sources: list[int]) -> gpucopy.Copy:
        assert self.host is not None
        offsets, at = [], 0
        for b in self.table:
            offsets.append(at)
            at += b.size
        self.offsets = offsets
        host_ptr = self.host.ptr

        def one(stream: Any, i: int, off: int, n: int) -> None:
            self.drv.call("cuMemcpyDtoHAsync_v2", gpucopy.C.c_void_p(host_ptr + offsets[i] + off),
                          gpucopy.U64(sources[i] + off), gpucopy.SZ(n), stream)

        def saved(i: int) -> None:
            if i >= self.shadowed:
                self.agent.done([self.table[i].va])

        sizes = [b.size for b in self.table]
        seconds = gpucopy.run_chunks(self.drv, gpucopy.grid(sizes, self.chunk), len(sizes),
                                     self.streams, one, saved)
        self.timings["d2h"] = seconds
        return gpucopy.Copy(sum(sizes), seconds)

    def drop_device(self) -> None:
        """pos lets go of the job's memory and its shadow (the job keeps its own mapping)."""
        if self.mem is not None:
            self.mem.close()
            self.mem = None
        if self.shadow is not None:
            self.shadow.close()
            self.shadow = None
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def write(self, folder: Path, compress: bool) -> None:
        assert self.host is not None
        writer = gpuimage.Writer(folder, compress)
        work = gpucopy.grid([b.size for b in self.table], self.chunk)

        def put(item: tuple[int, int, int]) -> None:
            i, off, n = item
            writer.put(self.table[i].va, off, self.host.view(self.offsets[i] + off, n))

        t = time.monotonic()
        with ThreadPoolExecutor(max_workers=image.workers()) as pool:
            list(pool.map(put, work))
        writer.close()
        buffers = [{"base": f"0x{b.va:x}", "size": b.size, "mapped": b.mapped,
                    "device": b.device, "chunks": sorted(writer.chunks.get(b.va, []),
                                                         key=lambda c: c["offset"])}
                   for b in self.table]
        gpuimage.write_index(folder, {"format": gpuimage.FORMAT, "pid": self.agent.pid,
                                      "parent": None, "buffers": buffers})
        self.timings["disk"] = time.monotonic() - t

    def close(self) -> None:
        self.drop_device()
        if self.host is not None:
            self.host.close()
            self.host = None


def checkpoint_gpu(pid: int, directory: Path, streams: int = DEFAULT_STREAMS,
                   chunk_mb: int = 64, compress: bool = False, echo: Echo = lambda _: None
                   ) -> Report:
    """The GPU state of `pid` at one instant, taken while it runs (rolls back only into a live
    job: `restore_gpu`)."""
    with Agent(pid) as agent:
        s = _Saver(agent, streams, chunk_mb << 20, echo)
        try:
            foreign = s.prepare()
            partial = image.prepare(Path(directory), agent.status().owned_bytes)
            t0 = time.monotonic()
            cut = s.cut_and_import()
            sources = s.snapshot()
            s.release()
            release_s = time.monotonic() - t0
            copy = s.to_host(sources)
            gate = agent.end()
            s.drop_device()
            manifest = _manifest(pid, gpu_only=True)
            try:
                s.write(partial, compress)
                manifest.timings = s.timings
                manifest.stall_s = gate.held_max_s
                final = image.seal(partial, manifest)
            except BaseException:
                image.discard(partial)
                raise
        finally:
            s.close()
    return Report(str(final), len(s.table), copy.bytes, cut, gate, s.shadow_bytes, release_s,
                  copy.gbps, None, foreign, s.timings)


def restore_gpu(pid: int, directory: Path, streams: int = DEFAULT_STREAMS, chunk_mb: int = 64,
                echo: Echo = lambda _: None) -> Report:
    """Put a GPU image back into the live job `pid`, on demand."""
    directory = Path(directory)
    image.verify(directory)
    saved = gpuimage.resolve(directory)
    with Agent(pid) as agent:
        drv = gpucopy.context(0)
        t0 = time.monotonic()
        cut = agent.cut(STALL_S)
        table = agent.table()
        missing = [b for b in table if b.va not in saved or saved[b.va][1] != b.size]
        if missing or len(saved) != len(table):
            agent.end()
            raise BadInput(f"the image {directory} does not hold the buffers process {pid} has "
                           f"now ({len(missing)} of {len(table)} differ)", "restore into the job "
                           "the image was taken of, in the same phase of its work")
        fds = agent.export()
        try:
            mem = gpucopy.Imported(drv, table, fds)
        finally:
            for fd in fds:
                os.close(fd)
        try:
            agent.restore()
            release_s = time.monotonic() - t0
            copy = _fill(drv, agent, table, mem.local, saved, streams, chunk_mb << 20)
        except BaseException:
            mem.close()
            raise      # the agent ends a half-restored job when the connection closes
        gate = agent.end()
        mem.close()
    return Report(str(directory), len(table), copy.bytes, cut, gate, 0, release_s, None,
                  copy.gbps, 0, {"h2d": copy.seconds})


def _fill(drv: Any, agent: Agent, table: list[Buffer], dest: list[int],
          saved: dict[int, tuple[Path, int, list[dict[str, Any]]]], streams: int, chunk: int
          ) -> gpucopy.Copy:
    """Read every buffer's chunks (checksums checked) into pinned staging and copy them to the
    job's memory, telling the agent each buffer that is back."""
    chunk_of = {(i, c["offset"]): c for i, b in enumerate(table) for c in saved[b.va][2]}
    work = sorted((i, off, c["raw"]) for (i, off), c in chunk_of.items())
    biggest = max((n for _i, _o, n in work), default=1)
    local = threading.local()
    staging: list[gpucopy.Pinned] = []
    lock = threading.Lock()

    def one(stream: Any, i: int, off: int, n: int) -> None:
        st = getattr(local, "staging", None)
        if st is None:
            st = local.staging = gpucopy.Pinned(drv, biggest)
            local.fds = {}
            with lock:
                staging.append(st)
        b = table[i]
        gpuimage.read_chunk_into(saved[b.va][0], chunk_of[(i, off)], st.view(0, n), local.fds)
        drv.call("cuMemcpyHtoDAsync_v2", gpucopy.U64(dest[i] + off), gpucopy.C.c_void_p(st.ptr),
                 gpucopy.SZ(n), stream)

    try:
        seconds = gpucopy.run_chunks(drv, work, len(table), streams, one,
                                     lambda i: agent.done([table[i].va]))
    finally:
        for st in staging:
            st.close()
    return gpucopy.Copy(sum(n for _i, _o, n in work), seconds)
