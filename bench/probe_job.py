"""Jobs for bench/restart_gpu.py's probes; they know nothing of pos.

  python bench/probe_job.py driver LOG   # the driver API alone (ctypes): a memset and a sync
                                         # every 5 ms, `I WALLTIME` appended to LOG after each
  python bench/probe_job.py ctxmem       # a small PyTorch training job; then, for each setting
                                         # of the stack limit, one JSON line (the context's
                                         # limits, device memory used) and READY; it goes on
                                         # at each line on its standard input

`driver` says where the driver itself spends a restored process's first call; `ctxmem` how
much device memory the context holds beyond the job's buffers (what the driver's checkpoint
copies when pos has hoisted the buffers) and what the stack limit has to do with it.
"""

import ctypes
import json
import os
import sys
import time

LIMITS = {"stack": 0, "printf_fifo": 1, "malloc_heap": 2, "pending_launches": 4}


def cuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")

    def check(r: int) -> int:
        if r:
            raise RuntimeError(f"CUDA error {r}")
        return r

    for name in ("cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent",
                 "cuMemAlloc_v2", "cuMemsetD32_v2", "cuCtxSynchronize", "cuMemGetInfo_v2",
                 "cuCtxGetLimit"):
        getattr(lib, name).restype = check
    return lib     # cuCtxSetLimit's result is reported, not raised


def driver(log: str) -> None:
    lib = cuda()
    dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    lib.cuInit(0)
    lib.cuDeviceGet(ctypes.byref(dev), 0)
    lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    lib.cuCtxSetCurrent(ctx)
    n = 256 << 20
    lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(n))
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    i = 0
    while True:
        i += 1
        lib.cuMemsetD32_v2(ptr, ctypes.c_uint(i), ctypes.c_size_t(n // 4))
        lib.cuCtxSynchronize()
        os.write(fd, f"{i} {time.time():.6f}\n".encode())
        time.sleep(0.005)


def ctxmem() -> None:
    import torch
    import torch.nn as nn

    dev = torch.device("cuda")
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 10)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(512, 256, device=dev), torch.randint(0, 10, (512,), device=dev)
    for _ in range(5):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    lib = cuda()

    def report(setting: str, rc: int = 0) -> None:
        free, total, v = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_size_t()
        lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        limits = {}
        for name, k in LIMITS.items():
            lib.cuCtxGetLimit(ctypes.byref(v), k)
            limits[name] = v.value
        print(json.dumps({"setting": setting, "rc": rc, "used_mib": (total.value - free.value) / 2**20,
                          "torch_reserved_mib": torch.cuda.memory_reserved() / 2**20,
                          "limits": limits}), flush=True)
        print("READY", flush=True)
        sys.stdin.readline()

    report("as trained")
    for stack in (1024, 256):
        report(f"stack {stack}", lib.cuCtxSetLimit(LIMITS["stack"], ctypes.c_size_t(stack)))
    report("stack 256, malloc heap 0",
           lib.cuCtxSetLimit(LIMITS["malloc_heap"], ctypes.c_size_t(0)))
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    torch.cuda.synchronize()
    report("after another step")


if __name__ == "__main__":
    driver(sys.argv[2]) if sys.argv[1] == "driver" else ctxmem()
