"""The fake GPU driver and its workloads, without root and without tracing.

The tracer tests compare what pos records against the JSON the workloads print, so these tests
check that JSON against values computed here from the workloads' own allocation pointers, and
check that the fake libraries export what the uprobes attach to. The checkpoint API's state
machine is driven through ctypes, as pos's engine will drive the real driver's.
"""

import ctypes
import struct
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile

from pos.driver import CU_PROCESS_STATE_CHECKPOINTED as CHECKPOINTED
from pos.driver import CU_PROCESS_STATE_LOCKED as LOCKED
from pos.driver import CU_PROCESS_STATE_RUNNING as RUNNING
from pos.driver import CUDA_ERROR_ILLEGAL_STATE as ILLEGAL_STATE
from pos.driver import CUDA_ERROR_INVALID_IMAGE as INVALID_IMAGE
from pos.driver import CUDA_ERROR_INVALID_VALUE as INVALID_VALUE
from pos.driver import CUDA_ERROR_NOT_INITIALIZED as NOT_INITIALIZED
from pos.driver import CUDA_ERROR_UNKNOWN as UNKNOWN
from pos.driver import CUDA_SUCCESS as SUCCESS
from pos.driver import (CUcheckpointLockArgs, CUcontext, CUdeviceptr, CUfunction, CUmodule,
                        CUprocessState, Driver, Functions)
from pos.tracer.probes import CUDA, HIP, Family
from workloads.harness import Job

KERNELS = ("_Z4axpyfPKfPfi", "_Z9pair_copy4Pairf", "_Z5mixed5MixedPKd", "_Z7scalarscsixdPf",
           "_Z4fillIfEvPT_S0_i", "_Z4fillIiEvPT_S0_i", "no_params", "_Z11tensor_list10TensorListf",
           "_Z4manyPfiiiiiiiiiiiiiiiiiii")
AXPY, PAIR_COPY, MIXED, SCALARS, FILL_F, FILL_I, NO_PARAMS, TENSOR_LIST, MANY = KERNELS
CHECKPOINT_API = ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                  "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock",
                  "cuCheckpointProcessGetState", "cuCheckpointProcessGetRestoreThreadId")
CUDA_EXPORTS = (
    "cuInit", "cuDriverGetVersion", "cuDeviceGet", "cuDeviceGetCount", "cuCtxCreate_v2",
    "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent", "cuCtxSynchronize", "cuGetErrorString",
    "cuMemAlloc_v2", "cuMemAllocPitch_v2", "cuMemAllocAsync", "cuMemAllocAsync_ptsz",
    "cuMemFree_v2", "cuMemFreeAsync", "cuMemFreeAsync_ptsz", "cuMemAddressReserve",
    "cuMemAddressFree", "cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemUnmap",
    "cuModuleLoadData", "cuModuleLoadDataEx", "cuModuleGetFunction", "cuLibraryLoadData",
    "cuLibraryGetKernel", "cuKernelGetFunction", "cuLaunchKernel", "cuLaunchKernel_ptsz",
    "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz", "cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2",
    "cuMemcpyDtoD_v2", "cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync_v2_ptsz",
    "cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync_v2_ptsz", "cuMemcpyDtoDAsync_v2",
    "cuMemcpyDtoDAsync_v2_ptsz", "cuMemcpyAsync", "cuMemcpyAsync_ptsz", "cuMemsetD8_v2",
    "cuMemsetD32_v2", "cuMemsetD8Async", "cuMemsetD8Async_ptsz", "cuMemsetD32Async",
    "cuMemsetD32Async_ptsz", "cuStreamCreate", "cuStreamSynchronize", "cuStreamSynchronize_ptsz",
    "cuEventCreate", "cuEventRecord", "cuEventSynchronize", "cuStreamDestroy_v2",
    *CHECKPOINT_API)
