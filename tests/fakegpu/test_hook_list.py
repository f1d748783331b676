"""The agent's hook list held to cuda.h, as test_driver.py holds pos/driver.py: every entry
point of the families that read or write device memory (pos/agent/hook/gated.h) that cuda.h
declares, in every version the driver exports, the names cuda.h maps to newer ones and the
per-thread variants, is wrapped (wrapped.h, agent.h's OWN_WRAPPERS), let through (PASSES, each
with why) or refused (LEGACY), so that an entry point a newer cuda.h adds fails here until
someone decides; and every wrapper takes what cuda.h's function takes.

cuda.h is the one beside nvcc (on a machine without CUDA, the toolkit's pip wheels), read as
the driver is built (__CUDA_API_VERSION_INTERNAL: every exported version), as a program sees it
and with per-thread default streams."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT, need
from tests.fakegpu.test_driver import CHECK, _same

HOOK = ROOT / "pos" / "agent" / "hook"
READINGS: tuple[list[str], ...] = (["-D__CUDA_API_VERSION_INTERNAL"], [],
                                   ["-DCUDA_API_PER_THREAD_DEFAULT_STREAM"])


def listed(header: str, macro: str) -> list[str]:
    """The first argument of each X(...) in `#define MACRO(X)` of a header beside the agent."""
    lines = (HOOK / header).read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"#define {macro}(X)"))
    body = [lines[at]]
    while body[-1].rstrip().endswith("\\"):
        at += 1
        body.append(lines[at])
    text = re.sub(r"/\*.*?\*/", "", "\n".join(body)[len(f"#define {macro}(X)"):], flags=re.S)
    return re.findall(r"\bX\((\w+)", text)


FAMILIES = tuple(listed("gated.h", "FAMILIES"))
WRAPPED = set(listed("wrapped.h", "HOOKS")) | set(listed("agent.h", "OWN_WRAPPERS"))
PASSES = set(listed("gated.h", "PASSES"))
LEGACY = set(listed("gated.h", "LEGACY"))


def _nvcc() -> str:
    """nvcc, beside which cuda.h is."""
    nvcc = shutil.which("nvcc")
    need(nvcc is not None, "nvcc (and the cuda.h beside it) is needed to check the hook list")
    assert nvcc is not None
    return nvcc


def _preprocess(tmp: Path, *flags: str) -> str:
    """cuda.h through nvcc's preprocessor."""
    src = tmp / "h.c"
    src.write_text("#include <cuda.h>\n")
    return subprocess.run([_nvcc(), "-E", *flags, "-x", "c", str(src)], check=True,
                          capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def cuda_h(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Every driver function cuda.h declares, read the three ways: {name: its parameters}."""
    tmp = tmp_path_factory.mktemp("cuda_h")
    declared: dict[str, str] = {}
    for flags in READINGS:
        for m in re.finditer(r"\bCUresult\s+(?:__attribute__\(\(\w+\)\)\s+)?(cu\w+)\s*"
                             r"\(([^)]*)\)", _preprocess(tmp, *flags)):
            declared.setdefault(m.group(1), " ".join(m.group(2).split()))
    return declared


def in_family(name: str) -> bool:
    """Whether `name` is of a family that reads or writes device memory (gated.h)."""
    return name.startswith(FAMILIES)


def test_every_memory_entry_point_of_cuda_h_is_decided(cuda_h: dict[str, str]) -> None:
    family = {n for n in cuda_h if in_family(n)}
    assert {"cuMemcpyBatchAsync_v2", "cuMemcpy3DBatchAsync_v2_ptsz", "cuMemcpyAtoD_v2_ptds",
            "cuMemsetD2D8Async_ptsz", "cuStreamWaitValue64_v2_ptsz"} <= family
    undecided = sorted(family - WRAPPED - PASSES - LEGACY)
    assert not undecided, ("entry points of cuda.h that touch device memory, neither wrapped "
                           "(wrapped.h) nor listed in gated.h (PASSES, LEGACY)", undecided)


def test_each_decision_is_one_and_names_an_entry_point_of_cuda_h(
        cuda_h: dict[str, str]) -> None:
    assert not WRAPPED & PASSES and not WRAPPED & LEGACY and not PASSES & LEGACY
    for name in PASSES | LEGACY:
        assert name in cuda_h and in_family(name), name
    assert sorted(WRAPPED - set(cuda_h)) == []


def test_each_legacy_entry_point_has_a_wrapped_successor(
        cuda_h: dict[str, str], tmp_path: Path) -> None:
    """A refused entry point is one that cuda.h maps to a newer version (itself wrapped), and
    takes 32-bit addresses or sizes."""
    maps = dict(re.findall(r"^#define (cu\w+) +(?:__CUDA_API_PT[DS][SZ]\()?(cu\w+)\)?$",
                           _preprocess(tmp_path, "-Xcompiler", "-dM"), re.M))
    for name in LEGACY:
        assert maps.get(name) == f"{name}_v2" and f"{name}_v2" in WRAPPED, name
        assert re.search(r"CUdeviceptr_v1|unsigned int|_v1 \*", cuda_h[name]), cuda_h[name]


def _kinds(nvcc: str, out: Path, head: str, names: list[str]) -> dict[str, list[str]]:
    """What C++ says of each function's parameters (test_driver's CHECK), under `head`."""
    src = out / "check.cpp"
    src.write_text(CHECK.replace("#include <cuda.h>", head)
                   .replace("%BODY%", "\n".join(f"    FN({n});" for n in names)))
    subprocess.run([nvcc, "-std=c++17", "-cudart", "none", "-D__CUDA_API_VERSION_INTERNAL",
                    f"-I{HOOK}", "-o", str(out / "check"), str(src)], check=True,
                   capture_output=True)
    said = subprocess.run([str(out / "check")], check=True, capture_output=True, text=True)
    return {w[1]: w[2:] for w in (line.split() for line in said.stdout.splitlines())}


def test_every_wrapper_takes_what_cuda_h_declares(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Parameter by parameter, in kind and size; the agent may take a pointer to any struct
    as void *."""
    nvcc = _nvcc()
    hooks = listed("wrapped.h", "HOOKS")
    theirs = _kinds(nvcc, tmp_path_factory.mktemp("theirs"), "#include <cuda.h>", hooks)
    ours = _kinds(nvcc, tmp_path_factory.mktemp("ours"), '#include "abi.h"\n#include "wrapped.h"',
                  hooks)
    for name in hooks:
        c, o = theirs[name], ours[name]
        assert len(c) == len(o) and all(
            (b == "p>v" and a.startswith("p>")) or _same(a, b) for a, b in zip(c, o)), (name, c, o)
