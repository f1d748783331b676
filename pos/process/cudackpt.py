"""The CUDA driver's process checkpoint API (driver >= 570; GPU remapping on restore >= 580),
called from outside the target through `pos.driver`, which checks every CUresult.

A target goes RUNNING --lock--> LOCKED --checkpoint--> CHECKPOINTED (its device memory copied
into host memory, no /dev/nvidia* left open: CRIU can dump it) --restore--> LOCKED --unlock-->
RUNNING. The argument structs are pos.driver's (cuda.h of CUDA 13).
"""

import ctypes
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

from pos.driver import (CU_PROCESS_STATE_CHECKPOINTED, CU_PROCESS_STATE_FAILED,
                        CU_PROCESS_STATE_LOCKED, CU_PROCESS_STATE_RUNNING,
                        CUDA_ERROR_NOT_INITIALIZED, CUcheckpointCheckpointArgs,
                        CUcheckpointGpuPair, CUcheckpointLockArgs, CUcheckpointRestoreArgs,
                        CUcheckpointUnlockArgs, CUprocessState, Driver, DriverError, driver, hint)
from pos.process import procs

STATES = {CU_PROCESS_STATE_RUNNING: "running", CU_PROCESS_STATE_LOCKED: "locked",
          CU_PROCESS_STATE_CHECKPOINTED: "checkpointed", CU_PROCESS_STATE_FAILED: "failed"}


def _drv() -> Driver:
    d = driver()
    d.init()
    return d


def lock(pid: int, timeout_ms: int) -> None:
    """Block the target's CUDA calls once its in-flight work is done (or fail after timeout)."""
    args, d = CUcheckpointLockArgs(timeoutMs=timeout_ms), _drv()
    with hint(f"the process's CUDA work did not drain within {timeout_ms} ms; retry, or give a "
              "longer --lock-timeout"):
        d.cuCheckpointProcessLock(pid, ctypes.byref(args))


def checkpoint(pid: int) -> None:
    """Copy the locked target's device memory to host memory and release its GPU."""
    _drv().cuCheckpointProcessCheckpoint(pid, ctypes.byref(CUcheckpointCheckpointArgs()))


def uuid_bytes(uuid: str) -> bytes:
    """NVML's 'GPU-xxxxxxxx-xxxx-...' as the 16 bytes of a CUuuid."""
    hexdigits = uuid.removeprefix("GPU-").replace("-", "")
    raw = bytes.fromhex(hexdigits)
    if len(raw) != 16:
        raise ValueError(f"not a GPU UUID: {uuid}")
    return raw


def restore(pid: int, gpu_pairs: Sequence[tuple[str, str]] = ()) -> None:
    """Bring the device memory back (onto other GPUs when `gpu_pairs` maps old -> new UUIDs)."""
    args = CUcheckpointRestoreArgs()
    pairs = (CUcheckpointGpuPair * len(gpu_pairs))()
    for i, (old, new) in enumerate(gpu_pairs):
        pairs[i].oldUuid.bytes[:] = list(uuid_bytes(old))
        pairs[i].newUuid.bytes[:] = list(uuid_bytes(new))
    if gpu_pairs:
        args.gpuPairs = ctypes.cast(pairs, ctypes.POINTER(CUcheckpointGpuPair))
        args.gpuPairsCount = len(gpu_pairs)
    d = _drv()
    with hint("the GPU could not take the state back; the process was not resumed"):
        d.cuCheckpointProcessRestore(pid, ctypes.byref(args))


def unlock(pid: int) -> None:
    """Let the target's CUDA calls run again."""
    _drv().cuCheckpointProcessUnlock(pid, ctypes.byref(CUcheckpointUnlockArgs()))


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
    out = CUprocessState()
    _drv().cuCheckpointProcessGetState(pid, ctypes.byref(out))
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
