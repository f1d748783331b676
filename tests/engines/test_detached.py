"""`pos restore` of a concurrent image where no restore service runs: a process of pos's own,
detached from the command, restores it; the command returns once the job runs while that
process fills the rest of its device memory (the fake driver's copies to the device made slow),
and removes its log once the fill succeeded. A failure before the job runs is the command's
one sentence, with its exit code, and stays in the log; one after it (damaged GPU data) ends
the job and is said in the log; a restorer killed half-way is said in one sentence, and its
watchdog ends the half-restored job. With the restore itself stood in for: the protocol between
the command and its restorer (lines, Running, --until-filled, a restore left to the command, a
failure, a bug) and an unwritable log folder."""

import json
import os
import time
from pathlib import Path
from typing import Callable, Optional

import pytest

from pos import concurrent
from pos.engines import detached, service
from pos.engines.service_protocol import Failed, InProcess, Message, Request, Restored, Running
from pos.errors import BadInput, PosError
from pos.image import gpuindex, names
from pos.operation import oplock
from tests.agent.conftest import fill_job, gpu_env, ran_past  # noqa: F401  (fixtures)
from tests.conftest import wait_for
from tests.engines.conftest import one_sentence, pos
from tests.engines.test_service import SLOW_LINK_US, saved_job
from tests.image.damage import damage, largest
from workloads.fill_job import image_values, torn


def logs(env: dict[str, str]) -> list[Path]:
    return sorted(Path(env["POS_LOG_DIR"]).glob("*-restore.log"))


def test_the_command_returns_once_the_job_runs_and_the_fill_goes_on(
        fill_job, gpu_env, tmp_path: Path, criu_ready) -> None:
    env = {**gpu_env, "POS_LOG_DIR": str(tmp_path / "logs")}
    job, img, saved = saved_job(fill_job, gpu_env, tmp_path)
    t = time.monotonic()
    r = pos("restore", "-D", str(img), "--json",
            env={**env, "POS_FAKECUDA_HTOD_DELAY_US": str(SLOW_LINK_US)})
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t < SLOW_LINK_US / 1e6     # before a single copy to the device
    report = json.loads(r.stdout)
    assert report["restored_pid"] == job.pid and report["filling"] is True
    assert report["bytes"] == sum(b.size for b in gpuindex.read(img).buffers)
    assert "all_back_at" not in report["timings"] and report["h2d_gbps"] is None
    (log,) = logs(env)              # the restorer's, while it fills
    assert log.stat().st_mode & 0o777 == 0o600
    with oplock.deletable(img) as free:
        assert not free             # retention leaves the image the fill reads
    wait_for(lambda: not log.exists(), timeout=60, what="the fill's end (its log removed)")
    with oplock.deletable(img) as free:
        assert free
    ran_past(job.pid, max(saved))
    later = image_values(Path(concurrent.checkpoint_gpu(job.pid, tmp_path / "after").path))
    assert not torn(later) and max(later) > max(saved)


def test_until_filled_waits_for_the_restorer_s_figures(fill_job, gpu_env, tmp_path: Path,
                                                      criu_ready) -> None:
    env = {**gpu_env, "POS_LOG_DIR": str(tmp_path / "logs")}
    job, img, saved = saved_job(fill_job, gpu_env, tmp_path)
    r = pos("restore", "-D", str(img), "--until-filled", "--json", env=env)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["filling"] is False and report["timings"]["all_back_at"] > 0
    assert report["h2d_gbps"] > 0 and report["restored_pid"] == job.pid
    wait_for(lambda: logs(env) == [], what="the restorer's log removed")
    ran_past(job.pid, max(saved))


def test_a_failure_before_the_job_runs_is_one_sentence_and_stays_in_the_log(
        fill_job, gpu_env, tmp_path: Path, criu_ready) -> None:
    env = {**gpu_env, "POS_LOG_DIR": str(tmp_path / "logs")}
    job, img, _saved = saved_job(fill_job, gpu_env, tmp_path)
    target = largest(img, "pages-*.img")
    damage(target, "truncate")
    r = pos("restore", "-D", str(img), env=env)
    said = one_sentence(r, 2, f"{target.name} has")
    assert not job.alive()
    (log,) = logs(env)
    assert log.read_text().splitlines()[-1] == \
        f"restore of {img}: {said.removeprefix('Error: ')}"


def test_a_restorer_killed_half_way_is_one_sentence_and_its_job_ends(
        fill_job, gpu_env, tmp_path: Path, criu_ready) -> None:
    env = {**gpu_env, "POS_LOG_DIR": str(tmp_path / "logs")}
    job, img, _saved = saved_job(fill_job, gpu_env, tmp_path)
    r = pos("restore", "-D", str(img), env={**env, "POS_FAULT_AT": "remap=KILL"})
    one_sentence(r, 1, "pos's restoring process gave no outcome for the restore",
                 str(logs(env)[0]))
    wait_for(lambda: not os.path.exists(f"/proc/{job.pid}") or
             open(f"/proc/{job.pid}/stat").read().split()[2] == "Z", timeout=60,
             what="the half-restored job's end")


