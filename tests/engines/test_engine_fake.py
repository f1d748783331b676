"""The driver orchestration against the fake libcuda (real CRIU, fake GPU): the order of the
cuCheckpointProcess* calls, every injected failure, and pos killed at every step -- each time
the target must end up running, its CUDA state unlocked."""

import json
from pathlib import Path

import pytest

from pos.image import names
from tests.engines.conftest import Counter, alive, lines, one_sentence, pos, wait_for

CALLS = ("Lock", "Checkpoint", "Restore", "Unlock")


@pytest.fixture
def gpu(tmp_path: Path, fakegpu: dict[str, Path], criu_ready: None) -> dict[str, str]:
    """The environment of pos and the target: the fake driver, its log and state directory."""
    return {"POS_LIBCUDA": str(fakegpu["libcuda"]),
            "POS_FAKECUDA_LOG": str(tmp_path / "calls.log"),
            "POS_FAKECUDA_STATE_DIR": str(tmp_path / "fakecuda"),
            "POS_DB": str(tmp_path / "pos.db"),
            "POS_WATCHDOG_LOG": str(tmp_path / "wd.log")}


@pytest.fixture
def target(tmp_path: Path, gpu: dict[str, str], fakegpu: dict[str, Path], counters) -> Counter:
    c = Counter(tmp_path / "count", cuda=fakegpu["libcuda"], env=gpu)
    counters.append(c)
    return c


def calls(gpu: dict[str, str], pid: int) -> list[str]:
    """The state-changing checkpoint calls made on `pid`, in order."""
    log = Path(gpu["POS_FAKECUDA_LOG"])
    out = []
    for line in (log.read_text().splitlines() if log.exists() else []):
        name, p = line.split()
        short = name.removeprefix("cuCheckpointProcess")
        if int(p) == pid and short in CALLS:
            out.append(short)
    return out


def cuda_state(gpu: dict[str, str], pid: int) -> str:
    return (Path(gpu["POS_FAKECUDA_STATE_DIR"]) / str(pid)).read_text().strip()


def runs_unlocked(c: Counter, gpu: dict[str, str]) -> None:
    assert c.running()
    assert cuda_state(gpu, c.pid) == "running"


def test_checkpoint_then_restore_calls_the_driver_in_order(tmp_path, gpu, target) -> None:
    img = tmp_path / "img"
    r = pos("checkpoint", str(target.pid), "-D", str(img), env=gpu)
    assert r.returncode == 0, r.stderr
    assert calls(gpu, target.pid) == ["Lock", "Checkpoint"]
    assert cuda_state(gpu, target.pid) == "checkpointed"
    manifest = json.loads((img / names.MANIFEST).read_text())
    assert manifest["gpu_pids"] == [target.pid] and manifest["cuda_version"]
    # CRIU's kernel-feature cache kept before the lock (pos/process/kdat.py), timed
    assert {"criu_cache", "lock", "checkpoint", "dump"} <= set(manifest["timings"])
    target.reap_original()
    at_dump = len(lines(target.path))
    r = pos("restore", "-D", str(img), env=gpu)
    assert r.returncode == 0, r.stderr
    assert calls(gpu, target.pid) == ["Lock", "Checkpoint", "Restore", "Unlock"]
    wait_for(lambda: len(lines(target.path)) > at_dump + 10, what="the restored counter")
    values = lines(target.path)
    assert values == list(range(1, len(values) + 1))
    runs_unlocked(target, gpu)


def test_leave_running_restores_and_unlocks_the_original(tmp_path, gpu, target) -> None:
    r = pos("checkpoint", str(target.pid), "-D", str(tmp_path / "img"), "--leave-running",
            env=gpu)
    assert r.returncode == 0, r.stderr
    assert calls(gpu, target.pid) == ["Lock", "Checkpoint", "Restore", "Unlock"]
    manifest = json.loads((tmp_path / "img" / names.MANIFEST).read_text())
    assert manifest["stall_s"] >= manifest["timings"]["dump"]
    at = manifest["timings"]
    assert 0 <= at["step_lock_at"] <= at["step_dump_at"] <= at["step_restore_at"] \
        <= at["step_seal_at"]                 # when each step began
    runs_unlocked(target, gpu)


@pytest.mark.parametrize("fail,leave_running", [
    ("cuCheckpointProcessLock", False),
    ("cuCheckpointProcessCheckpoint", False),
    ("cuCheckpointProcessRestore:1", True),     # once: the undo's retry gets past it
    ("cuCheckpointProcessUnlock:1", True),
])
def test_injected_driver_failure_leaves_the_target_running(tmp_path, gpu, target, fail,
                                                           leave_running) -> None:
    args = ["checkpoint", str(target.pid), "-D", str(tmp_path / "img")]
    r = pos(*args, *(["--leave-running"] if leave_running else []),
            env={**gpu, "POS_FAKECUDA_FAIL": fail})
    one_sentence(r, 1, fail.split(":")[0], "CUDA_ERROR_UNKNOWN")
    runs_unlocked(target, gpu)
    assert not (tmp_path / "img").exists() and not names.partial(tmp_path / "img").exists()


