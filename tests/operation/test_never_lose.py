"""Without --leave-running, pos killed at any moment of a checkpoint leaves the job running or a
sealed image that restores it (issue 26: a dump that ended the job before the image was sealed,
under a parent that did not reap it, lost the job). CRIU leaves the tree stopped and pos ends it
only once the image is sealed. Real CRIU; the fake driver for the GPU steps."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import pytest

from pos import image
from pos.image import names
from pos.process import procs
from tests.engines.conftest import (COUNTER, alive, counts_on, lines, one_sentence, pos,
                                      wait_for)

# a supervisor busy elsewhere: it starts the job and never waits for it
LAUNCHER = """import subprocess, sys, time
p = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True)
print(p.pid, flush=True)
time.sleep(1e6)
"""


class Unreaped:
    """A counter (64 MiB of ballast: the dump takes a while) whose parent never reaps it: once
    it dies, its PID stays taken until the parent goes."""

    def __init__(self, path: Path, env: dict[str, str], cuda: Optional[Path] = None) -> None:
        argv = [sys.executable, str(COUNTER), str(path), "--ballast-mb", "64",
                *(["--cuda", str(cuda)] if cuda else [])]
        self.parent = subprocess.Popen([sys.executable, "-c", LAUNCHER, *argv],
                                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       env={**os.environ, **env})
        self.pid = int(self.parent.stdout.readline())
        self.path = path
        wait_for(lambda: len(lines(path)) >= 5, what="the counter")

    def counting(self) -> bool:
        """Alive, not stopped, and its count goes on."""
        if not alive(self.pid) or procs.state(self.pid) in ("T", "t"):
            return False
        counts_on([self.path], 4)
        return True

    def free(self) -> None:
        """The parent goes: its dead child comes to pytest (the subreaper), which reaps it."""
        self.parent.kill()
        self.parent.wait()
        wait_for(lambda: reaped(self.pid), what=f"PID {self.pid} to be reaped")

    def stop(self) -> None:
        for pid in reversed(procs.tree(self.pid)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.free()


def reaped(pid: int) -> bool:
    """`pid` is gone, or a zombie child of pytest, reaped here."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return not Path(f"/proc/{pid}").exists()


def watchdogs(parent: int) -> list[int]:
    """pos's watchdogs whose parent is `parent` (pos, or pytest once pos is dead)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and procs.parent(int(d.name)) == parent and \
                    b"pos.operation.watchdog" in (d / "cmdline").read_bytes():
                found.append(int(d.name))
        except OSError:
            continue
    return found


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"POS_DB": str(tmp_path / "pos.db"), "POS_WATCHDOG_LOG": str(tmp_path / "wd.log")}


@pytest.fixture
def jobs(criu_ready: None) -> Iterator[list[Unreaped]]:
    made: list[Unreaped] = []
    yield made
    for job in made:
        job.stop()


def restores_and_goes_on(job: Unreaped, img: Path, env: dict[str, str]) -> None:
    """The job, ended after a sealed image of it: the restore is refused while its parent has
    not reaped it, and works once it has; the count goes on from the dump, no number twice
    (the job did not run between the dump and its end)."""
    image.verify(img)
    wait_for(lambda: not alive(job.pid), what="the job's end")
    one_sentence(pos("restore", "-D", str(img), env=env), 2, f"PID {job.pid} of the image is "
                 "taken", "a zombie its parent has not reaped")
    job.free()
    at_dump = len(lines(job.path))
    r = pos("restore", "-D", str(img), env=env)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: len(lines(job.path)) > at_dump + 10, what="the restored counter")
    values = lines(job.path)
    assert values == list(range(1, len(values) + 1))


@pytest.mark.parametrize("step", ["lock", "checkpoint", "dump", "dump:criu", "seal", "end"])
def test_pos_killed_at_each_step_leaves_the_job_running_or_a_sealed_image(
        tmp_path: Path, fakegpu: dict[str, Path], env: dict[str, str], jobs: list[Unreaped],
        step: str) -> None:
    gpu = {**env, "POS_LIBCUDA": str(fakegpu["libcuda"]),
           "POS_FAKECUDA_STATE_DIR": str(tmp_path / "fakecuda")}
    job = Unreaped(tmp_path / "count", gpu, cuda=fakegpu["libcuda"])
    jobs.append(job)
    img = tmp_path / "img"
    r = pos("checkpoint", str(job.pid), "-D", str(img), env={**gpu, "POS_FAULT_AT": f"{step}=KILL"})
    assert r.returncode == -9, (r.returncode, r.stderr)
    log = Path(env["POS_WATCHDOG_LOG"])
    wait_for(lambda: log.exists() and "undo done" in log.read_text(), timeout=60,
             what="the watchdog's undo")
    assert not names.partial(tmp_path / "img").exists()
    if step == "end":            # sealed: the watchdog ends the job, as the checkpoint was to
        restores_and_goes_on(job, img, gpu)
        return
    assert not img.exists()
    assert job.counting()
    assert (tmp_path / "fakecuda" / str(job.pid)).read_text().strip() == "running"


# moments spread over a checkpoint after its watchdog is up (about 0.45 s here: the dump from
# 0.06 s, the seal from 0.14 s, the end at 0.23 s); before it pos has touched nothing
@pytest.mark.parametrize("delay", [0.0, 0.03, 0.06, 0.09, 0.12, 0.15, 0.18, 0.21, 0.25, 0.35])
def test_pos_killed_at_any_moment_leaves_the_job_running_or_a_sealed_image(
        tmp_path: Path, env: dict[str, str], jobs: list[Unreaped], delay: float) -> None:
    job = Unreaped(tmp_path / "count", env)
    jobs.append(job)
    img = tmp_path / "img"
    p = subprocess.Popen([sys.executable, "-m", "pos.cli", "checkpoint", str(job.pid), "-D",
                          str(img)], env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         cwd=Path(__file__).resolve().parents[2])
    try:
        wait_for(lambda: watchdogs(p.pid) or p.poll() is not None, what="pos's watchdog")
        time.sleep(delay)        # the moment pos dies, not a wait for a condition
        p.kill()
    finally:
        p.wait()
    wait_for(lambda: not [w for w in watchdogs(os.getpid()) if alive(w)], timeout=60,
             what="the watchdog's undo")
    for w in watchdogs(os.getpid()):
        reaped(w)
    assert not names.partial(tmp_path / "img").exists()
    if alive(job.pid):           # it runs on (an image sealed before pos died may be there)
        assert job.counting()
        if img.exists():
            image.verify(img)
        return
    restores_and_goes_on(job, img, env)
