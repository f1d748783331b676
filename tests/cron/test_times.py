"""Trigger and misfire logic under a controlled clock: the daemon's tick with a fake snapshot
worker, so that time and outcomes are the test's to decide."""

from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Optional

import pytest

from pos.errors import BadInput
from pos import image
from pos.cron import times
from pos.image import Manifest
from pos.cron.daemon import Daemon
from pos.store import images, schedules
from pos.store.db import open_db

T0 = datetime(2025, 3, 2, 12, 0, 0, tzinfo=timezone.utc)   # a Sunday


class FakeClock:
    def __init__(self, t: datetime) -> None:
        self.t = t

    def now(self) -> datetime:
        return self.t

    def advance(self, **kw: float) -> None:
        self.t += timedelta(**kw)


class FakeWorker:
    """A snapshot worker that finishes when the test says so."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.pid = 1 << 22            # no such process
        self.result: Optional[tuple[int, dict[str, Any]]] = None
        self.terminated = False

    def poll(self) -> Optional[tuple[int, dict[str, Any]]]:
        return self.result

    def terminate(self) -> None:
        self.terminated = True
        self.result = (1, {"error": "interrupted and undone"})




@pytest.fixture
def rig(tmp_path: Path):
    clock = FakeClock(T0)
    workers: list[FakeWorker] = []

    def launch(argv: list[str]) -> FakeWorker:
        workers.append(FakeWorker(argv))
        return workers[-1]

    db = str(tmp_path / "pos.db")
    d = Daemon(db, clock, launch, log=lambda _: None)
    return d, clock, workers, db


def add(db: str, expr: str, kind: str, target: str, root: Path) -> int:
    return schedules.add(open_db(db), cron=expr, target_kind=kind, target=target,
                         root=str(root), engine="auto", leave_running=True, keep=None,
                         max_age_s=None, max_bytes=None, created_at=T0,
                         next_run_at=times.next_fire(expr, T0)).id


def test_crontab_semantics() -> None:
    assert times.next_fire("*/15 * * * *", T0) == T0 + timedelta(minutes=15)
    # 0 is Sunday (crontab(5)); T0 is a Sunday noon, so the next is a week later
    assert times.next_fire("0 12 * * 0", T0) == T0 + timedelta(days=7)
    assert times.next_fire("0 12 * * 1", T0) == T0 + timedelta(days=1)
    assert times.next_fire("* * * * * */10", T0) == T0 + timedelta(seconds=10)
    assert times.fires_between("* * * * *", T0, T0 + timedelta(minutes=10)) == 10
    assert times.validate("  */5   * * * * ") == "*/5 * * * *"


@pytest.mark.parametrize("expr", ["61 * * * *", "* * *", "every minute", "",
                                  "* * * * * * *", "0 0 1 1 * 0 2030", "@hourly"])
def test_invalid_expression_is_one_sentence(expr: str) -> None:
    with pytest.raises(BadInput, match="invalid cron expression .*give five fields"):
        times.validate(expr)


def test_seven_fields_name_the_count() -> None:
    # croniter takes a seventh field (the year); pos promises five or six
    with pytest.raises(BadInput) as e:
        times.validate("* * * * * * *")
    assert e.value.message == ("invalid cron expression '* * * * * * *' (7 fields): give five "
                               "fields (minute hour day month weekday, UTC), or six with seconds "
                               "last, e.g. '*/15 * * * *'.")


def test_due_run_starts_once_and_coalesces_missed_fires(rig, sleeper, tmp_path) -> None:
    d, clock, workers, db = rig
    sid = add(db, "* * * * *", "pid", str(sleeper), tmp_path / "imgs")
    d.tick()
    assert workers == []                          # not due before 12:01
    clock.advance(minutes=5, seconds=30)          # 12:01 .. 12:05 have passed: one run serves 5
    d.tick()
    d.tick()                                      # still running: no second snapshot
    assert len(workers) == 1
    assert f"--pid {sleeper}" in " ".join(workers[0].argv)
    assert workers[0].argv[workers[0].argv.index("--dir") + 1] == \
        str(tmp_path / "imgs" / str(sid) / "20250302T120530Z")
    run = schedules.runs(open_db(db), sid)[0]
    assert (run.outcome, run.coalesced) == ("running", 5)
    clock.advance(minutes=2)                      # the run takes 2 minutes: 12:06, 12:07 missed
    workers[0].result = (0, {"engine": "criu", "path": "/x", "bytes": 10, "stall_s": 0.2})
    d.tick()
    run = schedules.runs(open_db(db), sid)[0]
    assert (run.outcome, run.engine, run.bytes, run.stall_s) == ("ok", "criu", 10, 0.2)
    assert schedules.utc(schedules.get(open_db(db), sid).next_run_at) == \
        T0 + timedelta(minutes=8)                 # the first fire after the run ended
    clock.advance(minutes=1)
    d.tick()
    assert len(workers) == 2
    assert schedules.runs(open_db(db), sid)[1].coalesced == 1


def test_no_target_is_recorded_once_per_fire_time(rig, tmp_path) -> None:
    d, clock, workers, db = rig
    sid = add(db, "* * * * *", "match", "no-such-job-[0-9]{9}", tmp_path / "imgs")
    said: list[str] = []
    d.log = said.append
    clock.advance(minutes=1)
    for _ in range(5):
        d.tick()
    clock.advance(minutes=1)
    d.tick()
    runs = schedules.runs(open_db(db), sid)
    assert [r.outcome for r in runs] == ["no-target", "no-target"]
    assert "no process is the command line matching" in runs[0].error
    assert len(said) == 1 and workers == []       # logged once while nothing changes


def test_never_two_snapshots_of_one_target(rig, sleeper, tmp_path) -> None:
    d, clock, workers, db = rig
    a = add(db, "* * * * *", "pid", str(sleeper), tmp_path / "imgs")
    b = add(db, "* * * * *", "match", "^sleep 600\\.4242$", tmp_path / "imgs")
    clock.advance(minutes=1)
    d.tick()
    assert len(workers) == 1                      # b waits: its target is busy
    clock.advance(minutes=1)
    workers[0].result = (0, {"engine": "criu", "path": "/x", "bytes": 1, "stall_s": 0.1})
    d.tick()                                      # a finished; b starts, serving 2 fire times
    assert len(workers) == 2
    assert [r.coalesced for r in schedules.runs(open_db(db), b)] == [2]
    assert len(schedules.runs(open_db(db), a)) == 1


def test_failures_are_recorded_and_the_daemon_goes_on(rig, sleeper, tmp_path) -> None:
    d, clock, workers, db = rig
    sid = add(db, "* * * * *", "pid", str(sleeper), tmp_path / "imgs")
    clock.advance(minutes=1)
    d.tick()
    workers[0].result = (2, {"engine": None, "error": "/x has 1.0 MiB free: free space."})
    clock.advance(minutes=1)
    d.tick()
    clock.advance(minutes=1)
    d.tick()
    workers[1].result = (-9, {"error": "the snapshot worker died (killed by signal 9)"})
    clock.advance(seconds=1)
    d.tick()
    runs = schedules.runs(open_db(db), sid)
    assert [r.outcome for r in runs] == ["bad-input", "failed"]
    assert runs[0].error.startswith("/x has 1.0 MiB free")


def test_restart_picks_up_schedules_and_abandons_orphan_runs(rig, sleeper, tmp_path) -> None:
    d, clock, workers, db = rig
    sid = add(db, "* * * * *", "pid", str(sleeper), tmp_path / "imgs")
    clock.advance(minutes=1)
    d.tick()                                      # running when the daemon "dies"
    later = FakeClock(clock.t + timedelta(minutes=10))
    fresh: list[FakeWorker] = []
    d2 = Daemon(db, later, lambda argv: fresh.append(FakeWorker(argv)) or fresh[-1],
                log=lambda _: None)
    assert schedules.abandon_running(d2.store, later.now()) == 1
    d2.tick()
    assert len(fresh) == 1
    outcomes = [r.outcome for r in schedules.runs(open_db(db), sid)]
    assert outcomes == ["abandoned", "running"]


def test_shutdown_abandons_after_the_grace(rig, sleeper, tmp_path) -> None:
    d, clock, workers, db = rig
    sid = add(db, "* * * * *", "pid", str(sleeper), tmp_path / "imgs")
    clock.advance(minutes=1)
    d.tick()
    d.stopping.set()
    d.shutdown(grace_s=0.2)
    assert workers[0].terminated
    assert [r.outcome for r in schedules.runs(open_db(db), sid)] == ["abandoned"]


def test_an_image_sealed_after_its_snapshot_was_abandoned_is_recorded(rig, sleeper,
                                                                      tmp_path) -> None:
    """The agent of an abandoned concurrent snapshot seals its image later; the schedule's next
    snapshot records it, once, before retention counts it."""
    d, clock, workers, db = rig
    said: list[str] = []
    d.log = said.append
    sid = add(db, "* * * * *", "pid", str(sleeper), tmp_path / "imgs")
    for _ in range(2):
        clock.advance(minutes=1)
        d.tick()
        if len(workers) == 1:      # the first run's agent seals its image in the run's folder
            argv = workers[0].argv
            late = Path(argv[argv.index("--dir") + 1])
            late.mkdir()
            image.write_manifest(late, Manifest(
                pid=sleeper, pids=[sleeper], gpu_pids=[sleeper], comm="sleep", cmdline="sleep",
                created_at="2025-03-02T11:59:00+00:00", host="h", kernel="k",
                criu_version="", criu_options={}, leave_running=True, size_bytes=4096))
        workers[-1].result = (0, {"engine": "concurrent", "path": "/x", "bytes": 1,
                                  "stall_s": 0.0})
        d.tick()
    assert [i.path for i in images.list_images(db)] == [str(late)]
    assert said.count(f"schedule {sid}: recorded {late}, an image finished after its snapshot "
                      "was abandoned") == 1


def test_a_store_error_while_recording_late_images_does_not_stop_the_schedule(
        rig, sleeper, tmp_path, monkeypatch) -> None:
    d, clock, workers, db = rig
    said: list[str] = []
    d.log = said.append
    sid = add(db, "* * * * *", "pid", str(sleeper), tmp_path / "imgs")

    def busy(*_: Any) -> set[str]:
        raise RuntimeError("database is locked")

    monkeypatch.setattr(images, "recorded", busy)
    clock.advance(minutes=1)
    d.tick()
    workers[0].result = (0, {"engine": "criu", "path": "/x", "bytes": 1, "stall_s": 0.1})
    d.tick()
    assert any("recording the images of" in line and "database is locked" in line
               for line in said), said
    assert schedules.utc(schedules.get(open_db(db), sid).next_run_at) > clock.now()