HIP_EXPORTS = (
    "hipMalloc", "hipMallocManaged", "hipMallocAsync", "hipExtMallocWithFlags", "hipFree",
    "hipFreeAsync", "hipModuleLoadData", "hipModuleGetFunction", "hipModuleLaunchKernel",
    "hipExtModuleLaunchKernel", "hipLaunchKernel", "hipMemcpy", "hipMemcpyAsync", "hipMemcpyHtoD",
    "hipMemcpyDtoH", "hipMemcpyDtoD", "hipMemset", "hipMemsetAsync", "hipDeviceSynchronize",
    "hipStreamSynchronize", "hipStreamCreate")



def h(x: str | int) -> int:
    return int(x, 16) if isinstance(x, str) else x


def le(fmt: str, *values: object) -> str:
    """Hex of values packed little-endian, as the workloads print parameter bytes."""
    return struct.pack("<" + fmt, *values).hex()


# ---- the build ------------------------------------------------------------------------------

def _exports(path: Path) -> dict[str, int]:
    with open(path, "rb") as f:
        elf = ELFFile(f)
        return {s.name: s["st_value"] for s in elf.get_section_by_name(".dynsym").iter_symbols()
                if s["st_info"]["type"] == "STT_FUNC" and s["st_shndx"] != "SHN_UNDEF"
                and s["st_info"]["bind"] == "STB_GLOBAL"}


def _dynamic(path: Path) -> dict[str, list[str]]:
    tags: dict[str, list[str]] = {}
    with open(path, "rb") as f:
        for section in ELFFile(f).iter_sections():
            if isinstance(section, DynamicSection):
                for tag in section.iter_tags():
                    for attr in ("soname", "needed", "runpath", "rpath"):
                        if hasattr(tag, attr):
                            tags.setdefault(tag.entry.d_tag, []).append(getattr(tag, attr))
    return tags


@pytest.mark.parametrize("lib,required,family", [("libcuda", CUDA_EXPORTS, CUDA),
                                                 ("libamdhip64", HIP_EXPORTS, HIP)])
def test_exports_one_function_per_symbol(fakegpu: dict[str, Path], lib: str,
                                         required: tuple[str, ...], family: Family) -> None:
    exports = _exports(fakegpu[lib])
    missing = set(required) - set(exports)
    assert not missing, f"{lib} lacks {sorted(missing)}"
    # two symbols at one address would fire each other's uprobes
    by_address: dict[int, list[str]] = {}
    for name, address in exports.items():
        by_address.setdefault(address, []).append(name)
    assert not [names for names in by_address.values() if len(names) > 1]
    # the tracer finds the library in /proc/PID/maps by this basename prefix
    assert fakegpu[lib].name.startswith(family.library_prefixes)


def test_sonames_and_links(fakegpu: dict[str, Path]) -> None:
    assert _dynamic(fakegpu["libcuda"])["DT_SONAME"] == ["libcuda.so.1"]
    assert _dynamic(fakegpu["libamdhip64"])["DT_SONAME"] == ["libamdhip64.so.6"]
    cuda_app = _dynamic(fakegpu["cuda_app"])
    assert "libcuda.so.1" in cuda_app["DT_NEEDED"]
    assert str(fakegpu["dir"]) in (cuda_app.get("DT_RUNPATH", []) + cuda_app.get("DT_RPATH", []))
    assert "libamdhip64.so.6" in _dynamic(fakegpu["hip_app"])["DT_NEEDED"]


def test_images(fakegpu: dict[str, Path]) -> None:
    with open(fakegpu["cubin"], "rb") as f:
        symbols = {s.name for s in ELFFile(f).get_section_by_name(".symtab").iter_symbols()
                   if s["st_info"]["type"] == "STT_FUNC"}
    assert set(KERNELS) <= symbols, "the workloads' hard-coded kernel names are stale"
    fatbin = fakegpu["fatbin"].read_bytes()
    zfatbin = fakegpu["zfatbin"].read_bytes()
    for image in (fatbin, zfatbin):
        assert struct.unpack_from("<I", image)[0] == 0xBA55ED50
    assert len(zfatbin) < len(fatbin) // 2  # really compressed
    with open(fakegpu["libkernels"], "rb") as f:
        elf = ELFFile(f)
        assert elf.get_section_by_name(".nv_fatbin").data()[:len(fatbin)] == fatbin
        wrapper = elf.get_section_by_name(".nvFatBinSegment").data()
        assert struct.unpack_from("<ii", wrapper) == (0x466243B1, 1)


