"""What the driver's calls for each of a job's buffers cost while pos holds the job, and whether
they run faster side by side. A checkpoint's hold spends 0.15-0.24 s on them for the GPT-2 job's
441-486 buffers (bench/results/2026-11-30.md, perf run 29): the job's export and pos's import
and mapping at the take, the job's unmap and release at the hoist, its import, map and access
at the remap. The agent and pos make those calls one buffer after another.

This process makes buffers the way the agent does (cuMemCreate with POSIX descriptor handles,
each in its own address range a granule apart, mapped read-write), with the sizes of a GPU
index's buffers (`--index`, an image's gpu-index.json) or `--buffers` of `--mib` each, and
exports each once. Then, for each thread count in turn (`--threads`), `--repeat` times:

- hoist: each buffer unmapped and its handle released (the descriptor keeps the memory);
- remap: each descriptor imported, mapped back at its address, access set;
- take: each descriptor imported again and mapped at a new address, as pos maps the job's
  memory, then let go (`drop`).

With one thread, each kind of call is also timed on its own. Writes DIR/vmm.json:

    python3 bench/vmm_probe.py --out DIR [--index FILE] [--threads 1,2,4,8] [--repeat 3]
"""

import argparse
import ctypes as C
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pos import driver as cu  # noqa: E402
from pos.concurrent import gpucopy  # noqa: E402

HANDLE_FD = cu.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
GRANULE = 2 << 20       # the agent's, cuMemGetAllocationGranularity's answer on H100 and H200


class Calls:
    """Seconds spent in each kind of driver call, summed over the threads."""

    def __init__(self) -> None:
        self.s: dict[str, float] = {}
        self.lock = threading.Lock()

    def __call__(self, name: str, fn: Callable[[], Any]) -> Any:
        t = time.monotonic()
        r = fn()
        with self.lock:
            self.s[name] = self.s.get(name, 0.0) + time.monotonic() - t
        return r


def sizes_of(a: argparse.Namespace, granule: int) -> list[int]:
    if a.index:
        got = [int(b["mapped"]) for b in json.loads(a.index.read_text())["buffers"]]
    else:
        got = [a.mib << 20] * a.buffers
    return [-(-n // granule) * granule for n in got]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--index", type=Path, help="an image's gpu-index.json: its buffers' sizes")
    ap.add_argument("--buffers", type=int, default=441)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    context = gpucopy.Context(0)
    drv = context.drv
    prop = cu.CUmemAllocationProp(cu.CU_MEM_ALLOCATION_TYPE_PINNED, HANDLE_FD,
                                  cu.CUmemLocation(cu.CU_MEM_LOCATION_TYPE_DEVICE, 0))
    sizes = sizes_of(a, GRANULE)
    acc = cu.CUmemAccessDesc(cu.CUmemLocation(cu.CU_MEM_LOCATION_TYPE_DEVICE, 0),
                             cu.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    vas, handles, fds = [], [], []
    made = time.monotonic()
    for n in sizes:            # as the agent's own_alloc: a range of its own, mapped, exported
        va, h, fd = cu.CUdeviceptr(), cu.CUmemGenericAllocationHandle(), C.c_int(-1)
        drv.cuMemAddressReserve(C.byref(va), n + GRANULE, 0, 0, 0)
        drv.cuMemCreate(C.byref(h), n, C.byref(prop), 0)
        drv.cuMemMap(va, n, 0, h, 0)
        drv.cuMemSetAccess(va, n, C.byref(acc), 1)
        drv.cuMemExportToShareableHandle(C.byref(fd), h, HANDLE_FD, 0)
        vas.append(va.value)
        handles.append(h.value)
        fds.append(fd.value)
    made_s = time.monotonic() - made

    def each(threads: int, fn: Callable[[int], None]) -> float:
        def part(k: int) -> None:
            context.use()
            for i in range(k, len(sizes), threads):
                fn(i)
        t = time.monotonic()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(part, range(threads)))
        return time.monotonic() - t

    rows: list[dict[str, Any]] = []
    counts = [int(x) for x in a.threads.split(",")]
    for r in range(a.repeat):
        for threads in counts if r % 2 == 0 else counts[::-1]:
            calls = Calls()
            local = [0] * len(sizes)
            taken = [0] * len(sizes)

            def hoist(i: int) -> None:
                calls("unmap", lambda: drv.cuMemUnmap(vas[i], sizes[i]))
                calls("release", lambda: drv.cuMemRelease(handles[i]))

            def remap(i: int) -> None:
                h = cu.CUmemGenericAllocationHandle()
                calls("import", lambda: drv.cuMemImportFromShareableHandle(
                    C.byref(h), fds[i], HANDLE_FD))
                calls("map", lambda: drv.cuMemMap(vas[i], sizes[i], 0, h, 0))
                calls("access", lambda: drv.cuMemSetAccess(vas[i], sizes[i], C.byref(acc), 1))
                handles[i] = h.value

            def take(i: int) -> None:
                h, va = cu.CUmemGenericAllocationHandle(), cu.CUdeviceptr()
                calls("take_import", lambda: drv.cuMemImportFromShareableHandle(
                    C.byref(h), fds[i], HANDLE_FD))
                calls("take_reserve", lambda: drv.cuMemAddressReserve(
                    C.byref(va), sizes[i], 0, 0, 0))
                calls("take_map", lambda: drv.cuMemMap(va, sizes[i], 0, h, 0))
                calls("take_access", lambda: drv.cuMemSetAccess(va, sizes[i], C.byref(acc), 1))
                local[i], taken[i] = va.value, h.value

            def drop(i: int) -> None:
                drv.cuMemUnmap(local[i], sizes[i])
                drv.cuMemAddressFree(local[i], sizes[i])
                drv.cuMemRelease(taken[i])

            row: dict[str, Any] = {
                "round": r, "threads": threads, "hoist_s": each(threads, hoist),
                "remap_s": each(threads, remap), "take_s": each(threads, take),
                "drop_s": each(threads, drop)}
            if threads == 1:
                row["calls_s"] = {k: round(v, 5) for k, v in calls.s.items()}
            rows.append({k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()})
            print(json.dumps(rows[-1]), flush=True)
    for at, n, held, exported in zip(vas, sizes, handles, fds):
        drv.cuMemUnmap(at, n)
        drv.cuMemRelease(held)
        drv.cuMemAddressFree(at, n + GRANULE)
        os.close(exported)
    result = {"buffers": len(sizes), "bytes": sum(sizes), "granule": GRANULE,
              "made_s": round(made_s, 3), "rows": rows}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "vmm.json").write_text(json.dumps(result, indent=1) + "\n")
    context.close()


if __name__ == "__main__":
    main()
