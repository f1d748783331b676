"""Fixtures of the agent tests: the fake driver's fill_job and peer_job (tests/fakegpu/) started
under the real `pos run`, as a user starts a job: its agent owns its memory and answers pos."""

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
import pytest

from pos.agent.control import Agent, Buffer
from tests.conftest import ROOT, wait_for
from tests.engines.conftest import criu_ready  # noqa: F401  (a fixture)


class Job:
    """`pos run -- ARGV`, its output in a file (CRIU dumps no pipe to pos), in a session of its
    own; started once it printed READY."""

    def __init__(self, argv: list[str], out: Path, env: dict[str, str],
                 name: Optional[str] = None) -> None:
        self.out = out
        with open(self.out, "w") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pos.cli", "run", *(["--name", name] if name else []),
                 "--", *argv], cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=f,
                stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid
        self.printed("READY")

    def printed(self, word: str, timeout: float = 30, times: int = 1) -> str:
        """The job's output once it holds `word` (`times` times), the job still running."""
        def there() -> bool:
            text = self.out.read_text()
            if text.count(word) >= times:
                return True
            assert self.proc.poll() is None, f"the job ended before it printed {word}: {text}"
            return False

        wait_for(there, timeout, lambda: f"the job to print {word}: {self.out.read_text()}")
        return self.out.read_text()

    def alive(self) -> bool:
        try:
            return open(f"/proc/{self.pid}/stat").read().split()[2] not in "ZX"
        except OSError:
            return False

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait()


class FillJob(Job):
    """`pos run -- fill_job CUBIN N BYTES PAUSE`."""

    def __init__(self, fakegpu: dict[str, Path], folder: Path, env: dict[str, str],
                 buffers: int, size: int, name: Optional[str] = None) -> None:
        """`env` may hold FILL_JOB_POOL_BYTES (memory from the stream-ordered pool)."""
        self.pause = folder / "pause"
        super().__init__([str(fakegpu["fill_job"]), str(fakegpu["cubin"]), str(buffers),
                          str(size), str(self.pause)], folder / "job.out", env, name)

    def hold(self) -> int:
        """Pause the job (its pause file) and return once it says it makes no more CUDA calls:
        the operations it made. `pause.unlink()` lets it go on."""
        times = self.out.read_text().count("PAUSED") + 1
        self.pause.touch()
        return int(self.printed("PAUSED", times=times).rsplit("PAUSED", 1)[1].split()[0])


def operations(pid: int, table: list[Buffer]) -> int:
    """How many operations the fill_job `pid` has begun: the highest value in its buffers
    (`table`, its agent's), operation k writing k into one; read from its memory, which is the
    fake driver's device memory."""
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        return max(int(np.frombuffer(os.pread(mem.fileno(), b.size & ~3, b.va), np.uint32)
                       .max()) for b in table)


def ran_past(pid: int, done: Optional[int] = None, timeout: float = 20) -> int:
    """Until the fill_job `pid` has begun an operation past its `done`-th (None: past those it
    began by now), so that an exact image taken next holds more than `done`; how many it had
    begun then."""
    with Agent(pid) as a:
        table = a.table()
    seen = [operations(pid, table)]
    done = seen[0] if done is None else done

    def past() -> bool:
        try:
            seen[0] = operations(pid, table)
        except OSError as e:
            raise AssertionError(f"process {pid} ended before operation {done + 1}: {e}") from e
        return seen[0] > done

    wait_for(past, timeout, lambda: f"process {pid} to compute past operation {done} "
             f"(at {seen[0]})")
    return seen[0]


