"""How fast the concurrent checkpoint can copy device memory into host memory while the job is
held: the job's own memory that the GPU has no room to copy (PyTorch's expandable segments
above about 45% of an H200) goes there, 43 GB at 60% of the GPU. Root, on an NVIDIA GPU:

    python3 bench/hostcopy_probe.py --out DIR [--gib 16] [--rounds 2]

Ways, each on fresh host memory, 64 MiB pieces, 16 threads (ownmem.MOVERS), in turn:
  pageable       the driver copies each piece straight into pageable memory (a bytearray)
  bounce         pos's own (pos/concurrent/ownmem.py _to_host): through one piece of
                 page-locked memory a thread (made before, untimed, as pos makes it before
                 the cut), then moved into anonymous memory on transparent huge pages
  bounce-halves  through two pieces a thread, the device copying into one while the other
                 is moved out
  bounce-faulted as bounce, into anonymous memory faulted in before (16 threads writing it,
                 timed apart, as `fault_s`): what faulting the memory in before the cut leaves
                 of the copy while the job is held
and the link's limit beside them. Writes DIR/hostcopy.json.
"""

import argparse
import ctypes as C
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pos.concurrent import gpucopy, ownmem  # noqa: E402
from pos.driver import CUdeviceptr, driver  # noqa: E402

GIB = 1 << 30


Way = Callable[[Any, list[tuple[int, int, int]], Any], Any]


def pageable(drv: Any, work: list[tuple[int, int, int]], _staging: Any) -> None:
    runs = ownmem._split(work, ownmem._threads(len(work)))
    host = [[bytearray(n) for _, _, n in run] for run in runs]

    def copy(k: int) -> None:
        for (at, _o, n), into in zip(runs[k], host[k]):
            drv.cuMemcpyDtoH_v2(C.addressof((C.c_char * n).from_buffer(into)), at, n)

    ownmem._with_context(drv, len(runs), copy)


def move(into: Any, at_host: int, n: int) -> None:
    C.memmove(C.addressof(C.c_char.from_buffer(into)), at_host, n)


def bounce(drv: Any, work: list[tuple[int, int, int]], staging: Any) -> None:
    for run in ownmem._to_host(drv, work, staging, ownmem.HostPieces([])):
        for m in run:
            m.close()


def faulted(drv: Any, work: list[tuple[int, int, int]], staging: Any) -> dict[str, float]:
    pieces = ownmem.HostPieces([n for _, _, n in work])
    t = time.monotonic()
    pieces.fault_behind()
    while pieces.faulted < pieces.bytes:    # as a take that finds every piece faulted in
        time.sleep(0.001)
    pieces.settle()
    fault_s = time.monotonic() - t
    t = time.monotonic()
    host = ownmem._to_host(drv, work, staging, pieces)
    copy_s = time.monotonic() - t
    for run in host:
        for m in run:
            m.close()
    pieces.close()
    return {"fault_s": round(fault_s, 3), "copy_s": round(copy_s, 3)}


def halves(drv: Any, work: list[tuple[int, int, int]], staging: Any) -> None:
    runs = ownmem._split(work, min(ownmem._threads(len(work)),
                                   staging.size // (2 * ownmem.PIECE)))
    host = [[ownmem._anonymous(n) for _, _, n in run] for run in runs]

    def copy(k: int) -> None:
        half = [staging.ptr + (2 * k + j) * ownmem.PIECE for j in (0, 1)]
        s = gpucopy.stream(drv)
        try:
            last: Any = None      # copied, to move out
            for j, ((at, _o, n), into) in enumerate(zip(runs[k], host[k])):
                drv.cuMemcpyDtoHAsync_v2(half[j % 2], at, n, s)
                if last is not None:
                    move(*last)
                drv.cuStreamSynchronize(s)
                last = (into, half[j % 2], n)
            if last is not None:
                move(*last)
        finally:
            drv.raw.cuStreamDestroy_v2(s)

    ownmem._with_context(drv, len(runs), copy)
    for run in host:
        for m in run:
            m.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--gib", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ways", default="bounce,bounce-faulted,bounce-halves,pageable",
                    help="which, in this order (the first pays the process's first copy)")
    a = ap.parse_args()
    drv = driver()
    drv.init()
    ctx = gpucopy.Context(0)
    src = CUdeviceptr()
    size = a.gib * GIB
    drv.cuMemAlloc_v2(C.byref(src), size)
    drv.cuMemsetD8_v2(src, 7, size)
    work = [(src.value + at, at, min(ownmem.PIECE, size - at))
            for at in range(0, size, ownmem.PIECE)]
    known: dict[str, Way] = {"bounce-halves": halves, "bounce": bounce, "pageable": pageable,
                             "bounce-faulted": faulted}
    ways = {name: known[name] for name in a.ways.split(",")}
    # the page-locked memory is made before the cut: not timed (two pieces a thread)
    staging = gpucopy.Pinned(drv, ownmem._threads(ownmem.MOVERS) * 2 * ownmem.PIECE)
    res: dict[str, Any] = {"gib": a.gib, "order": list(ways), "threads": ownmem._threads(len(work)),
                           "link_limit_gbps": 55.0, "rounds": []}
    for r in range(a.rounds):
        row = {}
        for name, way in ways.items():
            t = time.monotonic()
            parts = way(drv, work, staging) or {}
            s = parts.get("copy_s") or time.monotonic() - t
            row[name] = {"seconds": round(s, 3), "gbps": round(size / s / 1e9, 2), **parts}
            print(r, name, row[name], flush=True)
        res["rounds"].append(row)
    staging.close()
    drv.cuMemFree_v2(src)
    ctx.close()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hostcopy.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
