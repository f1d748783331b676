"""A restore ends, in one sentence, bounded in time and disk, with nothing left behind (issue 26):
a damaged stop-the-world image of a plain process through real CRIU; a restorer that loops on a
short read (ended when the check beside it fails, or when its log passes its bound); SIGINT or
SIGTERM in the middle; and the work folder of a failed restore removed, CRIU's log kept."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pos import image
from pos.image import names
from pos.process import procs
from tests.conftest import ROOT
from tests.image.damage import DAMAGES, damage, largest, record_as_is
from tests.engines.conftest import Counter, alive, lines, one_sentence, pos, wait_for

# what the refusal names, for each damage of the file NAME
SAYS = {"truncate": "{name} has", "flip": "of {name} do not match their checksum",
        "missing": "{name} is missing"}


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """pos's environment; its temporary folders go to TMPDIR, which must stay empty."""
    (tmp_path / "tmp").mkdir()
    return {"POS_DB": str(tmp_path / "pos.db"), "POS_WATCHDOG_LOG": str(tmp_path / "wd.log"),
            "POS_LOG_DIR": str(tmp_path / "logs"), "TMPDIR": str(tmp_path / "tmp")}


def running_with(text: str) -> list[int]:
    """The live processes whose command line holds `text` (a CRIU given the image's folder)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if d.name.isdigit() and text in cmdline and procs.alive(int(d.name)):
            found.append(int(d.name))
    return found


def nothing_left(img: Path, env: dict[str, str], pids: list[int]) -> None:
    """No CRIU of the image runs, none of its processes lives, no temporary folder is left."""
    assert not running_with(str(img)), "a CRIU of the image runs on"
    assert not [p for p in pids if alive(p)], "a process of the image lives"
    assert not list(Path(env["TMPDIR"]).iterdir()), "pos left a temporary folder"


def log_bytes(env: dict[str, str]) -> int:
    """What the restore's CRIU has logged so far (in its work folder, under TMPDIR)."""
    return sum(f.stat().st_size for f in Path(env["TMPDIR"]).glob(f"pos-*/{names.RESTORE_LOG}"))


def image_of(tmp_path: Path, counters: list[Counter], env: dict[str, str]
             ) -> tuple[Counter, Path]:
    """A counter with 16 MiB of ballast, checkpointed (it ends) and reaped: its PID is free."""
    c = Counter(tmp_path / "count", ballast_mb=16)
    counters.append(c)
    img = tmp_path / "img"
    r = pos("checkpoint", str(c.pid), "-D", str(img), env=env)
    assert r.returncode == 0, r.stderr
    c.reap_original()
    return c, img


def looping(img: Path, sizes_only: bool) -> Path:
    """Cut the largest pages file in half and make the manifest agree (`sizes_only`: in its
    size, not its checksums). CRIU's restorer then loops on the short read for good."""
    pages = largest(img, "pages-*.img")
    damage(pages, "truncate")
    record_as_is(img, pages.name, sizes_only)
    return pages


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_image_is_refused_in_one_sentence_with_nothing_run(tmp_path, counters, env,
                                                                    how: str) -> None:
    c, img = image_of(tmp_path, counters, env)
    pages = largest(img, "pages-*.img")
    damage(pages, how)
    counted = c.path.read_text()
    r = pos("restore", "-D", str(img), env=env, timeout=60)
    one_sentence(r, 2, SAYS[how].format(name=pages.name))
    nothing_left(img, env, [c.pid])
    assert c.path.read_text() == counted


def test_a_check_that_fails_beside_criu_ends_it_at_once(tmp_path, counters, env) -> None:
    """The size agrees with the manifest, the checksum does not: CRIU, looping on the short
    read, is ended as soon as the check fails (pos waited for it for good before)."""
    c, img = image_of(tmp_path, counters, env)
    pages = looping(img, sizes_only=True)
    r = pos("restore", "-D", str(img), env={**env, "POS_CRIU_LOG_MAX_MB": "100000"},
            timeout=60)
    one_sentence(r, 2, f"of {pages.name} do not match their checksum")
    nothing_left(img, env, [c.pid])


def test_a_criu_that_loops_is_ended_by_its_log_bound(tmp_path, counters, env) -> None:
    """pos finds nothing wrong (the manifest was made to agree), CRIU loops: its log is bounded,
    a bounded copy of it kept and named."""
    c, img = image_of(tmp_path, counters, env)
    looping(img, sizes_only=False)
    r = pos("restore", "-D", str(img), env={**env, "POS_CRIU_LOG_MAX_MB": "4"}, timeout=60)
    said = one_sentence(r, 1, "criu restore was ended after its log passed 4 MiB, repeating",
                        "check it with `pos inspect DIR --verify`")
    kept = Path(re.search(r"CRIU's log: (\S+) \(", said).group(1))
    assert kept.parent == Path(env["POS_LOG_DIR"]) and kept.stat().st_size > 4 << 20
    nothing_left(img, env, [c.pid])


