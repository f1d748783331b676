"""A job that fills 85% of the GPU, checkpointed whole by the concurrent engine from outside at a
step it does not choose, killed, and restored into a new process: every loss and the ballast's
digest bit for bit. The image goes to the disk where it has room, else to /dev/shm with a small
page-locked arena (a checkpoint then streams: the host need not hold the image twice)."""

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent.parent
FRACTION = 0.85
POS = [sys.executable, "-m", "pos.cli"]


def _lines(log: Path) -> list[list[str]]:
    return [ln.split() for ln in log.read_text().splitlines() if ln.strip()]


def _steps(log: Path) -> int:
    return sum(1 for ln in _lines(log) if ln[0].isdigit()) if log.exists() else 0


def _wait_steps(log: Path, n: int, timeout: float = 300) -> None:
    t = time.monotonic()
    while _steps(log) < n:
        assert time.monotonic() - t < timeout, f"no step {n} in {log} within {timeout} s"
        time.sleep(0.1)


def _where(job_gib: float) -> tuple[Path, dict[str, str]]:
    """A folder with room for the image, and the environment pos needs to write it there."""
    need = (job_gib + 4) * 2**30
    disk = Path("/var/tmp")
    if shutil.disk_usage(disk).free > need:
        return disk, {}
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if ram > need + 16 * 2**30:
        return Path("/dev/shm"), {"POS_PIN_MAX_GIB": "8"}
    pytest.skip(f"no room here for the image of a {job_gib:.0f} GiB job")


def test_a_job_at_85_percent_of_the_gpu_is_restored_bit_for_bit() -> None:
    total = float(subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=memory.total",
                                  "--format=csv,noheader,nounits"], capture_output=True,
                                 text=True, check=True).stdout) / 1024
    job_gib = FRACTION * total
    base, env = _where(job_gib)
    work = base / f"pos-scale-test-{os.getpid()}"
    work.mkdir()
    log, img = work / "job.log", work / "img"
    env = {**os.environ, **env}
    # its stderr appended to a file of its own: a file the job writes that is not opened to
    # append, as the test's own output may be, is refused by the restore once it has grown
    with open(work / "job.err", "ab") as err:
        job = subprocess.Popen([*POS, "run", "--", sys.executable, "workloads/train_gpt.py",
                                str(log), "--steps", "0", "--ctx", "512", "--fill-to",
                                f"{job_gib:.2f}", "--digest-every", "10"], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        _wait_steps(log, 12)
        time.sleep(random.uniform(0, 1.0))
        r = subprocess.run([*POS, "checkpoint", str(job.pid), "-D", str(img), "--concurrent",
                            "--leave-running"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=900)
        assert r.returncode == 0, r.stderr
        _wait_steps(log, _steps(log) + 5)
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        last = max(int(ln[0]) for ln in _lines(log) if ln[0].isdigit())
        r = subprocess.run([*POS, "restore", "-D", str(img)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        t = time.monotonic()     # the restored job recomputes the steps after the cut, then on
        while max(int(ln[0]) for ln in _lines(log) if ln[0].isdigit()) < last + 5:
            assert time.monotonic() - t < 300, "the restored job did not get past its old steps"
            time.sleep(0.2)
        losses: dict[int, set[str]] = {}
        digests = set()
        for ln in _lines(log):
            if ln[0] == "ballast":
                digests.add(ln[2])
            else:
                losses.setdefault(int(ln[0]), set()).add(ln[1])
        assert all(len(v) == 1 for v in losses.values()), "a step's loss differs after restore"
        assert len(digests) == 1, f"the ballast changed: {digests}"
    finally:
        subprocess.run(["pkill", "-9", "-f", str(log)])
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        shutil.rmtree(work, ignore_errors=True)
