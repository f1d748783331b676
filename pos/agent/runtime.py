"""The one place that talks to the application's own CUDA runtime (ctypes): a runtime launch
names its kernel by the host stub that nvcc generated, and only the runtime instance that
registered the stub can say which CUfunction it launches (cudaGetFuncBySymbol, CUDA >= 11).

The agent does not load a runtime of its own: it asks each libcudart already mapped into the
process (PyTorch's, from the nvidia-cuda-runtime wheel; an extension may bring another), in
the order they were mapped, and takes the first answer. A stub no runtime knows (a runtime
linked statically into a library hides its symbols) gets no layout, so its launches wait for
every buffer during a checkpoint: slower, never wrong.
"""

import ctypes
import os
from typing import Optional

from pos.tracer.target import mapped_files

CUDA_SUCCESS = 0


def mapped_runtimes() -> list[str]:
    """The paths of the libcudart.so* files mapped into this process, in mapping order."""
    return [p for p in mapped_files(os.getpid())
            if os.path.basename(p).startswith("libcudart.so")]


class Runtimes:
    """The process's CUDA runtimes, opened lazily (a job starts its runtime after the agent);
    the process's mappings are read again only when no runtime known so far has the stub."""

    def __init__(self) -> None:
        self._libs: dict[str, Optional[ctypes.CDLL]] = {}

    def _open_new(self) -> list[ctypes.CDLL]:
        """The runtimes mapped since the last look."""
        new = []
        for path in mapped_runtimes():
            if path in self._libs:
                continue
            self._libs[path] = None
            try:   # RTLD_NOLOAD: only a runtime the process has loaded already
                lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
                fn = lib.cudaGetFuncBySymbol
            except (OSError, AttributeError):
                continue
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
            self._libs[path] = lib
            new.append(lib)
        return new

    @staticmethod
    def _ask(libs: list[ctypes.CDLL], stub: int) -> Optional[int]:
        out = ctypes.c_void_p()
        for lib in libs:
            if lib.cudaGetFuncBySymbol(ctypes.byref(out), ctypes.c_void_p(stub)) == CUDA_SUCCESS \
                    and out.value:
                return out.value
        return None

    def function_of(self, stub: int) -> Optional[int]:
        """The CUfunction (cudaFunction_t) that launches of host stub `stub` run, or None."""
        known = [lib for lib in self._libs.values() if lib is not None]
        return self._ask(known, stub) or self._ask(self._open_new(), stub)