def test_pos_killed_while_criu_loops_the_watchdog_ends_it(tmp_path, counters, env) -> None:
    """pos dies during a restore whose CRIU loops: the watchdog ends CRIU by its log bound and
    removes pos's work folder."""
    c, img = image_of(tmp_path, counters, env)
    looping(img, sizes_only=False)
    r = pos("restore", "-D", str(img), env={**env, "POS_CRIU_LOG_MAX_MB": "4",
                                            "POS_FAULT_AT": "criu-restore:criu=KILL"})
    assert r.returncode == -9, (r.returncode, r.stderr)
    log = Path(env["POS_WATCHDOG_LOG"])
    wait_for(lambda: log.exists() and "undo done" in log.read_text(), timeout=60,
             what="the watchdog")
    assert "passed 4 MiB" in log.read_text() and "ending CRIU" in log.read_text()
    nothing_left(img, env, [c.pid])


def test_a_bad_log_bound_is_one_sentence(tmp_path, counters, env) -> None:
    c, img = image_of(tmp_path, counters, env)
    one_sentence(pos("restore", "-D", str(img), env={**env, "POS_CRIU_LOG_MAX_MB": "0"}), 2,
                 "POS_CRIU_LOG_MAX_MB=0 is not a whole number of MiB")
    nothing_left(img, env, [c.pid])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_ends_a_restore_within_2_s(tmp_path, counters, env, sig) -> None:
    """While CRIU's restorer loops: pos ends within 2 s, says so, leaves nothing running and
    the image as it was."""
    c, img = image_of(tmp_path, counters, env)
    looping(img, sizes_only=False)
    before = {f.name: (f.stat().st_size, f.stat().st_mtime_ns) for f in img.iterdir()}
    p = subprocess.Popen([sys.executable, "-m", "pos.cli", "restore", "-D", str(img)],
                         cwd=ROOT, env={**os.environ, **env,
                                        "POS_CRIU_LOG_MAX_MB": "100000"},
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: p.poll() is not None or log_bytes(env) > 1 << 20,
                 what="CRIU's restorer looping")
        assert p.poll() is None and alive(c.pid), p.communicate()
        t0 = time.monotonic()
        p.send_signal(sig)
        out, err = p.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    one_sentence(r, 1, f"restore of PID {c.pid} from {img} stopped, nothing of it left running",
                 "the image is untouched")
    assert took < 2, took
    nothing_left(img, env, [c.pid])
    assert {f.name: (f.stat().st_size, f.stat().st_mtime_ns) for f in img.iterdir()} == before
    image.verify(img)


@pytest.mark.parametrize("point", ["criu-restore:criu=INT", "verify=TERM"])
def test_a_restore_stopped_at_each_step_leaves_nothing(tmp_path, counters, env,
                                                       point: str) -> None:
    """Stopped while CRIU runs, or while the restored tree waits (stopped) for the check."""
    c, img = image_of(tmp_path, counters, env)
    counted = c.path.read_text()
    r = pos("restore", "-D", str(img), env={**env, "POS_FAULT_AT": point})
    one_sentence(r, 1, "stopped, nothing of it left running", "the image is untouched")
    nothing_left(img, env, [c.pid])
    assert c.path.read_text() == counted
    image.verify(img)


def test_a_failed_restore_keeps_criu_s_log_and_no_work_folder(tmp_path, counters, env) -> None:
    """CRIU fails (an mm image gone, the manifest made to agree): the error names CRIU's log,
    kept under POS_LOG_DIR; the work folder is gone."""
    c, img = image_of(tmp_path, counters, env)
    mm = next(img.glob("mm-*.img"))
    mm.unlink()
    manifest = json.loads((img / names.MANIFEST).read_text())
    del manifest["files"][mm.name]
    (img / names.MANIFEST).write_text(json.dumps(manifest))
    r = pos("restore", "-D", str(img), env=env)
    said = one_sentence(r, 1, "criu restore failed: ", "see CRIU's log ")
    kept = Path(said.rsplit("see CRIU's log ", 1)[1].rstrip("."))
    assert kept.parent == Path(env["POS_LOG_DIR"]) and "Error" in kept.read_text()
    nothing_left(img, env, [c.pid])
    assert lines(c.path) == list(range(1, len(lines(c.path)) + 1))
