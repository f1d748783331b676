"""The copier: device buffers to host staging on its own streams, then to disk by writer threads.

Each copy thread owns a CUDA stream; it claims the next buffer (URGENT ones first, those a
waiting application call needs; then the predicted order), waits for the buffer's shadow copy
event when it saves a shadow, and moves the buffer in chunks through a pool of staging buffers
(pinned with cuMemAllocHost_v2 where the driver has it). The buffer is marked saved as soon as
its last chunk is in host memory, which releases the calls waiting on it; writer threads
checksum, optionally compress and append the chunks meanwhile. Several copies are in flight
(one per stream) and the staging pool bounds host memory.

Not proven on a GPU yet: the throughput (target 40 GB/s of the 53 GB/s PCIe limit).
"""

import ctypes
import queue
import threading
from typing import Any, Callable, Optional

import numpy as np

from pos.agent import state as S
from pos.agent.gpuimage import Writer
from pos.driver import Driver

CHUNK = 64 << 20
CU_EVENT_DISABLE_TIMING = 2


class Staging:
    """A bounded pool of host buffers for device-to-host (and host-to-device) chunks."""

    def __init__(self, drv: Driver, count: int, size: int) -> None:
        self.drv, self.size = drv, size
        self.free: "queue.Queue[np.ndarray]" = queue.Queue()
        self._pinned: list[ctypes.c_void_p] = []
        for _ in range(count):
            if drv.has("cuMemAllocHost_v2"):
                p = ctypes.c_void_p()
                drv.call("cuMemAllocHost_v2", ctypes.byref(p), ctypes.c_size_t(size))
                self._pinned.append(p)
                buf = np.frombuffer((ctypes.c_uint8 * size).from_address(p.value), np.uint8)
            else:
                buf = np.empty(size, np.uint8)
            self.free.put(buf)

    def close(self) -> None:
        for p in self._pinned:
            self.drv.call("cuMemFreeHost", p)
        self._pinned = []


class Copier:
    """Saves every buffer the state marks for the image; `run` returns when all are saved."""

    def __init__(self, drv: Driver, st: S.State, writer: Writer,
                 register: Callable[[], Any], unregister: Callable[[], None],
                 streams: int = 4, writers: int = 4, staging: int = 12,
                 chunk: int = CHUNK) -> None:
        self.drv, self.st, self.writer = drv, st, writer
        self.register, self.unregister = register, unregister
        self.n_streams, self.n_writers, self.chunk = streams, writers, chunk
        self.staging = Staging(drv, staging, chunk)
        self.bytes_in = 0
        self.bytes_stored = 0
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._q: "queue.Queue[Optional[tuple[int, int, np.ndarray, int]]]" = queue.Queue()

    def _copy_thread(self) -> None:
        st = self.st
        self.register()
        stream = ctypes.c_void_p()
        try:
            self.drv.call("cuStreamCreate", ctypes.byref(stream), 1)   # CU_STREAM_NON_BLOCKING
            out = np.zeros(4, np.int64)
            while not self.errors and S.claim_locked(st.mutex, st.ctl, st.bases, st.ends,
                                                     st.status, st.flags, st.shadow, st.order,
                                                     st.sh_off, out):
                base, src, size, extent = (int(x) for x in out)
                if extent >= 0:              # the shadow copy must have run on its stream
                    self.drv.call("cuEventSynchronize", ctypes.c_void_p(int(st.sh_event[extent])))
                for off in range(0, size, self.chunk):
                    n = min(self.chunk, size - off)
                    buf = self.staging.free.get()
                    self.drv.call("cuMemcpyDtoHAsync_v2", ctypes.c_void_p(buf.ctypes.data),
                                  ctypes.c_uint64(src + off), ctypes.c_size_t(n), stream)
                    self.drv.call("cuStreamSynchronize", stream)
                    self._q.put((base, off, buf, n))
                S.finish_locked(st.mutex, st.cond, st.ctl, st.bases, st.ends, st.status,
                                st.flags, st.shadow, st.sh_size, np.uint64(base))
                with self._lock:
                    self.bytes_in += size
        except BaseException as e:          # reported by run(); the agent ends the checkpoint
            self.errors.append(e)
        finally:
            if stream.value:
                self.drv.call("cuStreamDestroy_v2", stream)
            self.unregister()

    def _write_thread(self) -> None:
        while (item := self._q.get()) is not None:
            base, off, buf, n = item
            try:
                if not self.errors:
                    stored = self.writer.put(base, off, buf[:n])
                    with self._lock:
                        self.bytes_stored += stored
            except BaseException as e:
                self.errors.append(e)
            finally:
                self.staging.free.put(buf)

    def run(self) -> None:
        """Copy until nothing is left to claim; raises the first error of any thread."""
        writers = [threading.Thread(target=self._write_thread, name=f"pos-writer-{i}",
                                    daemon=True) for i in range(self.n_writers)]
        copiers = [threading.Thread(target=self._copy_thread, name=f"pos-copier-{i}",
                                    daemon=True) for i in range(self.n_streams)]
        for t in writers + copiers:
            t.start()
        for t in copiers:
            t.join()
        for _ in writers:
            self._q.put(None)
        for t in writers:
            t.join()
        self.staging.close()
        if self.errors:
            raise self.errors[0]
