"""`pos checkpoint` / `pos restore` of CPU processes through real CRIU (root, no GPU)."""

import json
import os
import re
from pathlib import Path

import pytest

from pos.image import criustats, names
from pos.process import procs

from tests.engines.conftest import Counter, lines, one_sentence, pos, reap, wait_for


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"POS_DB": str(tmp_path / "pos.db"), "POS_WATCHDOG_LOG": str(tmp_path / "wd.log"),
            "POS_LOG_DIR": str(tmp_path / "logs")}


def continues(c: Counter, restored_after: dict[Path, int]) -> None:
    """Each file counts on without a gap or a repeat after the restore."""
    wait_for(lambda: all(len(lines(f)) > restored_after[f] + 20 for f in c.files),
             what="the restored counter")
    for f in c.files:
        values = lines(f)
        assert values == list(range(1, len(values) + 1)), f"{f}: {values[:5]}...{values[-5:]}"


def test_dump_and_restore_continue_from_the_dumped_value(tmp_path, counters, env) -> None:
    c = Counter(tmp_path / "count")
    counters.append(c)
    r = pos("checkpoint", str(c.pid), "-D", str(tmp_path / "img"), env=env)
    assert r.returncode == 0, r.stderr
    c.reap_original()
    at_dump = {f: len(lines(f)) for f in c.files}
    assert not names.partial(tmp_path / "img").exists()
    r = pos("restore", "-D", str(tmp_path / "img"), env=env)
    assert r.returncode == 0, r.stderr
    assert f"restored PID {c.pid}" in r.stdout
    continues(c, at_dump)


def test_leave_running_then_restore(tmp_path, counters, env) -> None:
    c = Counter(tmp_path / "count")
    counters.append(c)
    before = len(lines(c.path))
    r = pos("checkpoint", str(c.pid), "-D", str(tmp_path / "img"), "--leave-running", env=env)
    assert r.returncode == 0, r.stderr
    after = len(lines(c.path))
    assert c.running()
    manifest = json.loads((tmp_path / "img" / names.MANIFEST).read_text())
    assert manifest["leave_running"] and manifest["stall_s"] is not None
    c.proc.kill()
    c.reap_original()
    killed_at = len(lines(c.path))
    r = pos("restore", "-D", str(tmp_path / "img"), env=env)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: len(lines(c.path)) > killed_at + 10, what="the restored counter")
    resumed = lines(c.path)[killed_at:]
    # the restored process continues from the value it had during the dump
    assert before < resumed[0] <= after + 1, (before, resumed[0], after)
    assert resumed == list(range(resumed[0], resumed[0] + len(resumed)))


def test_process_tree(tmp_path, counters, env) -> None:
    c = Counter(tmp_path / "count", children=2)
    counters.append(c)
    tree = c.pids()
    assert len(tree) == 3
    r = pos("checkpoint", str(c.pid), "-D", str(tmp_path / "img"), env=env)
    assert r.returncode == 0, r.stderr
    c.reap_original()
    at_dump = {f: len(lines(f)) for f in c.files}
    r = pos("restore", "-D", str(tmp_path / "img"), env=env)
    assert r.returncode == 0, r.stderr
    assert c.pids() == tree
    continues(c, at_dump)


def test_shell_job_needs_the_option(tmp_path, counters, env) -> None:
    c = Counter(tmp_path / "count", shell_job=True)
    counters.append(c)
    r = pos("checkpoint", str(c.pid), "-D", str(tmp_path / "img"), env=env)
    # a background job of a shell, no terminal anywhere: not "a terminal session"
    one_sentence(r, 2, f"PID {c.pid} does not lead its session: the session's leader (the shell "
                 "or script that started it) is not part of the dump: add --shell-job, or start "
                 "the job in a session of its own (setsid COMMAND) (CRIU's log: ")
    assert c.running()
    assert not (tmp_path / "img").exists() and not names.partial(tmp_path / "img").exists()
    # the log the sentence names outlives the removed image folder, root-only
    log = Path(re.search(r"CRIU's log: (\S+?)\)", r.stderr).group(1))
    assert log.parent == tmp_path / "logs" and "Error" in log.read_text()
    assert log.stat().st_mode & 0o777 == 0o600
    r = pos("checkpoint", str(c.pid), "-D", str(tmp_path / "img"), "--shell-job", env=env)
    assert r.returncode == 0, r.stderr
    c.reap_original()
    at_dump = {f: len(lines(f)) for f in c.files}
    r = pos("restore", "-D", str(tmp_path / "img"), env=env)
    assert r.returncode == 0, r.stderr
    continues(c, at_dump)


def test_image_is_root_only_listed_and_inspected(tmp_path, counters, env) -> None:
    c = Counter(tmp_path / "count")
    counters.append(c)
    img = tmp_path / "img"
    assert pos("checkpoint", str(c.pid), "-D", str(img), "--leave-running",
               env=env).returncode == 0
    assert img.stat().st_mode & 0o777 == 0o700
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in img.iterdir())
    manifest = json.loads((img / names.MANIFEST).read_text())
    assert manifest["pid"] == c.pid and manifest["gpu_pids"] == []
    assert set(manifest["files"]) == {f.name for f in img.iterdir()} - {names.MANIFEST}
    timings = manifest["timings"]
    assert {"dump", "checksum", "frozen", "criu_memdump", "criu_memwrite"} <= set(timings)
    assert 0 < timings["frozen"] <= timings["dump"] and timings["criu_written_mib"] > 0
    stats = criustats.dump_stats(img)         # CRIU's own stats-dump, kept in the image
    assert stats is not None and stats.pages_scanned >= stats.pages_written > 0
    assert stats.timings() == {k: timings[k] for k in stats.timings()}
    r = pos("images", env=env)
    assert r.returncode == 0 and str(img) in r.stdout and str(c.pid) in r.stdout
    r = pos("inspect", str(img), "--verify")
    assert r.returncode == 0, r.stderr
    assert f"PID {c.pid}" in r.stdout
    assert "every file matches its checksums (fold64 of each 64 MiB chunk)" in r.stdout
    assert json.loads(pos("inspect", str(img), "--json").stdout)["pid"] == c.pid


def test_corrupt_or_incomplete_image_is_refused(tmp_path, counters, env) -> None:
    c = Counter(tmp_path / "count")
    counters.append(c)
    img = tmp_path / "img"
    assert pos("checkpoint", str(c.pid), "-D", str(img), "--leave-running",
               env=env).returncode == 0
    c.proc.kill()
    c.reap_original()
    pages = next(img.glob("pages-*.img"))
    data = bytearray(pages.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pages.write_bytes(bytes(data))
    counted = c.path.read_text()
    one_sentence(pos("restore", "-D", str(img), env=env), 2,
                 f"of {pages.name} do not match their checksum in the manifest")
    # CRIU restored it stopped beside the check, which then failed: killed, it never ran
    assert procs.wait_gone(c.pid, 5)
    reap(c.pid)
    assert c.path.read_text() == counted
    pages.unlink()
    one_sentence(pos("restore", "-D", str(img), env=env), 2, f"{pages.name} is missing")
    (img / names.MANIFEST).unlink()
    one_sentence(pos("restore", "-D", str(img), env=env), 2, "is not a complete pos image")
    os.rename(img, names.partial(tmp_path / "img"))
    one_sentence(pos("restore", "-D", str(names.partial(tmp_path / "img")), env=env), 2,
                 "is an incomplete image")