# ---- the workloads --------------------------------------------------------------------------

@contextmanager
def running(argv: list[str]) -> Iterator[Job]:
    """A workload that must end cleanly (exit status 0) once the block is done with it."""
    job = Job(argv)
    try:
        yield job
    finally:
        if job.p.poll() is None:
            job.close()
    assert job.p.returncode == 0


@pytest.fixture(params=["cubin", "fatbin", "library", "wrapped"])
def cuda_job(request: pytest.FixtureRequest, fakegpu: dict[str, Path]) -> Iterator[Job]:
    with running([str(fakegpu["cuda_app"]), request.param, str(fakegpu["dir"])]) as job:
        yield job


@pytest.fixture
def hip_job(fakegpu: dict[str, Path]) -> Iterator[Job]:
    with running([str(fakegpu["hip_app"]), str(fakegpu["dir"])]) as job:
        yield job


def _maps(pid: int) -> set[str]:
    return {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if "/" in line}


def _check_allocations(allocs: list[dict], reserved: str) -> list[tuple[int, int]]:
    """Distinct, non-overlapping ranges; a VMM mapping lies inside its reservation."""
    ranges = sorted((h(a["ptr"]), a["size"]) for a in allocs if a["api"] not in
                    ("cuMemCreate", "cuMemMap"))
    assert all(size > 0 and ptr for ptr, size in ranges)
    for (p0, s0), (p1, _) in zip(ranges, ranges[1:]):
        assert p0 + s0 <= p1, "allocations overlap"
    for m in (a for a in allocs if a["api"] == "cuMemMap"):
        r = next(a for a in allocs if a["api"] == reserved)
        assert h(r["ptr"]) <= h(m["ptr"]) and h(m["ptr"]) + m["size"] <= h(r["ptr"]) + r["size"]
    return ranges


def _inside(ptr: int, ranges: list[tuple[int, int]]) -> bool:
    return any(p <= ptr < p + s for p, s in ranges)


def _check_copies(copies: list[dict], ranges: list[tuple[int, int]]) -> None:
    """Each side of a directed copy is device memory exactly when its direction says so."""
    sides = {"HtoD": (False, True), "DtoH": (True, False), "DtoD": (True, True)}
    for copy in copies:
        if copy["direction"] in sides:
            src_device, dst_device = sides[copy["direction"]]
            assert _inside(h(copy["src"]), ranges) == src_device, copy
            assert _inside(h(copy["dst"]), ranges) == dst_device, copy
            assert _inside(h(copy["dst"]) + copy["size"] - 1, ranges) == dst_device, copy


