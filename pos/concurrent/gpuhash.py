"""The checksum and pointer scan of each chunk of a checkpoint's copy, made on the GPU that holds
it (POS_HASH_ON: `auto`, the default, where the driver can load the kernel; `gpu`): pos's
kernel (pos/image/blocks.cu) hashes the chunk's 4 KiB blocks and marks which of the job's
buffers its words point into, on the chunk's own stream just before its copy to host memory,
so that the savers on the CPU only write it. On the H200 host the savers hashed, scanned and
wrote a ring into /dev/shm at 15-20 GB/s, where the writes alone ran at 20-26
(bench/results/2026-11-29-drain). The chunk's checksum is then of kind `blocks`
(pos/image/hash.h), which a restore checks on the CPU as it fills.

The kernel is loaded before the cut (the driver compiles its PTX for the GPU then: 0.13 s the
first time on the H200 host, 2 ms once its cache held it). A driver that cannot load it is
refused there in one sentence under `gpu`, the job untouched, and leaves the hashing to the
CPU under `auto`. Each copy then gives the kernel the buffers' address ranges, and each
stream a little device and page-locked memory of its own.
"""

from __future__ import annotations

import ctypes as C
import threading
from dataclasses import dataclass

import numpy as np

from pos import native
from pos.driver import CUdeviceptr, CUfunction, CUmodule, Driver, DriverError
from pos.errors import BadInput
from pos.image import gpu as gpuimage
from pos.image.gpu import BLOCK      # the bytes a thread of the kernel hashes

THREADS = 256       # a thread block's threads


class Kernel:
    """pos_blocks, loaded into the current context."""

    def __init__(self, drv: Driver) -> None:
        self.drv = drv
        self.module, self.fn = CUmodule(), CUfunction()
        try:
            drv.cuModuleLoadData(C.byref(self.module), native.ptx())
        except DriverError as e:
            raise BadInput(f"the CUDA driver cannot load pos's checksum kernel ({e.name})",
                           "set POS_HASH_ON=auto or cpu (the copy then hashes on the CPU), "
                           "or use a driver of CUDA 13 or newer") from None
        try:
            drv.cuModuleGetFunction(C.byref(self.fn), self.module, b"pos_blocks")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.module.value:
            self.drv.raw.cuModuleUnload(self.module)
            self.module = CUmodule()


@dataclass
class _Scratch:
    """One stream's room: the blocks' hashes and the hits on the device, and their copies in
    page-locked host memory."""

    device: int
    host: int
    hashes: np.ndarray
    hits: np.ndarray


class Sums:
    """One copy's use of the kernel: its buffers' address ranges (`targets`) on the device, and
    each stream's scratch, made at its first chunk. launch() queues a chunk's hash and scan on
    its stream; once the stream is synchronised, result() gives the chunk's checksum and hits
    (as gpu.checksum_points, of kind `blocks`). close() once no stream runs."""

    def __init__(self, drv: Driver, kernel: Kernel, targets: gpuimage.Targets,
                 chunk: int) -> None:
        self.drv, self.kernel = drv, kernel
        self.k = int(targets.starts.shape[0])
        self.blocks = -(-chunk // BLOCK)
        self._lock = threading.Lock()
        self._mine: dict[int, _Scratch] = {}
        self.ranges = 0
        if self.k:
            both = np.concatenate([targets.starts, targets.ends])
            p = CUdeviceptr()
            drv.cuMemAlloc_v2(C.byref(p), both.nbytes)
            self.ranges = p.value
            drv.cuMemcpyHtoD_v2(self.ranges, both.ctypes.data, both.nbytes)

    def _scratch(self, stream: C.c_void_p) -> _Scratch:
        key = stream.value or 0
        with self._lock:
            sc = self._mine.get(key)
        if sc is not None:
            return sc
        size = self.blocks * 8 + max(1, self.k)
        d, h = CUdeviceptr(), C.c_void_p()
        self.drv.cuMemAlloc_v2(C.byref(d), size)
        try:
            self.drv.cuMemHostAlloc(C.byref(h), size, 0)
        except BaseException:
            self.drv.raw.cuMemFree_v2(d)
            raise
        assert h.value is not None
        view = np.ctypeslib.as_array((C.c_uint8 * size).from_address(h.value))
        sc = _Scratch(d.value, h.value, view[:self.blocks * 8].view(np.uint64),
                      view[self.blocks * 8:self.blocks * 8 + self.k])
        with self._lock:
            self._mine[key] = sc
        return sc

    def launch(self, stream: C.c_void_p, src: int, n: int) -> None:
        """The hash and scan of the n bytes at src (device memory in the current context),
        and their copy back, queued on `stream`."""
        sc = self._scratch(stream)
        hits = sc.device + self.blocks * 8
        if self.k:
            self.drv.cuMemsetD8Async(hits, 0, self.k, stream)
        args = [C.c_uint64(src), C.c_uint64(n), C.c_uint64(sc.device),
                C.c_uint64(self.ranges), C.c_uint64(self.ranges + 8 * self.k),
                C.c_uint64(self.k), C.c_uint64(hits)]
        params = (C.c_void_p * len(args))(*[C.addressof(a) for a in args])
        count = -(-n // BLOCK)
        self.drv.cuLaunchKernel(self.kernel.fn, -(-count // THREADS), 1, 1, THREADS, 1, 1, 0,
                                stream, params, None)
        self.drv.cuMemcpyDtoHAsync_v2(sc.host, sc.device, count * 8, stream)
        if self.k:
            self.drv.cuMemcpyDtoHAsync_v2(sc.host + self.blocks * 8, hits, self.k, stream)

    def result(self, stream: C.c_void_p, n: int) -> tuple[int, np.ndarray]:
        """The checksum (kind `blocks`) and hits of the n bytes last launched on `stream`,
        which the caller has synchronised."""
        sc = self._scratch(stream)
        return gpuimage.blocks_fold(sc.hashes, n), sc.hits.copy()

    def close(self) -> None:
        with self._lock:
            mine, self._mine = list(self._mine.values()), {}
        for sc in mine:
            self.drv.raw.cuMemFree_v2(sc.device)
            self.drv.raw.cuMemFreeHost(sc.host)
        if self.ranges:
            self.drv.raw.cuMemFree_v2(self.ranges)
            self.ranges = 0
