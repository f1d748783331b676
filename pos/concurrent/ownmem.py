"""The job's own cuMem memory, taken into the image as pos takes the memory it owns: allocations
the job made and mapped itself, which pos's agent does not own (NCCL's buffers, which the rank's
peers import; all of the memory of a job started with PyTorch's expandable segments). Left in
the job, the driver's checkpoint copies them into its host memory and CRIU writes them while
the job is frozen: with NCCL's defaults about a third of a 2-rank Llama job's hold (1.4 of 3.9 s
on two H200s, bench/results/2026-11-29.md, with NCCL's channels cut to two); the whole hold of
a GPT-2 job with expandable segments, 31 s for 20 GB (bench/results/2026-12-01.md). Taken
(checkpoint.own_plan says whose), the Llama job's 2 ranks were held 2.79 s against 3.39 s in
the same run (bench/results/2026-11-30.md).

Taken, each is copied while every process is held (the peers write into it through their own
mappings, which no gate of its owner sees): device to device into memory of pos's own, as far
as the GPU has room, the rest into host memory; it is given up by the job (the agent's
own-down: pos's descriptors hold the memory) and mapped back after the driver's restore
(own-up), in place. The copy is written into the image once the job runs again: written while
the job was held, 1 GB of the 2-rank Llama job's NCCL buffers had held it 2.2 s more
(bench/results/2026-11-30.md). A restored process gets the memory made anew and filled before
any process of the job runs. The agent's side, and how the job's later calls on the handle it
made are answered: pos/agent/hook/peer.c.

The image holds, for each process with such memory, an index (address, size, device of each
allocation, in the agent's `exports` order) and the bytes, one allocation after another, in
parts that follow each other (names.own_memory, names.own_memory_part)."""

from __future__ import annotations

import bisect
import ctypes as C
import json
import mmap
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Union

from pos.agent.control import Agent, Buffer, OwnExport, Refused
from pos.concurrent.crew import side_by_side
from pos import image
from pos.errors import BadInput, PosError
from pos.image import filehash, names

if TYPE_CHECKING:
    from pos.concurrent import gpucopy
    from pos.driver import Driver

PIECE = 64 << 20    # bytes copied between the device and the host at a time
MOVERS = 16         # threads that move them between the device and the image, at most
Timed = Callable[[str, Callable[[], Any]], Any]    # a part's name, the part: what it returns


@dataclass(frozen=True)
class Region:
    """One of the job's own allocations, mapped at [va, va+size) on `device`."""

    va: int
    size: int
    device: int


class Taken:
    """What a checkpoint took of one job's own memory: pos's descriptors, which hold it while
    the job has given it up (own-up maps them back in place), and its bytes at the cut (the
    regions' one after another), until `write` puts them into the image: the first on the
    device (`shadow`, as much as the GPU had room for), the rest in host memory (`host`: runs
    that follow each other, each of pieces that do)."""

    def __init__(self, regions: list[Region], fds: list[int]) -> None:
        self.regions, self.fds = regions, fds
        self.shadow: Optional[gpucopy.Shadow] = None
        self.host: list[list[mmap.mmap]] = []
        # of the host memory, the bytes faulted in before the take, and for how long (None:
        # none was faulted in before)
        self.faulted = 0
        self.fault_s: Optional[float] = None
        # what the take made and used, let go with the copy once the job runs again: pos's
        # mapping of the job's memory and the page-locked memory of the copy (closed while the
        # job was held, 0.2-0.5 s more of it at thousands of pieces, bench/results/2026-12-01.md)
        self.later: list[Union["gpucopy.Imported", "gpucopy.Pinned", HostPieces]] = []

    @property
    def bytes(self) -> int:
        return sum(r.size for r in self.regions)

    @property
    def on_device(self) -> int:
        """The bytes of the copy on the device; the rest is in host memory."""
        return min(self.bytes, self.shadow.size if self.shadow is not None else 0)

    def write(self, drv: "Driver", folder: Path, pid: Optional[int]
              ) -> dict[str, filehash.Written]:
        """The bytes taken at the cut into `folder` (the image being written; `pid`: the
        process's, in an image of several), with the index; pos's copy of them let go. Called
        with the context current that `take` ran in. The data parts' checksums, made as they
        were written (by name)."""
        if not self.regions:
            return {}
        n = self.on_device
        ptr = self.shadow.ptr if self.shadow is not None else 0
        device = [(ptr + at, at, min(PIECE, n - at)) for at in range(0, n, PIECE)]
        runs = _split(device, _threads(len(device))) if device else []
        host, self.host = self.host, []
        written = {names.own_memory_part(pid, len(runs) + k): _written(len(p) for p in run)
                   for k, run in enumerate(host)}

        def put(k: int) -> None:
            run = host[k]
            name = names.own_memory_part(pid, len(runs) + k)
            with open(folder / name, "wb", buffering=0) as f:
                while run:
                    piece = run.pop(0)
                    with memoryview(piece) as view:
                        _write_hashed(f, view, written[name])
                    piece.close()           # let go once written

        # what is in host memory first, each piece let go once written: where the image is
        # kept in memory the host never holds it twice
        if host:
            side_by_side("pos-own-host", list(range(len(host))), put, lambda _: None)
        if runs:
            written.update(_write(drv, runs, folder, pid))
        index_name, _ = names.own_memory(pid)
        (folder / index_name).write_text(json.dumps([asdict(r) for r in self.regions]) + "\n")
        self.drop()
        return written

    def drop(self) -> None:
        """pos's copy of the bytes let go (the context `take` ran in current)."""
        for made in self.later:
            made.close()
        self.later = []
        if self.shadow is not None:
            self.shadow.close()
        for run in self.host:
            for piece in run:
                piece.close()
        self.shadow, self.host = None, []

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        self.drop()