@pytest.fixture
def gpu_env(tmp_path: Path, fakegpu: dict[str, Path],
            monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """pos's and the job's environment: the fake driver, its checkpoint state, the store."""
    if os.geteuid() != 0:
        pytest.skip("the agent answers root only, and pos needs root")
    env = {"POS_LIBCUDA": str(fakegpu["libcuda"]),
           "POS_FAKECUDA_STATE_DIR": str(tmp_path / "fakecuda"),
           "POS_DB": str(tmp_path / "pos.db"),
           "POS_WATCHDOG_LOG": str(tmp_path / "wd.log")}
    for name, value in env.items():   # pos in this process (the engine's functions) too,
        monkeypatch.setenv(name, value)   # for this test alone: a later one's store is its own
    return {**os.environ, **env}


@pytest.fixture
def fill_job(tmp_path: Path, fakegpu: dict[str, Path], gpu_env: dict[str, str]
             ) -> Iterator[Callable[..., FillJob]]:
    started: list[FillJob] = []

    def start(buffers: int = 12, size: int = 1 << 20, name: Optional[str] = None,
              pool_bytes: int = 0, launches: str = "", nccl: bool = False,
              copy: str = "", copy_when: Optional[Path] = None,
              linked: bool = False, elementwise: str = "") -> FillJob:
        """`launches`: every operation launches this kernel with axpy's parameters on the first
        buffer (FILL_JOB_AXPY); `elementwise`: this kernel instead, with the parameters PyTorch's
        elementwise kernels take, the first buffer the input, the second the output, the third an
        address the functor holds (FILL_JOB_ELEMENTWISE); `nccl`: an NCCL-named kernel, every 2 ms;
        `copy`: every operation also copies through the driver's entry point of that name, looked up
        with cuGetProcAddress (FILL_JOB_COPY), looked up once `copy_when` exists
        (FILL_JOB_COPY_WHEN); `linked`: through the fake's cuMemcpyFutureAsync, which a library it
        loads links to (FILL_JOB_LINKED)."""
        d = tmp_path / f"job{len(started)}"
        d.mkdir(exist_ok=True)
        env = {**gpu_env, **({"FILL_JOB_POOL_BYTES": str(pool_bytes)} if pool_bytes else {}),
               **({"FILL_JOB_AXPY": launches} if launches else {}),
               **({"FILL_JOB_ELEMENTWISE": elementwise} if elementwise else {}),
               **({"FILL_JOB_NCCL": "1"} if nccl else {}),
               **({"FILL_JOB_COPY": copy} if copy else {}),
               **({"FILL_JOB_COPY_WHEN": str(copy_when)} if copy_when else {}),
               **({"FILL_JOB_LINKED": str(fakegpu["future_copy"])} if linked else {})}
        job = FillJob(fakegpu, d, env, buffers, size, name)
        started.append(job)
        return job
    yield start
    for job in started:
        job.kill()


@pytest.fixture
def peer_job(tmp_path: Path, fakegpu: dict[str, Path], gpu_env: dict[str, str]
             ) -> Iterator[Callable[..., Job]]:
    """`pos run -- peer_job MODE DIR` (tests/fakegpu/peer_job.c), every one of a test with the
    same DIR unless `folder` names another (an importer maps the owner of its folder); `own`
    (False: POS_OWN=0, pos owns none of its memory); `stall_s`: the agent's bound on a silent
    pos (POS_AGENT_STALL_S), which is also how long it keeps a job held whose imports pos took
    down and did not put back."""
    folders: set[Path] = set()
    started: list[Job] = []

    def start(mode: str, own: bool = True, folder: str = "peers",
              stall_s: Optional[float] = None, env: Optional[dict[str, str]] = None) -> Job:
        exchange = tmp_path / folder
        exchange.mkdir(exist_ok=True)
        folders.add(exchange)
        env = {**gpu_env, **({} if own else {"POS_OWN": "0"}),
               **({} if stall_s is None else {"POS_AGENT_STALL_S": str(stall_s)}), **(env or {})}
        job = Job([str(fakegpu["peer_job"]), mode, str(exchange)],
                  tmp_path / f"{mode}-{folder}.out", env)
        started.append(job)
        return job
    yield start
    for exchange in folders:
        (exchange / "stop").touch()
    for job in started:
        try:
            job.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            job.kill()
