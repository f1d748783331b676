"""CRIU's lazy restore (POS_LAZY_PAGES=1, pos/operation/lazypages.py): the setting, the command
lines and the daemon's end without CRIU; then, through real CRIU and userfaultfd, a job of 200
MiB of private memory restored with and without it, its memory whole; the kernel's refusal in
one sentence; a damaged image, and pos killed while the daemon serves, with nothing left."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from pos.errors import BadInput
from pos.image import names
from pos.operation import lazypages
from pos.operation.plan import RestorePlan
from pos.process import criu as criu_mod
from pos.process.criu import Criu, Options
from pos.settings import Settings
from tests.conftest import reaped
from tests.image.damage import damage, largest
from tests.engines.conftest import alive, one_sentence, pos, reap, wait_for
from tests.restore.test_restore_bounds import nothing_left

JOB = Path(__file__).with_name("memory_job.py")
NO_UFFD = Path(__file__).with_name("no_uffd.py")
MIB = 200


# ---- without CRIU -------------------------------------------------------------------------

def test_the_setting_is_off_unless_1_and_a_bad_value_is_one_sentence() -> None:
    assert not Settings.from_env({}).lazy_pages
    assert not Settings.from_env({"POS_LAZY_PAGES": "0"}).lazy_pages
    assert Settings.from_env({"POS_LAZY_PAGES": "1"}).lazy_pages
    with pytest.raises(BadInput) as e:
        Settings.from_env({"POS_LAZY_PAGES": "yes"})
    assert e.value.message == ("POS_LAZY_PAGES=yes is not 0 or 1: unset it (CRIU then restores "
                               "all of the memory before the job runs).")


def test_the_daemon_and_the_restore_meet_in_one_work_folder(tmp_path: Path) -> None:
    criu = Criu("/usr/sbin/criu", (4, 2))
    img, work = tmp_path / "img", tmp_path / "work"
    daemon = criu.lazy_pages_argv(img, work, 7)
    assert daemon[:2] == ["/usr/sbin/criu", "lazy-pages"]
    assert daemon[daemon.index("-D") + 1] == str(img)
    assert daemon[daemon.index("-o") + 1] == names.LAZY_PAGES_LOG
    assert daemon[daemon.index("--status-fd") + 1] == "7"
    restore = criu.restore_argv(img, Options(), work, work / "pidfile", leave_stopped=True,
                                lazy_pages=True)
    assert "--lazy-pages" in restore
    # CRIU's socket between the two is lazy-pages.socket in the work folder of each
    assert daemon[daemon.index("-W") + 1] == restore[restore.index("-W") + 1] == str(work)
    assert "--lazy-pages" not in criu.restore_argv(img, Options(), work, work / "pidfile")


@pytest.mark.parametrize("said", [
    "Error (criu/cr-check.c:1225): UFFD is not supported",            # criu check's answer
    "Error (criu/cr-check.c:1238): Non-cooperative UFFD is not supported",
    "Error (criu/uffd.c:303): Unable to open an userfaultfd descriptor: Operation not permitted",
    "pie: 1: Error (criu/pie/restorer.c:1093): lazy-pages: register 7f0000 failed: rc:-1,"])
def test_a_refused_userfaultfd_is_one_sentence_naming_the_setting(said: str) -> None:
    e = criu_mod.known("restore", said, Path("/var/log/pos/x.log"))
    assert e is not None and isinstance(e, BadInput)
    assert e.message == ("criu restore failed: this kernel, or the sandbox pos runs in (a "
                         "container's seccomp profile), refuses CRIU the userfaultfd that a "
                         "lazy restore needs: set POS_LAZY_PAGES=0 (CRIU then restores all of "
                         "the memory before the job runs) (CRIU's log: /var/log/pos/x.log).")


def test_only_criu_s_error_lines_count_as_its_failure(tmp_path: Path) -> None:
    log = tmp_path / "criu.log"
    log.write_text("(00.1) uffd: 1-5: copy: mcopy_rc:-17, errno:17 (an error it recovered "
                   "from)\n(00.2) uffd: 1-5: UFFD transferred pages: (10/10)\n")
    assert not criu_mod.logged_error(log)
    log.write_text(log.read_text() + "(00.3) Error (criu/uffd.c:1040): 1-5: Error during "
                   "UFFD copy\n")
    assert criu_mod.logged_error(log)


def sleeper(group: bool = False) -> subprocess.Popen:
    """A process that sleeps, in a process group of its own when `group` (as CRIU's are)."""
    return subprocess.Popen(["sleep", "600"], start_new_session=group)


@pytest.fixture
def played(tmp_path: Path) -> Iterator[tuple[RestorePlan, subprocess.Popen, subprocess.Popen]]:
    """A plan whose restored tree is a sleeper, and whose daemon is another, with its log."""
    tree, daemon = sleeper(), sleeper(group=True)
    log = tmp_path / names.LAZY_PAGES_LOG
    log.write_text("(00.01) uffd: 1-5: #PF at 0x7f0000\n")
    plan = RestorePlan([tree.pid], lazy_pid=daemon.pid, lazy_log=str(log),
                       lazy_deadline=time.monotonic() + 60, log_dir=str(tmp_path / "logs"))
    yield plan, tree, daemon
    for p in (tree, daemon):
        p.kill()
        p.wait()


def gone(p: subprocess.Popen) -> bool:
    return p.poll() is not None


def test_a_daemon_that_served_every_page_leaves_the_job_running(played) -> None:
    plan, tree, _ = played
    served = subprocess.Popen(["true"], start_new_session=True)
    plan.lazy_pid = served.pid
    assert lazypages.settle(plan, served.wait) is None
    assert not gone(tree)


def test_a_daemon_killed_with_pages_left_takes_the_job_along(played) -> None:
    plan, tree, daemon = played
    daemon.kill()
    why = lazypages.settle(plan, daemon.wait)
    assert why is not None and why.message.startswith(
        "criu lazy-pages was killed (SIGKILL) before it had served all of the restored memory: "
        "the restored job was killed")
    assert tree.wait(timeout=10) == -signal.SIGKILL


def test_a_daemon_that_logged_an_error_takes_the_job_along(played) -> None:
    """The watchdog learns how the daemon ended from its log alone."""
    plan, tree, daemon = played
    Path(plan.lazy_log).write_text("(00.02) Error (criu/uffd.c:1040): 1-5: Error during UFFD "
                                   "copy\n")
    daemon.kill()
    daemon.wait()
    why = lazypages.settle(plan)
    assert why is not None and why.message.startswith(
        "criu lazy-pages failed: Error (criu/uffd.c:1040): 1-5: Error during UFFD copy: see "
        f"CRIU's log {plan.log_dir}/")
    assert tree.wait(timeout=10) == -signal.SIGKILL


def test_past_its_deadline_the_job_goes_first_then_the_daemon(played) -> None:
    plan, tree, daemon = played
    plan.lazy_deadline, plan.criu_wait_s = time.monotonic() + 1, 1
    why = lazypages.settle(plan, daemon.poll)
    assert why is not None and why.message.startswith(
        "criu lazy-pages had not served all of the restored memory 1 s after it started: the "
        "restored job was killed; raise POS_CRIU_WAIT_S, or set POS_LAZY_PAGES=0")
    assert tree.wait(timeout=10) == -signal.SIGKILL and daemon.wait(timeout=10) == -signal.SIGKILL


# ---- through CRIU ---------------------------------------------------------------------------

@pytest.fixture(scope="session")
def uffd(criu_ready: None) -> None:
    """CRIU's own word that this kernel lets it restore lazily."""
    lacks = criu_mod.find().lacks(lazypages.FEATURE)
    if lacks:
        pytest.skip(f"this kernel cannot restore lazily: criu check --feature "
                    f"{lazypages.FEATURE} says {lacks!r}")


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """pos's environment; its temporary folders go to TMPDIR, which must stay empty."""
    (tmp_path / "tmp").mkdir()
    return {"POS_DB": str(tmp_path / "pos.db"), "POS_WATCHDOG_LOG": str(tmp_path / "wd.log"),
            "POS_LOG_DIR": str(tmp_path / "logs"), "TMPDIR": str(tmp_path / "tmp")}


class MemoryJob:
    """memory_job.py (see there) in its own session."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.proc = subprocess.Popen([sys.executable, str(JOB), str(path), str(MIB)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self.pid = self.proc.pid
        self.start = Path(f"{path}.start")
        wait_for(self.start.exists, what="the job's memory")

    def holds(self) -> tuple[str, float]:
        """The sha256 of the memory it holds now, read by itself, and the seconds that took."""
        now = Path(f"{self.path}.now")
        now.unlink(missing_ok=True)
        os.kill(self.pid, signal.SIGUSR1)
        wait_for(now.exists, what="the restored job to read its memory")
        digest, seconds = now.read_text().split()
        return digest, float(seconds)

    def checkpoint(self, img: Path, env: dict[str, str]) -> None:
        """Stop-the-world: the job ends with the dump; its PID is free once reaped."""
        r = pos("checkpoint", str(self.pid), "-D", str(img), env=env)
        assert r.returncode == 0, r.stderr
        self.proc.wait(timeout=30)


@pytest.fixture
def job(tmp_path: Path, uffd: None) -> Iterator[MemoryJob]:
    made = MemoryJob(tmp_path / "job")
    yield made
    reap(made.pid)
    made.proc.poll()


def restore(img: Path, env: dict[str, str], lazy: str, *more: str,
            prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return pos("restore", "-D", str(img), *more, env={**env, "POS_LAZY_PAGES": lazy},
               prefix=prefix)


def timings(r: subprocess.CompletedProcess) -> dict[str, float]:
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["timings"]


@pytest.mark.parametrize("lazy", ["0", "1"])
def test_a_restore_gives_the_job_all_of_its_memory(tmp_path, env, job, lazy: str) -> None:
    img = tmp_path / "img"
    job.checkpoint(img, env)
    took = timings(restore(img, env, lazy, "--json"))
    assert job.holds()[0] == job.start.read_text()
    if lazy == "1":
        assert 0 < took["lazy_start"] and 0 <= took["lazy_wait"]
        assert took["criu_restore"] < took["lazy_done_at"]
    else:
        assert "lazy_start" not in took and "lazy_done_at" not in took
    nothing_left(img, env, [])            # no CRIU, the daemon none either; no work folder
    assert alive(job.pid)


def test_the_kernel_s_refusal_is_one_sentence_with_nothing_left(tmp_path, env, job) -> None:
    """userfaultfd(2) refused to pos and its CRIU, as a container's seccomp profile does."""
    img = tmp_path / "img"
    job.checkpoint(img, env)
    r = restore(img, env, "1", prefix=(sys.executable, str(NO_UFFD)))
    one_sentence(r, 2, "failed: this kernel, or the sandbox pos runs in (a container's seccomp "
                 "profile), refuses CRIU the userfaultfd that a lazy restore needs: set "
                 "POS_LAZY_PAGES=0 (CRIU then restores all of the memory before the job runs)")
    nothing_left(img, env, [job.pid])
    # the task CRIU restored, ended after CRIU: an orphan of this process (the subreaper), whose
    # zombie keeps its PID until reaped here, as PID 1 reaps it on a host
    wait_for(lambda: reaped(job.pid), what="the refused restore's task to be reaped")
    assert timings(restore(img, env, "0", "--json"))
    assert job.holds()[0] == job.start.read_text()


def test_a_damaged_image_never_runs_and_the_daemon_ends(tmp_path, env, job) -> None:
    """The image's check fails beside CRIU: the tree, given pages by the daemon while stopped,
    is killed without having run, the daemon after it."""
    img = tmp_path / "img"
    job.checkpoint(img, env)
    pages = largest(img, "pages-*.img")
    damage(pages, "flip")
    counted = job.path.read_text()
    one_sentence(restore(img, env, "1"), 2, f"of {pages.name} do not match their checksum")
    nothing_left(img, env, [job.pid])
    assert job.path.read_text() == counted


@pytest.mark.parametrize("point", ["criu-restore:criu=KILL", "verify=KILL", "lazy-pages=KILL"])
def test_pos_killed_while_the_daemon_serves_the_watchdog_sees_it_through(tmp_path, env, job,
                                                                          point: str) -> None:
    """The watchdog finishes the restore in pos's place: the check, the resume, and the
    daemon's end once it has served every page."""
    img = tmp_path / "img"
    job.checkpoint(img, env)
    r = restore(img, {**env, "POS_FAULT_AT": point}, "1")
    assert r.returncode == -9, (r.returncode, r.stderr)
    log = Path(env["POS_WATCHDOG_LOG"])
    wait_for(lambda: log.exists() and "undo done" in log.read_text(), timeout=60,
             what="the watchdog")
    assert "waiting for CRIU's lazy-pages daemon" in log.read_text()
    assert job.holds()[0] == job.start.read_text()
    nothing_left(img, env, [])


def test_a_lazy_restore_keeps_the_daemon_s_log_when_asked(tmp_path, env, job) -> None:
    img = tmp_path / "img"
    job.checkpoint(img, env)
    timings(restore(img, {**env, "POS_KEEP_RESTORE_LOG": "1"}, "1", "--json"))
    kept = list(Path(env["POS_LOG_DIR"]).glob(f"*{names.LAZY_PAGES_LOG}"))
    assert len(kept) == 1 and "UFFD transferred pages" in kept[0].read_text()