class HostPieces:
    """Anonymous memory for the pieces of a take's copy that go into host memory (`sizes`:
    each one's bytes), made before the cut and faulted in from then until the take begins
    (`fault_behind`, `settle`): into fresh memory 32 GiB came at 13-23 GB/s, into memory
    faulted in before at 39 GB/s, the faulting itself 42 GB/s. A job at 60% of an H200 (43 GB
    into host memory) was held 2.57-3.02 s so, against 3.08-3.66 s with it faulted in as
    copied, its cut 1.9-2.0 s after the command against 1.5-1.8 s. Waited for before the cut,
    the faulting put 1.2-5.6 s more before it; begun only after the mapping, it faulted 12 of
    the 43 GB in by the take (bench/results/2026-12-01.md). `get` hands a piece of a size over
    (made then where none is left); `close` lets those never handed over go."""

    def __init__(self, sizes: list[int]) -> None:
        self._free: dict[int, list[mmap.mmap]] = {}
        self._stop = threading.Event()
        self._faulting: Optional[threading.Thread] = None
        self.faulted = 0          # the bytes faulted in so far
        self.fault_s: Optional[float] = None     # how long that ran, once it has ended
        try:
            for n in sizes:
                self._free.setdefault(n, []).append(_anonymous(n))
        except BaseException:
            self.close()
            raise

    @property
    def bytes(self) -> int:
        return sum(n * len(ms) for n, ms in self._free.items())

    def fault_behind(self) -> None:
        """Every piece's pages faulted in from now on, on threads of their own (ctypes lets the
        GIL go), until `settle`."""
        pieces = [m for ms in self._free.values() for m in ms]
        threads = _threads(len(pieces))
        lock = threading.Lock()
        t0 = time.monotonic()

        def write(k: int) -> None:
            for m in pieces[k::threads]:
                if self._stop.is_set():
                    return
                C.memset(_address(m), 0, len(m))
                with lock:
                    self.faulted += len(m)

        def run() -> None:
            side_by_side("pos-own-fault", list(range(threads)), write, lambda _: None)
            self.fault_s = time.monotonic() - t0

        self._faulting = threading.Thread(target=run, name="pos-own-fault", daemon=True)
        self._faulting.start()

    def settle(self) -> None:
        """The faulting stopped where it is: the pieces not reached are faulted in as the copy
        writes them."""
        self._stop.set()
        if self._faulting is not None:
            self._faulting.join()
            self._faulting = None

    def get(self, n: int) -> mmap.mmap:
        ms = self._free.get(n)
        return ms.pop() if ms else _anonymous(n)

    def close(self) -> None:
        self.settle()
        for ms in self._free.values():
            for m in ms:
                m.close()
        self._free = {}


