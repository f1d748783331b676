"""The one place that talks to NVML (nvidia-ml-py), for what the CUDA driver API does not say:
the driver's version string, GPU UUIDs and names, which GPUs a process uses, and how much
device memory each GPU has free (a context is not needed to ask).

Like nvitop: NVML is initialised lazily and once; every query goes through `_query`, which
answers None instead of raising when NVML is missing (no driver, a CI machine) or the query is
not supported, so that callers write "n/a" rather than handle exceptions.
"""

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

T = TypeVar("T")
_lock = threading.Lock()
_state: dict[str, Any] = {}


def _nvml() -> Any:
    """The initialised pynvml module, or None when NVML cannot be used here."""
    with _lock:
        if "module" not in _state:
            try:
                import pynvml

                pynvml.nvmlInit()
                _state["module"] = pynvml
            except Exception:  # noqa: BLE001  (ImportError, NVMLError_LibraryNotFound, ...)
                _state["module"] = None
        return _state["module"]


def _query(fn: Callable[[Any], T]) -> Optional[T]:
    nv = _nvml()
    if nv is None:
        return None
    try:
        return fn(nv)
    except nv.NVMLError:
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def available() -> bool:
    return _nvml() is not None


MODULE_VERSION = "/sys/module/nvidia/version"   # the loaded kernel module's, NVML's too


def driver_version() -> Optional[str]:
    """The NVIDIA driver version, e.g. '580.159.04': the kernel module's, read from sysfs (a
    restore checks it before CRIU starts, and NVML's first use took 0.08-0.14 s there), else
    NVML's."""
    try:
        version = Path(MODULE_VERSION).read_text().strip()
    except OSError:
        version = ""
    return version or _query(lambda nv: _text(nv.nvmlSystemGetDriverVersion()))


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    persistent: bool     # in persistence mode: the driver keeps it started while idle


def _listing(nv: Any) -> list[Gpu]:
    def persistent(h: Any) -> bool:     # a GPU that cannot say is not known to be
        try:
            return bool(nv.nvmlDeviceGetPersistenceMode(h) == nv.NVML_FEATURE_ENABLED)
        except nv.NVMLError:
            return False

    out = []
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        out.append(Gpu(i, _text(nv.nvmlDeviceGetUUID(h)), _text(nv.nvmlDeviceGetName(h)),
                       persistent(h)))
    return out


def gpus() -> list[Gpu]:
    """The host's GPUs in NVML order (empty without NVML)."""
    return _query(_listing) or []


def persistent() -> bool:
    """Whether every GPU of the host is in persistence mode (the driver keeps an idle GPU
    started); False without NVML."""
    here = _query(_listing)
    return here is not None and all(g.persistent for g in here)


def gpus_of(pids: list[int]) -> dict[str, int]:
    """UUID -> device memory used, for the GPUs on which any of `pids` has a compute context."""
    def query(nv: Any) -> dict[str, int]:
        out: dict[str, int] = {}
        wanted = set(pids)
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid in wanted:
                    uuid = _text(nv.nvmlDeviceGetUUID(h))
                    out[uuid] = out.get(uuid, 0) + int(p.usedGpuMemory or 0)
        return out
    return _query(query) or {}


def memory_free() -> dict[str, int]:
    """UUID -> device memory free now, for every GPU of the host (empty without NVML)."""
    def query(nv: Any) -> dict[str, int]:
        out = {}
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            out[_text(nv.nvmlDeviceGetUUID(h))] = int(nv.nvmlDeviceGetMemoryInfo(h).free)
        return out
    return _query(query) or {}
