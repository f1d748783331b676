"""The concurrent engine's copier, outside the job: pos imports the job's device memory (the
descriptors its agent exports), snapshots it device-to-device into a shadow of its own while
the job is held (HBM speed: milliseconds), and copies the shadow to pinned host memory and then
to disk while the job runs. A restore goes the other way, buffer by buffer, telling the agent
each buffer that is back so that the job's calls that need it may go.

Every driver call goes through pos/driver.py (one place talks to libcuda)."""

import ctypes
import mmap
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from pos.agent.control import Buffer
from pos.concurrent.crew import Crew, Spares
from pos.concurrent.kept import Kept
from pos.driver import (CU_EVENT_DISABLE_TIMING, CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                        CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                        CU_MEM_LOCATION_TYPE_DEVICE, CU_STREAM_NON_BLOCKING, CUcontext,
                        CUdevice, CUdeviceptr, CUevent, CUmemAccessDesc, CUmemAllocationProp,
                        CUmemGenericAllocationHandle, CUmemLocation, CUstream, CUuuid, Driver,
                        driver)
from pos.errors import PosError

if TYPE_CHECKING:     # imported where used: a restore makes its context and memory beside
    import numpy as np    # CRIU first, and numpy took 0.15 s of that on the H100 host

C = ctypes


class Context:
    """pos's hold on one GPU's primary context: retained and made current on the thread that
    makes it, current again on another by `use()`, let go by `close()` once everything pos made
    in it is freed. An operation's hold ends with the operation; the restore service
    (pos/engines/service.py) keeps one of its own on each GPU for its whole life, which makes
    its operations' holds cheap (the first retain of a process makes the context, later ones
    count)."""

    def __init__(self, device: int = 0) -> None:
        self.drv, self.device = driver(), device
        self.ctx: Optional[C.c_void_p] = self.drv.primary_context(device)

    def use(self) -> None:
        self.drv.cuCtxSetCurrent(self.ctx)

    def close(self) -> None:
        if self.ctx is None:
            return
        self.ctx = None
        dev = CUdevice()
        self.drv.cuDeviceGet(C.byref(dev), self.device)
        self.drv.cuCtxSetCurrent(None)
        self.drv.cuDevicePrimaryCtxRelease_v2(dev)

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def current(drv: Driver) -> C.c_void_p:
    """The context current on this thread: what `context` made current, to make current again
    (`drv.cuCtxSetCurrent(ctx)`) where pos works on several GPUs from one thread."""
    ctx = CUcontext()
    drv.cuCtxGetCurrent(C.byref(ctx))
    return ctx


def device_count() -> int:
    """How many GPUs the CUDA driver shows this process."""
    drv = driver()
    drv.init()
    count = C.c_int()
    drv.cuDeviceGetCount(C.byref(count))
    return count.value


def ordinal(uuid: str) -> int:
    """This process's CUDA device number of the GPU named `uuid` (NVML's form, GPU-...): CUDA
    and NVML may number the GPUs of one host differently."""
    drv = driver()
    for i in range(device_count()):
        dev, raw = CUdevice(), CUuuid()
        drv.cuDeviceGet(C.byref(dev), i)
        drv.cuDeviceGetUuid_v2(C.byref(raw), dev)
        h = bytes(raw.bytes).hex()
        if f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}" == uuid:
            return i
    raise PosError(f"the CUDA driver does not see {uuid}", "check CUDA_VISIBLE_DEVICES")


def _device(device: int) -> CUmemLocation:
    return CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, device)


