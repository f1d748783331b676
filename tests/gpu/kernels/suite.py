"""Runs suite.cu on the GPU under the run-time validator: for each case of suite.json, the
write set the speculation predicts from the launch's real parameter bytes (layout from the
cubin's .nv.info, parameter kinds from the demangled name) and the buffers the validator saw
change. Shared by tests/gpu/test_analyzer_gpu.py and bench/validate_gpu.py."""

import ctypes
import json
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from pos.analyzer.access import launch_sets
from pos.analyzer.demangle import demangle, parameter_kinds
from pos.analyzer.validate import Validator
from pos.driver import CUdeviceptr, CUfunction, CUmodule, driver
from pos.tracer.fatbin import parse_image

HERE = Path(__file__).resolve().parent
N = 256
ONE = 0x3F800000          # 1.0f


def load_truth() -> list[dict[str, Any]]:
    return json.loads((HERE / "suite.json").read_text())["cases"]


def compile_suite(out: Path) -> bytes:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("nvcc is needed to compile tests/gpu/kernels/suite.cu")
    cubin = out / "suite.cubin"
    subprocess.run([nvcc, "-cubin", "-arch=sm_90", "-O2", "-o", str(cubin), str(HERE / "suite.cu")],
                   check=True)
    return cubin.read_bytes()


def _arg_bytes(arg: dict[str, Any], ptr: dict[str, int]) -> bytes:
    if "ptr" in arg:
        return struct.pack("<Q", ptr[arg["ptr"]] + arg.get("offset", 0))
    if "addr" in arg:
        return struct.pack("<Q", ptr[arg["addr"]])
    if "i32" in arg:
        return struct.pack("<i", arg["i32"])
    if "f32" in arg:
        return struct.pack("<f", arg["f32"])
    if "u64" in arg:
        return struct.pack("<Q", arg["u64"])
    blob = bytearray(arg["struct"])
    for off, field in arg["fields"]:
        b = _arg_bytes(field, ptr)
        blob[off:off + len(b)] = b
    return bytes(blob)


def run_suite(workdir: Path) -> list[dict[str, Any]]:
    """One record per case: names of the buffers predicted written, seen written, and whether
    the validator validated the kernel (on this launch alone: a fresh validator per case)."""
    d = driver()
    d.primary_context(0)
    cubin = compile_suite(workdir)
    layouts = parse_image(cubin)
    mangled = {}
    for name in layouts:
        text = demangle(name) or name
        mangled[text.split("(")[0].split()[-1]] = name
    module = CUmodule()
    d.cuModuleLoadData(ctypes.byref(module), cubin)
    records = []
    for case in load_truth():
        name = mangled[case["kernel"]]
        fn = CUfunction()
        d.cuModuleGetFunction(ctypes.byref(fn), module, name.encode())
        ptr: dict[str, int] = {}
        for b in ("X", "Y", "Z", "T"):
            p = CUdeviceptr()
            d.cuMemAlloc_v2(ctypes.byref(p), 4 * N)
            d.cuMemsetD32_v2(p, ONE, N)
            ptr[b] = p.value
        table = np.array([ptr[b] for b in case.get("table", [])] or [0], np.uint64)
        d.cuMemcpyHtoD_v2(ptr["T"], table.ctypes.data, table.nbytes)
        layout = layouts[name].params
        args = [_arg_bytes(a, ptr) for a in case["args"]]
        assert len(args) == len(layout), (case["case"], len(args), layout)
        blob = bytearray(max(p.offset + p.size for p in layout))
        storage = []
        for a, p in zip(args, layout):
            blob[p.offset:p.offset + len(a)] = a
            storage.append(ctypes.create_string_buffer(a, max(len(a), p.size)))
        kernel_params = (ctypes.c_void_p * len(storage))(*[ctypes.addressof(s) for s in storage])
        live = sorted((p, 4 * N) for p in ptr.values())
        bases = np.array([b for b, _ in live], np.uint64)
        ends = np.array([b + s for b, s in live], np.uint64)
        kinds, _ = parameter_kinds(name, len(layout))
        _, writes = launch_sets(bytes(blob), [p.offset for p in layout], [p.size for p in layout],
                                kinds, bases, ends)

        def launch() -> None:
            d.cuLaunchKernel(fn, 1, 1, 1, N, 1, 1, 0, None, kernel_params, None)

        v = Validator(d, chunk=1 << 20)
        try:
            changed, outside = v.validate(name, launch, live, writes)
        finally:
            v.close()
        by_ptr = {p: b for b, p in ptr.items()}
        records.append({"case": case["case"], "kernel": name,
                        "predicted": sorted(by_ptr[p] for p in writes),
                        "observed": sorted(by_ptr[p] for p in changed),
                        "outside": sorted(by_ptr[p] for p in outside),
                        "validated": v.is_validated(name),
                        "declared": {k: case[k] for k in ("writes", "predicted", "visible")}})
        for p in ptr.values():
            d.cuMemFree_v2(p)
    return records
