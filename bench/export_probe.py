"""Whether a process can tell, before exporting, that the driver would refuse to export memory
its own restore brought back. After a stop-the-world cycle that left a job running, two H200s
(driver 580.159.04) refused to export that memory, and each refusal left a /dev/nvidiactl
descriptor open (pos/agent/hook/export.c). A refusal is only safe while the job is held: the
agent then tells the leaked descriptor from the job's own by listing them around the call. To
export while the job runs, the agent must know beforehand, from the allocation's properties.

A child makes allocations the way the agent does (cuMemCreate, POSIX descriptor handles, mapped
and written), exports half of them once, and reads every allocation's properties. The parent
puts it through the driver's lock, checkpoint, restore and unlock, then the child reads the
properties again and tries each export, counting the /dev/nvidiactl descriptors each one left:

    python3 bench/export_probe.py --out DIR [--buffers 4] [--mib 64]

Writes DIR/export.json: the child's rows before and after the cycle, and the cycle's times.
"""

import argparse
import ctypes as C
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pos import driver as cu  # noqa: E402
from pos.concurrent import gpucopy  # noqa: E402
from pos.process import cudackpt  # noqa: E402


def nvidiactl_fds() -> set[int]:
    """This process's descriptors of /dev/nvidiactl (195:255)."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == 195 \
                and os.minor(st.st_rdev) == 255:
            found.add(int(name))
    return found


def look(drv: cu.Driver, handles: list[int], export: bool) -> list[dict[str, Any]]:
    """Each handle's properties, and with `export` its export tried (the descriptor closed)."""
    rows = []
    for h in handles:
        prop = cu.CUmemAllocationProp()
        rc = drv.raw.cuMemGetAllocationPropertiesFromHandle(C.byref(prop), h)
        row: dict[str, Any] = {"props_rc": rc, "type": prop.type,
                               "requested_handle_types": prop.requestedHandleTypes,
                               "location": [prop.location.type, prop.location.id]}
        if export:
            before, fd = nvidiactl_fds(), C.c_int(-1)
            t = time.monotonic()
            row["export_rc"] = drv.raw.cuMemExportToShareableHandle(
                C.byref(fd), h, cu.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
            row["export_s"] = round(time.monotonic() - t, 6)
            row["nvidiactl_left"] = len(nvidiactl_fds() - before - {fd.value})
            if row["export_rc"] == cu.CUDA_SUCCESS:
                os.close(fd.value)
        rows.append(row)
    return rows


def child(buffers: int, size: int) -> None:
    context = gpucopy.Context(0)
    drv = context.drv
    handles = []
    for i in range(buffers):
        prop = cu.CUmemAllocationProp(cu.CU_MEM_ALLOCATION_TYPE_PINNED,
                                      cu.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                      cu.CUmemLocation(cu.CU_MEM_LOCATION_TYPE_DEVICE, 0))
        h = cu.CUmemGenericAllocationHandle()
        drv.cuMemCreate(C.byref(h), size, C.byref(prop), 0)
        va = gpucopy._map(drv, size, h.value, 0)
        drv.cuMemsetD32_v2(va, 0x5A5A0000 + i, size // 4)
        handles.append(h.value)
    drv.cuCtxSynchronize()
    half = handles[: buffers // 2]
    print(json.dumps({"exported_before": look(drv, half, export=True),
                      "before": look(drv, handles, export=False)}), flush=True)
    sys.stdin.readline()                    # the parent's cycle is done
    print(json.dumps({"after": look(drv, handles, export=True),
                      "after_again": look(drv, handles, export=True)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--buffers", type=int, default=4)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--child", action="store_true")
    a = ap.parse_args()
    if a.child:
        child(a.buffers, a.mib << 20)
        return
    p = subprocess.Popen([sys.executable, __file__, "--child", "--buffers", str(a.buffers),
                          "--mib", str(a.mib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdin is not None and p.stdout is not None
    result: dict[str, Any] = json.loads(p.stdout.readline())
    times = {}
    for name, step in (("lock", lambda: cudackpt.lock(p.pid, 10000)),
                       ("checkpoint", lambda: cudackpt.checkpoint(p.pid)),
                       ("restore", lambda: cudackpt.restore(p.pid)),
                       ("unlock", lambda: cudackpt.unlock(p.pid))):
        t = time.monotonic()
        step()
        times[name] = round(time.monotonic() - t, 4)
    p.stdin.write("go\n")
    p.stdin.flush()
    result.update(json.loads(p.stdout.readline()))
    result["cycle_s"] = times
    result["child_exit"] = p.wait(timeout=60)
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "export.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
