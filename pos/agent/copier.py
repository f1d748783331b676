"""The copier (checkpoint) and the restorer (on-demand restore): device buffers to and from host
staging on their own streams, in chunks, with several copies in flight.

Checkpoint. Each copy thread owns a CUDA stream and `depth` events. It claims the next buffer
(URGENT ones first: those a waiting application call needs; then the predicted order), waits
for the buffer's shadow-copy event when it saves a shadow, and enqueues its chunks device to
host into pinned staging buffers, each followed by an event; it keeps up to `depth` chunks in
flight (double-buffered by default) and hands each completed chunk to the writer threads. When
the last chunk of a buffer has completed (one stream: its earlier chunks have too) the buffer
is marked saved, which releases the calls waiting on it; the writers checksum (numba, no GIL),
optionally compress, and write the chunks in large writes meanwhile. Chunks of different
buffers and streams complete in any order: each is recorded with its offset (gpuimage.Writer),
so the order on disk does not matter.

Restore. Each restorer thread claims the next buffer not back yet (URGENT first: a held
application call needs it), reads its chunks from the image into pinned staging (preadv
straight into the staging memory, checksum checked without the GIL), and enqueues them host to
device; reading chunk i+1 overlaps the copy of chunk i; when a buffer's copies are complete it
is marked back, releasing the calls that wait for it.

Staging is pinned with cuMemHostAlloc (cuMemAllocHost_v2, then plain memory, where the driver
lacks it), allocated once per agent and reused. No Python work per byte.

Not proven on a GPU yet: the throughput (target >= 40 GB/s of the 53 GB/s PCIe limit, both
ways); the options to tune it are `chunk` (64-256 MiB), `streams` and `depth`.
"""

import ctypes
import os
import queue
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import numpy as np

from pos.agent import state as S
from pos.agent.gpuimage import Writer, read_chunk_into
from pos.driver import Driver

CHUNK = 64 << 20
CU_EVENT_BLOCKING_SYNC = 1
CU_EVENT_DISABLE_TIMING = 2
CU_STREAM_NON_BLOCKING = 1


class Staging:
    """A bounded pool of pinned host buffers of `size` bytes for device<->host chunks."""

    def __init__(self, drv: Driver, count: int, size: int) -> None:
        self.drv, self.size, self.count = drv, size, count
        self.free: "queue.Queue[np.ndarray]" = queue.Queue()
        self._pinned: list[ctypes.c_void_p] = []
        self.pinned = False
        try:
            for _ in range(count):
                self.free.put(self._one())
        except BaseException:
            self.close()
            raise

    def _one(self) -> np.ndarray:
        p = ctypes.c_void_p()
        for name, args in (("cuMemHostAlloc", (ctypes.byref(p), ctypes.c_size_t(self.size), 0)),
                           ("cuMemAllocHost_v2", (ctypes.byref(p), ctypes.c_size_t(self.size)))):
            if self.drv.has(name):
                self.drv.call(name, *args, fix="lower the staging (chunk size or count)")
                self._pinned.append(p)
                self.pinned = True
                return np.frombuffer((ctypes.c_uint8 * self.size).from_address(p.value), np.uint8)
        return np.empty(self.size, np.uint8)

    def get(self) -> np.ndarray:
        return self.free.get()

    def put(self, buf: np.ndarray) -> None:
        self.free.put(buf)

    def close(self) -> None:
        for p in self._pinned:
            self.drv.call("cuMemFreeHost", p)
        self._pinned = []


class _Stream:
    """One CUDA stream and its ring of events (created by an agent thread)."""

    def __init__(self, drv: Driver, depth: int) -> None:
        self.drv = drv
        self.stream = ctypes.c_void_p()
        self.events: list[ctypes.c_void_p] = []
        drv.call("cuStreamCreate", ctypes.byref(self.stream), CU_STREAM_NON_BLOCKING)
        for _ in range(depth):
            ev = ctypes.c_void_p()
            # blocking sync: the copier's threads sleep on a chunk instead of spinning on a
            # core the application's launching thread may need (a chunk takes milliseconds)
            drv.call("cuEventCreate", ctypes.byref(ev),
                     CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC)
            self.events.append(ev)
        self.next = 0

    def event(self) -> ctypes.c_void_p:
        ev = self.events[self.next]
        self.next = (self.next + 1) % len(self.events)
        return ev

    def close(self) -> None:
        for ev in self.events:
            if self.drv.has("cuEventDestroy_v2"):
                self.drv.call("cuEventDestroy_v2", ev)
        if self.stream.value:
            self.drv.call("cuStreamDestroy_v2", self.stream)


