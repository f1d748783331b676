"""Checkpoint/restore of a real PyTorch training job on the GPU (driver checkpoint API + CRIU).

The job (workloads/train_det.py) is deterministic: its loss after every step, to the bit, must
be the same with a checkpoint in the middle as without -- both when the job runs on after a
--leave-running checkpoint (and again when that image is restored), and when it is killed by the
dump and restored. Needs root, CRIU >= 4 (POS_CRIU, see .device/setup.sh) and a GPU.
Extra CRIU options for pos, if this host's PyTorch needs them: POS_GPU_CRIU_OPTS="--shell-job".
"""

import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

JOB = ROOT / "workloads" / "train_det.py"
STEPS = 80
EXTRA = os.environ.get("POS_GPU_CRIU_OPTS", "").split()


@pytest.fixture(scope="module", autouse=True)
def subreaper() -> None:
    # restored processes (criu restore -d) come back to us, so that we can reap them
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)


def pos(*args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "pos.cli", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    print(f"$ pos {' '.join(args)}\n{r.stdout}{r.stderr}", flush=True)
    return r


def losses(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def start(out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(JOB), str(out), "--steps", str(STEPS)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=open(f"{out}.stderr", "w"), start_new_session=True)


def wait_steps(path: Path, n: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while len(losses(path)) < n:
        assert time.monotonic() < deadline, f"{path}: only {len(losses(path))} steps"
        time.sleep(0.05)


def wait_exit(pid: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid if not Path(f"/proc/{pid}").exists() else 0
        if done:
            return
        assert time.monotonic() < deadline, f"PID {pid} still runs"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    out = tmp_path_factory.mktemp("ref") / "losses"
    p = start(out)
    assert p.wait(timeout=600) == 0, Path(f"{out}.stderr").read_text()
    ref = losses(out)
    assert len(ref) == STEPS
    print(f"reference: {STEPS} steps, last loss {ref[-1]}")
    return ref


def test_leave_running_and_restore_are_bit_exact(tmp_path: Path, reference: list[str]) -> None:
    out, img = tmp_path / "losses", tmp_path / "img"
    p = start(out)
    wait_steps(out, STEPS // 3)
    r = pos("checkpoint", str(p.pid), "-D", str(img), "--leave-running", "--db",
            str(tmp_path / "pos.db"), *EXTRA)
    assert r.returncode == 0, r.stderr
    assert p.wait(timeout=600) == 0, Path(f"{out}.stderr").read_text()
    assert losses(out) == reference, "the job that ran on after the checkpoint diverged"
    r = pos("inspect", str(img))
    at = len(losses(out))
    r = pos("restore", "-D", str(img), "--db", str(tmp_path / "pos.db"))
    assert r.returncode == 0, r.stderr
    wait_exit(p.pid)
    resumed = losses(out)[at:]
    k = int(resumed[0].split()[0])
    print(f"restored job resumed at step {k}")
    assert resumed == reference[k - 1:], "the restored job diverged"


def test_kill_and_restore_is_bit_exact(tmp_path: Path, reference: list[str]) -> None:
    out, img = tmp_path / "losses", tmp_path / "img"
    p = start(out)
    wait_steps(out, STEPS // 3)
    r = pos("checkpoint", str(p.pid), "-D", str(img), "--db", str(tmp_path / "pos.db"), *EXTRA)
    assert r.returncode == 0, r.stderr
    p.wait(timeout=60)
    at = len(losses(out))
    r = pos("restore", "-D", str(img), "--db", str(tmp_path / "pos.db"))
    assert r.returncode == 0, r.stderr
    wait_exit(p.pid)
    print(f"killed after step {at}, restored, finished")
    assert losses(out) == reference
