"""A job as torchrun starts one, under `pos run`, against the fake driver with real CRIU
(issue 42, item 1): an elastic agent whose store runs on an event loop that would take an
io_uring (elastic_job.py), supervising two workers that hold device memory and talk to the
store over TCP at every step. Under `pos run` the agent's loop falls back to epoll; `pos
checkpoint --concurrent --leave-running --tcp-established` saves the whole tree while it runs;
after SIGKILL of every process `pos restore` brings it back, every worker's memory holds what
its step says, and the agent goes on supervising its workers to the job's end."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from pos.image import gpuindex
from pos.process import procs
from tests.conftest import ROOT, kill, reaped
from tests.engines.conftest import one_sentence, pos, wait_for

JOB = Path(__file__).with_name("elastic_job.py")
WORKERS = 2


class Elastic:
    """`pos run [RUN...] -- python elastic_job.py agent DIR 2`, in a session of its own."""

    def __init__(self, folder: Path, env: dict[str, str], *run: str) -> None:
        self.dir = folder
        folder.mkdir()
        self.proc = subprocess.Popen([sys.executable, "-m", "pos.cli", "run", *run, "--",
                                      sys.executable, str(JOB), "agent", str(folder),
                                      str(WORKERS)], cwd=ROOT, env=env,
                                     stdin=subprocess.DEVNULL,
                                     stdout=open(folder / "job.log", "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.root = self.proc.pid
        self.steps(5)
        self.pids = procs.tree(self.root)

    def said(self) -> str:
        return "".join(p.read_text() for p in sorted(self.dir.glob("*.txt"))
                       ) + (self.dir / "job.log").read_text()

    def lines(self, rank: int) -> list[str]:
        p = self.dir / f"rank-{rank}.txt"
        return p.read_text().split("\n")[:-1] if p.exists() else []

    def agent(self) -> list[str]:
        return (self.dir / "agent.txt").read_text().split("\n")[:-1]

    def steps(self, more: int, timeout: float = 30) -> None:
        """Until every worker made `more` steps more than now (the job runs)."""
        before = [len(self.lines(r)) for r in range(WORKERS)]

        def made() -> bool:
            assert not any("WRONG" in ln for r in range(WORKERS) for ln in self.lines(r)), \
                self.said()
            return all(len(self.lines(r)) >= b + more for r, b in enumerate(before))

        wait_for(made, timeout, lambda: f"{more} more steps of every worker: {self.said()}")

    def kill(self) -> None:
        kill(self.pids[::-1], self.proc)
        wait_for(lambda: all(map(reaped, self.pids)), what="the job's processes gone")


@pytest.fixture
def elastic(tmp_path: Path, gpu_env: dict[str, str], criu_ready) -> Iterator:
    started: list[Elastic] = []

    def start(*run: str) -> Elastic:
        started.append(Elastic(tmp_path / f"job{len(started)}", gpu_env, *run))
        return started[-1]
    yield start
    for job in started:
        job.kill()


def test_torchrun_like_tree_saved_while_it_runs_killed_and_restored(
        elastic, tmp_path: Path, gpu_env: dict[str, str]) -> None:
    job = elastic()
    assert job.agent()[0] == "LOOP epoll"       # pos run's filter: libuv's fallback
    assert len(job.pids) == 1 + WORKERS and not any(procs.io_urings(p) for p in job.pids)
    img = tmp_path / "img"
    r = pos("checkpoint", str(job.root), "-D", str(img), "--concurrent", "--leave-running",
            "--tcp-established", "--json", env=gpu_env, timeout=180)
    assert r.returncode == 0, r.stderr
    # each worker's memory; the agent, with CUDA initialised but no device memory, has an
    # empty index, and pos made no context nor page-locked memory for it
    assert gpuindex.jobs(img) == sorted(job.pids)
    assert gpuindex.read(img, job.root).buffers == ()
    saved = {x["pid"]: x for x in json.loads(r.stdout)["ranks"]}
    assert saved[job.root]["bytes"] == 0 and saved[job.pids[1]]["bytes"] > 0
    assert "context" not in saved[job.root]["timings"], saved[job.root]
    assert "pinned_peak_bytes" not in saved[job.root]["timings"]
    assert saved[job.pids[1]]["timings"]["pinned_peak_bytes"] > 0
    # the driver's calls, timed in every rank's own timings as well as over all of them
    assert all(saved[p]["timings"]["driver_checkpoint"] > 0 and
               saved[p]["timings"]["driver_restore"] > 0 for p in job.pids)
    job.steps(5)                                 # it ran on, untouched
    at_kill = [len(job.lines(r)) for r in range(WORKERS)]
    hb_at_kill = len(job.agent())
    job.kill()
    # The real driver keeps a process's checkpoint state inside the process, so the image holds
    # it as CRIU dumped it: checkpointed. The fake keeps it in a file, which the job's running on
    # after the checkpoint changed: put back what the image holds.
    for p in job.pids:
        (Path(gpu_env["POS_FAKECUDA_STATE_DIR"]) / str(p)).write_text("checkpointed\n")
    r = pos("restore", "-D", str(img), env=gpu_env, timeout=180)
    assert r.returncode == 0, r.stderr
    job.steps(10)                                # each worker's memory checked at every step
    for rank, n in enumerate(at_kill):
        after = [int(s) for s in job.lines(rank)[n:]]
        assert after == list(range(after[0], after[0] + len(after))), after
        assert after[0] <= n                     # from the image, taken before the kill
    wait_for(lambda: len(job.agent()) > hb_at_kill + 5, what="the restored agent's store "
             f"round trips: {job.said()}")
    (job.dir / "stop").touch()                   # the workers end; the agent sees it
    wait_for(lambda: job.agent()[-1] in ("DONE",) or job.agent()[-1].startswith("FAILED"),
             timeout=30, what=f"the restored agent's end: {job.said()}")
    assert job.agent()[-1] == "DONE", job.said()


def test_with_io_uring_allowed_the_tree_is_refused_untouched(
        elastic, tmp_path: Path, gpu_env: dict[str, str]) -> None:
    job = elastic("--allow-io-uring")
    assert job.agent()[0] == "LOOP io_uring"
    r = pos("checkpoint", str(job.root), "-D", str(tmp_path / "img"), "--concurrent",
            "--leave-running", "--tcp-established", env=gpu_env)
    one_sentence(r, 2, f"PID {job.root} (elastic_job.py) holds an io_uring",
                 "start the job again with `pos run` without --allow-io-uring")
    assert not (tmp_path / "img").exists()
    assert all(procs.state(p) in ("R", "S") for p in job.pids)
    job.steps(5)
