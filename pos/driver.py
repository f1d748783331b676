"""The one place that talks to the CUDA driver (libcuda.so.1).

Through ctypes rather than cuda-bindings: the same code then runs against the real driver on a
GPU host and against the fake libcuda.so.1 of the tests (cuda-bindings resolves every symbol
through cuGetProcAddress, which the fake does not implement), and in-process callers get the
raw entry points they need. Every call goes through `Driver.call`, which checks the CUresult and
turns a failure into a `DriverError` carrying the driver's own error name. Symbols that an older
driver lacks are checked with `Driver.has` before use (nvitop's habit), not discovered by a crash.
"""

import ctypes
import os
import threading
from typing import Any, Optional

from pos.errors import PosError

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
LIBRARY_ENV = "POS_LIBCUDA"      # a path to load instead of the system's libcuda.so.1


class DriverError(PosError):
    """A CUDA driver call that returned something other than CUDA_SUCCESS."""

    def __init__(self, function: str, code: int, name: str, fix: str = "") -> None:
        self.function, self.code, self.name = function, code, name
        super().__init__(f"{function} failed with {name} ({code})", fix)


class Driver:
    """libcuda.so.1 loaded once; `call(name, *args)` checks the result of every call."""

    def __init__(self, path: Optional[str] = None) -> None:
        self.path = path or os.environ.get(LIBRARY_ENV) or "libcuda.so.1"
        try:
            self.lib = ctypes.CDLL(self.path)
        except OSError as e:
            raise PosError(f"the CUDA driver library {self.path} could not be loaded ({e})",
                           "install the NVIDIA driver (>= 570), or run pos on the GPU host") from None
        self._initialised = False
        self._lock = threading.Lock()

    def has(self, name: str) -> bool:
        """Whether this driver exports `name` (older drivers lack the checkpoint API)."""
        return hasattr(self.lib, name)

    def function(self, name: str) -> Any:
        """The raw entry point, for callers that must call it without `call`'s checks."""
        if not self.has(name):
            raise PosError(f"the CUDA driver {self.path} has no {name}",
                           "update the NVIDIA driver (pos needs >= 570; >= 580 to migrate GPUs)")
        return getattr(self.lib, name)

    def error_name(self, code: int) -> str:
        text = ctypes.c_char_p()
        if self.has("cuGetErrorName") and \
                self.lib.cuGetErrorName(code, ctypes.byref(text)) == CUDA_SUCCESS and text.value:
            return text.value.decode()
        return f"CUresult {code}"

    def call(self, name: str, *args: Any, fix: str = "") -> None:
        """Call `name`; raise DriverError (with the driver's error name) unless it succeeds."""
        code = self.function(name)(*args)
        if code != CUDA_SUCCESS:
            raise DriverError(name, code, self.error_name(code), fix)

    def init(self) -> None:
        """cuInit once per process."""
        with self._lock:
            if not self._initialised:
                self.call("cuInit", 0)
                self._initialised = True

    def version(self) -> int:
        """The driver's CUDA version as the driver encodes it (13000 = 13.0)."""
        v = ctypes.c_int()
        self.call("cuDriverGetVersion", ctypes.byref(v))
        return v.value


_driver: Optional[Driver] = None
_driver_lock = threading.Lock()


def driver() -> Driver:
    """The process's one Driver, loaded on first use."""
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = Driver()
        return _driver