def test_cuda_app(cuda_job: Job, fakegpu: dict[str, Path]) -> None:
    mode = cuda_job.p.args[1]
    load = cuda_job.run("load")
    assert load["mode"] == mode and load["driver_version"] == 13000
    assert load["api"] == {"cubin": "cuModuleLoadData", "fatbin": "cuModuleLoadDataEx",
                           "library": "cuLibraryLoadData", "wrapped": "cuModuleLoadData"}[mode]
    assert h(load["module"]) and h(load["image"]) and load["image_size"] > 0
    maps = _maps(cuda_job.pid)
    assert str(fakegpu["libcuda"]) in maps
    if mode == "wrapped":
        assert str(fakegpu["libkernels"]) in maps
        assert load["image_size"] == fakegpu["fatbin"].stat().st_size

    lookup = cuda_job.run("lookup")
    functions = {k: h(v) for k, v in lookup["functions"].items()}
    assert list(functions) == list(KERNELS)
    assert len(set(functions.values())) == len(KERNELS) and all(functions.values())
    if mode == "library":
        kernels = {k: h(v) for k, v in lookup["kernels"].items()}
        assert list(kernels) == list(KERNELS)
        assert not set(kernels.values()) & set(functions.values())
    assert cuda_job.run("lookup") == lookup, "handles are stable per (module, name)"

    alloc = cuda_job.run("alloc")
    allocs = alloc["allocs"]
    assert [a["api"] for a in allocs] == ["cuMemAlloc_v2"] * 4 + [
        "cuMemAllocPitch_v2", "cuMemAllocAsync", "cuMemAddressReserve", "cuMemCreate", "cuMemMap"]
    assert [a["kind"] for a in allocs] == ["alloc"] * 6 + ["reserve", "create", "alloc"]
    ranges = _check_allocations(allocs, "cuMemAddressReserve")
    a, b, c, d, p, s, v = (h(x["ptr"]) for x in allocs[:7])
    assert allocs[4]["pitch"] % 512 == 0 and allocs[4]["pitch"] >= allocs[4]["width"]
    assert allocs[5]["stream"] == alloc["stream"]
    assert allocs[8]["ptr"] == allocs[6]["ptr"] and allocs[8]["handle"] == allocs[7]["handle"]
    stream = h(alloc["stream"])

    launch = cuda_job.run("launch")
    launches = launch["launches"]
    assert [x["name"] for x in launches] == [AXPY, PAIR_COPY, MIXED, SCALARS, FILL_F, FILL_I,
                                             NO_PARAMS, NO_PARAMS]
    assert {x["api"] for x in launches} == {"cuLaunchKernel", "cuLaunchKernel_ptsz",
                                            "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz"}
    for x in launches:
        assert h(x["function"]) == functions[x["name"]]
    axpy, pair, mixed, scalars, fill_f, fill_i, none, none_ex = launches
    assert axpy["params"] == [le("f", 2.5), le("Q", a + 16), le("Q", b), le("i", 1000)]
    assert pair["params"] == [le("QQi4x", c, p, 64), le("f", 0.5)]
    assert h(pair["stream"]) == stream and pair["api"] == "cuLaunchKernel_ptsz"
    assert mixed["params"] == [le("c7xQI4x", b"M", s, 32), le("Q", v)]
    assert mixed["api"] == "cuLaunchKernelEx" and h(mixed["stream"]) == stream
    assert mixed["shared_mem"] == 256
    assert scalars["params"] == [le("b", ord("C")), le("h", 0x1234), le("i", 0x5678ABCD),
                                 le("q", 0x1122334455667788), le("d", 6.25), le("Q", d)]
    assert fill_f["grid"] == [2, 3, 4] and fill_f["block"] == [8, 4, 2]
    assert fill_f["params"] == [le("Q", c), le("f", 1.5), le("i", 4096)]
    assert fill_i["extra"] and fill_i["buffer"] == le("Qii", s + 1024, 7, 256)
    assert "".join(fill_i["params"]) == fill_i["buffer"]
    assert none["params"] == [] and none_ex["params"] == []
    assert none_ex["api"] == "cuLaunchKernelEx_ptsz" and h(none_ex["stream"]) == stream

    _check_copies(launch["copies"], ranges)
    for m in launch["memsets"]:
        assert _inside(h(m["dst"]), ranges) and _inside(h(m["dst"]) + m["size"] - 1, ranges)
    seqs = sorted(x["seq"] for key in ("launches", "copies", "memsets", "syncs")
                  for x in launch[key])
    assert seqs == list(range(len(seqs)))
    assert {x["api"] for x in launch["syncs"]} >= {"cuStreamSynchronize", "cuCtxSynchronize"}

    structs = cuda_job.run("structs")["launches"]
    assert [x["name"] for x in structs] == [TENSOR_LIST, TENSOR_LIST, MANY, AXPY]
    for x, scale in zip(structs, (0.5, 0.25)):
        assert len(x["params"][0]) == 2 * 3368 and x["params"][1] == le("f", scale)
        assert x["params"][0][:2 * 24] == le("QQQ", c, c + 4096, c + 8192)
    assert structs[2]["params"] == [le("Q", c)] + [le("i", 100 + i) for i in range(1, 20)]
    assert structs[3]["params"] == [le("f", 3.0), le("Q", a), le("Q", b), le("i", 512)]

    free = cuda_job.run("free")
    assert [x["api"] for x in free["frees"]] == ["cuMemFree_v2"] * 5 + [
        "cuMemFreeAsync", "cuMemUnmap", "cuMemRelease", "cuMemAddressFree"]
    assert [x["kind"] for x in free["frees"]] == ["free"] * 7 + ["release", "unreserve"]
    assert free["frees"][7]["handle"] == allocs[7]["handle"]
    assert [h(x["ptr"]) for x in free["frees"][:6]] == [a, b, c, d, p, s]

    spin = cuda_job.run("spin 1000")
    assert spin["launches"] == 1000 and spin["seconds"] >= 0


