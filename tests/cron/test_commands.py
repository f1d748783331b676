"""`pos schedule`, `pos images`: exact exit codes and one-sentence errors (CliRunner)."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from pos.cli import cli


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("POS_DB", str(tmp_path / "pos.db"))

    def invoke(*args: str):
        return CliRunner().invoke(cli, list(args))
    return invoke




def fails(r, code: int, *fragments: str) -> None:
    assert r.exit_code == code, (r.exit_code, r.output)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def test_add_ls_rm(run, sleeper, tmp_path: Path) -> None:
    root = tmp_path / "snaps"
    r = run("schedule", "add", "--cron", "*/5 * * * *", "--pid", str(sleeper), "-D", str(root),
            "--keep", "3", "--max-age", "2d", "--leave-running")
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"schedule 1: PID {sleeper} at '*/5 * * * *' (UTC) into {root}/1, "
                               "keep 3, max-age 2d; next run ")
    assert root.is_dir()
    r = run("schedule", "ls")
    assert r.exit_code == 0
    row = r.output.splitlines()[1].split()
    assert row[:4] == ["1", "*/5", "*", "*"] and "keep 3, max-age 2d" in r.output
    r = run("schedule", "rm", "1")
    assert (r.exit_code, r.output) == (0, f"removed schedule 1; its images stay in {root}/1\n")
    assert len(run("schedule", "ls").output.splitlines()) == 1


def test_absent_match_target_is_accepted_with_a_note(run, tmp_path: Path) -> None:
    r = run("schedule", "add", "--cron", "0 * * * *", "--match", "no-such-job-[0-9]{9}",
            "-D", str(tmp_path / "s"))
    assert r.exit_code == 0
    assert "until one is, its runs are recorded as no-target" in r.output
    assert "without --leave-running each snapshot ends the target" in r.output


@pytest.mark.parametrize("args,fragments", [
    (["--cron", "61 * * * *"], ["invalid cron expression '61 * * * *'", "give five fields"]),
    (["--cron", "* * *"], ["invalid cron expression"]),
    (["--cron", "* * 31 2 *"], ["cron expression '* * 31 2 *' never fires", "give a day"]),
    (["--engine", "concurrent"], ["has no pos agent that owns its memory, so the concurrent "
                                  "engine cannot snapshot it: start the job with `pos run`"]),
    (["--keep", "0"], ["--keep 0 would keep no image"]),
    (["--max-age", "soon"], ["--max-age 'soon' is not a duration"]),
    (["--max-bytes", "lots"], ["--max-bytes 'lots' is not a size"]),
])
def test_bad_schedule_options(run, sleeper, tmp_path: Path, args, fragments) -> None:
    base = {"--cron": "* * * * *", "--pid": str(sleeper), "-D": str(tmp_path / "s")}
    opts = dict(base, **dict(zip(args[::2], args[1::2])))
    r = run("schedule", "add", *[x for kv in opts.items() for x in kv])
    fails(r, 2, *fragments)


def test_criu_options_are_stored_with_the_schedule(run, sleeper, tmp_path: Path) -> None:
    from pos.store import schedules
    from pos.store.db import open_db

    r = run("schedule", "add", "--cron", "* * * * *", "--pid", str(sleeper), "--shell-job",
            "--external", "file[2a:1234]", "--external", "unix[99]", "-D", str(tmp_path / "s"))
    assert r.exit_code == 0, r.output
    row = schedules.all_schedules(open_db(str(tmp_path / "pos.db")))[0]
    assert json.loads(row.criu_options) == {
        "shell_job": True, "tcp_established": False, "ext_unix_sk": False, "file_locks": False,
        "external": ["file[2a:1234]", "unix[99]"], "network_lock": None, "ghost_limit": None,
        "empty_netns": False}


def test_target_errors(run, sleeper, tmp_path: Path) -> None:
    d = str(tmp_path / "s")
    fails(run("schedule", "add", "--cron", "* * * * *", "-D", d), 2,
          "give exactly one target")
    fails(run("schedule", "add", "--cron", "* * * * *", "--pid", "1", "--name", "a", "-D", d),
          2, "give exactly one target")
    fails(run("schedule", "add", "--cron", "* * * * *", "--match", "sl(eep", "-D", d), 2,
          "not a valid regular expression")
    fails(run("schedule", "add", "--cron", "* * * * *", "--pid", "4194304", "-D", d), 2,
          "no process has PID 4194304")
    other = subprocess.Popen(["sleep", "600.4242"])
    try:
        fails(run("schedule", "add", "--cron", "* * * * *", "--match", "^sleep 600\\.4242$", "-D", d),
              2, "matches 2 processes", "make it match one job, or target a PID")
    finally:
        other.kill()
        other.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")
def test_read_only_root(run, sleeper, tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=True)
    try:
        fails(run("schedule", "add", "--cron", "* * * * *", "--pid", str(sleeper),
                  "-D", str(ro / "snaps")), 2, f"-D {ro}/snaps is not a writable directory")
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_root_under_a_file(run, sleeper, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    for root in (tmp_path / "afile", tmp_path / "afile" / "snaps"):
        fails(run("schedule", "add", "--cron", "* * * * *", "--pid", str(sleeper),
                  "-D", str(root)), 2, f"-D {root} cannot be a directory: {tmp_path}/afile is a "
              "file: give a directory")


def test_unknown_schedule_id(run) -> None:
    fails(run("schedule", "rm", "42"), 2, "no schedule has ID 42", "pos schedule ls")
    fails(run("images", "prune", "--schedule", "42"), 2, "no schedule has ID 42")


def test_images_alone_and_ls_list_the_same(run) -> None:
    a, b = run("images"), run("images", "ls")
    assert a.exit_code == b.exit_code == 0
    assert a.output == b.output and a.output.split()[:2] == ["ID", "CREATED"]


def test_daemon_refuses_a_bad_port_and_a_second_daemon(run, tmp_path: Path) -> None:
    from pos.cron.daemon import lock

    r = run("daemon", "--metrics-port", "70000")
    assert r.exit_code == 2 and r.stderr.strip().endswith(
        "invalid value for '--metrics-port': 70000 is not in the range 0<=x<=65535: give a "
        "value in that range."), r.output
    held = lock(str(tmp_path / "pos.db"))
    try:
        fails(run("daemon", "--metrics-port", "0"), 2,
              f"another pos daemon runs on {tmp_path / 'pos.db'} (PID {os.getpid()})")
    finally:
        held.close()


@pytest.mark.parametrize("args,fragment", [
    (["--grace", "-1"], "invalid value for '--grace': -1.0 is not in the range x>=0: give a "
                        "value in that range."),
    (["--poll", "0"], "invalid value for '--poll': 0.0 is not in the range x>0: give a value "
                      "in that range."),
])
def test_daemon_refuses_a_negative_grace_or_poll(run, args, fragment) -> None:
    r = run("daemon", "--metrics-port", "0", *args)
    assert r.exit_code == 2 and r.stderr.strip().endswith(fragment), r.output


def test_a_schema_3_store_is_migrated_with_its_schedules(tmp_path: Path) -> None:
    """A store written before schedules had CRIU options (and launches their capture and why
    they lack a layout, traces their dropped captures and completions) opens as the current
    schema, its rows kept."""
    import sqlite3

    from pos.store import schedules
    from pos.store.db import open_db
    from pos.store.models import SCHEMA_VERSION

    db = str(tmp_path / "old.db")
    open_db(db).dispose()
    with sqlite3.connect(db) as c:
        c.execute("ALTER TABLE schedules DROP COLUMN criu_options")
        c.execute("ALTER TABLE launches DROP COLUMN capture")
        for column in ("captures_dropped", "completed", "missing_no_layout", "missing_ambiguous",
                       "missing_no_capture", "missing_outside", "missing_outside_bytes",
                       "missing_few_addresses"):
            c.execute(f"ALTER TABLE traces DROP COLUMN {column}")
        c.execute("ALTER TABLE launches DROP COLUMN missing")
        c.execute("ALTER TABLE launches DROP COLUMN missing_bytes")
        c.execute("ALTER TABLE runs DROP COLUMN directory")
        c.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")
        c.execute("INSERT INTO schedules (cron, target_kind, target, root, engine, leave_running,"
                  " created_at, next_run_at) VALUES ('* * * * *', 'pid', '1', '/r', 'auto', 1,"
                  " '2026-01-01 00:00:00', '2026-01-01 00:01:00')")
    rows = schedules.all_schedules(open_db(db))
    assert [(r.target, r.criu_options) for r in rows] == [("1", "{}")]
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (
            str(SCHEMA_VERSION),)
    assert schedules.add(open_db(db), **new_schedule("/r")).id == 2


def new_schedule(root: str) -> dict:
    """The columns of a schedule, as `pos schedule add` would fill them."""
    from datetime import datetime, timezone

    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    return dict(cron="* * * * *", target_kind="pid", target="1", root=root, engine="auto",
                leave_running=True, keep=1, max_age_s=None, max_bytes=None, created_at=now,
                next_run_at=now)


def test_schedule_ids_are_never_reused_and_a_removed_schedules_images_stay(
        run, tmp_path: Path) -> None:
    """Schedule 1 made two images and was removed; the next schedule, with --keep 1 under the
    same root, is schedule 2, and pruning (every schedule's, and its own) deletes neither of
    schedule 1's images, which the store no longer records as anyone's."""
    from datetime import datetime, timedelta, timezone

    from pos import image
    from pos.image import Manifest
    from pos.store import schedules
    from pos.store.db import open_db

    root = tmp_path / "snaps"
    store = open_db(str(tmp_path / "pos.db"))
    first = schedules.add(store, **new_schedule(str(root)))
    made = []
    for minutes in (2, 1):
        when = datetime.now(timezone.utc) - timedelta(minutes=minutes)
        d = root / "1" / when.strftime("%Y%m%dT%H%M%SZ")
        d.mkdir(parents=True)
        image.write_manifest(d, Manifest(
            pid=1, pids=[1], gpu_pids=[], comm="c", cmdline="c",
            created_at=when.isoformat(timespec="seconds"), host="h", kernel="k",
            criu_version="4", criu_options={}, leave_running=True, size_bytes=1))
        schedules.start_run(store, first.id, when, when, 1, 1, str(d))
        made.append(d)
    r = run("images", "prune", "--schedule", "1", "--dry-run", "--json")
    assert [i["path"] for i in json.loads(r.output)["schedules"][0]["images"]] == [str(made[0])]
    assert run("schedule", "rm", "1").exit_code == 0
    second = schedules.add(store, **new_schedule(str(root)))
    assert second.id == 2
    for args in (("images", "prune"), ("images", "prune", "--schedule", "2")):
        r = run(*args)
        assert r.exit_code == 0, r.output
    assert all(d.is_dir() for d in made)
    assert run("schedule", "rm", "2").exit_code == 0
    assert schedules.add(store, **new_schedule(str(root))).id == 3


def test_the_listings_make_no_store(run, tmp_path: Path) -> None:
    """`pos images`, `pos schedule ls` and `pos images prune` only read: where there is no
    store they list nothing and leave none behind."""
    for args in (("images",), ("images", "ls", "--json"), ("schedule", "ls"),
                 ("images", "prune", "--dry-run"), ("images", "prune")):
        r = run(*args)
        assert r.exit_code == 0, (args, r.output)
    assert json.loads(run("images", "--json").output) == []
    assert json.loads(run("schedule", "ls", "--json").output) == []
    assert json.loads(run("images", "prune", "--json").output) == {"dry_run": False,
                                                                   "schedules": []}
    fails(run("images", "prune", "--schedule", "4"), 2, "no schedule has ID 4")
    assert not (tmp_path / "pos.db").exists()


def test_listings_as_json(run, sleeper, tmp_path: Path) -> None:
    from pos.store.images import record

    root = tmp_path / "snaps"
    assert run("schedule", "add", "--cron", "0 * * * *", "--pid", str(sleeper), "-D", str(root),
               "--keep", "2", "--leave-running").exit_code == 0
    (rows,) = [json.loads(run("schedule", "ls", "--json").output)]
    assert len(rows) == 1 and rows[0]["id"] == 1 and rows[0]["cron"] == "0 * * * *"
    assert rows[0]["target"] == str(sleeper) and rows[0]["keep"] == 2
    assert rows[0]["last_run"] is None and rows[0]["next_run_at"].endswith("Z")
    image = tmp_path / "img"
    image.mkdir()
    record(str(tmp_path / "pos.db"), str(image), json.dumps({
        "pid": 42, "comm": "train", "cmdline": "python train.py", "gpu_pids": [42],
        "created_at": "2026-11-27T10:00:00+00:00", "size_bytes": 1 << 20, "stall_s": 1.5}))
    (img,) = json.loads(run("images", "ls", "--json").output)
    assert img == {"id": 1, "created_at": "2026-11-27T10:00:00Z", "pid": 42, "comm": "train",
                   "gpu": True, "size_bytes": 1 << 20, "stall_s": 1.5, "state": "ok",
                   "restored_at": None, "path": str(image)}
    assert json.loads(run("images", "--json").output) == [img]
    pruned = json.loads(run("images", "prune", "--dry-run", "--json").output)
    assert pruned == {"dry_run": True, "schedules": [
        {"schedule": 1, "retention": "keep 2", "images": []}]}


def test_doctor_as_json(run) -> None:
    r = run("doctor", "--json")
    report = json.loads(r.stdout)
    assert set(report) == {"ok", "checks"} and r.exit_code == (0 if report["ok"] else 1)
    assert {c["status"] for c in report["checks"]} <= {"ok", "missing", "n/a", "unknown"}
    assert any(c["check"].startswith("Linux") for c in report["checks"])