def test_a_fill_that_fails_after_the_return_ends_the_job_and_says_why_in_the_log(
        fill_job, gpu_env, tmp_path: Path, criu_ready) -> None:
    """A flipped byte of the GPU data is found by the fill's chunk check, after the command
    returned (the fill starts at the job's release: by default it may meet the damage before,
    and the command says it): the restorer ends the job and its log ends with the sentence."""
    env = {**gpu_env, "POS_LOG_DIR": str(tmp_path / "logs"), "POS_FILL_FROM": "release"}
    job, img, _saved = saved_job(fill_job, gpu_env, tmp_path)
    target = largest(img, names.data_prefix() + "*")
    damage(target, "flip")
    r = pos("restore", "-D", str(img), "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["filling"] is True
    (log,) = logs(env)
    wait_for(lambda: f"{target.name} does not match its checksum" in log.read_text(),
             timeout=60, what="the fill's failure in the restorer's log")
    assert log.read_text().splitlines()[-1].startswith(f"restore of {img}: ")
    wait_for(lambda: not os.path.exists(f"/proc/{job.pid}") or
             open(f"/proc/{job.pid}/stat").read().split()[2] == "Z", timeout=60,
             what="the job's end")


# ---- the protocol between the command and its restorer, the restore itself stood in for -----

def restorer_does(monkeypatch: pytest.MonkeyPatch, restore: Callable[..., Message]) -> None:
    """The restorer (a fork of this process) runs `restore(echo, running)` in place of the
    service's restore."""
    def stand_in(request: Request, echo: Callable[[str], None],
                 running: Optional[Callable[[Running], None]] = None) -> Message:
        return restore(echo, running)
    monkeypatch.setattr(service, "restore", stand_in)


def test_lines_then_running_reach_the_command_and_the_fill_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def restore(echo: Callable[[str], None],
                running: Optional[Callable[[Running], None]]) -> Message:
        echo("restoring PID 7")
        assert running is not None
        running(Running("/img", {"filling": True}, ["restored PID 7 from /img"]))
        (tmp_path / "filled").write_text("")          # after the command returned
        return Restored("/img", {"filling": False}, ["restored PID 7 from /img"])
    restorer_does(monkeypatch, restore)
    said: list[str] = []
    out = detached.restore(str(tmp_path / "img"), None, said.append, tmp_path / "logs")
    assert isinstance(out, Running) and out.report == {"filling": True}
    assert said == ["restoring PID 7"]
    wait_for(lambda: (tmp_path / "filled").exists() and not list(
        (tmp_path / "logs").glob("*-restore.log")), what="the restorer's end, its log removed")


def test_until_filled_asks_for_no_running(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def restore(echo: Callable[[str], None],
                running: Optional[Callable[[Running], None]]) -> Message:
        return Restored("/img", {"running": running is not None}, [])
    restorer_does(monkeypatch, restore)
    out = detached.restore(str(tmp_path / "img"), "1", lambda _: None, tmp_path / "logs",
                           until_filled=True)
    assert isinstance(out, Restored) and out.report == {"running": False}


def test_a_restore_left_to_the_command_leaves_no_log(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    restorer_does(monkeypatch, lambda echo, running: InProcess("a shell job"))
    assert detached.restore(str(tmp_path / "img"), None, lambda _: None,
                            tmp_path / "logs") is None
    wait_for(lambda: not list((tmp_path / "logs").glob("*-restore.log")),
             what="the restorer's log removed")


def test_a_failure_is_raised_with_its_exit_code_and_kept_in_the_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    restorer_does(monkeypatch, lambda echo, running: Failed("the image is bad", "take another",
                                                            2))
    with pytest.raises(PosError) as e:
        detached.restore(str(tmp_path / "img"), None, lambda _: None, tmp_path / "logs")
    assert e.value.exit_code == 2 and e.value.message == "the image is bad: take another."
    (log,) = (tmp_path / "logs").glob("*-restore.log")
    wait_for(lambda: log.read_text() == f"restore of {tmp_path / 'img'}: {e.value.message}\n",
             what="the failure's sentence in the log")
    assert log.stat().st_mode & 0o777 == 0o600


def test_a_bug_in_the_restorer_is_one_sentence_here_and_a_traceback_in_its_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def restore(echo: Callable[[str], None],
                running: Optional[Callable[[Running], None]]) -> Message:
        raise RuntimeError("a bug")
    restorer_does(monkeypatch, restore)
    with pytest.raises(PosError) as e:
        detached.restore(str(tmp_path / "img"), None, lambda _: None, tmp_path / "logs")
    (log,) = (tmp_path / "logs").glob("*-restore.log")
    assert "gave no outcome" in e.value.message and str(log) in e.value.message
    assert "RuntimeError: a bug" in log.read_text()


def test_an_unwritable_log_folder_is_said_before_anything_is_restored(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(BadInput) as e:
        detached.restore(str(tmp_path / "img"), None, lambda _: None, tmp_path / "file" / "logs")
    assert "POS_LOG_DIR" in e.value.message