def test_hip_app(hip_job: Job, fakegpu: dict[str, Path]) -> None:
    load = hip_job.run("load")
    assert load["api"] == "hipModuleLoadData" and h(load["module"])
    assert str(fakegpu["libamdhip64"]) in _maps(hip_job.pid)

    lookup = hip_job.run("lookup")
    functions = {k: h(v) for k, v in lookup["functions"].items()}
    assert list(functions) == list(KERNELS) and len(set(functions.values())) == len(KERNELS)
    stubs = {k: h(v) for k, v in lookup["stubs"].items()}
    assert set(stubs) == {FILL_F, NO_PARAMS}

    alloc = hip_job.run("alloc")
    allocs = alloc["allocs"]
    assert {a["kind"] for a in allocs} == {"alloc"}
    ranges = _check_allocations(allocs, "")
    a, b, c, d, m, s, e = (h(x["ptr"]) for x in allocs)
    stream = h(alloc["stream"])

    launch = hip_job.run("launch")
    launches = launch["launches"]
    axpy, pair, mixed, scalars, fill_f, fill_i, none, none_module = launches
    assert axpy["params"] == [le("f", 2.5), le("Q", a + 16), le("Q", b), le("i", 1000)]
    assert pair["params"] == [le("QQi4x", c, m, 64), le("f", 0.5)]
    assert mixed["api"] == "hipExtModuleLaunchKernel" and mixed["grid"] == [2, 1, 1]
    assert mixed["params"] == [le("c7xQI4x", b"M", s, 32), le("Q", e)]
    assert scalars["extra"] and scalars["buffer"] == le(
        "bxhiqdQ", ord("C"), 0x1234, 0x5678ABCD, 0x1122334455667788, 6.25, d)
    # hipLaunchKernel: the host stub's address, dim3s by value, shared memory and stream
    assert fill_f["api"] == "hipLaunchKernel" and h(fill_f["function"]) == stubs[FILL_F]
    assert (fill_f["grid"], fill_f["block"], fill_f["shared_mem"], h(fill_f["stream"])) == (
        [2, 3, 4], [8, 4, 2], 128, stream)
    assert fill_i["params"] == [le("Q", s + 1024), le("i", 7), le("i", 256)]
    assert h(none["function"]) == stubs[NO_PARAMS] and none["params"] == []
    assert h(none_module["function"]) == functions[NO_PARAMS]
    for x in (axpy, pair, mixed, scalars, fill_i, none_module):
        assert h(x["function"]) == functions[x["name"]]
    _check_copies(launch["copies"], ranges)

    free = hip_job.run("free")
    assert [h(x["ptr"]) for x in free["frees"]] == [a, b, c, d, m, e, s]
    assert hip_job.run("spin 500")["launches"] == 500


def test_phases_out_of_order(fakegpu: dict[str, Path]) -> None:
    with running([str(fakegpu["cuda_app"]), "cubin", str(fakegpu["dir"])]) as job:
        assert job.run("launch") == {"phase": "launch", "error": "lookup and alloc first"}
        assert job.run("nonsense")["error"] == "unknown command"


# ---- the driver's checks, in this process ---------------------------------------------------