@dataclass
class Ready:
    """What a take needs, made before the cut, while the job runs: device memory for its copy
    (made while the ranks were held, it was part of the take's 0.16-0.40 s at 2 ranks), and the
    job's own memory exported and mapped in pos (own-export; the export and the mapping were
    0.03-0.11 s of each rank's take, its copy 0.001-0.005 s). At the cut the take is then only
    its copy, where the job's own allocations are still those exported (the agent's serials),
    and a fresh export otherwise: 0.051 s against 0.099 s with the 2 ranks held, in one call
    (bench/results/2026-11-30.md, run 9)."""

    shadow: Optional["gpucopy.Shadow"] = None
    regions: list[Region] = field(default_factory=list)
    serials: list[int] = field(default_factory=list)     # the agent's, of each mapping
    fds: list[int] = field(default_factory=list)
    mem: Optional["gpucopy.Imported"] = None
    staging: Optional["gpucopy.Pinned"] = None    # for what the shadow cannot hold (_to_host)
    host: Optional[HostPieces] = None             # and the host memory it goes into

    @property
    def bytes(self) -> int:
        """The job's own memory exported and mapped before the cut."""
        return sum(r.size for r in self.regions)

    def close(self) -> None:
        """Whatever the take did not use let go (the context `ready` ran in current)."""
        if self.mem is not None:
            self.mem.close()
        for fd in self.fds:
            os.close(fd)
        if self.shadow is not None:
            self.shadow.close()
        if self.staging is not None:
            self.staging.close()
        if self.host is not None:
            self.host.close()
        self.mem, self.fds, self.shadow, self.staging, self.host = None, [], None, None, None

    def map(self, drv: "Driver", timed: Timed, fault: bool) -> None:
        """The allocations exported mapped in pos; with `fault`, the host memory for what the
        shadow cannot hold faulted in beside the mapping, on threads of its own, until the take
        (once the host is known to have room for it: the caller's check). `timed`: where the
        mapping's seconds go (own_ready_map)."""
        from pos.concurrent import gpucopy

        if fault and self.host is not None:
            self.host.fault_behind()
        if self.regions:
            self.mem = timed("own_ready_map", lambda: gpucopy.Imported(
                drv, _buffers(self.regions), self.fds))


def ready(agent: Agent, drv: "Driver", device: int, size: int, timed: Timed) -> Ready:
    """The device memory for a take's copy of `size` bytes, as much of it as pos's shadow rule
    leaves the GPU room for (and the page-locked memory through which the rest goes, and the
    host memory it goes into, not yet faulted in), and the job's own allocations exported;
    nothing where there is nothing to take. `Ready.map` then maps them. `timed`: where the
    parts' seconds go (own_ready_export, own_ready_room)."""
    if not size:
        return Ready()
    try:
        got = timed("own_ready_export", agent.own_export)
    except Refused:     # an agent older than own-export, or the driver said no: the take
        got = OwnExport([], [], [], False)      # exports at the cut (and says so there)
    out = Ready(serials=got.serials, fds=got.fds)
    try:
        out.regions = _regions(agent, got.vas, device)
        out.shadow = timed("own_ready_room", lambda: _shadow(drv, size))
        n = out.shadow.size if out.shadow is not None else 0
        if size > n:
            out.staging = timed("own_ready_room", lambda: _staging(drv))
            placed = _placed(out.regions, [0] * len(out.regions))
            out.host = HostPieces([size for _, _, size in _beyond(list(placed), n)])
    except BaseException:
        out.close()
        raise
    return out