def test_a_job_the_driver_cannot_restore_in_place_is_ended_its_image_sealed(
        tmp_path, gpu, target) -> None:
    """A restore in place that fails twice: the driver refuses every later one (NVIDIA's
    cuda-checkpoint issue 44), so the job could never run again. Its image, whole, is sealed and
    restores where the driver takes it (the fake does; the real driver refused one such image
    too, so the sentence names the concurrent engine); the job is ended rather than left
    locked."""
    img = tmp_path / "img"
    r = pos("checkpoint", str(target.pid), "-D", str(img), "--leave-running",
            env={**gpu, "POS_FAKECUDA_FAIL": "cuCheckpointProcessRestore"})
    one_sentence(r, 1, f"could not give PID {target.pid} its GPU state back in place",
                 "pos ended the job", f"pos restore -D {img}", "pos checkpoint --concurrent")
    assert calls(gpu, target.pid) == ["Lock", "Checkpoint", "Restore", "Restore"]
    target.reap_original()                      # ended
    at_dump = len(lines(target.path))
    r = pos("restore", "-D", str(img), env=gpu)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: len(lines(target.path)) > at_dump + 10, what="the restored counter")


def test_failure_the_undo_cannot_fix_is_said(tmp_path, gpu, target) -> None:
    r = pos("checkpoint", str(target.pid), "-D", str(tmp_path / "img"), "--leave-running",
            env={**gpu, "POS_FAKECUDA_FAIL": "cuCheckpointProcessUnlock"})
    one_sentence(r, 1, "undoing it failed too")
    assert cuda_state(gpu, target.pid) == "locked"     # said, not hidden


def test_criu_failure_after_the_driver_checkpoint_is_undone(tmp_path, gpu, target) -> None:
    fake = tmp_path / "criu"
    from pos.process import criu

    real = criu.find().path
    fake.write_text(f"#!/bin/sh\n[ \"$1\" = dump ] && {{ echo 'Error (fake): dump refused' "
                    f">&2; exit 1; }}\nexec {real} \"$@\"\n")
    fake.chmod(0o755)
    r = pos("checkpoint", str(target.pid), "-D", str(tmp_path / "img"),
            env={**gpu, "POS_CRIU": str(fake)})
    one_sentence(r, 1, "criu dump failed")
    assert calls(gpu, target.pid) == ["Lock", "Checkpoint", "Restore", "Unlock"]
    runs_unlocked(target, gpu)


@pytest.mark.parametrize("point,leave_running", [
    ("lock=TERM", False),
    ("checkpoint=INT", False),
    ("dump=TERM", False),
    ("dump:criu=TERM", False),
    ("seal=INT", False),
])
def test_signal_at_each_step_is_undone(tmp_path, gpu, target, point, leave_running) -> None:
    r = pos("checkpoint", str(target.pid), "-D", str(tmp_path / "img"),
            env={**gpu, "POS_FAULT_AT": point})
    one_sentence(r, 1, "interrupted and undone")
    assert target.proc.poll() is None        # CRIU left it stopped, never ended it
    runs_unlocked(target, gpu)
    assert not (tmp_path / "img").exists() and not names.partial(tmp_path / "img").exists()


@pytest.mark.parametrize("point,leave_running", [
    ("lock=KILL", False),
    ("checkpoint=KILL", False),
    ("dump=KILL", False),
    ("dump:criu=KILL", False),
    ("seal=KILL", False),
    ("restore=KILL", True),
    ("unlock=KILL", True),
    ("dump:criu=KILL", True),
])
def test_pos_killed_at_each_step_the_watchdog_undoes(tmp_path, gpu, target, point,
                                                     leave_running) -> None:
    args = ["checkpoint", str(target.pid), "-D", str(tmp_path / "img")]
    r = pos(*args, *(["--leave-running"] if leave_running else []),
            env={**gpu, "POS_FAULT_AT": point})
    assert r.returncode == -9, (r.returncode, r.stderr)
    log = Path(gpu["POS_WATCHDOG_LOG"])
    wait_for(lambda: log.exists() and "undo done" in log.read_text(), timeout=60,
             what="the watchdog's undo")
    assert target.proc.poll() is None        # CRIU left it stopped, never ended it
    assert alive(target.pid)
    runs_unlocked(target, gpu)
    assert not (tmp_path / "img").exists() and not names.partial(tmp_path / "img").exists()


@pytest.mark.parametrize("point", ["criu-restore:criu=KILL", "verify=KILL", "restore=KILL",
                                   "unlock=KILL"])
