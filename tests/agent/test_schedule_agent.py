"""Schedules over `pos run` jobs: `--name` finds the job that `pos run --name` started, and the
daemon's `auto` engine takes the concurrent path through the job's agent (fake libcupti and
libcuda: this proves the plumbing — resolution, choice, socket, sealed image, recorded run — not
the GPU copy, which tests/gpu/test_concurrent_gpu.py covers on a GPU)."""

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from click.testing import CliRunner

from pos.cli import cli
from pos.scheduler import image, snapshot, targets
from pos.store import images, schedules
from pos.store.db import open_db
from tests.conftest import ROOT
from tests.scheduler.conftest import wait_for

# A job that sets (fake) CUDA up with 1 MiB of device memory, says so, and runs until a line
# arrives on its stdin.
JOB = """import ctypes, os, sys
cuda = ctypes.CDLL(os.environ["POS_LIBCUDA"])
ctx, buf = ctypes.c_void_p(), ctypes.c_uint64()
assert cuda.cuInit(0) == 0 and cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
assert cuda.cuMemAlloc_v2(ctypes.byref(buf), ctypes.c_size_t(1 << 20)) == 0
print("ready", flush=True)
sys.stdin.readline()
"""


def test_schedule_add_by_name_resolves_the_pos_run_job(pos_run, tmp_path: Path,
                                                      monkeypatch) -> None:  # type: ignore[no-untyped-def]
    name = f"job-{uuid.uuid4().hex[:8]}"
    job = pos_run(name, JOB)
    job.wait_for_agent()
    monkeypatch.setenv("POS_DB", str(tmp_path / "pos.db"))
    r = CliRunner().invoke(cli, ["schedule", "add", "--cron", "0 * * * *", "--name", name,
                                 "--engine", "concurrent", "-D", str(tmp_path / "s")])
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"schedule 1: the `pos run --name {name}` job at '0 * * * *'")
    assert "note:" not in r.output                # found, with an agent, never stopped
    assert targets.resolve(targets.Target("name", name)) == job.pid
    assert snapshot.choose("auto", job.pid) == "concurrent"
    assert job.end()[0] == 0


def test_snapshot_without_an_agent_is_one_recorded_sentence(sleeper, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "pos.scheduler.snapshot", "--pid", str(sleeper),
                        "--dir", str(tmp_path / "img"), "--engine", "concurrent",
                        "--db", str(tmp_path / "pos.db")], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert json.loads(r.stdout) == {"engine": None, "error": (
        f"PID {sleeper} has no pos agent (/run/pos/agent-{sleeper}.sock is missing), so the "
        "concurrent engine cannot snapshot it: start the job with `pos run`, or use --engine "
        "auto.")}
    assert not (tmp_path / "img").exists() and not (tmp_path / "img.partial").exists()


def test_daemon_auto_snapshots_a_pos_run_job_with_its_agent(pos_run, tmp_path: Path) -> None:
    name = f"job-{uuid.uuid4().hex[:8]}"
    job = pos_run(name, JOB)
    job.wait_for_agent()
    env = {**os.environ, "POS_DB": str(tmp_path / "pos.db")}
    root = tmp_path / "snaps"
    add = subprocess.run([sys.executable, "-m", "pos.cli", "schedule", "add", "--cron",
                          "* * * * * *", "--name", name, "--keep", "2", "-D", str(root)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert add.returncode == 0, add.stderr
    log = open(tmp_path / "daemon.log", "w")
    d = subprocess.Popen([sys.executable, "-m", "pos.cli", "daemon", "--metrics-port", "0",
                          "--poll", "0.2"], cwd=ROOT, env=env, stdout=log,
                         stderr=subprocess.STDOUT)
    store = open_db(env["POS_DB"])
    try:
        wait_for(lambda: [r.outcome for r in schedules.runs(store, 1)].count("ok") >= 3,
                 timeout=90, what="three snapshots")
    finally:
        d.send_signal(signal.SIGTERM)
        assert d.wait(timeout=60) == 0, (tmp_path / "daemon.log").read_text()
        log.close()
    runs = [r for r in schedules.runs(store, 1) if r.outcome == "ok"]
    assert {r.engine for r in runs} == {"concurrent"} and {r.pid for r in runs} == {job.pid}
    kept = sorted(root.joinpath("1").iterdir())
    assert len(kept) == 2 and not [k for k in kept if k.name.endswith(".partial")]
    stall = {r.path: r.stall_s for r in runs}
    for k in kept:
        m = image.verify(k)                          # sealed with the same manifest writer
        assert m.pid == job.pid and "gpu-index.json" in m.files
        # the run's stall is the time the agent held the job's calls, from the agent's report
        waited = json.loads((k / "gpu-index.json").read_text())["report"]["waited_s"]
        assert isinstance(stall[str(k)], float) and stall[str(k)] == waited
    assert {r.path for r in images.list_images(env["POS_DB"])} == {str(k) for k in kept}
    assert job.proc.poll() is None                   # never stopped
    assert job.end()[0] == 0