def take(agent: Agent, drv: "Driver", device: int, timed: Timed,
         made: Optional[Ready] = None) -> Taken:
    """The held job's own allocations that the driver exports, kept as descriptors, their bytes
    copied: device to device into `made`'s shadow (else into device memory made now) as far as
    pos's shadow rule leaves the GPU room (gpucopy.shadow_room), the rest into host memory.
    Where the allocations are those `made` exported before the cut, its descriptors and
    mapping serve; else they are exported and mapped now. What of `made` the take does not
    use is let go. The job still maps them: its agent's own-down gives them up. `timed`: where
    the parts' seconds go (own_export, own_map, own_copy, own_host)."""
    from pos.concurrent import gpucopy

    made = made or Ready()
    taken = Taken([], [])
    local: list[int] = []        # where pos maps each region (0: to be mapped)
    fresh: list[int] = []        # the regions exported now, to be mapped: their places
    try:
        got = timed("own_export", lambda: agent.own_take(made.serials))
        if made.mem is not None and (got.same or got.fresh is not None):
            local, fresh = _kept(agent, made, got, taken, device)
        else:
            taken.fds = got.fds          # closed with the take whatever happens next
            taken.regions = _regions(agent, got.vas, device)
            fresh = list(range(len(taken.regions)))
            local = [0] * len(taken.regions)
    except BaseException:
        made.close()
        taken.close()
        raise
    shadow, made.shadow = made.shadow, None
    staging, made.staging = made.staging, None
    pieces, made.host = made.host, None
    if pieces is not None:
        pieces.settle()
        taken.faulted, taken.fault_s = pieces.faulted, pieces.fault_s
    for later in (staging, pieces):
        if later is not None:
            taken.later.append(later)
    made.close()        # what the take does not use: the job's allocations changed since
    if shadow is not None and not taken.regions:
        shadow.close()       # nothing to copy
        shadow = None
    taken.shadow = shadow
    if not taken.regions:     # none the driver would export: its checkpoint keeps them
        return taken
    try:
        if fresh:
            mem = timed("own_map", lambda: gpucopy.Imported(
                drv, _buffers([taken.regions[i] for i in fresh]), [taken.fds[i] for i in fresh]))
            taken.later.append(mem)
            for i, at in zip(fresh, mem.local):
                local[i] = at
        _copy(drv, taken, local, timed, staging, pieces)
    except BaseException:
        taken.close()
        raise
    return taken


def _kept(agent: Agent, made: Ready, got: OwnExport, taken: Taken,
          device: int) -> tuple[list[int], list[int]]:
    """An own-take that kept the allocations `made` exported before the cut that are still
    there (all of them where `got.same`), and exported the others (`got.fresh`): into `taken`,
    every region and its descriptor, those of `made` moved (its mapping with them, let go once
    the job runs again), the rest of its descriptors closed; where pos maps each region (0:
    not yet), and the places of the fresh ones. Refused, with `got`'s descriptors closed, where
    the agent kept one that pos did not export."""
    assert made.mem is not None     # the caller's test
    before = {serial: k for k, serial in enumerate(made.serials)}
    fresh = sorted(set(got.fresh or []))
    anew = set(fresh)
    sizes = {a.va: a.size for a in agent.exports()} if fresh else {}
    if any(got.vas[i] not in sizes for i in fresh) or \
            any(serial not in before for i, serial in enumerate(got.serials)
                if i not in anew) or len(got.fds) != len(fresh):
        for fd in got.fds:
            os.close(fd)
        raise PosError(f"the agent of process {agent.pid} answered an own-take with allocations "
                       "pos did not export before the cut", "take the checkpoint again")
    fds = iter(got.fds)
    used: set[int] = set()
    local: list[int] = []
    for i, (va, serial) in enumerate(zip(got.vas, got.serials)):
        if i in anew:
            taken.regions.append(Region(va, sizes[va], device))
            taken.fds.append(next(fds))
            local.append(0)
        else:
            k = before[serial]
            used.add(k)
            taken.regions.append(made.regions[k])
            taken.fds.append(made.fds[k])
            local.append(made.mem.local[k])
    for k, fd in enumerate(made.fds):        # gone since the export
        if k not in used:
            os.close(fd)
    made.fds = []
    taken.later.append(made.mem)
    made.mem = None
    return local, fresh


def _regions(agent: Agent, vas: list[int], device: int) -> list[Region]:
    """The job's own allocations at `vas` (an own-export's or own-take's), with their sizes
    as the agent lists them."""
    if not vas:
        return []
    sizes = {a.va: a.size for a in agent.exports()}
    return [Region(va, sizes[va], device) for va in vas]


def _shadow(drv: "Driver", size: int) -> Optional["gpucopy.Shadow"]:
    """Device memory for the first of `size` bytes, as much as pos's shadow rule leaves the GPU
    room for; None where it leaves none."""
    from pos.concurrent import gpucopy

    n = min(size, gpucopy.shadow_room(drv))
    return gpucopy.Shadow(drv, n) if n > 0 else None


