"""The one place that talks to the CUDA driver (libcuda.so.1): every driver function pos calls,
declared once with its argument types, the structs it takes and the constants it needs, all as
cuda.h of CUDA 13 has them (tests/fakegpu/test_driver.py checks them against cuda.h).

Through ctypes rather than cuda-bindings: the same code then runs against the real driver on a
GPU host and against the fake libcuda.so.1 of the tests (cuda-bindings resolves every symbol
through cuGetProcAddress, which the fake does not implement), and in-process callers get the
raw entry points they need (the fill's C loop calls three of them itself).

`drv.cuMemAlloc_v2(byref(p), n)` checks the CUresult of every call and turns a failure into a
`DriverError` carrying the driver's own error name; `hint(fix)` adds what the user can do about
it. `drv.raw` holds the same functions returning their CUresult, for cleanup that must not raise
over the failure it cleans up after. Each function is bound once when the library is loaded, so
a call costs one ctypes call and its check. Symbols that an older driver lacks (the checkpoint
API before 570) are checked with `Driver.has` before use (nvitop's habit), not discovered by a
crash; using one anyway says which and how to get it.
"""

import ctypes
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from ctypes import (POINTER, Structure, byref, c_char, c_char_p, c_int, c_size_t, c_ubyte, c_uint,
                    c_uint64, c_ulonglong, c_ushort, c_void_p)
from typing import Any, Callable, Optional

from pos.errors import PosError

LIBRARY_ENV = "POS_LIBCUDA"      # a path to load instead of the system's libcuda.so.1
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"

# ---- cuda.h's types --------------------------------------------------------------------------
CUresult = c_int                 # an enum: every function returns one
CUdevice = c_int
CUdeviceptr = c_uint64
CUmemGenericAllocationHandle = c_uint64
CUcontext = CUstream = CUevent = CUmodule = CUfunction = c_void_p
CUprocessState = c_int           # an enum (CU_PROCESS_STATE_*)
CUmemAllocationHandleType = c_int  # an enum (CU_MEM_HANDLE_TYPE_*)

# ---- cuda.h's constants ----------------------------------------------------------------------
CUDA_SUCCESS = 0                 # CUresult
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_INVALID_IMAGE = 200
CUDA_ERROR_ILLEGAL_STATE = 401
CUDA_ERROR_UNKNOWN = 999
CU_PROCESS_STATE_RUNNING = 0     # CUprocessState
CU_PROCESS_STATE_LOCKED = 1
CU_PROCESS_STATE_CHECKPOINTED = 2
CU_PROCESS_STATE_FAILED = 3
CU_MEM_ALLOCATION_TYPE_PINNED = 1             # CUmemAllocationType
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1  # CUmemAllocationHandleType
CU_MEM_LOCATION_TYPE_DEVICE = 1               # CUmemLocationType
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3        # CUmemAccess_flags
CU_STREAM_NON_BLOCKING = 1                    # cuStreamCreate's flags
CU_EVENT_DISABLE_TIMING = 2                   # cuEventCreate's flags
CU_MEMHOSTREGISTER_PORTABLE = 1               # cuMemHostRegister's flags
CU_MEMHOSTREGISTER_DEVICEMAP = 2
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1        # cuIpcOpenMemHandle's flags


# ---- cuda.h's structs (field names as there) ---------------------------------------------------
class CUuuid(Structure):
    _fields_ = [("bytes", c_ubyte * 16)]      # char in cuda.h: unsigned here, for bytes()


