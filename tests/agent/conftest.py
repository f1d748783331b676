"""Fixtures of the agent tests: a fake libcupti (the agent's CUPTI calls succeed, no callback
is ever invoked; with POS_FAKECUPTI_BUSY another tool holds it already), and `pos run` jobs
started as a user would start them."""

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from pos.agent import socket_path
from tests.conftest import ROOT

# The calls the agent makes into libcupti; the names it resolves are a handful of real ones.
FAKE_CUPTI = r"""
#include <stddef.h>
#include <stdlib.h>
static const char *names[] = {"", "cuMemAlloc_v2", "cuMemFree_v2", "cuLaunchKernel",
                              "cuMemcpyHtoD_v2"};
static const char *runtime_names[] = {"", "cudaMalloc_v3020", "cudaLaunchKernel_v7000",
                                      "cudaMemcpyAsync_ptsz_v7000",
                                      "cudaMemcpyBatchAsync_v12080",
                                      "cudaMemcpyBatchAsync_v13000"};
int cuptiGetCallbackName(int domain, unsigned cbid, const char **name) {
    if (domain == 2 && cbid > 0 && cbid < sizeof(runtime_names) / sizeof(runtime_names[0])) {
        *name = runtime_names[cbid]; return 0;
    }
    if (domain != 1 || cbid == 0 || cbid >= sizeof(names) / sizeof(names[0])) return 1;
    *name = names[cbid]; return 0;
}
int cuptiSubscribe(void **sub, void *cb, void *ud) {
    (void)cb; (void)ud;
    if (getenv("POS_FAKECUPTI_BUSY")) return 39;  /* CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED */
    *sub = (void *)1; return 0;
}
int cuptiEnableCallback(unsigned e, void *s, int d, unsigned id) { (void)e; (void)s; (void)d; (void)id; return 0; }
int cuptiUnsubscribe(void *s) { (void)s; return 0; }
int cuptiGetResultString(int r, const char **s) { (void)r; *s = "fake"; return 0; }
"""


@pytest.fixture(scope="session")
def fake_cupti(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cupti")
    (d / "cupti.c").write_text(FAKE_CUPTI)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(d / "libcupti.so"), str(d / "cupti.c")],
                   check=True)
    return d / "libcupti.so"


class PosRun:
    """`pos run --name NAME -- python PROG` with the fake libcupti and libcuda; PROG reads one
    line of standard input and exits."""

    def __init__(self, name: str, prog: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([str(ROOT / ".venv/bin/pos"), "run", "--name", name, "--",
                                      sys.executable, str(prog)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.pid = self.proc.pid

    def wait_for_agent(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not os.path.exists(socket_path(self.pid)):
            assert self.proc.poll() is None, self.proc.communicate()
            assert time.monotonic() < deadline, "the agent's socket did not appear"
            time.sleep(0.1)

    def end(self) -> tuple[int, str]:
        """Let PROG exit; its exit status and standard error."""
        if self.proc.poll() is None:
            _, err = self.proc.communicate("\n", timeout=30)
        else:
            err = self.proc.stderr.read() if self.proc.stderr else ""
        return self.proc.returncode, err


@pytest.fixture
def pos_run(tmp_path: Path, fakegpu, fake_cupti: Path) -> Iterator:  # type: ignore[no-untyped-def]
    """Start `pos run` jobs (as root: the agent's socket lives in /run/pos); ended after."""
    if os.geteuid() != 0:
        pytest.skip("the agent's socket lives in /run/pos (root)")
    started: list[PosRun] = []

    def start(name: str, prog: str) -> PosRun:
        path = tmp_path / f"{name}.py"
        path.write_text(prog)
        env = dict(os.environ, POS_LIBCUPTI=str(fake_cupti), POS_LIBCUDA=str(fakegpu["libcuda"]))
        job = PosRun(name, path, env)
        started.append(job)
        return job
    yield start
    for job in started:
        if job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait()
