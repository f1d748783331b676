"""The run-time validator of the speculation, in-process, over pos.driver.

Around a launch (or any stretch of GPU work) it hashes every live allocation before and after,
on the GPU's own data: each allocation is copied in chunks into pinned host memory
(cuMemAllocHost_v2; pageable memory where the driver lacks it, as the test fake does) and
hashed there by a numba loop. The buffers whose hash changed are the ones the work wrote. A
kernel whose changed buffers are not all in its predicted write set is marked *unvalidated* by
name: callers (the concurrent engine) fall back to stop-the-world for it. A write that leaves
a buffer's bytes as they were is not seen, and need not be: a checkpoint of it is still right.

The calling thread must have the process's context current (in-process use), and the work
must be finished before `snapshot` (it synchronises the context itself).
"""

import ctypes
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from pos.driver import Driver, driver
from pos.image.checksum import fold

CHUNK = 64 << 20


@dataclass
class KernelRecord:
    """What the validator saw of one kernel name."""

    launches: int = 0
    violations: int = 0
    unpredicted: set[int] = field(default_factory=set)    # bases written outside the set

    @property
    def validated(self) -> bool:
        return self.launches > 0 and self.violations == 0


class Validator:
    """Hashes live allocations through the driver; keeps the per-kernel table."""

    def __init__(self, drv: Optional[Driver] = None, chunk: int = CHUNK) -> None:
        self.drv = drv or driver()
        self.chunk = chunk
        self.kernels: dict[str, KernelRecord] = {}
        self._pinned = ctypes.c_void_p()
        if self.drv.has("cuMemAllocHost_v2"):
            self.drv.cuMemAllocHost_v2(ctypes.byref(self._pinned), chunk)
            raw = (ctypes.c_uint8 * chunk).from_address(self._pinned.value or 0)
            self._host = np.ctypeslib.as_array(raw)
        else:
            self._host = np.empty(chunk, np.uint8)

    def close(self) -> None:
        if self._pinned.value:
            self.drv.cuMemFreeHost(self._pinned)
            self._pinned = ctypes.c_void_p()

    def _hash(self, base: int, size: int) -> int:
        h = np.uint64(size)
        for at in range(0, size, self.chunk):
            n = min(self.chunk, size - at)
            self.drv.cuMemcpyDtoH_v2(self._host.ctypes.data, base + at, n)
            h = np.uint64(fold(self._host[:n], int(h)))
        return int(h)

    def snapshot(self, allocations: Iterable[tuple[int, int]]) -> dict[int, int]:
        """{base: hash} of every (base, size) given, after the context's work has finished."""
        self.drv.cuCtxSynchronize()
        return {base: self._hash(base, size) for base, size in allocations}

    @staticmethod
    def changed(before: dict[int, int], after: dict[int, int]) -> set[int]:
        """Bases whose bytes differ (allocations in only one snapshot are not compared)."""
        return {b for b, h in after.items() if b in before and before[b] != h}

    def record(self, names: Iterable[str], predicted_writes: Iterable[int],
               changed: set[int]) -> set[int]:
        """Enter one checked piece of work (one launch, or one op's launches) in the table;
        returns the changed bases outside the predicted set (empty: validated)."""
        outside = changed - set(predicted_writes)
        for name in set(names):
            rec = self.kernels.setdefault(name, KernelRecord())
            rec.launches += 1
            if outside:
                rec.violations += 1
                rec.unpredicted |= outside
        return outside

    def validate(self, name: str, run: Callable[[], Any], allocations: list[tuple[int, int]],
                 predicted_writes: Iterable[int]) -> tuple[set[int], set[int]]:
        """Run one launch between two snapshots; (changed bases, those outside the prediction)."""
        before = self.snapshot(allocations)
        run()
        changed = self.changed(before, self.snapshot(allocations))
        return changed, self.record([name], predicted_writes, changed)

    def is_validated(self, name: str) -> bool:
        rec = self.kernels.get(name)
        return rec is not None and rec.validated

    def table(self) -> dict[str, Any]:
        """The JSON form that `pos analyze --validation` reads."""
        return {"kernels": {n: {"launches": r.launches, "violations": r.violations,
                                "validated": r.validated,
                                "unpredicted": [f"0x{b:x}" for b in sorted(r.unpredicted)]}
                            for n, r in sorted(self.kernels.items())}}

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.table(), f, indent=1)
