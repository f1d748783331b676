"""The concurrent engine's images, damaged (issue 26): a file cut short, a byte flipped, a file
gone, each refused in one sentence within 60 s, with nothing left running and nothing left in
TMPDIR; a restore stopped at each step; pos killed after the seal. Real CRIU, the fake driver.
(The stop-the-world kind: tests/restore/test_restore_bounds.py.)"""

from pathlib import Path

import pytest

from pos import concurrent
from pos import image
from pos.image import names
from tests.image.damage import DAMAGES, damage, largest
from tests.engines.conftest import one_sentence, pos, wait_for
from workloads.fill_job import image_values, torn

# what the refusal names, for each damage of the file NAME
SAYS = {"truncate": "{name} has", "missing": "{name} is missing",
        "flip": "of {name} do not match their checksum"}
FILES = {"pages": "pages-*.img", "data": names.data_prefix() + "*", "index": names.INDEX}


@pytest.fixture
def env(tmp_path: Path, gpu_env: dict[str, str]) -> dict[str, str]:
    """pos's environment; its temporary folders go to TMPDIR, which must stay empty."""
    (tmp_path / "tmp").mkdir()
    return {**gpu_env, "TMPDIR": str(tmp_path / "tmp"), "POS_LOG_DIR": str(tmp_path / "logs")}


def whole_process_image(fill_job, tmp_path: Path, env: dict[str, str]):  # type: ignore[no-untyped-def]
    """A whole-process concurrent image of a fill job, which the checkpoint ended."""
    job = fill_job()
    img = tmp_path / "full"
    r = pos("checkpoint", str(job.pid), "-D", str(img), "--concurrent", env=env)
    assert r.returncode == 0, r.stderr
    job.proc.wait(timeout=30)
    return job, img


def nothing_left(job, env: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    assert not job.alive(), "the restored job runs"
    assert not list(Path(env["TMPDIR"]).iterdir()), "pos left a temporary folder"


@pytest.mark.parametrize("part,how", [("pages", h) for h in DAMAGES] +
                         [("data", h) for h in DAMAGES])
def test_a_damaged_whole_process_image_is_refused_with_nothing_run(
        fill_job, tmp_path: Path, criu_ready, env, part: str, how: str) -> None:
    """CRIU's part: refused before CRIU (size, presence) or beside it (checksum, the tree
    stopped); the GPU data: before CRIU, or by the fill's chunk check, which ends the job
    before its memory is all back (said by the command that waits for the fill; otherwise in
    the restoring process's log: tests/engines/test_detached.py)."""
    job, img = whole_process_image(fill_job, tmp_path, env)
    target = largest(img, FILES[part])
    damage(target, how)
    wait = ["--until-filled"] if (part, how) == ("data", "flip") else []
    r = pos("restore", "-D", str(img), *wait, env=env, timeout=60)
    says = "does not match its checksum" if (part, how) == ("data", "flip") else SAYS[how]
    one_sentence(r, 2, says.format(name=target.name))
    nothing_left(job, env)


@pytest.mark.parametrize("part,how", [("data", h) for h in DAMAGES] + [("index", "flip")])
def test_a_damaged_gpu_only_image_is_refused(fill_job, tmp_path: Path, env, part: str,
                                             how: str) -> None:
    """Refused before the job is touched, which runs on; but a flipped byte of the data, found
    by the chunk's check after the job was let go on demand, ends the job (it must not compute
    on a mix of restored and stale buffers)."""
    job = fill_job()
    img = Path(concurrent.checkpoint_gpu(job.pid, tmp_path / "img").path)
    saved = image_values(img)
    target = largest(img, FILES[part])
    target.chmod(0o600)
    damage(target, how)
    r = pos("restore", "--gpu-only", str(job.pid), "-D", str(img), env=env, timeout=60)
    if (part, how) == ("data", "flip"):
        one_sentence(r, 2, "does not match its checksum")
        wait_for(lambda: not job.alive(), what="the half-restored job's end")
        return
    one_sentence(r, 2, SAYS[how].format(name=target.name))
    later = image_values(Path(concurrent.checkpoint_gpu(job.pid, tmp_path / "after").path))
    assert job.alive() and not torn(later) and max(later) > max(saved)   # it went on
    assert not list(Path(env["TMPDIR"]).iterdir())


@pytest.mark.parametrize("point", ["criu-restore:criu=INT", "verify=TERM", "remap=INT",
                                   "fill=TERM"])
def test_a_whole_process_restore_stopped_at_each_step_leaves_nothing(
        fill_job, tmp_path: Path, criu_ready, env, point: str) -> None:
    job, img = whole_process_image(fill_job, tmp_path, env)
    r = pos("restore", "-D", str(img), env={**env, "POS_FAULT_AT": point})
    one_sentence(r, 1, f"restore of PID {job.pid} from {img} stopped, nothing of it left "
                 "running", "the image is untouched")
    wait_for(lambda: not job.alive(), what="the restored job's end")
    nothing_left(job, env)
    image.verify(img)


def test_pos_killed_once_the_image_is_sealed_ends_the_job(fill_job, tmp_path: Path, criu_ready,
                                                         env) -> None:
    """Without --leave-running the job ends only once its image is sealed: pos killed there,
    the watchdog ends it, and the image restores it."""
    job = fill_job()
    img = tmp_path / "full"
    r = pos("checkpoint", str(job.pid), "-D", str(img), "--concurrent",
            env={**env, "POS_FAULT_AT": "end=KILL"})
    assert r.returncode == -9, (r.returncode, r.stderr)
    log = Path(env["POS_WATCHDOG_LOG"])
    wait_for(lambda: log.exists() and "undo done" in log.read_text(), timeout=60,
             what="the watchdog")
    assert "the image is sealed: ending the tree" in log.read_text()
    job.proc.wait(timeout=30)
    saved = image_values(img)
    assert not torn(saved)
    r = pos("restore", "-D", str(img), env=env)
    assert r.returncode == 0, r.stderr
    wait_for(job.alive, what="the restored job")
    later = image_values(Path(concurrent.checkpoint_gpu(job.pid, tmp_path / "after").path))
    assert not torn(later) and max(later) > max(saved)