def _copy(drv: "Driver", taken: Taken, local: list[int], timed: Timed,
          staging: Optional["gpucopy.Pinned"], pieces: Optional[HostPieces]) -> None:
    """`taken`'s bytes, mapped in pos at `local`, copied while the job is held: the first into
    its shadow (made now where it has none), the rest into host memory on threads, through
    `staging` (made now where there is none), into `pieces` as far as they go. Left to the
    driver's checkpoint instead, the 20 GB of a job with PyTorch's expandable segments held it
    31 s, and at 50% of an H200 the host could not hold them (bench/results/2026-12-01.md)."""
    from pos.concurrent import gpucopy

    if taken.shadow is None:
        taken.shadow = _shadow(drv, taken.bytes)
    n = taken.on_device
    placed = list(_placed(taken.regions, local))
    first = [(at, offset, min(size, n - offset)) for at, offset, size in placed if offset < n]
    if first:
        assert taken.shadow is not None       # on_device: some of it fits
        ptr = taken.shadow.ptr
        timed("own_copy", lambda: gpucopy.device_to_device(
            drv, [ptr + offset for _, offset, _ in first], [at for at, _, _ in first],
            [size for _, _, size in first]))
    rest = _beyond(placed, n)
    if rest:
        taken.host = timed("own_host", lambda: _to_host(drv, rest, staging,
                                                        pieces or HostPieces([])))


def _beyond(placed: list[tuple[int, int, int]], n: int) -> list[tuple[int, int, int]]:
    """What of the pieces `placed` (an address in pos, a place in the data, bytes) lies past
    the data's first `n` bytes."""
    return [(at + max(0, n - offset), max(offset, n), size - max(0, n - offset))
            for at, offset, size in placed if offset + size > n]


def _staging(drv: "Driver") -> "gpucopy.Pinned":
    """Page-locked memory for MOVERS threads, PIECE bytes each."""
    from pos.concurrent import gpucopy

    return gpucopy.Pinned(drv, _threads(MOVERS) * PIECE)


