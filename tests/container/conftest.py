"""Fixtures of the container tests: real rootful podman (runc, CRIU underneath), an image made
here from nothing (no registry is reached), and the fake driver's fill_job started in a
container with pos's agent through its CDI device, as a user starts one.

A host without podman fails these tests with the reason, never skips them: scripts/setup.sh
installs podman, runc and their configuration."""

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from pos.agent.control import Agent
from pos.container import podman
from tests.agent.conftest import gpu_env  # noqa: F401  (a fixture)
from tests.conftest import wait_for
from tests.engines.conftest import criu_ready, pos  # noqa: F401  (a fixture)
from workloads import base_image
from workloads.base_image import IMAGE, ULIMITS

BUFFERS, SIZE = 12, 1 << 20
PAUSE = "/tmp/pause"            # in the container's own /tmp: saved and restored with it


@pytest.fixture(scope="session")
def podman_ready(tmp_path_factory: pytest.TempPathFactory) -> None:
    """podman runs a container here, through runc, with a CRIU >= 4 on the PATH; the image."""
    missing = [b for b in ("podman", "runc", "criu") if shutil.which(b) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: run scripts/setup.sh", pytrace=False)
    info = subprocess.run(["podman", "info", "--format", "{{.Host.OCIRuntime.Name}}"],
                          capture_output=True, text=True)
    if info.returncode != 0 or info.stdout.strip() != "runc":
        pytest.fail("podman does not run containers through runc here (Debian's crun has no "
                    f"CRIU): {info.stdout.strip() or info.stderr.strip()}; run "
                    "scripts/setup.sh", pytrace=False)
    base_image.make(tmp_path_factory.mktemp("image"))


@pytest.fixture(scope="session")
def cdi_ready(podman_ready: None) -> None:
    """`pos cdi` as a user runs it: the spec in /etc/cdi, the agent in /opt/pos/lib."""
    r = pos("cdi")
    assert r.returncode == 0, r.stderr
    assert "pos.dev/agent=hook" in r.stdout


class Containers:
    """The containers of one test, each removed at its end."""

    def __init__(self, fakegpu: dict[str, Path], env: dict[str, str]) -> None:
        self.fakegpu, self.env = fakegpu, env
        self.prefix = f"pos-test-{uuid.uuid4().hex[:8]}"
        self.names: list[str] = []

    def name(self, what: str) -> str:
        n = f"{self.prefix}-{what}"
        self.names.append(n)
        return n

    def start(self, what: str = "job") -> str:
        """fill_job in a new container with the agent's CDI device, running once it said
        READY; its name."""
        name = self.name(what)
        state, fake = self.env["POS_FAKECUDA_STATE_DIR"], str(self.fakegpu["dir"])
        Path(state).mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["podman", "run", "-d", "--name", name, "--device", "pos.dev/agent=hook",
             *ULIMITS, "-v", "/usr:/usr:ro", "-v", f"{fake}:{fake}:ro", "-v",
             f"{state}:{state}", "-e", f"POS_FAKECUDA_STATE_DIR={state}", IMAGE,
             str(self.fakegpu["fill_job"]), str(self.fakegpu["cubin"]), str(BUFFERS),
             str(SIZE), PAUSE], check=True, capture_output=True, text=True)
        self.printed(name, "READY")
        return name

    def logs(self, name: str) -> str:
        return subprocess.run(["podman", "logs", name], capture_output=True,
                              text=True).stdout

    def printed(self, name: str, word: str, times: int = 1) -> str:
        wait_for(lambda: self.logs(name).count(word) >= times, 30,
                 lambda: f"container {name} to print {word}: {self.logs(name)}")
        return self.logs(name)

    def pid(self, name: str) -> int:
        return podman.inspect(name).pid

    def hold(self, name: str) -> int:
        """Pause the job (its pause file) and return once it makes no more CUDA calls: the
        operations it made."""
        times = self.logs(name).count("PAUSED") + 1
        subprocess.run(["podman", "exec", name, "/usr/bin/touch", PAUSE], check=True)
        return int(self.printed(name, "PAUSED", times).rsplit("PAUSED", 1)[1].split()[0])

    def go_on(self, name: str) -> None:
        subprocess.run(["podman", "exec", name, "/usr/bin/rm", PAUSE], check=True)

    def remove_all(self) -> None:
        for n in self.names:
            podman.remove(n)


@pytest.fixture
def containers(criu_ready: None, cdi_ready: None, fakegpu: dict[str, Path],
               gpu_env: dict[str, str]) -> Iterator[Containers]:  # noqa: F811
    c = Containers(fakegpu, gpu_env)
    yield c
    c.remove_all()


def values(pid: int, held: bool = True) -> list[int]:
    """One value per buffer of the fill_job `pid`, in address order, read from its memory (the
    fake driver's device memory). `held`: the job makes no call now, so a buffer that is not
    uniform is torn (AssertionError); otherwise one may be half written: its highest value."""
    with Agent(pid) as a:
        table = a.table()
    out = []
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for b in sorted(table, key=lambda b: b.va):
            seen = np.unique(np.frombuffer(os.pread(mem.fileno(), b.size, b.va), np.uint32))
            assert not held or len(seen) == 1, f"buffer {b.va:#x} of {pid} is torn: {seen[:4]}"
            out.append(int(seen.max()))
    return out


def running(name: str) -> bool:
    out = subprocess.run(["podman", "container", "inspect", name], capture_output=True,
                         text=True)
    return out.returncode == 0 and bool(json.loads(out.stdout)[0]["State"]["Running"])