class Imported:
    """The job's buffers mapped into this process: handle i holds buffers[i]'s memory, mapped
    at local[i]. All of them lie one after another in one address range of pos's, their access
    set once for each run of buffers on one device: mapped each into a range of its own (a
    reservation, a mapping and an access call each), the 4,561 pieces of a job with PyTorch's
    expandable segments at 60% of an H200 took 1.21 s to import and map, and made anew at its
    restore 1.95 s (bench/results/2026-12-01.md)."""

    def __init__(self, drv: Driver, buffers: Sequence[Buffer], fds: Sequence[int]) -> None:
        self.drv, self.buffers = drv, list(buffers)
        self.handles: list[int] = []
        self.local: list[int] = []
        self._range = (0, 0)        # pos's address range: where, how long
        try:
            for fd in fds:
                h = CUmemGenericAllocationHandle()
                drv.cuMemImportFromShareableHandle(C.byref(h), fd,
                                                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
                self.handles.append(h.value)
            self._map()
        except BaseException:
            self.close()
            raise

    @classmethod
    def create(cls, drv: Driver, buffers: Sequence[Buffer]) -> tuple["Imported", list[int]]:
        """New exportable memory for `buffers` (a restore into a new process): the mapping and
        one descriptor per buffer for the job to map."""
        mem = cls(drv, [], [])
        mem.buffers = list(buffers)
        fds: list[int] = []
        try:
            for b in mem.buffers:
                prop = CUmemAllocationProp(CU_MEM_ALLOCATION_TYPE_PINNED,
                                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                           _device(b.device))
                h = CUmemGenericAllocationHandle()
                drv.cuMemCreate(C.byref(h), b.mapped, C.byref(prop), 0)
                mem.handles.append(h.value)
                fd = C.c_int()
                drv.cuMemExportToShareableHandle(C.byref(fd), h,
                                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
                fds.append(fd.value)
            mem._map()
        except BaseException:
            for exported in fds:
                os.close(exported)
            mem.close()
            raise
        return mem, fds

    def _map(self) -> None:
        """Every handle mapped, one after another, into one new range; access set."""
        total = sum(b.mapped for b in self.buffers)
        if not total:
            return
        va = CUdeviceptr()
        self.drv.cuMemAddressReserve(C.byref(va), total, 0, 0, 0)
        self._range = (va.value, total)
        at = va.value
        for b, h in zip(self.buffers, self.handles):
            self.drv.cuMemMap(at, b.mapped, 0, h, 0)
            self.local.append(at)
            at += b.mapped
        k = 0
        while k < len(self.buffers):        # each run of buffers on one device
            end = k
            while end < len(self.buffers) and self.buffers[end].device == self.buffers[k].device:
                end += 1
            acc = CUmemAccessDesc(_device(self.buffers[k].device),
                                  CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            self.drv.cuMemSetAccess(self.local[k], sum(b.mapped for b in self.buffers[k:end]),
                                    C.byref(acc), 1)
            k = end

    def close(self) -> None:
        for va, b in zip(self.local, self.buffers):
            self.drv.raw.cuMemUnmap(va, b.mapped)
        if self._range[1]:
            self.drv.raw.cuMemAddressFree(*self._range)
        for h in self.handles:
            self.drv.raw.cuMemRelease(h)
        self.local, self.handles, self._range = [], [], (0, 0)


class Pinned:
    """One page-locked host arena, with numpy views of it, locked in PIECE-sized parts.

    How fast a host locks memory decides how long a checkpoint waits before its cut. On the
    H200 host (bench/results/2026-11-28-perf): the driver faulting the pages in itself
    (cuMemHostRegister on untouched memory) locked 5.5 GB/s, by 4 threads or 16; 16 threads
    writing the pages first faulted them in at 38 GB/s, and 8 threads then registered the
    present pages at 46 GB/s: 21 GB/s in all. Faulting and registering side by side ran no
    faster than the driver alone (each registration changes the mapping, under the lock the
    faults take), so the parts are all faulted in first, then registered. The memory is
    anonymous, on transparent huge pages.

    Only `ahead` bytes are locked before the constructor returns; the rest once `lock_rest()`
    is called, while the copy runs: `subscribe(fn)` hears of each part as it is registered. A
    checkpoint calls it once the job runs again (or is stopped for good): the driver's
    registrations then never meet the job's export, the driver's checkpoint or CRIU's dump. A
    part that fails to lock is given back and ends the locking: the arena is then what was
    locked (`error` says why), the rest given back. A copy must not cross a part: `grid` cuts
    chunks there."""

    PIECE = 1 << 30
    FAULTERS = 16
    REGISTERERS = 8
    # what one thread faults in at a time: the steps, not the parts, are shared among the
    # threads, so that the one part locked before the cut is faulted in by all of them (one
    # thread faulted its 1 GiB in 0.2-0.43 s of the wait before the cut on the H200 host)
    FAULT_STEP = 64 << 20

    def __init__(self, drv: Driver, size: int, ahead: Optional[int] = None,
                 kept: Optional[Kept] = None) -> None:
        self.drv, self.size = drv, max(size, 1)
        # `kept`: the pages live in a file kept for the next checkpoint (pos/concurrent/kept.py),
        # whose first `kept.present` bytes need no faulting in; the arena lets the file go at
        # `close`
        self._kept = kept
        self._present = 0
        if kept is None:
            self._map = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:
            try:
                kept.grow(self.size)
                self._map = mmap.mmap(kept.fd, self.size, flags=mmap.MAP_SHARED)
            except BaseException:
                kept.close()
                raise
            self._present = kept.present
        self.ptr = C.addressof(C.c_char.from_buffer(self._map))
        # not into the children pos forks (CRIU): the kernel copies pinned private pages at
        # fork, which took 11 s for 16 GiB inside the dump on the H100
        self._map.madvise(mmap.MADV_DONTFORK)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE)
        parts = [(at, min(self.PIECE, self.size - at)) for at in range(0, self.size, self.PIECE)]
        self._ctx = current(drv)
        self._cond = threading.Condition()
        self._stop = False
        self._ready: list[tuple[int, int]] = []      # the parts registered: (offset, length)
        self._subscribers: list[Callable[[int, int], None]] = []
        self.error: Optional[BaseException] = None
        self.t0 = time.monotonic()
        self.all_s: Optional[float] = None       # when every part was locked
        want = self.size if ahead is None else min(self.size, ahead)
        first = next(k for k, (at, n) in enumerate(parts) if at + n >= want) + 1
        self._rest = parts[first:]
        self._behind: Optional[threading.Thread] = None
        try:
            self._lock(parts[:first])
        except BaseException:
            self.close()
            raise
        if not self._rest:
            self.all_s = time.monotonic() - self.t0

    def lock_rest(self) -> None:
        """The parts not locked yet are locked from now on, on a thread of their own (a second
        call, or one on an arena locked whole or closed, does nothing)."""
        with self._cond:
            if not self._rest or self._behind is not None or self._stop:
                return
            self._behind = threading.Thread(target=self._lock_rest, args=(self._rest,),
                                            name="pos-pin", daemon=True)
            self._behind.start()          # under the lock: close() joins a started thread

    def _lock(self, parts: Sequence[tuple[int, int]]) -> None:
        """Fault every part in, then register each (see the class's docstring)."""
        from concurrent.futures import ThreadPoolExecutor

        steps = [(at, min(self.FAULT_STEP, start + n - at))
                 for start, n in parts for at in range(start, start + n, self.FAULT_STEP)]
        cpus = os.cpu_count() or 1
        with ThreadPoolExecutor(max(1, min(self.FAULTERS, len(steps), cpus)),
                                thread_name_prefix="pos-fault") as pool:
            list(pool.map(self._fault, steps))
        try:
            with ThreadPoolExecutor(max(1, min(self.REGISTERERS, len(parts), cpus)),
                                    thread_name_prefix="pos-lock") as pool:
                list(pool.map(self._register, parts))
        finally:        # what was faulted in and not registered (a failure, a stop): given back
            with self._cond:
                ready = set(self._ready)
            for at, n in parts:
                if (at, n) not in ready and self._kept is None:
                    self._map.madvise(mmap.MADV_DONTNEED, at, n)

    def _lock_rest(self, parts: Sequence[tuple[int, int]]) -> None:
        try:
            self._lock(parts)
        except BaseException as e:  # noqa: BLE001  (kept: the arena is what was locked)
            with self._cond:
                self.error = self.error or e
        with self._cond:
            if self.error is None and not self._stop:
                self.all_s = time.monotonic() - self.t0

    def _go_on(self) -> bool:
        with self._cond:
            return not self._stop and self.error is None

    def _fault(self, step: tuple[int, int]) -> None:
        """One step of a part faulted in (none in a kept file's memory: registered as it is)."""
        at, n = step
        if at + n > self._present and self._go_on():
            C.memset(self.ptr + at, 0, n)      # ctypes lets the GIL go

    def _register(self, part: tuple[int, int]) -> None:
        if not self._go_on():
            return
        at, n = part
        self.drv.cuCtxSetCurrent(self._ctx)
        try:
            self.drv.cuMemHostRegister_v2(self.ptr + at, n, 0)
        except BaseException as e:
            with self._cond:
                self.error = self.error or e                 # nothing more is locked
            raise
        with self._cond:
            self._ready.append(part)
            tell = list(self._subscribers)
        for fn in tell:
            fn(at, n)

    def subscribe(self, fn: Callable[[int, int], None]) -> None:
        """`fn(offset, length)` for each part locked so far, and for each part locked from now
        on (on the thread that locked it)."""
        with self._cond:
            self._subscribers.append(fn)
            ready = list(self._ready)
        for at, n in ready:
            fn(at, n)

    @property
    def pinned_bytes(self) -> int:
        with self._cond:
            return sum(n for _at, n in self._ready)

    def view(self, offset: int, n: int) -> "np.ndarray":
        import numpy as np

        return np.ctypeslib.as_array((C.c_uint8 * n).from_address(self.ptr + offset))

    def close(self) -> None:
        with self._cond:
            self._stop = True
        if self._behind is not None:
            self._behind.join()
        for at, _n in self._ready:
            self.drv.raw.cuMemHostUnregister(self.ptr + at)
        self._ready = []
        if self.ptr:
            self.ptr = 0
            try:
                self._map.close()
            except BufferError:       # a view still exported: the mapping goes with it
                pass
        if self._kept is not None:
            self._kept.close()


class Ring(C.Structure):
    """pos/image/chunks.c's `struct pos_ring`: one fill thread's page-locked pieces, its stream,
    an event per piece and the driver's entry points the C loop calls."""

    _fields_ = [("slots", C.c_void_p), ("piece", C.c_size_t), ("depth", C.c_size_t),
                ("events", C.c_void_p), ("pending", C.c_void_p), ("stream", C.c_void_p),
                ("copy", C.c_void_p), ("record", C.c_void_p), ("wait", C.c_void_p),
                ("next", C.c_size_t), ("error", C.c_int)]


class Rings:
    """The fill threads' rings, `depth` pieces of `piece` bytes each, in one pinned arena
    (threads * depth * piece bytes: 64 MiB for 16 threads of 4 x 1 MiB, where whole-chunk
    staging took 1 GiB and 0.2 s to pin). A thread's ring comes with the stream it copies on;
    at most `threads` threads get one."""

    def __init__(self, drv: Driver, threads: int, piece: int, depth: int) -> None:
        if piece <= 0 or depth <= 0 or piece % 32 or Pinned.PIECE % (piece * depth):
            raise ValueError("a ring's piece is a multiple of 32 bytes, and its pieces divide "
                             "the arena's pinned parts")
        self.drv, self.piece, self.depth = drv, piece, depth
        self.arena = Pinned(drv, threads * depth * piece)
        self.entry = [C.cast(f, C.c_void_p).value for f in        # the C loop checks them
                      (drv.raw.cuMemcpyHtoDAsync_v2, drv.raw.cuEventRecord,
                       drv.raw.cuEventSynchronize)]
        self.lock = threading.Lock()
        self.local = threading.local()
        self.events: list[C.c_void_p] = []
        self.taken = 0
        self.keep: list[object] = []      # the rings' ctypes arrays, alive while the rings are

    def mine(self, stream: C.c_void_p) -> Ring:
        """This thread's ring, copying on `stream` (the thread's own, from run_chunks)."""
        ring = getattr(self.local, "ring", None)
        if ring is not None:
            ring.stream = stream      # the ring's earlier copies were waited for on the old one
            return ring
        with self.lock:      # this thread's part of the arena, taken in the same breath
            at = self.taken * self.depth * self.piece
            if at >= self.arena.size:
                raise ValueError("more fill threads than the rings were made for")
            self.taken += 1
        events = (C.c_void_p * self.depth)()
        pending = (C.c_uint8 * self.depth)()
        with self.lock:
            self.keep += [events, pending]
        for k in range(self.depth):
            event = CUevent()
            self.drv.cuEventCreate(C.byref(event), CU_EVENT_DISABLE_TIMING)
            events[k] = event.value
            with self.lock:
                self.events.append(event)
        ring = Ring(self.arena.ptr + at, self.piece, self.depth, C.addressof(events),
                    C.addressof(pending), stream, *self.entry, 0, 0)
        self.local.ring = ring
        return ring

    def close(self) -> None:
        for e in self.events:
            self.drv.raw.cuEventDestroy_v2(e)
        self.events = []
        self.arena.close()


SHADOW_RESERVE = 1 << 30       # device memory left free for the job when sizing a shadow


class Shadow:
    """Device memory of pos's own holding a copy of some buffers, taken device-to-device."""

    def __init__(self, drv: Driver, size: int) -> None:
        self.drv, self.ptr, self.size = drv, 0, size
        p = CUdeviceptr()
        if size:
            drv.cuMemAlloc_v2(C.byref(p), size)
        self.ptr = p.value

    def close(self) -> None:
        if self.ptr:
            self.drv.raw.cuMemFree_v2(self.ptr)
            self.ptr = 0


def free_device_bytes(drv: Driver) -> int:
    free, total = C.c_size_t(), C.c_size_t()
    drv.cuMemGetInfo_v2(C.byref(free), C.byref(total))
    return free.value


def shadow_room(drv: Driver) -> int:
    """The device memory pos may take for shadows now: what is free but SHADOW_RESERVE."""
    return max(0, free_device_bytes(drv) - SHADOW_RESERVE)


@dataclass
class Copy:
    """One direction of a copy: bytes and seconds (its own, apart from the disk)."""

    bytes: int
    seconds: float
    read_thread_s: float = 0.0     # a restore's reads and checksums, summed over its threads

    @property
    def gbps(self) -> Optional[float]:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else None


def grid(sizes: Sequence[int], chunk: int, starts: Optional[Sequence[int]] = None,
         piece: int = 0) -> list[tuple[int, int, int]]:
    """(buffer index, offset, length) for every chunk, buffer by buffer; with `starts` (each
    buffer's place in a host arena) no chunk crosses a multiple of `piece` there."""
    out = []
    for i, n in enumerate(sizes):
        off = 0
        while off < n:
            k = min(chunk, n - off)
            if starts is not None and piece:
                k = min(k, piece - (starts[i] + off) % piece)
            out.append((i, off, k))
            off += k
    return out


def stream(drv: Driver) -> C.c_void_p:
    """A new stream of the current context that does not wait for the job's default stream."""
    s = CUstream()
    drv.cuStreamCreate(C.byref(s), CU_STREAM_NON_BLOCKING)
    return s


def chunks_of(work: Sequence[tuple[int, int, int]], buffers: int) -> list[int]:
    """How many of `work`'s chunks (buffer, offset, length) each of `buffers` buffers has."""
    counts = [0] * buffers
    for i, _off, _n in work:
        counts[i] += 1
    return counts


class _Streams:
    """One stream per worker thread, made current with the caller's context."""

    def __init__(self, drv: Driver) -> None:
        self.drv = drv
        self.ctx = current(drv)
        self.local = threading.local()
        self.all: list[C.c_void_p] = []
        self.lock = threading.Lock()

    def mine(self) -> C.c_void_p:
        s = getattr(self.local, "stream", None)
        if s is None:
            self.drv.cuCtxSetCurrent(self.ctx)
            s = stream(self.drv)
            self.local.stream = s
            with self.lock:
                self.all.append(s)
        return s

    def close(self) -> None:
        for s in self.all:
            self.drv.raw.cuStreamDestroy_v2(s)


class Order:
    """The chunks left to copy: those of a buffer the job's calls wait for first, then the rest
    in the copier's order."""

    def __init__(self, work: list[tuple[int, int, int]]) -> None:
        self.lock = threading.Lock()
        self.left: dict[int, deque[tuple[int, int, int]]] = {}
        for w in work:
            self.left.setdefault(w[0], deque()).append(w)
        self.order = deque(self.left)          # buffers in the order of their first chunk
        self.wanted: deque[int] = deque()

    def want(self, buffers: list[int]) -> None:
        with self.lock:
            self.wanted.extend(i for i in buffers if self.left.get(i))

    def follow(self, agent_of: Callable[[], Any], by_va: dict[int, int],
               until: threading.Event, needed: Callable[[list[int]], list[int]],
               also: Sequence["Order"] = ()) -> threading.Thread:
        """Until `until` is set, ask the job's agent (once `agent_of()` gives one) every 2 ms
        which buffers its calls wait for, and take first what those wait for (`needed`:
        handout.Handout.needed), in this order and in those of `also`. A failed question ends
        this: the chunks go on in order."""
        def run() -> None:
            while not until.wait(0.002):
                agent = agent_of()
                if agent is None:
                    continue
                try:
                    vas = agent.wanted()
                except Exception:
                    return
                wanted = needed([by_va[v] for v in vas if v in by_va])
                for order in (self, *also):
                    order.want(wanted)

        t = threading.Thread(target=run, name="pos-wanted", daemon=True)
        t.start()
        return t

    def take(self) -> Optional[tuple[int, int, int]]:
        with self.lock:
            for q in (self.wanted, self.order):
                while q and not self.left.get(q[0]):
                    q.popleft()
                if q:
                    return self.left[q[0]].popleft()
            return None


def run_chunks(drv: Driver, work: Sequence[tuple[int, int, int]], buffers: int, workers: int,
               one: Callable[[C.c_void_p, int, int, int], None],
               buffer_done: Callable[[int], None] = lambda _i: None,
               order: Optional[Order] = None, spares: Optional[Spares] = None) -> float:
    """Run `one(stream, buffer, offset, length)` over every chunk of `work` on `workers`
    threads (a Crew, on `spares` while any is left), each with its own stream, in `order`
    (else as listed); `buffer_done(i)` once buffer i's chunks are complete (at once for a
    buffer without chunks). The first failure stops the threads taking more chunks and is
    raised. Returns the seconds it took."""
    left = chunks_of(work, buffers)
    for i, n in enumerate(left):
        if n == 0:
            buffer_done(i)
    order = order or Order(list(work))
    lock = threading.Lock()
    streams = _Streams(drv)
    crew = Crew("pos-chunks")

    def worker() -> None:
        s = streams.mine()
        while not crew.stopped.is_set() and (item := order.take()):
            i, off, n = item
            try:
                one(s, i, off, n)
            except BaseException:
                # copies it queued before failing must end before their memory is freed
                drv.raw.cuStreamSynchronize(s)
                raise
            drv.cuStreamSynchronize(s)
            with lock:
                left[i] -= 1
                last = left[i] == 0
            if last:
                buffer_done(i)

    t = time.monotonic()
    try:
        crew.run([(str(k), worker) for k in range(max(1, workers))], spares)
    finally:
        streams.close()
    return time.monotonic() - t


def device_to_device(drv: Driver, dst: Sequence[int], src: Sequence[int], sizes: Sequence[int]
                     ) -> None:
    """Copy src[i] -> dst[i] on one stream and wait: the shadow taken while the job is held."""
    s = stream(drv)
    try:
        for d, a, n in zip(dst, src, sizes):
            drv.cuMemcpyDtoDAsync_v2(d, a, n, s)
        drv.cuStreamSynchronize(s)
    finally:
        drv.raw.cuStreamDestroy_v2(s)
