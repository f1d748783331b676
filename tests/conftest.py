"""Shared fixtures: the fake GPU driver built once per session, and prerequisite gates.

Outside the suite's own script a missing prerequisite skips the tests that need it; under
scripts/test.sh (POS_REQUIRE_PREREQS=1, as in CI) it fails them instead, so that a machine that
cannot run real eBPF never reports green.
"""

import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
REQUIRED = os.environ.get("POS_REQUIRE_PREREQS") == "1"


def need(condition: bool, why: str) -> None:
    """Skip (or, under scripts/test.sh, fail) when a prerequisite is missing."""
    if condition:
        return
    if REQUIRED:
        pytest.fail(f"prerequisite missing: {why}", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="session")
def bpf_ready() -> None:
    from pos import host

    need(os.geteuid() == 0, "real eBPF needs root")
    for check in host.TRACING_CHECKS:
        problem = check()
        need(problem is None, problem.message if problem else "")


@pytest.fixture(scope="session")
def fakegpu(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The fake libcuda/libamdhip64, their workloads and the kernels' cubin and fatbin."""
    need(shutil.which("nvcc") is not None, "nvcc is needed to compile the test kernels")
    need(shutil.which("gcc") is not None, "gcc is needed to build the fake driver")
    from tests.fakegpu.build import build

    return build(tmp_path_factory.mktemp("fakegpu"))
