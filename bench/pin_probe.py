"""How fast host memory can be page-locked, and filled from the GPU, on this host: the wait
before a concurrent checkpoint's cut is the pin of its arena (39.5 s for 112 GB on an H200
host). Root, on an NVIDIA GPU:

    python3 bench/pin_probe.py --out DIR [--gib 16]

Ways measured, each on fresh memory of --gib GiB, in 1 GiB pieces:
  register-tN     anonymous memory on transparent huge pages, cuMemHostRegister by N
                  threads (the driver faults the pages in: pos's arena before 2026-11-28)
  fault+reg-t16   the pages faulted in by 16 threads first (memset), then
                  registered by 8 threads: which of the two is the slow part
  arena           pos's arena as it is (gpucopy.Pinned), all of it locked before it returns
  allochost-t8    cuMemAllocHost, one piece a thread, 8 threads
and the copy device-to-host into a pinned arena (8 streams, 64 MiB chunks: the engine's
settings) against the link's limit. Writes DIR/pin.json.
"""

import argparse
import ctypes as C
import json
import mmap
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pos.concurrent import gpucopy  # noqa: E402
from pos.driver import CUdeviceptr, driver  # noqa: E402

GIB = 1 << 30


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t = time.monotonic()
    out = fn()
    return out, time.monotonic() - t


def fresh(gib: int) -> tuple[mmap.mmap, int]:
    """Anonymous memory on transparent huge pages, as pos's arena takes it, untouched."""
    m = mmap.mmap(-1, gib * GIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    return m, C.addressof(C.c_char.from_buffer(m))


def register(drv: Any, gib: int, threads: int) -> dict[str, float]:
    """cuMemHostRegister on untouched memory by `threads` threads: the driver faults it in."""
    _m, ptr = fresh(gib)
    ctx = gpucopy.current(drv)

    def reg(k: int) -> None:
        drv.cuCtxSetCurrent(ctx)
        drv.cuMemHostRegister_v2(ptr + k * GIB, GIB, 0)

    with ThreadPoolExecutor(threads) as pool:
        _, s = timed(lambda: list(pool.map(reg, range(gib))))
    t = time.monotonic()
    for k in range(gib):
        drv.cuMemHostUnregister(ptr + k * GIB)
    return {"pin_s": s, "gbps": gib * GIB / s / 1e9, "unpin_s": time.monotonic() - t}


def arena(drv: Any, gib: int) -> dict[str, float]:
    """pos's own arena (gpucopy.Pinned), all of it locked before it returns."""
    a, s = timed(lambda: gpucopy.Pinned(drv, gib * GIB))
    _, u = timed(a.close)
    return {"pin_s": s, "gbps": gib * GIB / s / 1e9, "unpin_s": u}


def fault_then_register(drv: Any, gib: int) -> dict[str, float]:
    _m, ptr = fresh(gib)
    ctx = gpucopy.current(drv)

    def touch(k: int) -> None:
        C.memset(ptr + k * GIB, 1, GIB)        # ctypes lets the GIL go

    def reg(k: int) -> None:
        drv.cuCtxSetCurrent(ctx)
        drv.cuMemHostRegister_v2(ptr + k * GIB, GIB, 0)

    with ThreadPoolExecutor(16) as pool:
        _, f = timed(lambda: list(pool.map(touch, range(gib))))
    with ThreadPoolExecutor(8) as pool:
        _, r = timed(lambda: list(pool.map(reg, range(gib))))
    for k in range(gib):
        drv.cuMemHostUnregister(ptr + k * GIB)
    return {"fault_s": f, "fault_gbps": gib * GIB / f / 1e9, "register_s": r,
            "register_gbps": gib * GIB / r / 1e9, "gbps": gib * GIB / (f + r) / 1e9}


def alloc_host(drv: Any, gib: int) -> dict[str, float]:
    ctx = gpucopy.current(drv)
    ptrs: list[int] = []

    def one(_k: int) -> None:
        drv.cuCtxSetCurrent(ctx)
        p = C.c_void_p()
        drv.cuMemAllocHost_v2(C.byref(p), GIB)
        ptrs.append(p.value or 0)

    with ThreadPoolExecutor(8) as pool:
        _, s = timed(lambda: list(pool.map(one, range(gib))))
    for p in ptrs:
        drv.cuMemFreeHost(p)
    return {"pin_s": s, "gbps": gib * GIB / s / 1e9}


def d2h(drv: Any, gib: int) -> dict[str, float]:
    src = CUdeviceptr()
    drv.cuMemAlloc_v2(C.byref(src), gib * GIB)
    arena = gpucopy.Pinned(drv, gib * GIB)
    chunk = 64 << 20
    work = gpucopy.grid([gib * GIB], chunk)

    def one(stream: Any, _i: int, off: int, n: int) -> None:
        drv.cuMemcpyDtoHAsync_v2(arena.ptr + off, src.value + off, n, stream)

    try:
        gpucopy.run_chunks(drv, work, 1, 8, one)            # warm
        s = gpucopy.run_chunks(drv, work, 1, 8, one)
    finally:
        arena.close()
        drv.cuMemFree_v2(src)
    return {"seconds": s, "gbps": gib * GIB / s / 1e9, "link_limit_gbps": 55.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--gib", type=int, default=16)
    a = ap.parse_args()
    drv = driver()
    drv.init()
    ctx = gpucopy.Context(0)
    res: dict[str, Any] = {"gib": a.gib}
    for n in (1, 4, 8, 16):
        res[f"register-t{n}"] = register(drv, a.gib, n)
        print(n, res[f"register-t{n}"], flush=True)
    res["fault+reg-t16"] = fault_then_register(drv, a.gib)
    print(res["fault+reg-t16"], flush=True)
    res["arena"] = arena(drv, a.gib)
    print(res["arena"], flush=True)
    res["allochost-t8"] = alloc_host(drv, a.gib)
    print(res["allochost-t8"], flush=True)
    res["d2h-8streams-64MiB"] = d2h(drv, a.gib)
    print(res["d2h-8streams-64MiB"], flush=True)
    ctx.close()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pin.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
