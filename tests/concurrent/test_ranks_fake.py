"""A job of several CUDA processes, as DDP's ranks are, against the fake driver with real CRIU:
two fill_jobs under one `pos run` shell, each launching an NCCL-named kernel at every operation.
The collective cut must hold both before the same NCCL launch (so both images hold the same
number of operations: the fake's ranks do not wait for each other, so nothing else would make
them equal), write one image of the whole tree, and bring every process's memory back in a
restore. What this cannot prove is NCCL's behaviour (bench/ddp.py does, on two GPUs)."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from pos import concurrent
from pos.agent.control import Agent, Refused
from pos.image import gpuindex, names
from tests.agent.conftest import ran_past
from tests.conftest import ROOT, ShellJobs, kill, reaped
from tests.engines.conftest import pos, wait_for
from workloads.fill_job import image_values, torn


class Ranks(ShellJobs):
    """`pos run -- sh -c 'fill_job ... & fill_job ... & wait'` (n fill_jobs), in NCCL mode."""

    def __init__(self, fakegpu: dict[str, Path], folder: Path, env: dict[str, str],
                 n: int = 2) -> None:
        self.outs = [folder / f"rank{r}.out" for r in range(n)]
        job = f"{fakegpu['fill_job']} {fakegpu['cubin']} 8 {1 << 20}"
        script = " & ".join(f"{job} > {out} 2>&1" for out in self.outs) + " & wait"
        self.proc = subprocess.Popen([sys.executable, "-m", "pos.cli", "run", "--", "sh", "-c",
                                      script], cwd=ROOT, env={**env, "FILL_JOB_NCCL": "1"},
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self.root = self.proc.pid
        wait_for(self.ready, 30, lambda: f"every rank to print READY: {self.said()}")
        self.pids = [int(o.read_text().split("READY")[1].split()[0]) for o in self.outs]

    def kill(self) -> None:
        kill([*self.pids, self.root], self.proc)


@pytest.fixture
def ranks(tmp_path: Path, fakegpu: dict[str, Path], gpu_env: dict[str, str]) -> Iterator[Ranks]:
    r = Ranks(fakegpu, tmp_path, gpu_env)
    yield r
    r.kill()


@pytest.fixture
def one_under_a_shell(tmp_path: Path, fakegpu: dict[str, Path], gpu_env: dict[str, str]
                      ) -> Iterator[Ranks]:
    r = Ranks(fakegpu, tmp_path, gpu_env, n=1)
    yield r
    r.kill()


def alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in "ZXT"
    except OSError:
        return False


def test_the_cut_at_an_nccl_launch_refuses_a_point_passed_or_not_reached(fill_job) -> None:
    job = fill_job(nccl=True)
    with Agent(job.pid) as agent:
        wait_for(lambda: agent.status().nccl_launches > 0, what="an NCCL launch")
        made = agent.status().nccl_launches
        assert made > 0
        with pytest.raises(Refused) as passed:
            agent.cut(5, at=0)
        assert passed.value.past >= made
        with pytest.raises(Refused) as far:
            agent.cut(0.2, at=made + 100_000)
        assert 0 < far.value.past < made + 100_000
        assert agent.status().phase == "idle"
        cut = agent.cut(5, at=agent.status().nccl_launches + 3)   # held there, then let go
        assert cut.buffers == 12
        assert agent.status().nccl_launches >= made + 3
        agent.end()
    assert job.alive()


@pytest.mark.parametrize("leave_running", [False, True])
def test_ranks_are_cut_before_the_same_collective_and_each_restored(
        ranks: Ranks, tmp_path: Path, criu_ready, gpu_env, leave_running: bool) -> None:
    for p in ranks.pids:
        ran_past(p, 0)
    img = tmp_path / "ddp"
    r = pos("checkpoint", str(ranks.root), "-D", str(img), "--concurrent", "--json",
            *(["--leave-running"] if leave_running else []), env=gpu_env)
    assert r.returncode == 0, r.stderr
    assert gpuindex.jobs(img) == sorted(ranks.pids)
    timings = json.loads(r.stdout)["timings"]      # the ranks' private memory, for CRIU
    assert timings["anon_prepared_bytes"] > 0 and timings["anon_frozen_bytes"] > 0
    saved = [image_values(img, p) for p in ranks.pids]
    assert not any(torn(v) for v in saved)
    assert max(saved[0]) == max(saved[1]) > 0     # the same NCCL launch: the same state
    if leave_running:          # both run on (the fake's state of a process that ran on after
        for p in ranks.pids:   # its checkpoint cannot be restored: the GPU suite restores it)
            with Agent(p) as a:
                assert a.status().phase == "idle"
            later = image_values(Path(concurrent.checkpoint_gpu(p, tmp_path / f"on-{p}").path))
            assert max(later) > max(saved[0])
        return
    ranks.proc.wait(timeout=30)                   # CRIU's dump, then the tree ended
    for p in ranks.pids:       # gone, and reaped where this process became their parent
        wait_for(lambda: reaped(p), what=f"rank {p}'s end")
    r = pos("restore", "-D", str(img), env=gpu_env)
    assert r.returncode == 0, r.stderr
    try:
        for p, before in zip(ranks.pids, saved):
            ran_past(p, max(before))
            assert alive(p)
            now = image_values(Path(concurrent.checkpoint_gpu(p, tmp_path / f"after-{p}").path))
            assert not torn(now) and max(now) > max(before)    # it went on from the image
    finally:
        ranks.kill()


def test_one_job_under_a_shell_is_imaged_and_restored_through_its_own_agent(
        one_under_a_shell: Ranks, tmp_path: Path, criu_ready, gpu_env) -> None:
    """The tree's root (a shell) is not the CUDA process: the image's one GPU index names the
    job, and the restore maps its memory back through the job's agent, not the root's."""
    job = one_under_a_shell
    ran_past(job.pids[0], 0)
    img = tmp_path / "one"
    r = pos("checkpoint", str(job.root), "-D", str(img), "--concurrent", env=gpu_env)
    assert r.returncode == 0, r.stderr
    assert (img / names.INDEX).is_file()
    saved = image_values(img)
    assert not torn(saved)
    job.proc.wait(timeout=30)
    wait_for(lambda: reaped(job.pids[0]), what="the job's end")
    r = pos("restore", "-D", str(img), env=gpu_env)
    assert r.returncode == 0, r.stderr
    try:
        ran_past(job.pids[0], max(saved))
        now = image_values(Path(concurrent.checkpoint_gpu(job.pids[0], tmp_path / "after").path))
        assert not torn(now) and max(now) > max(saved)
    finally:
        job.kill()


def each_runs_with_its_memory(ranks: Ranks, tmp_path: Path, gpu_env: dict[str, str]) -> None:
    """Every rank released, alive, its memory whole, running as far as the driver knows."""
    for p in ranks.pids:
        with Agent(p) as a:
            wait_for(lambda: a.status().phase == "idle", what=f"rank {p}'s release")
        after = image_values(Path(concurrent.checkpoint_gpu(p, tmp_path / f"after-{p}").path))
        assert alive(p) and not torn(after)
        assert (Path(gpu_env["POS_FAKECUDA_STATE_DIR"]) / str(p)).read_text().strip() \
            == "running"


@pytest.mark.parametrize("step", ["reconnect", "cut", "hoist", "checkpoint", "dump", "restore",
                                  "copy"])
def test_pos_killed_at_each_step_leaves_every_rank_running_with_its_memory(
        ranks: Ranks, tmp_path: Path, criu_ready, gpu_env, step: str) -> None:
    """The watchdog holds each rank's hoisted memory and gives each its own back."""
    for p in ranks.pids:
        ran_past(p, 0)
    r = pos("checkpoint", str(ranks.root), "-D", str(tmp_path / "img"), "--concurrent",
            "--leave-running", env={**gpu_env, "POS_FAULT_AT": f"{step}=KILL"})
    assert r.returncode == -9, (r.returncode, r.stderr)
    log = Path(gpu_env["POS_WATCHDOG_LOG"])
    wait_for(lambda: log.exists() and "undo done" in log.read_text(), timeout=60,
             what="the watchdog's undo")
    each_runs_with_its_memory(ranks, tmp_path, gpu_env)


