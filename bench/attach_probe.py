"""What a restore's first GPU calls cost on this host when no process holds its GPUs (the job
killed): NVML's start and CUDA's. The restore's checks took 0.91-1.07 s on 4x H200 hosts
against 0.10-0.12 s on a one-GPU host; NVML alone, in a process of its own, 0.05 s. Root, on
a host with NVIDIA GPUs and none of them in use:

    python3 bench/attach_probe.py --out DIR [--repeat 3] [--ways A,B]

Each way is measured in a fresh process, --repeat times:
  nvml-all        NVML's start, every GPU by index, its UUID and name (what the restore's
                  check asks)
  ctx-cold        cuInit and GPU 0's primary context, every GPU visible (the refill's start,
                  beside the checks)
  ctx-one         the same with CUDA_VISIBLE_DEVICES=0: cuInit starts only that GPU
  ctx-held        ctx-cold while another process holds the GPUs through NVML
  nvml-beside     nvml-all while another process runs cuInit with every GPU visible, as the
                  restore's check runs beside the refill's start
  pos-again       pos's NVML listing (nvml.gpus) a second time in one process, as the
                  restore's check asks after devices.start_cuda
  pos-thread-one  the same while a thread of that process makes the refill's context (its
                  imports, GPU 0 by UUID, the primary context) after devices.start_cuda, as
                  `pos restore` does: CUDA sees GPU 0 alone
  pos-thread-all  the same, CUDA seeing every GPU (no start_cuda first)
  pos-ctx-one     devices.start_cuda and the refill's context on GPU 0, in pos's own calls
  pos-ctx-all     the refill's context on GPU 0, CUDA seeing every GPU
  pos-start-beside  NVML's first listing in a process whose other thread has begun the
                  refill's context on GPU 0, CUDA seeing every GPU (NVML not yet started)
  pos-start-beside4  the same with four threads, one context on each of GPUs 0-3
Also: whether each GPU is in persistence mode. Writes DIR/attach.json.
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
CTX = "assert cu.cuInit(0) == 0 and cu.cuDeviceGet(C.byref(d), 0) == 0\n" \
    "assert cu.cuDevicePrimaryCtxRetain(C.byref(c), d) == 0"
NVML = "pynvml.nvmlInit()\n" \
    "for i in range(pynvml.nvmlDeviceGetCount()):\n" \
    "    h = pynvml.nvmlDeviceGetHandleByIndex(i)\n" \
    "    pynvml.nvmlDeviceGetUUID(h); pynvml.nvmlDeviceGetName(h)"
POS = "from pos import nvml\nfrom pos.concurrent import devices\nimport threading\n" \
    "nvml.persistent()\nu = nvml.gpus()[0].uuid"
NARROW = "assert devices.start_cuda([u]), 'CUDA not narrowed'"
CONTEXT = "gpucopy.Context(gpucopy.ordinal(u))"
REFILL = "def refill():\n" \
    "    from pos.concurrent import gpucopy\n" \
    f"    {CONTEXT}\n" \
    "threading.Thread(target=refill, daemon=True).start()"
WAYS = {        # way -> (its imports, not timed; what is timed; what runs beside it)
    "nvml-all": ("import pynvml", NVML, None),
    "ctx-cold": (CUDA, CTX, None),
    "ctx-one": ("import os; os.environ['CUDA_VISIBLE_DEVICES'] = '0'\n" + CUDA, CTX, None),
    "ctx-held": (CUDA, CTX, f"import pynvml\n{NVML}\nprint('ready', flush=True)\n"
                            "time.sleep(60)"),
    "nvml-beside": ("import pynvml", NVML, f"{CUDA}\nprint('ready', flush=True)\n{CTX}\n"
                                            "time.sleep(60)"),
    "pos-again": (POS, "nvml.gpus()", None),
    "pos-thread-one": (f"{POS}\n{NARROW}\n{REFILL}", "nvml.gpus()", None),
    "pos-thread-all": (f"{POS}\n{REFILL}", "nvml.gpus()", None),
    "pos-ctx-one": (f"{POS}\nfrom pos.concurrent import gpucopy", f"{NARROW}\n{CONTEXT}", None),
    "pos-ctx-all": (f"{POS}\nfrom pos.concurrent import gpucopy", CONTEXT, None),
    "pos-start-beside": ("from pos import nvml\nimport threading\n"
                         + REFILL.replace("gpucopy.ordinal(u)", "0")
                         + "\ntime.sleep(0.05)", "nvml.gpus()", None),
    "pos-start-beside4": ("from pos import nvml\nimport threading\n"
                          + REFILL.replace("def refill():", "def refill(i):")
                          .replace("gpucopy.ordinal(u)", "i")
                          .replace("daemon=True).start()",
                                   "args=(i,), daemon=True).start() for i in range(4)]")
                          .replace("threading.Thread(", "[threading.Thread(")
                          + "\ntime.sleep(0.05)", "nvml.gpus()", None),
}
PERSISTENCE = "import json, pynvml; pynvml.nvmlInit()\n" \
    "print(json.dumps([pynvml.nvmlDeviceGetPersistenceMode(\n" \
    "    pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(pynvml.nvmlDeviceGetCount())]))"


def once(way: str) -> float:
    """Seconds the way took in a fresh process, its imports made first (and what runs beside
    it started, up to its own first GPU call)."""
    setup, body, beside = WAYS[way]
    code = f"{PRELUDE}{setup}\nt = time.monotonic()\n{body}\nprint(time.monotonic() - t)\n"
    other = None
    if beside is not None:
        other = subprocess.Popen([sys.executable, "-c", PRELUDE + beside],
                                 stdout=subprocess.PIPE, text=True)
        assert other.stdout is not None
        if other.stdout.readline().strip() != "ready":
            other.wait()
            raise RuntimeError(f"what runs beside {way} failed")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120)
    finally:
        if other is not None:
            other.kill()
            other.wait()
    return timed(out)


def timed(out: subprocess.CompletedProcess) -> float:
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr else "failed")
    return round(float(out.stdout.strip().splitlines()[-1]), 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ways", default=",".join(WAYS), help="which ways, comma-separated")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"ways": {}}
    modes = subprocess.run([sys.executable, "-c", PERSISTENCE], capture_output=True,
                           text=True, timeout=120)
    res["persistence"] = json.loads(modes.stdout) if modes.returncode == 0 else \
        modes.stderr[-500:]
    for way in a.ways.split(","):
        runs: list[Any] = []
        for _ in range(a.repeat):
            time.sleep(1)               # the GPUs let go by the process before
            try:
                runs.append(once(way))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                runs.append(str(e))
        res["ways"][way] = runs
        print(way, runs, flush=True)
    (a.out / "attach.json").write_text(json.dumps(res, indent=1) + "\n")
    print("persistence", res["persistence"])


if __name__ == "__main__":
    main()
