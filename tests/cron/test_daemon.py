"""`pos daemon` end to end on CPU processes through real CRIU: snapshots every second, pruned
to the newest two, metrics scraped on localhost, SIGTERM, a restart that picks the schedule up
again, one kept image restored and checked to count on; a ROOT out of space, survived; and
SIGTERM with a tiny --grace while CRIU is dumping: the snapshot abandoned, the target running."""

import re
import signal
import socket
import subprocess
import sys
import os
import urllib.request
from pathlib import Path

import pytest

from pos.cron import retention
from pos.image import names
from pos.process import procs
from pos.store import schedules
from pos.store.db import open_db
from tests.conftest import ROOT
from tests.engines.conftest import Counter, lines, pos, wait_for


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"POS_DB": str(tmp_path / "pos.db"), "POS_WATCHDOG_LOG": str(tmp_path / "wd.log")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    def __init__(self, env: dict[str, str], log: Path, port: int = 0,
                 grace: float = 30) -> None:
        self.log = open(log, "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pos.cli", "daemon", "--metrics-port", str(port),
             "--poll", "0.2", "--grace", str(grace)], cwd=ROOT, env={**os.environ, **env},
            stdout=self.log, stderr=subprocess.STDOUT)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=60)
        self.log.close()
        return rc


def outcomes(db: str, sid: int) -> list[str]:
    return [r.outcome for r in schedules.runs(open_db(db), sid)]


def test_daemon_snapshots_prunes_restarts_and_an_image_restores(tmp_path, counters, env):
    c = Counter(tmp_path / "count")
    counters.append(c)
    root = tmp_path / "snaps"
    r = pos("schedule", "add", "--cron", "* * * * * *", "--match",
            re.escape(str(tmp_path / "count")), "--engine", "criu", "--keep", "2",
            "--leave-running", "-D", str(root), env=env)
    assert r.returncode == 0, r.stderr
    port = free_port()
    d = Daemon(env, tmp_path / "daemon.log", port)
    try:
        wait_for(lambda: outcomes(env["POS_DB"], 1).count("ok") >= 3, timeout=90,
                 what="three snapshots")
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    finally:
        assert d.stop() == 0, (tmp_path / "daemon.log").read_text()
    text = metrics.decode()
    ok = re.search(r'^pos_snapshots_total\{outcome="ok",schedule="1"\} (\S+)$', text, re.M)
    assert ok and float(ok.group(1)) >= 3, text
    assert re.search(r'^pos_snapshot_stall_seconds_count\{schedule="1"\} [1-9]', text, re.M)
    assert re.search(r'^pos_snapshot_duration_seconds_count\{schedule="1"\} [1-9]', text, re.M)
    assert re.search(r'^pos_snapshot_bytes\{schedule="1"\} [1-9]', text, re.M)
    assert re.search(r'^pos_schedule_next_run_timestamp_seconds\{schedule="1"\} 1\.', text, re.M)
    assert c.running()                            # never left frozen
    assert "running" not in outcomes(env["POS_DB"], 1)
    kept = retention.images_in(root / "1")
    assert len(kept) == 2
    assert not list((root / "1").glob("*" + names.PARTIAL_SUFFIX))
    ls = pos("images", "ls", env=env).stdout.splitlines()
    assert len(ls) == 3                           # the pruned images' rows are gone too
    runs = schedules.runs(open_db(env["POS_DB"]), 1)
    assert all(r.engine == "criu" and r.bytes and r.stall_s is not None
               for r in runs if r.outcome == "ok")
    assert "ok" in pos("schedule", "ls", env=env).stdout

    before = outcomes(env["POS_DB"], 1).count("ok")
    d = Daemon(env, tmp_path / "daemon.log")      # a restart picks the schedule up
    try:
        wait_for(lambda: outcomes(env["POS_DB"], 1).count("ok") > before, timeout=60,
                 what="a snapshot after the restart")
    finally:
        assert d.stop() == 0

    newest = retention.images_in(root / "1")[-1].path
    c.proc.kill()
    c.reap_original()
    killed_at = len(lines(c.path))
    r = pos("restore", "-D", str(newest), env=env)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: len(lines(c.path)) > killed_at + 10, what="the restored counter")
    resumed = lines(c.path)[killed_at:]
    assert resumed == list(range(resumed[0], resumed[0] + len(resumed)))


def test_root_out_of_space_is_recorded_and_survived(tmp_path, counters, env):
    c = Counter(tmp_path / "count")
    counters.append(c)
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)], check=True)
    try:
        r = pos("schedule", "add", "--cron", "* * * * * *", "--pid", str(c.pid),
                "--leave-running", "-D", str(small), env=env)
        assert r.returncode == 0, r.stderr
        d = Daemon(env, tmp_path / "daemon.log")
        try:
            wait_for(lambda: len(outcomes(env["POS_DB"], 1)) >= 3, timeout=60,
                     what="three runs")
            assert d.proc.poll() is None          # the daemon lives on
        finally:
            assert d.stop() == 0
    finally:
        subprocess.run(["umount", str(small)], check=True)
    runs = schedules.runs(open_db(env["POS_DB"]), 1)
    assert {r.outcome for r in runs} == {"bad-input"}
    assert re.match(r".* MiB free and the image needs about .* MiB: free space there",
                    runs[0].error)
    assert c.running()


def test_sigterm_abandons_a_real_criu_snapshot_in_flight(tmp_path, counters, env):
    """The target holds 768 MiB so that CRIU's dump takes a while; SIGTERM reaches the daemon
    once CRIU has begun writing pages, and --grace 0.1 makes it abandon the snapshot."""
    c = Counter(tmp_path / "count", ballast_mb=768)
    counters.append(c)
    root = tmp_path / "snaps"
    r = pos("schedule", "add", "--cron", "* * * * * *", "--pid", str(c.pid), "--engine", "criu",
            "--leave-running", "-D", str(root), env=env)
    assert r.returncode == 0, r.stderr
    d = Daemon(env, tmp_path / "daemon.log", grace=0.1)
    try:
        wait_for(lambda: any(root.glob(f"1/*{names.PARTIAL_SUFFIX}/pages-*.img")), timeout=60,
                 what="CRIU writing pages")
    finally:
        assert d.stop() == 0, (tmp_path / "daemon.log").read_text()
    log = (tmp_path / "daemon.log").read_text()
    assert f"schedule 1: abandoning the snapshot of PID {c.pid}" in log, log
    runs = schedules.runs(open_db(env["POS_DB"]), 1)
    assert [r.outcome for r in runs] == ["abandoned"], [(r.outcome, r.error) for r in runs]
    assert runs[0].error == (f"checkpoint of PID {c.pid} interrupted and undone: the "
                             "processes run as before.")
    assert list(root.joinpath("1").iterdir()) == []       # no DIR.partial, no image
    assert c.running()                                    # counting on: not frozen
    for pid in c.pids():
        assert procs.state(pid) not in ("T", "t"), pid
        status = Path(f"/proc/{pid}/status").read_text()
        assert "\nTracerPid:\t0\n" in status, status      # CRIU's ptrace is gone