def test_a_take_that_fails_beside_anothers_leaves_every_rank_running_with_its_memory(
        ranks: Ranks, tmp_path: Path, criu_ready, gpu_env) -> None:
    """The ranks' memory is taken at once, on threads: the first import pos makes fails, so one
    rank's take fails while the other's may succeed; the memory each took is given back, each
    rank released, and pos says why in one sentence."""
    for p in ranks.pids:
        ran_past(p, 0)
    r = pos("checkpoint", str(ranks.root), "-D", str(tmp_path / "img"), "--concurrent",
            "--leave-running",
            env={**gpu_env, "POS_FAKECUDA_FAIL": "cuMemImportFromShareableHandle:1"})
    assert r.returncode == 1 and "cuMemImportFromShareableHandle" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "img").exists()
    each_runs_with_its_memory(ranks, tmp_path, gpu_env)


def test_a_pin_that_fails_beside_anothers_leaves_every_rank_untouched(
        ranks: Ranks, tmp_path: Path, criu_ready, gpu_env) -> None:
    """The ranks' arenas are locked at once, on threads, before the cut: the first
    registration pos makes fails, so one rank's arena fails while the other's may be locked;
    each is given back, no rank was held, and pos says why in one sentence."""
    for p in ranks.pids:
        ran_past(p, 0)
    r = pos("checkpoint", str(ranks.root), "-D", str(tmp_path / "img"), "--concurrent",
            "--leave-running", env={**gpu_env, "POS_FAKECUDA_FAIL": "cuMemHostRegister_v2:1"})
    assert r.returncode == 1 and "cuMemHostRegister_v2" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "img").exists()
    each_runs_with_its_memory(ranks, tmp_path, gpu_env)


@pytest.fixture
def kept_files() -> Iterator[None]:
    """The kept arenas a test makes under /run/pos/arena, removed after it."""
    from pos.concurrent import kept

    before = set(kept.ROOT.glob("arena-*")) if kept.ROOT.exists() else set()
    yield
    for f in set(kept.ROOT.glob("arena-*")) - before:
        f.unlink()


def test_kept_arenas_serve_the_next_checkpoint(ranks: Ranks, tmp_path: Path, criu_ready,
                                               gpu_env, kept_files) -> None:
    """POS_PIN_KEEP=1: each rank's arena stays in a file of its own, which the next
    checkpoint's arenas find in memory."""
    for p in ranks.pids:
        ran_past(p, 0)
    env = {**gpu_env, "POS_PIN_KEEP": "1"}
    for k, kept_before in enumerate((False, True)):
        r = pos("checkpoint", str(ranks.root), "-D", str(tmp_path / f"img{k}"), "--concurrent",
                "--leave-running", "--json", env=env)
        assert r.returncode == 0, r.stderr
        timings = json.loads(r.stdout)["timings"]
        assert (timings["pin_kept_bytes"] > 0) is kept_before, timings
    each_runs_with_its_memory(ranks, tmp_path, gpu_env)