class CUmemLocation(Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class CUmemAllocationPropFlags(Structure):
    """CUmemAllocationProp.allocFlags (an unnamed struct in cuda.h)."""

    _fields_ = [("compressionType", c_ubyte), ("gpuDirectRDMACapable", c_ubyte),
                ("usage", c_ushort), ("reserved", c_ubyte * 4)]


class CUmemAllocationProp(Structure):
    _fields_ = [("type", c_int), ("requestedHandleTypes", c_int), ("location", CUmemLocation),
                ("win32HandleMetaData", c_void_p), ("allocFlags", CUmemAllocationPropFlags)]


class CUmemAccessDesc(Structure):
    _fields_ = [("location", CUmemLocation), ("flags", c_int)]


class CUipcMemHandle(Structure):
    _fields_ = [("reserved", c_char * 64)]


class CUcheckpointLockArgs(Structure):
    _fields_ = [("timeoutMs", c_uint), ("reserved0", c_uint), ("reserved1", c_uint64 * 7)]


class CUcheckpointCheckpointArgs(Structure):
    _fields_ = [("reserved", c_uint64 * 8)]


class CUcheckpointGpuPair(Structure):
    _fields_ = [("oldUuid", CUuuid), ("newUuid", CUuuid)]


class CUcheckpointRestoreArgs(Structure):
    _fields_ = [("gpuPairs", POINTER(CUcheckpointGpuPair)), ("gpuPairsCount", c_uint),
                ("reserved", c_char * 44), ("reserved1", c_uint64)]


class CUcheckpointUnlockArgs(Structure):
    _fields_ = [("reserved", c_uint64 * 8)]


# ---- the functions ---------------------------------------------------------------------------
class DriverError(PosError):
    """A CUDA driver call that returned something other than CUDA_SUCCESS."""

    def __init__(self, function: str, code: int, name: str, fix: str = "") -> None:
        self.function, self.code, self.name = function, code, name
        super().__init__(f"{function} failed with {name} ({code})", fix)


@contextmanager
def hint(fix: str) -> Iterator[None]:
    """A driver call failing inside says `fix` as what to do about it."""
    try:
        yield
    except DriverError as e:
        raise DriverError(e.function, e.code, e.name, fix) from None


class Fn:
    """One driver function: its arguments' ctypes types (the result is a CUresult). Bound per
    library into the instance under the same name; this descriptor answers only where the
    library lacks the symbol."""

    def __init__(self, *argtypes: Any) -> None:
        self.argtypes, self.name = list(argtypes), ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, functions: Optional["Functions"], owner: type) -> Any:
        if functions is None:
            return self
        raise PosError(f"the CUDA driver {functions.path} has no {self.name}",
                       "update the NVIDIA driver (pos needs >= 570; >= 580 to migrate GPUs)")


P = POINTER      # short, for the table below