def test_pos_killed_during_restore_the_watchdog_finishes_it(tmp_path, gpu, target,
                                                            point) -> None:
    img = tmp_path / "img"
    assert pos("checkpoint", str(target.pid), "-D", str(img), env=gpu).returncode == 0
    target.reap_original()
    r = pos("restore", "-D", str(img), env={**gpu, "POS_FAULT_AT": point})
    assert r.returncode == -9, (r.returncode, r.stderr)
    log = Path(gpu["POS_WATCHDOG_LOG"])
    wait_for(lambda: log.exists() and "undo done" in log.read_text(), timeout=60,
             what="the watchdog")
    runs_unlocked(target, gpu)


def test_pos_killed_while_a_corrupt_image_is_checked_the_tree_never_runs(tmp_path, gpu,
                                                                          target) -> None:
    """pos dies while CRIU restores: the watchdog lets CRIU finish (the tree stopped), then
    finds the image bad and ends the tree. (A pos that lives ends CRIU itself once the check
    fails: test_restore_bounds.py.)"""
    img = tmp_path / "img"
    assert pos("checkpoint", str(target.pid), "-D", str(img), env=gpu).returncode == 0
    target.reap_original()
    counted = target.path.read_text()
    pages = next(img.glob("pages-*.img"))
    data = bytearray(pages.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pages.write_bytes(bytes(data))
    r = pos("restore", "-D", str(img), env={**gpu, "POS_FAULT_AT": "criu-restore:criu=KILL"})
    assert r.returncode == -9, (r.returncode, r.stderr)
    log = Path(gpu["POS_WATCHDOG_LOG"])
    wait_for(lambda: log.exists() and "undo done" in log.read_text(), timeout=60,
             what="the watchdog")
    assert "killing the restored tree, which never ran" in log.read_text()
    wait_for(lambda: not alive(target.pid), what="the restored tree to be gone")
    assert target.path.read_text() == counted


def test_restore_failure_leaves_nothing_half_restored(tmp_path, gpu, target) -> None:
    img = tmp_path / "img"
    assert pos("checkpoint", str(target.pid), "-D", str(img), env=gpu).returncode == 0
    target.reap_original()
    r = pos("restore", "-D", str(img), env={**gpu, "POS_FAKECUDA_FAIL": "cuCheckpointProcessRestore"})
    one_sentence(r, 1, "cuCheckpointProcessRestore failed")
    wait_for(lambda: not alive(target.pid), what="the half-restored process to be gone")


def test_image_from_another_driver_is_refused(tmp_path, gpu, target) -> None:
    img = tmp_path / "img"
    assert pos("checkpoint", str(target.pid), "-D", str(img), env=gpu).returncode == 0
    target.reap_original()
    path = img / names.MANIFEST
    manifest = json.loads(path.read_text())
    manifest["cuda_version"] = 11000
    path.write_text(json.dumps(manifest))
    one_sentence(pos("restore", "-D", str(img), env=gpu), 2,
                 "was taken with a CUDA 11000 driver", "same driver")


def test_migrate_to_gpu_needs_nvml(gpu, target) -> None:
    # the fake driver has no NVML beside it: the GPUs cannot be named, nothing is touched
    one_sentence(pos("migrate", str(target.pid), "--to-gpu", "1", env=gpu), 2,
                 "NVML is not available")
    assert calls(gpu, target.pid) == []
    runs_unlocked(target, gpu)


def test_restore_to_gpu_needs_nvml_and_a_whole_process_image(gpu, tmp_path: Path) -> None:
    # the fake driver has no NVML beside it: the GPUs cannot be named, nothing is restored
    one_sentence(pos("restore", "-D", str(tmp_path), "--to-gpu", "1", env=gpu), 2,
                 "NVML is not available")
    r = pos("restore", "-D", str(tmp_path), "--to-gpu", "1", "--gpu-only", "123", env=gpu)
    assert r.returncode == 2 and "--to-gpu goes with whole-process images" in r.stderr


def test_the_driver_numbers_a_gpu_named_by_nvml(gpu, monkeypatch) -> None:
    from pos.concurrent import gpucopy
    from pos.errors import PosError

    monkeypatch.setenv("POS_LIBCUDA", gpu["POS_LIBCUDA"])
    monkeypatch.setenv("POS_FAKECUDA_STATE_DIR", gpu["POS_FAKECUDA_STATE_DIR"])
    assert gpucopy.ordinal("GPU-10111213-1415-1617-1819-1a1b1c1d1e1f") == 0
    with pytest.raises(PosError, match="does not see GPU-00"):
        gpucopy.ordinal("GPU-00000000-0000-0000-0000-000000000000")


def test_migrate_usage_errors(criu_ready) -> None:
    r = pos("migrate", "123")
    assert r.returncode == 2 and "exactly one of --to-gpu N, --to HOST, --listen or --new-key" in r.stderr
    r = pos("migrate", "--listen")
    assert r.returncode == 2 and "--listen needs -D DIR" in r.stderr
    r = pos("migrate", "123", "--to-gpu", "1", "-D", "/tmp/nowhere")
    assert r.returncode == 2 and "-D goes with --to-gpu only with --concurrent" in r.stderr