@pytest.fixture
def cuda(fakegpu: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Functions:
    """The fake libcuda in this process through pos.driver's declarations, each call returning
    its CUresult; its checkpoint state kept under tmp_path."""
    monkeypatch.setenv("POS_FAKECUDA_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("POS_FAKECUDA_LOG", raising=False)
    monkeypatch.delenv("POS_FAKECUDA_FAIL", raising=False)
    return Driver(str(fakegpu["libcuda"])).raw


def test_driver_checks(cuda: Functions) -> None:
    ptr, ctx = CUdeviceptr(), CUcontext()
    assert cuda.cuInit(0) == SUCCESS
    assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == SUCCESS
    assert cuda.cuCtxSetCurrent(ctx) == SUCCESS
    assert cuda.cuMemAlloc_v2(ctypes.byref(ptr), 0) == INVALID_VALUE
    assert cuda.cuMemAlloc_v2(ctypes.byref(ptr), 4096) == SUCCESS
    data = bytes(range(256)) * 16
    back = ctypes.create_string_buffer(4096)
    assert cuda.cuMemcpyHtoD_v2(ptr, data, 4096) == SUCCESS
    assert cuda.cuMemcpyDtoH_v2(back, ptr, 4096) == SUCCESS
    assert back.raw == data
    # a device range must lie inside an allocation
    assert cuda.cuMemcpyHtoD_v2(ptr.value + 1, data, 4096) == INVALID_VALUE
    assert cuda.cuMemcpyDtoH_v2(back, ctypes.addressof(back), 16) == INVALID_VALUE

    module, func = CUmodule(), CUfunction()
    assert cuda.cuModuleLoadData(ctypes.byref(module), b"not an image") == INVALID_IMAGE
    cubin = ctypes.create_string_buffer(b"\x7fELF" + bytes(60))
    assert cuda.cuModuleLoadData(ctypes.byref(module), cubin) == SUCCESS
    assert cuda.cuModuleGetFunction(ctypes.byref(func), module, AXPY.encode()) == SUCCESS
    params = (ctypes.c_void_p * 4)()
    extra = (ctypes.c_void_p * 1)()

    def launch(block: int, p: object, x: object) -> int:
        return cuda.cuLaunchKernel(func, 1, 1, 1, block, 1, 1, 0, None, p, x)

    assert launch(128, params, None) == SUCCESS
    assert launch(128, None, None) == INVALID_VALUE   # axpy has parameters
    assert launch(128, params, extra) == INVALID_VALUE  # not both forms
    assert launch(2048, params, None) == INVALID_VALUE  # too many threads per block
    assert cuda.cuMemFree_v2(ptr) == SUCCESS
    assert cuda.cuMemFree_v2(ptr) == INVALID_VALUE


# ---- the checkpoint API ---------------------------------------------------------------------

def _state(cuda: Functions, pid: int) -> tuple[int, int]:
    state = CUprocessState(-1)
    return cuda.cuCheckpointProcessGetState(pid, ctypes.byref(state)), state.value


def _call(cuda: Functions, name: str, pid: int) -> int:
    return getattr(cuda, name)(pid, None)


@pytest.fixture
def target(cuda: Functions, fakegpu: dict[str, Path]) -> Iterator[Job]:
    """A CUDA process (cuInit done) whose state the tests drive from this one."""
    with running([str(fakegpu["cuda_app"]), "cubin", str(fakegpu["dir"])]) as job:
        job.run("load")
        yield job


def test_checkpoint_state_machine(cuda: Functions, target: Job, tmp_path: Path) -> None:
    pid = target.pid
    state_file = tmp_path / "state" / str(pid)
    assert state_file.read_text() == "running\n"
    assert _state(cuda, pid) == (SUCCESS, RUNNING)
    for wrong in ("cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore",
                  "cuCheckpointProcessUnlock"):
        assert _call(cuda, wrong, pid) == ILLEGAL_STATE
    assert _call(cuda, "cuCheckpointProcessLock", pid) == SUCCESS
    assert _state(cuda, pid) == (SUCCESS, LOCKED)
    assert _call(cuda, "cuCheckpointProcessLock", pid) == ILLEGAL_STATE
    assert _call(cuda, "cuCheckpointProcessRestore", pid) == ILLEGAL_STATE
    assert _call(cuda, "cuCheckpointProcessCheckpoint", pid) == SUCCESS
    assert _state(cuda, pid) == (SUCCESS, CHECKPOINTED)
    assert state_file.read_text() == "checkpointed\n"
    tid = ctypes.c_int()
    assert cuda.cuCheckpointProcessGetRestoreThreadId(pid, ctypes.byref(tid)) == SUCCESS
    assert tid.value == pid
    for wrong in ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                  "cuCheckpointProcessUnlock"):
        assert _call(cuda, wrong, pid) == ILLEGAL_STATE
    assert _call(cuda, "cuCheckpointProcessRestore", pid) == SUCCESS
    assert _state(cuda, pid) == (SUCCESS, LOCKED)
    assert _call(cuda, "cuCheckpointProcessUnlock", pid) == SUCCESS
    assert _state(cuda, pid) == (SUCCESS, RUNNING)
    # the target is unharmed, and removes its state when it exits
    assert "error" not in target.run("lookup")
    target.close()
    assert not state_file.exists()


def test_checkpoint_state_survives_across_processes(cuda: Functions, target: Job,
                                                    fakegpu: dict[str, Path]) -> None:
    assert _call(cuda, "cuCheckpointProcessLock", target.pid) == SUCCESS
    script = (f"from pos.driver import Driver; cuda = Driver({str(fakegpu['libcuda'])!r}).raw; "
              f"print(cuda.cuCheckpointProcessCheckpoint({target.pid}, None))")
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           check=True)
    assert other.stdout.strip() == str(SUCCESS)
    assert _state(cuda, target.pid) == (SUCCESS, CHECKPOINTED)


