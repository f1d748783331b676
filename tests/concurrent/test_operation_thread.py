"""The engines in a long-lived process (the daemon, a restore service): an operation run on a
worker thread works, its undo too (signals are the main thread's), and once it returns, however
it ended, it holds nothing: no thread, no descriptor, no hold on a GPU context, no device or
page-locked memory of the (fake) driver's."""

import ctypes
import os
import threading
from pathlib import Path
from typing import Callable

import pytest

from pos import concurrent
from pos.errors import PosError
from pos.image.opened import open_image
from pos.operation.engine import Save
from tests.conftest import wait_for
from workloads.fill_job import image_values, torn

EVERY_RANGE = 0xFF        # tests/fakegpu/fake_common.h: every kind of range


def held(fakegpu: dict[str, Path]) -> tuple[set[str], set[str], int, int]:
    """What this process holds: its threads, its descriptors, and of the fake driver's state
    the holds on the primary context and the ranges of memory (fakeHeld)."""
    lib = ctypes.CDLL(str(fakegpu["libcuda"]))       # the library pos loaded: its state
    lib.fakeHeld.restype = ctypes.c_long
    return ({t.name for t in threading.enumerate()}, set(os.listdir("/proc/self/fd")),
            lib.fakeHeld(0), lib.fakeHeld(EVERY_RANGE))


def on_a_thread(work: Callable[[], object]) -> object:
    """`work()` on a worker thread, as a service runs it; its result, or its exception."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(work())
        except BaseException as e:  # noqa: BLE001  (handed to the test)
            out.append(e)

    t = threading.Thread(target=run, name="service-worker")
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "the operation did not return"
    return out[0]


def settled(fakegpu: dict[str, Path], before: tuple, timeout: float = 5.0) -> None:
    """Everything the operations took is let go (threads that ended may take a moment to be
    gone from threading.enumerate)."""
    wait_for(lambda: held(fakegpu) == before, timeout,
             lambda: f"what the operations held to be let go: {held(fakegpu)} != {before}")


def test_checkpoints_and_restores_on_a_worker_thread_hold_nothing_after(
        fill_job, tmp_path: Path, criu_ready, fakegpu, gpu_env) -> None:
    job = fill_job()
    concurrent.checkpoint_gpu(job.pid, tmp_path / "warm")    # the driver loaded, pos imported
    before = held(fakegpu)
    for i in range(2):
        gpu_only = on_a_thread(lambda: concurrent.checkpoint_gpu(job.pid, tmp_path / f"g{i}"))
        assert not isinstance(gpu_only, BaseException), gpu_only
        assert not torn(image_values(tmp_path / f"g{i}"))
        back = on_a_thread(lambda: concurrent.restore_gpu(job.pid, open_image(tmp_path / f"g{i}")))
        assert not isinstance(back, BaseException), back
        whole = on_a_thread(lambda: concurrent.checkpoint_full(job.pid, tmp_path / f"w{i}",
                                                               Save(leave_running=True)))
        assert not isinstance(whole, BaseException), whole
        assert job.alive()
        settled(fakegpu, before)


def test_a_failure_on_a_worker_thread_is_undone_and_holds_nothing(
        fill_job, tmp_path: Path, criu_ready, fakegpu, gpu_env,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's checkpoint fails inside the frozen part: the undo (which ignored SIGINT
    and SIGTERM through signal.signal, refused off the main thread) maps the job's memory back
    and lets it run on."""
    job = fill_job()
    concurrent.checkpoint_gpu(job.pid, tmp_path / "warm")
    before = held(fakegpu)
    monkeypatch.setenv("POS_FAKECUDA_FAIL", "cuCheckpointProcessCheckpoint")
    for i in range(2):
        failed = on_a_thread(lambda: concurrent.checkpoint_full(job.pid, tmp_path / f"w{i}",
                                                                Save(leave_running=True)))
        assert isinstance(failed, PosError), failed
        assert "cuCheckpointProcessCheckpoint" in str(failed)
        assert not (tmp_path / f"w{i}").exists() and not (tmp_path / f"w{i}.partial").exists()
        settled(fakegpu, before)
    monkeypatch.delenv("POS_FAKECUDA_FAIL")
    assert job.alive()
    assert not torn(image_values(Path(concurrent.checkpoint_gpu(job.pid, tmp_path / "after").path)))
