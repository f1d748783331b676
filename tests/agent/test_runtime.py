"""pos/agent/runtime.py against a fake libcudart mapped into this process: host stubs resolve
through the runtime that has them, others get no function."""

import ctypes
import subprocess
from pathlib import Path

import pytest

from pos.agent.runtime import Runtimes, mapped_runtimes

# cudaGetFuncBySymbol as the runtime answers it: a function for the stubs it registered, else
# cudaErrorInvalidDeviceFunction (98)
FAKE_CUDART = r"""
#include <stdint.h>
int cudaGetFuncBySymbol(void **func, const void *stub) {
    uintptr_t s = (uintptr_t)stub;
    if (s < 0x10000 || s >= 0x20000) return 98;
    *func = (void *)(s + 0xF000000);
    return 0;
}
"""


@pytest.fixture(scope="module")
def fake_cudart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cudart")
    (d / "cudart.c").write_text(FAKE_CUDART)
    lib = d / "libcudart.so.12"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(d / "cudart.c")], check=True)
    return lib


def test_a_stub_resolves_through_the_mapped_runtime(fake_cudart: Path) -> None:
    runtimes = Runtimes()
    assert str(fake_cudart) not in mapped_runtimes()
    assert runtimes.function_of(0x10040) is None          # no runtime mapped yet: none loaded
    keep = ctypes.CDLL(str(fake_cudart))                  # the application loads its runtime
    assert str(fake_cudart) in mapped_runtimes()
    assert runtimes.function_of(0x10040) == 0xF010040
    assert runtimes.function_of(0x30000) is None          # a stub no runtime registered
    del keep


def test_callback_ids_of_both_domains(fake_cupti: Path) -> None:
    """Runtime ids are looked up by name without the version suffix CUPTI gives them."""
    from pos.agent.cupti import DOMAIN_DRIVER_API, DOMAIN_RUNTIME_API, Cupti

    cupti = Cupti(str(fake_cupti))
    assert cupti.callback_ids(DOMAIN_RUNTIME_API) == {
        "cudaMalloc": [1], "cudaLaunchKernel": [2], "cudaMemcpyAsync_ptsz": [3],
        "cudaMemcpyBatchAsync": [4, 5]}                  # two versions: both enabled
    assert cupti.callback_ids(DOMAIN_DRIVER_API)["cuLaunchKernel"] == [3]