def _to_host(drv: "Driver", work: list[tuple[int, int, int]],
             staging: Optional["gpucopy.Pinned"], pieces: HostPieces) -> list[list[mmap.mmap]]:
    """The pieces of `work` (an address in pos, a place in the data, bytes) copied into host
    memory, on threads, each through PIECE bytes of `staging` (made here where it is None) of
    its own: one run of them after another, a thread each (written into the image as a part
    of its own), each piece into anonymous memory of its own from `pieces` (let go once
    written). Copied by the driver straight into pageable memory, 13.2 GB on 16 threads came at
    1.7 GB/s, and held the job 7.6 s; through page-locked memory, at 17-27 GB/s; through two
    pieces a thread, the device's copy into one beside the move out of the other, no faster
    (bench/results/2026-12-01.md)."""
    made = staging is None
    pinned = staging if staging is not None else _staging(drv)
    try:
        runs = _split(work, min(_threads(len(work)), pinned.size // PIECE))
        host = [[pieces.get(n) for _, _, n in run] for run in runs]

        def copy(k: int) -> None:
            bounce = pinned.ptr + k * PIECE
            for (at, _offset, n), into in zip(runs[k], host[k]):
                drv.cuMemcpyDtoH_v2(bounce, at, n)
                C.memmove(_address(into), bounce, n)

        _with_context(drv, len(runs), copy)
    finally:
        if made:
            pinned.close()
    return host


def _address(m: mmap.mmap) -> int:
    return C.addressof(C.c_char.from_buffer(m))


def _anonymous(n: int) -> mmap.mmap:
    """`n` bytes of anonymous memory, on transparent huge pages where the kernel has them (16
    threads faulted such pages in at 38 GB/s on the H200 host, bench/results/2026-11-28-perf),
    and left out of the children pos forks (CRIU)."""
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_DONTFORK)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    return m


def _buffers(regions: list[Region]) -> list[Buffer]:
    return [Buffer(r.va, r.size, r.size, r.device, True) for r in regions]


def _write(drv: "Driver", parts: list[list[tuple[int, int, int]]], folder: Path,
           pid: Optional[int]) -> dict[str, filehash.Written]:
    """Runs of pieces (a device address, a place in the data, bytes) into the image's first
    data parts in `folder` (names.own_memory_part), a run a part and a thread, each through
    page-locked memory of its own. One piece at a time through pageable memory into one file,
    the 50 GB of a job with PyTorch's expandable segments went into the image at 2.2 GB/s; on
    threads into one file no faster, a file of a tmpfs taking one write at a time
    (bench/results/2026-12-01.md). Each part is hashed as it is written (`_write_hashed`)."""
    written = {names.own_memory_part(pid, k): _written(n for _at, _offset, n in run)
               for k, run in enumerate(parts)}

    def write(k: int, host: int, view: memoryview) -> None:
        name = names.own_memory_part(pid, k)
        with open(folder / name, "wb", buffering=0) as f:
            for at, _offset, n in parts[k]:
                drv.cuMemcpyDtoH_v2(host, at, n)
                _write_hashed(f, view[:n], written[name])

    _on_threads(drv, len(parts), write)
    return written


def _written(sizes: Iterator[int]) -> filehash.Written:
    """The checksums of a data part of these pieces' bytes, made as it is written."""
    return filehash.Written(sum(sizes), image.CHUNK_BYTES)


def _write_hashed(f: Any, data: memoryview, written: filehash.Written) -> None:
    """All of `data` folded into `written`, then written into the unbuffered file `f` (a write
    may take only some)."""
    import numpy as np      # imported by the copy by now (gpucopy)

    written.add(np.frombuffer(data, np.uint8))
    done = 0
    while done < len(data):
        done += f.write(data[done:]) or 0


def _read(drv: "Driver", regions: list[Region], local: list[int], folder: Path,
          pid: Optional[int], manifest: image.Manifest) -> None:
    """`regions`, mapped in pos at `local`, filled from the image's data parts in `folder` (their
    bytes one after another) on threads, a chunk of the manifest's at a time, each through
    page-locked memory of its own: one piece at a time through pageable memory, the 50 GB of a
    job with PyTorch's expandable segments came back at 3.8 GB/s, on 16 threads at 28 GB/s
    (bench/results/2026-12-01.md). Each chunk is checked against its checksum as it is read,
    as the GPU data is (checked whole first, beside CRIU, those 50 GB held the job's first step
    2.7-3.1 s more). A chunk that does not match is refused in one sentence."""
    import numpy as np      # imported by the restore's thread by now (gpucopy)

    into = list(zip(_starts(regions), local, [r.size for r in regions]))
    paths = _parts_of(folder, pid)
    parts = [image.sums(folder, manifest, p.name) for p in paths]
    chunks: list[tuple[int, int, int]] = []    # a part, a chunk of it, where the part begins
    begins = 0
    for j, sums in enumerate(parts):
        chunks += [(j, i, begins) for i in range(len(sums.chunks))]
        begins += sums.size
    fds = [os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in paths]
    threads = _threads(len(chunks))
    try:
        def read(k: int, host: int, view: memoryview) -> None:
            buf = np.frombuffer(view, np.uint8)
            for j, i, begin in chunks[k::threads]:
                at, n = parts[j].span(i)
                if not parts[j].read(i, fds[j], buf):
                    raise image.corrupt(folder, paths[j].name, at, n)
                _scatter(drv, into, begin + at, host, n)

        _on_threads(drv, threads, read, manifest.chunk_bytes)
    finally:
        for fd in fds:
            os.close(fd)


def _scatter(drv: "Driver", into: list[tuple[int, int, int]], offset: int, host: int,
             n: int) -> None:
    """The `n` bytes at `host`, the image's data at `offset`, copied into the regions they
    belong to (`into`: each region's place in the data, its address in pos, its size)."""
    k = max(0, bisect.bisect_right(into, (offset, 1 << 64)) - 1)
    end = offset + n
    while k < len(into) and into[k][0] < end:
        start, at, size = into[k]
        lo, hi = max(start, offset), min(start + size, end)
        if hi > lo:
            drv.cuMemcpyHtoD_v2(at + lo - start, host + lo - offset, hi - lo)
        k += 1


def _parts_of(folder: Path, pid: Optional[int]) -> list[Path]:
    """The data parts an image holds, in order (an image without more than one has its first)."""
    paths = [folder / names.own_memory_part(pid, 0)]
    while (more := folder / names.own_memory_part(pid, len(paths))).exists():
        paths.append(more)
    return paths


def _threads(pieces: int) -> int:
    return max(1, min(MOVERS, filehash.workers(), pieces))


def _split(work: list[tuple[int, int, int]], n: int) -> list[list[tuple[int, int, int]]]:
    """`work` in `n` runs of about the same bytes, one after another (none empty)."""
    total = sum(w[2] for w in work)
    runs: list[list[tuple[int, int, int]]] = [[]]
    done = 0
    for w in work:
        if runs[-1] and done >= total * len(runs) / n:
            runs.append([])
        runs[-1].append(w)
        done += w[2]
    return runs


def _on_threads(drv: "Driver", threads: int, fn: Callable[[int, int, memoryview], None],
                each: int = PIECE) -> None:
    """`fn(k, host, view)` for k in range(threads), each on a thread of its own with the
    context current here and `each` bytes of page-locked memory of its own (at `host`, seen
    through `view`)."""
    from pos.concurrent import gpucopy

    staging = gpucopy.Pinned(drv, threads * each)
    try:
        def run(k: int) -> None:
            host = staging.ptr + k * each
            fn(k, host, memoryview((C.c_char * each).from_address(host)).cast("B"))

        _with_context(drv, threads, run)
    finally:
        staging.close()


def _with_context(drv: "Driver", threads: int, fn: Callable[[int], None]) -> None:
    """`fn(k)` for k in range(threads), each on a thread of its own with the context current
    here."""
    from pos.concurrent import gpucopy

    ctx = gpucopy.current(drv)

    def run(k: int) -> None:
        drv.cuCtxSetCurrent(ctx)
        fn(k)

    side_by_side("pos-own-move", list(range(threads)), run, lambda _: None)


def _placed(regions: list[Region], local: list[int]) -> Iterator[tuple[int, int, int]]:
    """Each piece of the regions, mapped in pos at `local`: its address in pos, its place in
    the image's file (the regions one after another), its bytes."""
    offset = 0
    for at, n in _pieces(regions, local):
        yield at, offset, n
        offset += n


def _starts(regions: list[Region]) -> list[int]:
    """Where each region begins in the image's data (the regions one after another)."""
    starts, at = [], 0
    for r in regions:
        starts.append(at)
        at += r.size
    return starts


def _pieces(regions: list[Region], local: list[int]) -> Iterator[tuple[int, int]]:
    """Each piece of the regions, mapped in pos at `local`, in the image's order: its address
    in pos and its bytes."""
    for r, base in zip(regions, local):
        for at in range(0, r.size, PIECE):
            yield base + at, min(PIECE, r.size - at)


def saved(folder: Path, pid: Optional[int]) -> list[Region]:
    """The job's own allocations an image holds ([] where its checkpoint took none)."""
    index_name, data_name = names.own_memory(pid)
    path = folder / index_name
    if not path.exists():
        return []
    try:
        regions = [Region(int(r["va"]), int(r["size"]), int(r["device"]))
                   for r in json.loads(path.read_text())]
    except (ValueError, TypeError, KeyError) as e:
        raise BadInput(f"{path} is damaged ({e})", "restore another image of the job") from None
    parts = _parts_of(folder, pid)
    if sum(p.stat().st_size if p.exists() else -1 for p in parts) != sum(r.size for r in regions):
        raise BadInput(f"{folder / data_name} does not hold what {path} lists",
                       "restore another image of the job")
    return regions


class Made:
    """A restored process's own allocations, as its image lists them (`saved`), made anew on
    its GPU and filled from the image while CRIU restores the process (the restore's prefetch,
    pos/concurrent/prefetch.py): pos's mapping, and one descriptor an allocation for the job to
    map (`hand_over`)."""

    def __init__(self, drv: "Driver", device: int, folder: Path, pid: Optional[int],
                 listed: list[Region], manifest: image.Manifest) -> None:
        """`manifest`: the image's, checked for its files (image.check_files)."""
        from pos.concurrent import gpucopy

        self.folder = folder
        self.regions = [Region(r.va, r.size, device) for r in listed]
        t = time.monotonic()
        self.mem, self.fds = gpucopy.Imported.create(drv, _buffers(self.regions))
        self.make_s = time.monotonic() - t      # the memory made and mapped, then filled
        try:
            _read(drv, self.regions, self.mem.local, folder, pid, manifest)
        except BaseException:
            self.close()
            raise
        self.fill_s = time.monotonic() - t - self.make_s

    @property
    def bytes(self) -> int:
        return sum(r.size for r in self.regions)

    def hand_over(self, agent: Agent) -> int:
        """The memory mapped at its addresses by the restored job's agent (own-up), before any
        process of the job runs; the bytes."""
        down = [(a.va, a.size) for a in agent.exports() if a.down]
        if down != [(r.va, r.size) for r in self.regions]:
            raise PosError(f"the restored process {agent.pid}'s own allocations do not match "
                           f"{self.folder}'s", "take a new checkpoint")
        agent.own_up(self.fds)
        return self.bytes

    def close(self) -> None:
        """pos's mapping and descriptors let go (the job's mappings hold the memory once it
        has it; the context it was made in current)."""
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        self.mem.close()
