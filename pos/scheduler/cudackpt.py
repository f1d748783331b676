"""The CUDA driver's process checkpoint API (driver >= 570; GPU remapping on restore >= 580),
called from outside the target through `pos.driver`, which checks every CUresult.

A target goes RUNNING --lock--> LOCKED --checkpoint--> CHECKPOINTED (its device memory copied
into host memory, no /dev/nvidia* left open: CRIU can dump it) --restore--> LOCKED --unlock-->
RUNNING. The argument structs mirror cuda.h of CUDA 13 (see tests/fakegpu/libcuda.c).
"""

import ctypes
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

from pos.driver import DriverError, driver
from pos.scheduler import procs

CUDA_ERROR_NOT_INITIALIZED = 3
STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}


class LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint),
                ("reserved1", ctypes.c_uint64 * 7)]


class CheckpointArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class GpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", Uuid), ("newUuid", Uuid)]


class RestoreArgs(ctypes.Structure):
    _fields_ = [("gpuPairs", ctypes.POINTER(GpuPair)), ("gpuPairsCount", ctypes.c_uint),
                ("reserved", ctypes.c_char * 44), ("reserved1", ctypes.c_uint64)]


class UnlockArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


for _s in (LockArgs, CheckpointArgs, RestoreArgs, UnlockArgs):
    assert ctypes.sizeof(_s) == 64, _s


def _drv():
    d = driver()
    d.init()
    return d


def lock(pid: int, timeout_ms: int) -> None:
    """Block the target's CUDA calls once its in-flight work is done (or fail after timeout)."""
    args = LockArgs(timeoutMs=timeout_ms)
    _drv().call("cuCheckpointProcessLock", pid, ctypes.byref(args),
                fix=f"the process's CUDA work did not drain within {timeout_ms} ms; retry, or "
                    "give a longer --lock-timeout")


def checkpoint(pid: int) -> None:
    """Copy the locked target's device memory to host memory and release its GPU."""
    _drv().call("cuCheckpointProcessCheckpoint", pid, ctypes.byref(CheckpointArgs()))


def uuid_bytes(uuid: str) -> bytes:
    """NVML's 'GPU-xxxxxxxx-xxxx-...' as the 16 bytes of a CUuuid."""
    hexdigits = uuid.removeprefix("GPU-").replace("-", "")
    raw = bytes.fromhex(hexdigits)
    if len(raw) != 16:
        raise ValueError(f"not a GPU UUID: {uuid}")
    return raw


def restore(pid: int, gpu_pairs: Sequence[tuple[str, str]] = ()) -> None:
    """Bring the device memory back (onto other GPUs when `gpu_pairs` maps old -> new UUIDs)."""
    args = RestoreArgs()
    pairs = (GpuPair * len(gpu_pairs))()
    for i, (old, new) in enumerate(gpu_pairs):
        pairs[i].oldUuid.bytes[:] = list(uuid_bytes(old))
        pairs[i].newUuid.bytes[:] = list(uuid_bytes(new))
    if gpu_pairs:
        args.gpuPairs = ctypes.cast(pairs, ctypes.POINTER(GpuPair))
        args.gpuPairsCount = len(gpu_pairs)
    _drv().call("cuCheckpointProcessRestore", pid, ctypes.byref(args),
                fix="the GPU could not take the state back; the process was not resumed")


def unlock(pid: int) -> None:
    """Let the target's CUDA calls run again."""
    _drv().call("cuCheckpointProcessUnlock", pid, ctypes.byref(UnlockArgs()))


def each(pids: Sequence[int], call: Callable[[int], None]) -> None:
    """`call(pid)` for every process at once, on threads: the driver's calls on different
    processes are independent, so a job of several (DDP's ranks) is held for the slowest one's
    time rather than for their sum. The first failure is raised once every call returned."""
    if len(pids) <= 1:
        for p in pids:
            call(p)
        return
    with ThreadPoolExecutor(len(pids), thread_name_prefix="pos-driver") as pool:
        done = [pool.submit(call, p) for p in pids]
    for f in done:
        f.result()


def get_state(pid: int) -> str:
    """running, locked, checkpointed or failed."""
    out = ctypes.c_int()
    _drv().call("cuCheckpointProcessGetState", pid, ctypes.byref(out))
    return STATES.get(out.value, f"state {out.value}")


def cuda_state(pid: int) -> Optional[str]:
    """The target's state, or None when it has not initialised CUDA (nothing to checkpoint)."""
    try:
        return get_state(pid)
    except DriverError as e:
        if e.code == CUDA_ERROR_NOT_INITIALIZED:
            return None
        raise


def driver_version() -> Optional[int]:
    """cuDriverGetVersion (13000 = CUDA 13.0), None when no driver can be loaded."""
    try:
        return driver().version()
    except Exception:  # noqa: BLE001  (no driver on this host: the manifest says n/a)
        return None


def gpu_pids(pids: list[int]) -> list[int]:
    """The processes of the tree that hold CUDA state (map libcuda and initialised CUDA)."""
    candidates = [p for p in pids if procs.maps_libcuda(p)]
    if not candidates:
        return []
    return [p for p in candidates if cuda_state(p) is not None]
