"""pos's checksum kernel (pos/image/blocks.ptx) on a real GPU: the driver compiles the PTX that
ships, and for chunks of every shape (whole 64 MiB, a part block, a tail of 1-7 bytes) the
checksum and the pointer hits it makes equal the CPU's of the same bytes, which a restore
checks."""

import ctypes as C

import numpy as np

from pos.concurrent import gpucopy
from pos.concurrent.gpuhash import Kernel, Sums
from pos.driver import CUdeviceptr, CUstream
from pos.image import gpu as gpuimage

CHUNK = 64 << 20


def test_the_gpu_hashes_and_scans_as_the_cpu_checks() -> None:
    context = gpucopy.Context(0)
    drv = context.drv
    rng = np.random.default_rng(7)
    ranges = [(0x7F00_0000_0000 + i * 0x20_0000, 0x7F00_0000_0000 + i * 0x20_0000 + 0x10_0000)
              for i in range(500)]
    targets = gpuimage.Targets(ranges)
    kernel = Kernel(drv)
    sums = Sums(drv, kernel, targets, CHUNK)
    p, s = CUdeviceptr(), CUstream()
    drv.cuMemAlloc_v2(C.byref(p), CHUNK)
    drv.cuStreamCreate(C.byref(s), gpucopy.CU_STREAM_NON_BLOCKING)
    try:
        for n in (CHUNK, CHUNK - 5, 4096 * 7 + 40, 4097, 100, 8):
            data = rng.integers(0, 256, n, np.uint8)
            words = data[:n // 8 * 8].view(np.uint64)
            for j in range(min(len(words), 4)):
                words[j * len(words) // 4] = ranges[(n + 37 * j) % 500][0] + 64 * j
            drv.cuMemcpyHtoD_v2(p.value, data.ctypes.data, n)
            sums.launch(s, p.value, n)
            drv.cuStreamSynchronize(s)
            h, hits = sums.result(s, n)
            want_h, want_hits = gpuimage.blocks_points(data, targets)
            assert h == want_h, n
            assert list(hits.nonzero()[0]) == list(want_hits.nonzero()[0]), n
            assert want_hits.any()
    finally:
        drv.cuStreamDestroy_v2(s)
        drv.cuMemFree_v2(p.value)
        sums.close()
        kernel.close()
        context.close()
