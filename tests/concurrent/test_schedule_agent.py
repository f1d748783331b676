"""Schedules over `pos run` jobs: `--name` finds the job that `pos run --name` started, and the
daemon's `auto` engine takes the concurrent path through the job's agent: whole-process images
taken while the job runs (fake driver, real CRIU: this proves the plumbing — resolution, choice,
sealed image, recorded run — not the GPU copy, which tests/gpu covers on a GPU)."""

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from click.testing import CliRunner

from pos.cli import cli
from pos import image
from pos.cron import snapshot, targets
from pos.image import names
from pos.store import images, schedules
from pos.store.db import open_db
from tests.conftest import ROOT
from tests.engines.conftest import wait_for


def test_schedule_add_by_name_resolves_the_pos_run_job(fill_job, tmp_path: Path,
                                                      monkeypatch) -> None:  # type: ignore[no-untyped-def]
    name = f"job-{uuid.uuid4().hex[:8]}"
    job = fill_job(name=name)
    monkeypatch.setenv("POS_DB", str(tmp_path / "pos.db"))
    r = CliRunner().invoke(cli, ["schedule", "add", "--cron", "0 * * * *", "--name", name,
                                 "--engine", "concurrent", "-D", str(tmp_path / "s")])
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"schedule 1: the `pos run --name {name}` job at '0 * * * *'")
    # found, with an agent: only the note of every schedule without --leave-running (the
    # concurrent engine too ends the job once its image is sealed)
    assert [line for line in r.output.splitlines() if line.startswith("note:")] == [
        "note: without --leave-running each snapshot ends the target (restore it with "
        "`pos restore`)"]
    assert targets.resolve(targets.Target("name", name)) == job.pid
    assert snapshot.choose("auto", job.pid) == "concurrent"


def test_snapshot_without_an_agent_is_one_recorded_sentence(sleeper, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "pos.cron.snapshot", "--pid", str(sleeper),
                        "--dir", str(tmp_path / "img"), "--engine", "concurrent",
                        "--db", str(tmp_path / "pos.db")], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert json.loads(r.stdout) == {"engine": None, "error": (
        f"PID {sleeper} has no pos agent that owns its memory, so the concurrent engine cannot "
        "snapshot it: start the job with `pos run`, or use --engine auto.")}
    assert not (tmp_path / "img").exists() and not names.partial(tmp_path / "img").exists()


def test_daemon_auto_snapshots_a_pos_run_job_with_its_agent(fill_job, tmp_path: Path,
                                                           criu_ready) -> None:  # type: ignore[no-untyped-def]
    name = f"job-{uuid.uuid4().hex[:8]}"
    job = fill_job(name=name)
    env = {**os.environ, "POS_DB": str(tmp_path / "pos.db")}
    root = tmp_path / "snaps"
    add = subprocess.run([sys.executable, "-m", "pos.cli", "schedule", "add", "--cron",
                          "* * * * * *", "--name", name, "--keep", "2", "--leave-running",
                          "-D", str(root)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert add.returncode == 0, add.stderr
    log = open(tmp_path / "daemon.log", "w")
    d = subprocess.Popen([sys.executable, "-m", "pos.cli", "daemon", "--metrics-port", "0",
                          "--poll", "0.2"], cwd=ROOT, env=env, stdout=log,
                         stderr=subprocess.STDOUT)
    store = open_db(env["POS_DB"])
    try:
        wait_for(lambda: [r.outcome for r in schedules.runs(store, 1)].count("ok") >= 3,
                 timeout=120, what="three snapshots")
    finally:
        d.send_signal(signal.SIGTERM)
        assert d.wait(timeout=60) == 0, (tmp_path / "daemon.log").read_text()
        log.close()
    runs = [r for r in schedules.runs(store, 1) if r.outcome == "ok"]
    assert {r.engine for r in runs} == {"concurrent"} and {r.pid for r in runs} == {job.pid}
    kept = sorted(root.joinpath("1").iterdir())
    assert len(kept) == 2 and not [k for k in kept if names.is_partial(k.name)]
    for k in kept:
        m = image.verify(k)                 # whole-process: CRIU's files and the GPU's
        assert m.pid == job.pid and names.INDEX in m.files and names.INVENTORY in m.files
    assert all(isinstance(r.stall_s, float) and r.stall_s >= 0 for r in runs)
    assert {r.path for r in images.list_images(env["POS_DB"])} == {str(k) for k in kept}
    assert job.alive()                      # never stopped
