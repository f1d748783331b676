"""What asking NVML about this host's GPUs costs when no process holds them, as at the start of
a restore (the job killed): NVML attaches a GPU the first time it is asked about it, and the
restore's checks took 0.93-1.01 s on 4x H200 hosts against 0.10-0.12 s on a one-GPU host.
Root, on a host with NVIDIA GPUs and none of them in use:

    python3 bench/attach_probe.py --out DIR [--repeat 3]

Each way is measured in a fresh process, --repeat times:
  nvml-all        every GPU by index, its UUID and name (pos's listing before it read the
                  driver's /proc files)
  listed          pos.nvml.gpus(): the driver's /proc files and NVML's start, no GPU attached
  free-one        pos.nvml.memory_free() of GPU 0 alone (one GPU attached, by its bus id)
  free-all        pos.nvml.memory_free() of every GPU (attached side by side)
  ctx-cold        cuInit and GPU 0's primary context, nothing else holding the GPU
  ctx-held        the same while another process holds GPU 0 attached through NVML: whether
                  an attach made by the restore's checks is one its CUDA start no longer makes
Also: whether the /proc files list the GPUs in NVML's order, and each GPU's persistence mode.
Writes DIR/attach.json.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

PRELUDE = f"import sys, time; sys.path.insert(0, {str(ROOT)!r})\n"
CUDA = "import ctypes as C; cu = C.CDLL('libcuda.so.1'); d = C.c_int(); c = C.c_void_p()"
WAYS = {        # way -> (its imports, not timed; what is timed)
    "nvml-all": ("import pynvml",
                 "pynvml.nvmlInit()\n"
                 "for i in range(pynvml.nvmlDeviceGetCount()):\n"
                 "    h = pynvml.nvmlDeviceGetHandleByIndex(i)\n"
                 "    pynvml.nvmlDeviceGetUUID(h); pynvml.nvmlDeviceGetName(h)"),
    "listed": ("from pos import nvml", "assert nvml.gpus()"),
    "free-one": ("from pos import nvml", "assert nvml.memory_free([nvml.gpus()[0].uuid])"),
    "free-all": ("from pos import nvml", "g = nvml.gpus()\n"
                 "assert len(nvml.memory_free([x.uuid for x in g])) == len(g)"),
    "ctx-cold": (CUDA, "assert cu.cuInit(0) == 0 and cu.cuDeviceGet(C.byref(d), 0) == 0\n"
                       "assert cu.cuDevicePrimaryCtxRetain(C.byref(c), d) == 0"),
}
WAYS["ctx-held"] = WAYS["ctx-cold"]
HOLDER = PRELUDE + "from pos import nvml; nvml.memory_free([nvml.gpus()[0].uuid])\n" \
    "print('held', flush=True); time.sleep(60)\n"
ORDER = PRELUDE + "import json, pynvml; from pos import nvml; pynvml.nvmlInit()\n" \
    "hs = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]\n" \
    "n = [pynvml.nvmlDeviceGetUUID(h) for h in hs]\n" \
    "print(json.dumps({'nvml': [x.decode() if isinstance(x, bytes) else x for x in n],\n" \
    "                  'listed': [g.uuid for g in nvml.gpus()],\n" \
    "                  'persistence': [pynvml.nvmlDeviceGetPersistenceMode(h) for h in hs]}))\n"


def once(way: str) -> float:
    """Seconds the way took in a fresh process, its imports made first."""
    setup, body = WAYS[way]
    code = f"{PRELUDE}{setup}\nt = time.monotonic()\n{body}\nprint(time.monotonic() - t)\n"
    holder = None
    if way == "ctx-held":
        holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE,
                                  text=True)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120)
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    return timed(out)


def timed(out: subprocess.CompletedProcess) -> float:
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr else "failed")
    return round(float(out.stdout.strip().splitlines()[-1]), 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"ways": {}}
    order = subprocess.run([sys.executable, "-c", ORDER], capture_output=True, text=True,
                           timeout=120)
    res["order"] = json.loads(order.stdout) if order.returncode == 0 else order.stderr[-500:]
    for way in WAYS:
        runs = []
        for _ in range(a.repeat):
            time.sleep(1)               # the GPUs let go by the process before
            try:
                runs.append(once(way))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                runs.append(str(e))
        res["ways"][way] = runs
        print(way, runs, flush=True)
    (a.out / "attach.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res["order"]))


if __name__ == "__main__":
    main()
