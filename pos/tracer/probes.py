"""Which driver functions pos probes, in one table.

The position of a symbol in `API_NAMES` is its `api` number in every event (pos/bpf/events.h);
the C text of each family defines `on_<symbol>` (entry) and, for symbols in `RETURNS`,
`ret_<symbol>` (return). A symbol missing from the traced library is skipped, not fatal: older
drivers lack the newer entry points.
"""

import re
from dataclasses import dataclass
from importlib import resources

DEFAULT_RINGBUF_PAGES = 16384    # 64 MiB: --ringbuf-mb's default


@dataclass(frozen=True)
class Family:
    """A probed library: which file it is and which of its symbols pos probes."""

    name: str
    source: str               # the C file under pos/bpf/
    library_prefixes: tuple[str, ...]  # basenames, in /proc/PID/maps, that belong to it
    symbols: tuple[str, ...]


def _variants(*names: str, suffix: str) -> tuple[str, ...]:
    return tuple(n for name in names for n in (name, name + suffix))


CUDA = Family(
    name="cuda",
    source="cuda.c",
    library_prefixes=("libcuda.so",),
    symbols=(
        "cuMemAlloc_v2", "cuMemAllocManaged", "cuMemAllocPitch_v2",
        *_variants("cuMemAllocAsync", "cuMemAllocFromPoolAsync", "cuMemFreeAsync", suffix="_ptsz"),
        "cuMemFree_v2",
        "cuMemAddressReserve", "cuMemAddressFree", "cuMemCreate", "cuMemRelease", "cuMemMap",
        "cuMemUnmap",
        *_variants("cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel",
                   "cuGraphLaunch", suffix="_ptsz"),
        *_variants("cuMemcpy", "cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2", "cuMemcpyDtoD_v2",
                   "cuMemcpyPeer", "cuMemcpy2D_v2", suffix="_ptds"),
        *_variants("cuMemcpyAsync", "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2",
                   "cuMemcpyDtoDAsync_v2", "cuMemcpyPeerAsync", "cuMemcpy2DAsync_v2",
                   suffix="_ptsz"),
        *_variants("cuMemsetD8_v2", "cuMemsetD16_v2", "cuMemsetD32_v2", suffix="_ptds"),
        *_variants("cuMemsetD8Async", "cuMemsetD16Async", "cuMemsetD32Async", suffix="_ptsz"),
        "cuCtxSynchronize", "cuEventSynchronize",
        *_variants("cuStreamSynchronize", "cuEventRecord", "cuStreamWaitEvent", suffix="_ptsz"),
        "cuModuleLoadData", "cuModuleLoadDataEx", "cuModuleLoadFatBinary", "cuLibraryLoadData",
        "cuModuleGetFunction", "cuLibraryGetKernel", "cuKernelGetFunction",
    ),
)

HIP = Family(
    name="hip",
    source="hip.c",
    library_prefixes=("libamdhip64.so",),
    symbols=(
        "hipMalloc", "hipMallocManaged", "hipMallocAsync", "hipExtMallocWithFlags", "hipFree",
        "hipFreeAsync", "hipModuleLaunchKernel", "hipExtModuleLaunchKernel", "hipLaunchKernel",
        "hipMemcpy", "hipMemcpyAsync", "hipMemcpyHtoD", "hipMemcpyDtoH", "hipMemcpyDtoD",
        "hipMemset", "hipMemsetAsync", "hipDeviceSynchronize", "hipStreamSynchronize",
        "hipModuleLoadData", "hipModuleGetFunction",
    ),
)

FAMILIES = (CUDA, HIP)

# Calls whose result (an out-parameter or the return code) matters get a return probe.
RETURNS = frozenset({
    "cuMemAlloc_v2", "cuMemAllocManaged", "cuMemAllocPitch_v2", "cuMemAllocAsync",
    "cuMemAllocAsync_ptsz", "cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync_ptsz",
    "cuMemAddressReserve", "cuMemCreate", "cuMemMap",
    "cuModuleLoadData", "cuModuleLoadDataEx", "cuModuleLoadFatBinary", "cuLibraryLoadData",
    "cuModuleGetFunction", "cuLibraryGetKernel", "cuKernelGetFunction",
    "hipMalloc", "hipMallocManaged", "hipMallocAsync", "hipExtMallocWithFlags",
    "hipModuleLoadData", "hipModuleGetFunction",
})

API_NAMES: tuple[str, ...] = tuple(s for f in FAMILIES for s in f.symbols)
API_IDS: dict[str, int] = {name: i for i, name in enumerate(API_NAMES)}


# a C comment, or a word in capitals: the placeholders are filled in code, never in comments
_TOKEN = re.compile(r"/\*.*?\*/|//[^\n]*|\b[A-Z][A-Z_]+\b", re.S)


def bpf_text(family: Family, ringbuf_pages: int) -> str:
    """The family's C program with its placeholders filled, ready for bcc."""
    src = resources.files("pos.bpf").joinpath(family.source).read_text()
    values = {"API_DEFINES": "\n".join(f"#define API_{name} {i}" for name, i in API_IDS.items()),
              "RINGBUF_PAGES": str(ringbuf_pages)}
    common = resources.files("pos.bpf").joinpath("common.h").read_text()
    common = _TOKEN.sub(lambda m: values.get(m.group(0), m.group(0)), common)
    return src.replace('#include "common.h"', common)


def bpf_include_dir() -> str:
    """Where events.h lives, for bcc's -I."""
    return str(resources.files("pos.bpf"))
