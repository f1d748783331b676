"""The one module that loads libcupti (ctypes): find it, subscribe a callback, enable driver-API
and runtime-API callbacks by name.

Both domains: a PyTorch job allocates, copies and launches through the CUDA runtime
(cudaMalloc, cudaLaunchKernel), Triton and the caching allocator's expandable segments
(cuMemMap) through the driver API. Whether CUPTI also reports the driver calls a runtime call
makes inside is not documented (Nsight Systems hides them; HPCToolkit's and parcagpu's CUPTI
code handles them as nested): the callback learns which at the first such call
(pos/agent/callbacks.py).

libcupti is looked for in this order: $POS_LIBCUPTI, the nvidia-cuda-cupti wheel (any
`nvidia/**/libcupti.so*` on sys.path), $CUDA_HOME (extras/CUPTI/lib64, lib64), then the
dynamic linker's cache. Callback ids are resolved from their names with cuptiGetCallbackName,
so that pos does not depend on one CUDA release's numbering of cupti_driver_cbid.h and
cupti_runtime_cbid.h; runtime names lose their version suffix (cudaLaunchKernel_v7000 ->
cudaLaunchKernel, cudaMemcpyAsync_ptsz_v7000 -> cudaMemcpyAsync_ptsz), and every version is
enabled.
"""

import ctypes
import glob
import os
import re
import subprocess
import sys
from typing import Iterable, Optional

from pos.errors import BadInput, PosError

LIBRARY_ENV = "POS_LIBCUPTI"
DOMAIN_DRIVER_API, DOMAIN_RUNTIME_API = 1, 2   # CUpti_CallbackDomain
MAX_CBID = 2048
CUPTI_SUCCESS = 0
CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED = 39   # cupti_result.h


def candidates() -> list[str]:
    """Paths where libcupti may be, most specific first."""
    found: list[str] = []
    if os.environ.get(LIBRARY_ENV):
        found.append(os.environ[LIBRARY_ENV])
    for entry in sys.path:
        found += sorted(glob.glob(os.path.join(entry, "nvidia", "**", "libcupti.so*"),
                                  recursive=True), reverse=True)
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    for sub in ("extras/CUPTI/lib64", "lib64", "targets/x86_64-linux/lib"):
        found += sorted(glob.glob(os.path.join(home, sub, "libcupti.so*")), reverse=True)
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=5).stdout
        found += [line.split("=>")[-1].strip() for line in out.splitlines() if "libcupti.so" in line]
    except (OSError, subprocess.SubprocessError):
        pass
    return found


class Cupti:
    """libcupti loaded once; `check` turns a CUptiResult into a PosError with CUPTI's text."""

    def __init__(self, path: Optional[str] = None) -> None:
        paths = [path] if path else candidates()
        self.lib = None
        for p in paths:
            try:
                self.lib = ctypes.CDLL(p)
                self.path = p
                break
            except OSError:
                continue
        if self.lib is None:
            raise BadInput("libcupti was not found (needed by the pos agent)",
                           "pip install nvidia-cuda-cupti, set CUDA_HOME, or set POS_LIBCUPTI "
                           "to the library's path")
        self.subscriber = ctypes.c_void_p()

    def check(self, name: str, code: int) -> None:
        if code != CUPTI_SUCCESS:
            text = ctypes.c_char_p()
            self.lib.cuptiGetResultString(code, ctypes.byref(text))
            raise PosError(f"{name} failed: {(text.value or b'?').decode()} ({code})",
                           "check that the CUDA driver and libcupti versions match")

    def callback_ids(self, domain: int = DOMAIN_DRIVER_API) -> dict[str, list[int]]:
        """API name -> its callback ids in `domain`, as this libcupti numbers them (runtime
        names without their version suffix: cudaMemcpyBatchAsync_v12080 and _v13000 are one
        name with two ids)."""
        names: dict[str, list[int]] = {}
        fn = self.lib.cuptiGetCallbackName
        text = ctypes.c_char_p()
        for cbid in range(1, MAX_CBID):
            if fn(domain, cbid, ctypes.byref(text)) == CUPTI_SUCCESS and text.value:
                name = text.value.decode()
                if domain == DOMAIN_RUNTIME_API:
                    name = re.sub(r"_v\d+$", "", name)
                names.setdefault(name, []).append(cbid)
        return names

    def subscribe(self, callback_address: int) -> None:
        code = self.lib.cuptiSubscribe(ctypes.byref(self.subscriber),
                                       ctypes.c_void_p(callback_address), None)
        if code == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED:
            raise BadInput("another CUPTI tool (a profiler such as Nsight Systems, "
                           "compute-sanitizer or torch.profiler's CUDA tracing) already holds the "
                           "process's one CUPTI subscription", "run the job under `pos run` "
                           "without it, or without `pos run` while profiling")
        self.check("cuptiSubscribe", code)

    def enable(self, domain: int, cbids: Iterable[int]) -> None:
        for cbid in cbids:
            self.check("cuptiEnableCallback", self.lib.cuptiEnableCallback(
                1, self.subscriber, domain, cbid))
