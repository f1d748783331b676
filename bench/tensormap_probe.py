"""Whether the checkpoint gate sees the address a TMA descriptor holds. A kernel for Hopper and
later GPUs can take a tensor map (CUtensorMap, 128 bytes, made by cuTensorMapEncodeTiled) as a
by-value parameter and write the tensor through it; the agent's gate reads a launch's
parameters as 8-byte words and waits for the pending buffers they point into
(pos/agent/hook/gate.c). The driver calls the map opaque, so this asks the GPU's driver where,
if anywhere, the tensor's address sits in the map as a plain word. Root not needed, on an NVIDIA
GPU of compute capability 9.0 or later:

    python3 bench/tensormap_probe.py --out DIR

Writes DIR/tensormap.json: for tensors at several offsets into one allocation, the map's words
that equal the tensor's address or point into the allocation.
"""

import argparse
import ctypes as C
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pos.driver import CUdeviceptr, driver  # noqa: E402
from concurrent_gpu import machine  # noqa: E402

U64 = C.c_uint64
U32 = C.c_uint32
FLOAT16 = 6                 # CU_TENSOR_MAP_DATA_TYPE_FLOAT16
SWIZZLE_128B = 3            # CU_TENSOR_MAP_SWIZZLE_128B
MIB = 1 << 20


def encode(lib: Any, address: int, rows: int, cols: int) -> bytes:
    """A 2-D tiled map of a rows x cols fp16 tensor at `address`, as a GEMM would make one."""
    tmap = (C.c_uint8 * 128)()
    dims = (U64 * 2)(cols, rows)
    strides = (U64 * 1)(cols * 2)
    box = (U32 * 2)(64, 64)
    elem = (U32 * 2)(1, 1)
    r = lib.cuTensorMapEncodeTiled(tmap, FLOAT16, 2, C.c_void_p(address), dims, strides, box,
                                   elem, 0, SWIZZLE_128B, 2, 0)
    if r != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {r}")
    return bytes(tmap)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    drv = driver()
    drv.primary_context(0)
    base = CUdeviceptr()
    size = 64 * MIB
    drv.cuMemAlloc_v2(C.byref(base), size)
    lib = C.CDLL("libcuda.so.1")
    rows = []
    for offset in (0, 4096, 1 * MIB + 128, 32 * MIB):
        address = base.value + offset
        words = [int.from_bytes(m[i:i + 8], "little")
                 for m in [encode(lib, address, 1024, 1024)] for i in range(0, 128, 8)]
        rows.append({"offset": offset,
                     "address_at": [i * 8 for i, w in enumerate(words) if w == address],
                     "inside_at": [i * 8 for i, w in enumerate(words)
                                   if base.value <= w < base.value + size],
                     "words": [f"{w:#018x}" for w in words]})
        print(f"offset {offset}: the address at bytes {rows[-1]['address_at']}, "
              f"words into the allocation at bytes {rows[-1]['inside_at']}")
    (a.out / "tensormap.json").write_text(json.dumps({"machine": machine(), "rows": rows},
                                                     indent=1) + "\n")


if __name__ == "__main__":
    main()
