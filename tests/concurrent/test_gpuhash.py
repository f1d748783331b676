"""The copy's checksum and pointer scan made on the GPU (pos/concurrent/gpuhash.py), against the
fake driver, which runs pos's kernel with hash.h's code on the CPU: the checksum and hits of each
chunk are those the CPU makes of the same bytes (kind `blocks`), on several streams at once,
and the kernel that ships (blocks.ptx) was made from the kernel's sources as they are."""

import ctypes as C
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from pos import native
from pos.concurrent import gpucopy
from pos.concurrent.gpuhash import Kernel, Sums
from pos.driver import CUdeviceptr, CUstream
from pos.image import gpu as gpuimage

CHUNK = 1 << 16


def test_the_shipped_kernel_was_made_from_its_sources() -> None:
    """blocks.ptx names the digest of blocks.cu and hash.h it was made from: a change to
    either without `python -m pos.native --ptx` would ship a kernel that hashes otherwise than
    the CPU checks."""
    first = native.PTX.read_text().splitlines()[0]
    assert first == native.PTX_MARK + native.ptx_digest()


def test_nvcc_makes_the_kernel_without_complaint(tmp_path: Path, monkeypatch) -> None:
    """The kernel's source compiles (nvcc), and ptxas takes the PTX for a Hopper GPU."""
    if not shutil.which("nvcc") or not shutil.which("ptxas"):
        pytest.skip("nvcc and ptxas (the CUDA toolkit) are needed to compile the kernel")
    import subprocess

    out = tmp_path / "blocks.ptx"
    monkeypatch.setattr(native, "PTX", out)
    native.build_ptx()
    assert out.read_text().splitlines()[0] == native.PTX_MARK + native.ptx_digest()
    r = subprocess.run(["ptxas", "-arch=sm_90", "-o", str(tmp_path / "b.cubin"), str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_each_chunk_gets_the_checksum_and_hits_the_cpu_makes(drv) -> None:
    """Three streams, chunks of every length against the kernel's blocks (a tail of 1-7 bytes,
    words that make no group, a part block), some words pointing into the targets."""
    rng = np.random.default_rng(3)
    ranges = [(0x7F00_0000_0000 + i * 0x10_0000, 0x7F00_0000_0000 + i * 0x10_0000 + 0x8000)
              for i in range(30)]
    targets = gpuimage.Targets(ranges)
    lengths = [CHUNK, CHUNK - 3, 4096 * 3 + 40, 100, 8, 4097]
    datas = [rng.integers(0, 256, n, np.uint8) for n in lengths]
    for k, data in enumerate(datas):
        words = data[:len(data) // 8 * 8].view(np.uint64)
        for j in range(min(len(words), 3)):
            words[j * len(words) // 3] = ranges[(5 * k + j) % 30][0] + 8 * j
    kernel = Kernel(drv)
    sums = Sums(drv, kernel, targets, CHUNK)
    got: dict[int, tuple[int, np.ndarray]] = {}
    ctx = gpucopy.current(drv)

    def run(ks: list[int]) -> None:
        drv.cuCtxSetCurrent(ctx)
        s = CUstream()
        drv.cuStreamCreate(C.byref(s), gpucopy.CU_STREAM_NON_BLOCKING)
        for k in ks:
            p = CUdeviceptr()
            drv.cuMemAlloc_v2(C.byref(p), CHUNK)
            drv.cuMemcpyHtoD_v2(p.value, datas[k].ctypes.data, len(datas[k]))
            sums.launch(s, p.value, len(datas[k]))
            drv.cuStreamSynchronize(s)
            got[k] = sums.result(s, len(datas[k]))
            drv.cuMemFree_v2(p.value)

    threads = [threading.Thread(target=run, args=([k for k in range(len(datas)) if k % 3 == t],))
               for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sums.close()
    kernel.close()
    assert sorted(got) == list(range(len(datas)))
    for k, data in enumerate(datas):
        h, hits = gpuimage.blocks_points(data, targets)
        assert got[k][0] == h and list(got[k][1]) == list(hits), k
        assert hits.any() == (len(data) >= 8)
