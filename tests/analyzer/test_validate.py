"""The run-time validator through pos.driver against the fake libcuda.so.1 (device memory is
host memory there, and no kernel runs, so the "launches" here are sets and copies; the
validator's plumbing is what is proven -- tests/gpu proves it on kernels)."""

import ctypes
from pathlib import Path

import numpy as np
import pytest

from pos.analyzer.access import launch_sets
from pos.analyzer.demangle import parameter_kinds
from pos.analyzer.validate import Validator
from pos.image.checksum import fold
from pos.driver import CUdeviceptr, Driver


@pytest.fixture()
def fake_driver(fakegpu: dict[str, Path]) -> Driver:
    d = Driver(str(fakegpu["libcuda"]))
    d.primary_context(0)
    return d


def alloc(d: Driver, size: int) -> int:
    p = CUdeviceptr()
    d.cuMemAlloc_v2(ctypes.byref(p), size)
    d.cuMemsetD8_v2(p, 0, size)
    return p.value


def test_hash_sees_one_changed_word_and_order() -> None:
    w = np.arange(1001, dtype=np.uint64)
    w2 = w.copy()
    w2[500] ^= np.uint64(1 << 40)
    w3 = w.copy()
    w3[[3, 4]] = w3[[4, 3]]
    assert len({fold(x.view(np.uint8), 0) for x in (w, w2, w3)}) == 3


def test_writes_outside_the_predicted_set_mark_the_kernel(fake_driver: Driver) -> None:
    d = fake_driver
    x, y, z = alloc(d, 4096), alloc(d, 100_003), alloc(d, 256)
    live = [(x, 4096), (y, 100_003), (z, 256)]
    v = Validator(d, chunk=1 << 16)          # several chunks for y, and a ragged tail
    try:
        # "axpy(alpha, x, y, n)" as speculated: y is its write set
        kinds, _ = parameter_kinds("_Z4axpyfPKfPfi", 4)
        bases = np.array(sorted(b for b, _ in live), np.uint64)
        ends = np.array([b + s for b, s in sorted(live)], np.uint64)
        params = np.zeros(32, np.uint8)
        params[8:16].view(np.uint64)[0] = x + 8
        params[16:24].view(np.uint64)[0] = y
        reads, writes = launch_sets(params.tobytes(), [0, 8, 16, 24], [4, 8, 8, 4], kinds, bases, ends)
        assert (reads, writes) == ({x, y}, {y})

        value = iter(range(1, 100))

        def write_y() -> None:                 # the last byte of the last chunk of y, anew
            d.cuMemsetD8_v2(y + 100_002, next(value), 1)

        def write_y_and_z() -> None:
            write_y()
            d.cuMemsetD32_v2(z, 1, 4)

        assert v.validate("axpy", write_y, live, writes) == ({y}, set())
        assert v.is_validated("axpy")
        changed, outside = v.validate("gather", write_y_and_z, live, writes)
        assert (changed, outside) == ({y, z}, {z})
        assert not v.is_validated("gather")
        assert v.validate("gather", write_y, live, writes) == ({y}, set())   # still marked
        assert v.validate("noop", lambda: None, live, set()) == (set(), set())
        t = v.table()["kernels"]
        assert t["gather"] == {"launches": 2, "violations": 1, "validated": False,
                               "unpredicted": [f"0x{z:x}"]}
        assert t["axpy"]["validated"] is True
    finally:
        v.close()