@contextmanager
def _agent_stream(drv: Driver, depth: int, register: Callable[[], Any],
                  unregister: Callable[[], None], errors: list) -> Iterator[_Stream]:
    """The stream of one copier or restorer thread, which is an agent thread meanwhile (its
    calls pass the callback untouched); the stream is closed and the thread unregistered however
    the work ends (a failure to close is recorded in `errors`)."""
    register()
    s: Optional[_Stream] = None
    try:
        s = _Stream(drv, depth)
        yield s
    finally:
        if s is not None:
            try:
                s.close()
            except BaseException as e:
                errors.append(e)
        unregister()


def _claims(st: S.State, errors: list, abort: threading.Event) -> Iterator[np.ndarray]:
    """The buffers the state hands this thread next (copier and restorer alike), as the
    claim's (base, source, size, shadow extent) row, until none is left or the work stops."""
    out = np.zeros(4, np.int64)
    while not errors and not abort.is_set() and S.claim_locked(
            st.mutex, st.cond, st.ctl, st.bases, st.ends, st.status, st.flags, st.shadow,
            st.order, st.sh_off, out):
        yield out


class Copier:
    """Saves every buffer the state marks for the image; `run` returns when all are saved."""

    def __init__(self, drv: Driver, st: S.State, writer: Writer,
                 register: Callable[[], Any], unregister: Callable[[], None],
                 streams: int = 4, writers: int = 4, staging: Optional[Staging] = None,
                 chunk: int = CHUNK, depth: int = 2) -> None:
        self.drv, self.st, self.writer = drv, st, writer
        self.register, self.unregister = register, unregister
        self.n_streams, self.n_writers, self.depth = streams, writers, max(1, depth)
        self.own_staging = staging is None
        self.staging = staging or Staging(drv, streams * self.depth + writers, chunk)
        self.chunk = self.staging.size
        self.bytes_in = 0
        self.bytes_stored = 0
        self.t_host: Optional[float] = None      # when the last buffer was in host memory
        self.errors: list[BaseException] = []
        self.abort = threading.Event()
        self._lock = threading.Lock()
        self._q: "queue.Queue[Optional[tuple[int, int, np.ndarray, int]]]" = queue.Queue()

    def _finish(self, base: int, size: int) -> None:
        st = self.st
        S.finish_locked(st.mutex, st.cond, st.ctl, st.bases, st.ends, st.status, st.flags,
                        st.shadow, st.sh_size, np.uint64(base))
        with self._lock:
            self.bytes_in += size
            self.t_host = time.monotonic()

    def _copy_thread(self) -> None:
        st = self.st
        inflight: list[tuple[ctypes.c_void_p, int, int, np.ndarray, int, int]] = []

        def retire() -> None:
            ev, base, off, buf, n, size = inflight.pop(0)
            self.drv.call("cuEventSynchronize", ev)
            self._q.put((base, off, buf, n))
            if size:                                    # the last chunk of its buffer
                self._finish(base, size)

        try:
            with _agent_stream(self.drv, self.depth, self.register, self.unregister,
                               self.errors) as s:
                for out in _claims(st, self.errors, self.abort):
                    base, src, size, extent = (int(x) for x in out)
                    if extent >= 0:          # the shadow copy must have run on its stream
                        self.drv.call("cuEventSynchronize",
                                      ctypes.c_void_p(int(st.sh_event[extent])))
                    for off in range(0, size, self.chunk):
                        n = min(self.chunk, size - off)
                        while inflight and (len(inflight) >= self.depth
                                            or self.staging.free.empty()):
                            retire()
                        buf = self.staging.get()
                        ev = s.event()
                        self.drv.call("cuMemcpyDtoHAsync_v2", ctypes.c_void_p(buf.ctypes.data),
                                      ctypes.c_uint64(src + off), ctypes.c_size_t(n), s.stream)
                        self.drv.call("cuEventRecord", ev, s.stream)
                        inflight.append((ev, base, off, buf, n, size if off + n >= size else 0))
                    if size == 0:
                        self._finish(base, 0)
                while inflight:
                    retire()
        except BaseException as e:          # reported by run(); the agent ends the checkpoint
            self.errors.append(e)
            for item in inflight:
                self.staging.put(item[3])

    def _write_thread(self) -> None:
        while (item := self._q.get()) is not None:
            base, off, buf, n = item
            try:
                if not self.errors and not self.abort.is_set():
                    stored = self.writer.put(base, off, buf[:n])
                    with self._lock:
                        self.bytes_stored += stored
            except BaseException as e:
                self.errors.append(e)
            finally:
                self.staging.put(buf)

    def start(self) -> list[threading.Thread]:
        self._writers = [threading.Thread(target=self._write_thread, name=f"pos-writer-{i}",
                                          daemon=True) for i in range(self.n_writers)]
        self._copiers = [threading.Thread(target=self._copy_thread, name=f"pos-copier-{i}",
                                          daemon=True) for i in range(self.n_streams)]
        for t in self._writers + self._copiers:
            t.start()
        return self._copiers

    def join(self) -> None:
        """Wait for the copy threads, then the writers; raise the first error of any."""
        for t in self._copiers:
            t.join()
        for _ in self._writers:
            self._q.put(None)
        for t in self._writers:
            t.join()
        if self.own_staging:
            self.staging.close()
        if self.errors:
            raise self.errors[0]

    def run(self) -> None:
        """Copy until nothing is left to claim; raises the first error of any thread."""
        self.start()
        self.join()


