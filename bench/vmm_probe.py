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

With one thread, each kind of call is also timed on its own.

With `--ranges`, instead, pos's own mapping (gpucopy.Imported: every buffer in one address
range of pos's, access set once) against the way before it (each buffer in a range of its
own, access set for each), `--repeat` times, the order turned each round:

- make: new memory made for each buffer, exported, mapped in this process (a restore's), then
  let go; `make_each` created, exported, released, imported again, reserved, mapped, access;
- take: each buffer's descriptor imported and mapped (a checkpoint's, before its cut), then
  let go; `take_each` as `take` above.

Writes DIR/vmm.json:

    python3 bench/vmm_probe.py --out DIR [--index FILE] [--threads 1,2,4,8] [--repeat 3]
    python3 bench/vmm_probe.py --out DIR --buffers 4561 --mib 20 --ranges
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
from pos.agent.control import Buffer  # noqa: E402
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


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.monotonic()
    got = fn()
    return time.monotonic() - t, got


def ranges(drv: Any, sizes: list[int], prop: Any, acc: Any, repeat: int) -> dict[str, Any]:
    """pos's mapping of many buffers into one range against each into its own (see above)."""
    buffers = [Buffer(0, n, n, 0, True) for n in sizes]

    def each_made() -> list[tuple[int, int, int]]:       # (va, handle, descriptor)
        got = []
        for n in sizes:
            h, fd, va = cu.CUmemGenericAllocationHandle(), C.c_int(-1), cu.CUdeviceptr()
            drv.cuMemCreate(C.byref(h), n, C.byref(prop), 0)
            drv.cuMemExportToShareableHandle(C.byref(fd), h, HANDLE_FD, 0)
            drv.cuMemRelease(h)
            drv.cuMemImportFromShareableHandle(C.byref(h), fd.value, HANDLE_FD)
            drv.cuMemAddressReserve(C.byref(va), n, 0, 0, 0)
            drv.cuMemMap(va, n, 0, h, 0)
            drv.cuMemSetAccess(va, n, C.byref(acc), 1)
            got.append((va.value, h.value, fd.value))
        return got

    def each_taken(fds: list[int]) -> list[tuple[int, int, int]]:
        got = []
        for n, fd in zip(sizes, fds):
            h, va = cu.CUmemGenericAllocationHandle(), cu.CUdeviceptr()
            drv.cuMemImportFromShareableHandle(C.byref(h), fd, HANDLE_FD)
            drv.cuMemAddressReserve(C.byref(va), n, 0, 0, 0)
            drv.cuMemMap(va, n, 0, h, 0)
            drv.cuMemSetAccess(va, n, C.byref(acc), 1)
            got.append((va.value, h.value, -1))
        return got

    def each_gone(got: list[tuple[int, int, int]]) -> None:
        for (va, h, fd), n in zip(got, sizes):
            drv.cuMemUnmap(va, n)
            drv.cuMemAddressFree(va, n)
            drv.cuMemRelease(h)
            if fd >= 0:
                os.close(fd)

    def make_each() -> tuple[float, float]:
        s, got = timed(each_made)
        return s, timed(lambda: each_gone(got))[0]

    def make_range() -> tuple[float, float]:
        s, (mem, fds) = timed(lambda: gpucopy.Imported.create(drv, buffers))
        gone, _ = timed(mem.close)
        for fd in fds:
            os.close(fd)
        return s, gone

    rows: list[dict[str, Any]] = []
    ways = {"make_each": make_each, "make_range": make_range}
    for r in range(repeat):
        row: dict[str, Any] = {"round": r}
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            row[f"{name}_s"], row[f"{name}_gone_s"] = (round(x, 4) for x in ways[name]())
        rows.append(row)
        print(json.dumps(row), flush=True)
    mem, fds = gpucopy.Imported.create(drv, buffers)     # the job's, to be taken
    try:
        def take_each() -> tuple[float, float]:
            s, got = timed(lambda: each_taken(fds))
            return s, timed(lambda: each_gone(got))[0]

        def take_range() -> tuple[float, float]:
            s, taken = timed(lambda: gpucopy.Imported(drv, buffers, fds))
            return s, timed(taken.close)[0]

        takes = {"take_each": take_each, "take_range": take_range}
        for r in range(repeat):
            row = rows[r]
            for name in (list(takes) if r % 2 == 0 else list(takes)[::-1]):
                row[f"{name}_s"], row[f"{name}_gone_s"] = (round(x, 4) for x in takes[name]())
            print(json.dumps(row), flush=True)
    finally:
        mem.close()
        for fd in fds:
            os.close(fd)
    return {"buffers": len(sizes), "bytes": sum(sizes), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--index", type=Path, help="an image's gpu-index.json: its buffers' sizes")
    ap.add_argument("--buffers", type=int, default=441)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ranges", action="store_true",
                    help="pos's mapping into one range against each buffer in its own")
    a = ap.parse_args()
    context = gpucopy.Context(0)
    drv = context.drv
    prop = cu.CUmemAllocationProp(cu.CU_MEM_ALLOCATION_TYPE_PINNED, HANDLE_FD,
                                  cu.CUmemLocation(cu.CU_MEM_LOCATION_TYPE_DEVICE, 0))
    sizes = sizes_of(a, GRANULE)
    acc = cu.CUmemAccessDesc(cu.CUmemLocation(cu.CU_MEM_LOCATION_TYPE_DEVICE, 0),
                             cu.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    if a.ranges:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "vmm.json").write_text(json.dumps(
            ranges(drv, sizes, prop, acc, a.repeat), indent=1) + "\n")
        context.close()
        return
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