class Functions:
    """Every driver function pos calls, as cuda.h declares it, bound to one library; `errcheck`
    (ctypes' hook, given the result, the function and its arguments) checks each call."""

    # initialisation, errors
    cuInit = Fn(c_uint)
    cuDriverGetVersion = Fn(P(c_int))
    cuGetErrorName = Fn(CUresult, P(c_char_p))
    # devices, contexts
    cuDeviceGetCount = Fn(P(c_int))
    cuDeviceGet = Fn(P(CUdevice), c_int)
    cuDeviceGetUuid_v2 = Fn(P(CUuuid), CUdevice)
    cuDevicePrimaryCtxRetain = Fn(P(CUcontext), CUdevice)
    cuDevicePrimaryCtxRelease_v2 = Fn(CUdevice)
    cuCtxGetCurrent = Fn(P(CUcontext))
    cuCtxSetCurrent = Fn(CUcontext)
    cuCtxSynchronize = Fn()
    # streams, events
    cuStreamCreate = Fn(P(CUstream), c_uint)
    cuStreamSynchronize = Fn(CUstream)
    cuStreamDestroy_v2 = Fn(CUstream)
    cuEventCreate = Fn(P(CUevent), c_uint)
    cuEventRecord = Fn(CUevent, CUstream)
    cuEventSynchronize = Fn(CUevent)
    cuEventDestroy_v2 = Fn(CUevent)
    # memory, copies
    cuMemGetInfo_v2 = Fn(P(c_size_t), P(c_size_t))
    cuMemAlloc_v2 = Fn(P(CUdeviceptr), c_size_t)
    cuMemFree_v2 = Fn(CUdeviceptr)
    cuMemAllocHost_v2 = Fn(P(c_void_p), c_size_t)
    cuMemHostAlloc = Fn(P(c_void_p), c_size_t, c_uint)
    cuMemFreeHost = Fn(c_void_p)
    cuMemHostRegister_v2 = Fn(c_void_p, c_size_t, c_uint)
    cuMemHostUnregister = Fn(c_void_p)
    cuMemsetD8_v2 = Fn(CUdeviceptr, c_ubyte, c_size_t)
    cuMemsetD8Async = Fn(CUdeviceptr, c_ubyte, c_size_t, CUstream)
    cuMemsetD32_v2 = Fn(CUdeviceptr, c_uint, c_size_t)
    cuMemcpyHtoD_v2 = Fn(CUdeviceptr, c_void_p, c_size_t)
    cuMemcpyDtoH_v2 = Fn(c_void_p, CUdeviceptr, c_size_t)
    cuMemcpyHtoDAsync_v2 = Fn(CUdeviceptr, c_void_p, c_size_t, CUstream)
    cuMemcpyDtoHAsync_v2 = Fn(c_void_p, CUdeviceptr, c_size_t, CUstream)
    cuMemcpyDtoDAsync_v2 = Fn(CUdeviceptr, CUdeviceptr, c_size_t, CUstream)
    # virtual memory management, shareable handles
    cuMemAddressReserve = Fn(P(CUdeviceptr), c_size_t, c_size_t, CUdeviceptr, c_ulonglong)
    cuMemAddressFree = Fn(CUdeviceptr, c_size_t)
    cuMemCreate = Fn(P(CUmemGenericAllocationHandle), c_size_t, P(CUmemAllocationProp),
                     c_ulonglong)
    cuMemRelease = Fn(CUmemGenericAllocationHandle)
    cuMemMap = Fn(CUdeviceptr, c_size_t, c_size_t, CUmemGenericAllocationHandle, c_ulonglong)
    cuMemUnmap = Fn(CUdeviceptr, c_size_t)
    cuMemSetAccess = Fn(CUdeviceptr, c_size_t, P(CUmemAccessDesc), c_size_t)
    # the shareable handle: an int written at the pointer (export), the fd as a pointer (import)
    cuMemGetAllocationPropertiesFromHandle = Fn(P(CUmemAllocationProp),
                                                CUmemGenericAllocationHandle)
    cuMemExportToShareableHandle = Fn(c_void_p, CUmemGenericAllocationHandle,
                                      CUmemAllocationHandleType, c_ulonglong)
    cuMemImportFromShareableHandle = Fn(P(CUmemGenericAllocationHandle), c_void_p,
                                        CUmemAllocationHandleType)
    cuIpcGetMemHandle = Fn(P(CUipcMemHandle), CUdeviceptr)
    cuIpcOpenMemHandle_v2 = Fn(P(CUdeviceptr), CUipcMemHandle, c_uint)
    # modules, launches
    cuModuleLoadData = Fn(P(CUmodule), c_void_p)
    cuModuleGetFunction = Fn(P(CUfunction), CUmodule, c_char_p)
    cuModuleUnload = Fn(CUmodule)
    cuLaunchKernel = Fn(CUfunction, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint,
                        CUstream, P(c_void_p), P(c_void_p))
    # the process checkpoint API (driver >= 570)
    cuCheckpointProcessLock = Fn(c_int, P(CUcheckpointLockArgs))
    cuCheckpointProcessCheckpoint = Fn(c_int, P(CUcheckpointCheckpointArgs))
    cuCheckpointProcessRestore = Fn(c_int, P(CUcheckpointRestoreArgs))
    cuCheckpointProcessUnlock = Fn(c_int, P(CUcheckpointUnlockArgs))
    cuCheckpointProcessGetState = Fn(c_int, P(CUprocessState))
    cuCheckpointProcessGetRestoreThreadId = Fn(c_int, P(c_int))

    def __init__(self, lib: ctypes.CDLL, path: str,
                 errcheck: Optional[Callable[..., Any]] = None) -> None:
        self.path = path
        self.present: set[str] = set()
        for fn in declared():
            try:
                f = lib[fn.name]          # a function object of its own, not the library's
            except AttributeError:
                continue
            f.argtypes, f.restype = fn.argtypes, CUresult
            if errcheck is not None:
                f.errcheck = errcheck
            setattr(self, fn.name, f)
            self.present.add(fn.name)

    def has(self, name: str) -> bool:
        """Whether this driver exports `name` (older drivers lack the checkpoint API)."""
        if not isinstance(getattr(Functions, name, None), Fn):
            raise AttributeError(f"pos.driver declares no {name}")
        return name in self.present