class Restorer:
    """Puts the buffers of an image back (on demand: the state says which are not back yet and
    which a held call needs first); `run` returns when all are back."""

    def __init__(self, drv: Driver, st: S.State, plan: dict[int, tuple[Any, int, list]],
                 register: Callable[[], Any], unregister: Callable[[], None],
                 streams: int = 8, staging: Optional[Staging] = None, chunk: int = CHUNK,
                 depth: int = 2) -> None:
        self.drv, self.st, self.plan = drv, st, plan
        self.register, self.unregister = register, unregister
        self.n_streams, self.depth = streams, max(1, depth)
        biggest = max((c["raw"] for _, _, cs in plan.values() for c in cs), default=1)
        self.own_staging = staging is None or staging.size < biggest
        self.staging = staging if not self.own_staging else \
            Staging(drv, streams * self.depth, max(chunk, biggest))
        self.bytes = 0
        self.errors: list[BaseException] = []
        self.abort = threading.Event()
        self._lock = threading.Lock()

    def _thread(self) -> None:
        st = self.st
        fds: dict[str, int] = {}
        held: list[np.ndarray] = []
        try:
            with _agent_stream(self.drv, self.depth, self.register, self.unregister,
                               self.errors) as s:
                for out in _claims(st, self.errors, self.abort):
                    base = int(out[0])
                    folder, size, chunks = self.plan[base]
                    ring: list[tuple[ctypes.c_void_p, np.ndarray]] = []
                    for c in chunks:
                        if len(ring) >= self.depth or (ring and self.staging.free.empty()):
                            ev, buf = ring.pop(0)
                            self.drv.call("cuEventSynchronize", ev)
                            held.remove(buf)
                            self.staging.put(buf)
                        buf = self.staging.get()
                        held.append(buf)
                        read_chunk_into(folder, c, buf, fds)
                        ev = s.event()
                        self.drv.call("cuMemcpyHtoDAsync_v2",
                                      ctypes.c_uint64(base + c["offset"]),
                                      ctypes.c_void_p(buf.ctypes.data),
                                      ctypes.c_size_t(c["raw"]), s.stream)
                        self.drv.call("cuEventRecord", ev, s.stream)
                        ring.append((ev, buf))
                    self.drv.call("cuStreamSynchronize", s.stream)
                    for _, buf in ring:
                        held.remove(buf)
                        self.staging.put(buf)
                    S.finish_locked(st.mutex, st.cond, st.ctl, st.bases, st.ends, st.status,
                                    st.flags, st.shadow, st.sh_size, np.uint64(base))
                    with self._lock:
                        self.bytes += size
        except BaseException as e:
            self.errors.append(e)
        finally:
            for buf in held:
                self.staging.put(buf)
            for fd in fds.values():
                os.close(fd)

    def start(self) -> list[threading.Thread]:
        self._threads = [threading.Thread(target=self._thread, name=f"pos-restorer-{i}",
                                          daemon=True) for i in range(self.n_streams)]
        for t in self._threads:
            t.start()
        return self._threads

    def join(self) -> None:
        for t in self._threads:
            t.join()
        if self.own_staging:
            self.staging.close()
        if self.errors:
            raise self.errors[0]