def test_checkpoint_targets_and_arguments(cuda: Functions, target: Job) -> None:
    assert cuda.cuCheckpointProcessGetState(target.pid, None) == INVALID_VALUE
    assert _call(cuda, "cuCheckpointProcessLock", 0) == INVALID_VALUE
    with subprocess.Popen(["sleep", "30"]) as plain:  # alive, but never called cuInit
        try:
            assert _state(cuda, plain.pid)[0] == NOT_INITIALIZED
        finally:
            plain.kill()
    plain.wait()
    assert _state(cuda, plain.pid)[0] == INVALID_VALUE  # gone
    # reserved fields must be zero; a rejected call leaves the state alone
    args = CUcheckpointLockArgs(timeoutMs=5000)
    args.reserved1[2] = 1
    assert cuda.cuCheckpointProcessLock(target.pid, ctypes.byref(args)) == INVALID_VALUE
    args.reserved1[2] = 0
    assert cuda.cuCheckpointProcessLock(target.pid, ctypes.byref(args)) == SUCCESS
    assert _state(cuda, target.pid) == (SUCCESS, LOCKED)


def test_checkpoint_log_and_injected_failures(cuda: Functions, target: Job, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "calls.log"
    monkeypatch.setenv("POS_FAKECUDA_LOG", str(log))
    monkeypatch.setenv("POS_FAKECUDA_FAIL",
                       "cuCheckpointProcessCheckpoint,cuCheckpointProcessUnlockX")
    pid = target.pid
    assert _call(cuda, "cuCheckpointProcessLock", pid) == SUCCESS
    assert _call(cuda, "cuCheckpointProcessCheckpoint", pid) == UNKNOWN
    assert _state(cuda, pid) == (SUCCESS, LOCKED)  # a failed call changes nothing
    assert _call(cuda, "cuCheckpointProcessUnlock", pid) == SUCCESS  # names match whole
    assert _call(cuda, "cuCheckpointProcessUnlock", pid) == ILLEGAL_STATE  # logged too
    assert log.read_text().splitlines() == [
        f"cuCheckpointProcessLock {pid}", f"cuCheckpointProcessCheckpoint {pid}",
        f"cuCheckpointProcessGetState {pid}", f"cuCheckpointProcessUnlock {pid}",
        f"cuCheckpointProcessUnlock {pid}"]
    monkeypatch.setenv("POS_FAKECUDA_FAIL", "cuCheckpointProcessGetState")
    assert _state(cuda, pid)[0] == UNKNOWN