def declared() -> list[Fn]:
    """Every function of the table."""
    return [v for v in vars(Functions).values() if isinstance(v, Fn)]


class Driver(Functions):
    """libcuda.so.1 loaded once, its functions checked (`raw`: the same, unchecked)."""

    def __init__(self, path: Optional[str] = None) -> None:
        path = path or os.environ.get(LIBRARY_ENV) or "libcuda.so.1"
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise PosError(f"the CUDA driver library {path} could not be loaded ({e})",
                           "install the NVIDIA driver (>= 570), or run pos on the GPU host") from None
        super().__init__(lib, path, self._check)
        self.raw = Functions(lib, path)
        self._initialised = False
        self._lock = threading.Lock()

    def _check(self, code: int, fn: Any, _args: tuple) -> int:
        """ctypes' errcheck of every checked function: a failure raises, with the driver's name."""
        if code != CUDA_SUCCESS:
            raise DriverError(fn.__name__, code, self.error_name(code))
        return code

    def error_name(self, code: int) -> str:
        text = c_char_p()
        if self.has("cuGetErrorName") and \
                self.raw.cuGetErrorName(code, byref(text)) == CUDA_SUCCESS and text.value:
            return text.value.decode()
        return f"CUresult {code}"

    def init(self) -> None:
        """cuInit once per process."""
        self._start(None)

    def init_seeing(self, uuids: list[str]) -> bool:
        """cuInit seeing only the GPUs `uuids` (NVML's form, each on this host), where CUDA has
        not started in this process and CUDA_VISIBLE_DEVICES is not set; whether it did. cuInit
        starts every GPU it sees (0.91-1.04 s for four H200s, 0.19-0.33 s for one), and what it
        saw is the process's CUDA for its life: only a process with one job's work to do (`pos
        restore`, not the restore service) asks. The variable is set for the call alone, the
        caller's only thread then, so that the programs pos starts (CRIU) never see it."""
        if VISIBLE_ENV in os.environ or not uuids:
            return False
        return self._start(",".join(uuids))

    def _start(self, visible: Optional[str]) -> bool:
        """cuInit, unless this process made it already (whether it did now), with `visible`
        as CUDA_VISIBLE_DEVICES for the call alone where given."""
        with self._lock:
            if self._initialised:
                return False
            if visible is not None:
                os.environ[VISIBLE_ENV] = visible
            try:
                self.cuInit(0)
            finally:
                if visible is not None:
                    del os.environ[VISIBLE_ENV]
            self._initialised = True
            return True

    def version(self) -> int:
        """The driver's CUDA version as the driver encodes it (13000 = 13.0)."""
        v = c_int()
        self.cuDriverGetVersion(byref(v))
        return v.value

    def primary_context(self, device: int) -> c_void_p:
        """CUDA device `device`'s primary context, made current on this thread (cuInit first)."""
        self.init()
        dev, ctx = CUdevice(), CUcontext()
        self.cuDeviceGet(byref(dev), device)
        self.cuDevicePrimaryCtxRetain(byref(ctx), dev)
        self.cuCtxSetCurrent(ctx)
        return ctx


_driver: Optional[Driver] = None
_driver_lock = threading.Lock()


def driver() -> Driver:
    """The process's one Driver, loaded on first use."""
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = Driver()
        return _driver
