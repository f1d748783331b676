"""`pos daemon`: runs the schedules of the store, records every run, applies retention, and
serves Prometheus metrics on localhost.

One thread, one loop: each tick reads the schedules (so that `pos schedule add/rm` take effect
without a restart), reaps finished snapshots and starts the due ones. A snapshot runs in a child
process (pos.cron.snapshot) with the engine's Guard and watchdog behind it; the daemon never
touches the target itself. Rules (times.py has the misfire policy):
  - one run at a time per schedule, and never two snapshots of one process tree at once: a due
    schedule whose target is busy waits, and its fire times coalesce;
  - a run that finds no target, or a bad one, is recorded once per fire time, not retried;
  - retention runs after each successful snapshot;
  - SIGTERM/SIGINT: no new runs; running snapshots get `grace` seconds to finish, then SIGTERM,
    which abandons them through the Guard (target running, no DIR.partial left).
"""

import fcntl
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from pos import host, image
from pos.cron import retention, targets, times
from pos.cron.times import Clock, SystemClock
from pos.errors import BadInput, PosError
from pos.process import procs
from pos.store import images, schedules
from pos.store.db import open_db
from pos.store.models import Schedule

DEFAULT_GRACE_S = 120.0
STAMP = "%Y%m%dT%H%M%SZ"      # ROOT/<schedule id>/<UTC time of the run>
Log = Callable[[str], None]


class Worker(Protocol):
    pid: int

    def poll(self) -> Optional[tuple[int, dict[str, Any]]]:
        """None while running; then (exit code, the worker's JSON result)."""
        ...

    def terminate(self) -> None:
        ...


class ChildWorker:
    """A `python -m pos.cron.snapshot` child; its output goes to files (no pipe to fill)."""

    def __init__(self, argv: list[str]) -> None:
        self.out = tempfile.TemporaryFile()
        self.err = tempfile.TemporaryFile()
        self.proc = host.pos_module("pos.cron.snapshot", *argv, stdin=subprocess.DEVNULL,
                                    stdout=self.out, stderr=self.err, start_new_session=True)
        self.pid = self.proc.pid

    def poll(self) -> Optional[tuple[int, dict[str, Any]]]:
        rc = self.proc.poll()
        if rc is None:
            return None
        self.out.seek(0)
        self.err.seek(0)
        lines = self.out.read().decode(errors="replace").strip().splitlines()
        errs = self.err.read().decode(errors="replace").strip().splitlines()
        self.out.close()
        self.err.close()
        try:
            return rc, json.loads(lines[-1])
        except (IndexError, ValueError):
            why = errs[-1] if errs else (f"killed by signal {-rc}" if rc < 0 else f"exit {rc}")
            return rc, {"error": f"the snapshot worker died ({why})"}

    def terminate(self) -> None:
        try:
            self.proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass


@dataclass
class Job:
    schedule: Schedule
    run_id: int
    pid: int
    tree: list[int]
    directory: Path
    started: datetime
    worker: Worker
    stopped: bool = False        # the daemon asked it to abandon


class Metrics:
    """The daemon's Prometheus metrics, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.snapshots = Counter("pos_snapshots", "Scheduled snapshot runs by outcome.",
                                 ["schedule", "outcome"], registry=r)
        self.stall = Histogram("pos_snapshot_stall_seconds", "How long the target could not "
                               "run during a snapshot.", ["schedule"], registry=r,
                               buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.duration = Histogram("pos_snapshot_duration_seconds", "Wall time of a snapshot "
                                  "run.", ["schedule"], registry=r,
                                  buckets=(0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800))
        self.bytes = Gauge("pos_snapshot_bytes", "Size of the latest image.", ["schedule"],
                           registry=r)
        self.written = Counter("pos_snapshot_written_bytes", "Bytes of images written.",
                               ["schedule"], registry=r)
        self.next_run = Gauge("pos_schedule_next_run_timestamp_seconds", "When the schedule "
                              "fires next (Unix time).", ["schedule"], registry=r)

    def forget(self, schedule_id: str) -> None:
        """A schedule was removed: its next-run series ends."""
        try:
            self.next_run.remove(schedule_id)
        except KeyError:
            pass


def _log(line: str) -> None:
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}", flush=True)


class Daemon:
    def __init__(self, db: str, clock: Clock = SystemClock(),
                 launcher: Callable[[list[str]], Worker] = ChildWorker, log: Log = _log) -> None:
        self.db, self.clock, self.launcher, self.log = db, clock, launcher, log
        self.store = open_db(db)
        self.metrics = Metrics()
        self.jobs: dict[int, Job] = {}
        self.stopping = threading.Event()
        self._said: dict[int, str] = {}      # last problem logged per schedule (no storms)
        self._known: set[int] = set()

    # ---- one tick -------------------------------------------------------------------------
    def tick(self) -> None:
        """Reap finished snapshots, then start what is due."""
        now = self.clock.now()
        for sid in list(self.jobs):
            self._reap(self.jobs[sid], now)
        current = schedules.all_schedules(self.store)
        for gone in self._known - {s.id for s in current}:
            self.metrics.forget(str(gone))
        self._known = {s.id for s in current}
        for s in current:
            if s.id in self.jobs or self.stopping.is_set():
                continue
            try:
                self._consider(s, now)
            except Exception as e:     # the daemon outlives any one schedule's failure
                self._say(s.id, f"schedule {s.id}: {type(e).__name__}: {e}")
                self._advance(s, now)

    def _say(self, sid: int, line: str) -> None:
        if self._said.get(sid) != line:
            self.log(line)
        self._said[sid] = line

    def _advance(self, s: Schedule, after: datetime) -> None:
        nxt = times.next_fire(s.cron, after)
        schedules.set_next(self.store, s.id, nxt)
        self.metrics.next_run.labels(str(s.id)).set(nxt.timestamp())

    def _consider(self, s: Schedule, now: datetime) -> None:
        due = schedules.utc(s.next_run_at)
        assert due is not None
        self.metrics.next_run.labels(str(s.id)).set(due.timestamp())
        if due > now:
            return
        coalesced = 1 + times.fires_between(s.cron, due, now)
        target = targets.Target(s.target_kind, s.target)
        try:
            pid = targets.resolve(target, frozenset(j.worker.pid for j in self.jobs.values()))
        except PosError as e:
            outcome = "no-target" if isinstance(e, targets.NoTarget) else "bad-input"
            self._record_unstarted(s, due, now, coalesced, None, outcome, e.message)
            return
        if any(pid in j.tree for j in self.jobs.values()):
            return                       # another schedule snapshots it: wait, coalesce
        folder = Path(s.root) / str(s.id)
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            self._record_unstarted(s, due, now, coalesced, pid, "bad-input",
                                   f"cannot create {folder} ({e.strerror}): make ROOT "
                                   "writable, or remove the schedule and add it with another -D.")
            return
        directory = folder / now.strftime(STAMP)
        argv = ["--pid", str(pid), "--dir", str(directory), "--engine", s.engine,
                "--criu-options", s.criu_options or "{}", "--db", self.db] \
            + (["--leave-running"] if s.leave_running else [])
        run_id = schedules.start_run(self.store, s.id, due, now, coalesced, pid, str(directory))
        self.jobs[s.id] = Job(s, run_id, pid, procs.tree(pid), directory, now,
                              self.launcher(argv))
        self.log(f"schedule {s.id}: snapshot of PID {pid} into {directory}"
                 + (f" (serves {coalesced} fire times)" if coalesced > 1 else ""))

    def _record_unstarted(self, s: Schedule, due: datetime, now: datetime, coalesced: int,
                          pid: Optional[int], outcome: str, error: str) -> None:
        run_id = schedules.start_run(self.store, s.id, due, now, coalesced, pid)
        schedules.finish_run(self.store, run_id, now, outcome, error=error)
        self.metrics.snapshots.labels(str(s.id), outcome).inc()
        self._say(s.id, f"schedule {s.id}: {outcome}: {error}")
        self._advance(s, now)

    def _reap(self, job: Job, now: datetime) -> None:
        done = job.worker.poll()
        if done is None:
            return
        del self.jobs[job.schedule.id]
        code, res = done
        s, sid = job.schedule, str(job.schedule.id)
        error = res.get("error")
        outcome = ("ok" if code == 0 and not error else "abandoned" if job.stopped
                   else "bad-input" if code == 2 else "failed")
        schedules.finish_run(self.store, job.run_id, now, outcome, engine=res.get("engine"),
                             path=res.get("path"), bytes=res.get("bytes"),
                             stall_s=res.get("stall_s"), error=error)
        m = self.metrics
        m.snapshots.labels(sid, outcome).inc()
        m.duration.labels(sid).observe((now - job.started).total_seconds())
        if outcome == "ok":
            self._said.pop(s.id, None)
            if res.get("stall_s") is not None:
                m.stall.labels(sid).observe(res["stall_s"])
            m.bytes.labels(sid).set(res.get("bytes") or 0)
            m.written.labels(sid).inc(res.get("bytes") or 0)
            self.log(f"schedule {s.id}: ok, {res.get('path')} "
                     f"({retention.format_bytes(res.get('bytes') or 0)}, {res.get('engine')})")
            self._retain(s, now)
        else:
            self._say(s.id, f"schedule {s.id}: {outcome}: {error}")
        if not self.stopping.is_set():
            self._advance(s, now)

    def _retain(self, s: Schedule, now: datetime) -> None:
        folder = Path(s.root) / str(s.id)
        owned = schedules.made_by(self.store, s.id)
        self._adopt(s, folder, owned)
        policy = retention.Policy(s.keep, s.max_age_s, s.max_bytes)
        gone = retention.prune(folder, owned, policy, now)
        if gone:
            images.forget(self.db, [str(k.path) for k in gone])
            self.log(f"schedule {s.id}: pruned {len(gone)} image(s) ({policy})")

    def _adopt(self, s: Schedule, folder: Path, owned: set[str]) -> None:
        """Record the sealed images of the schedule's runs that the store lacks: the agent
        of an abandoned concurrent snapshot finishes and seals its image after the daemon
        stopped waiting for it (pos/cron/snapshot.py), so no run recorded it."""
        try:
            kept = [str(k.path) for k in retention.images_in(folder, owned)]
            known = images.recorded(self.db, kept)
            for path in (p for p in kept if p not in known):
                images.record(self.db, path, image.load(Path(path)).to_json())
                self.log(f"schedule {s.id}: recorded {path}, an image finished after its "
                         "snapshot was abandoned")
        except Exception as e:   # a store busy, an image going: the next snapshot tries again
            self.log(f"schedule {s.id}: recording the images of {folder} failed "
                     f"({type(e).__name__}: {e}); retention goes on")

    # ---- the loop ---------------------------------------------------------------------------
    def serve_metrics(self, port: int, address: str = "127.0.0.1") -> Any:
        """Start the Prometheus endpoint; the server (its .server_port, .shutdown())."""
        try:      # the port is 1-65535 (`pos daemon --metrics-port`)
            server, _thread = start_http_server(port, address, registry=self.metrics.registry)
        except OSError as e:
            raise BadInput(f"cannot serve metrics on {address}:{port} ({e.strerror})",
                           "give another --metrics-port, or 0 for none") from None
        return server

    def run(self, poll_s: float = 1.0, grace_s: float = DEFAULT_GRACE_S) -> None:
        """Tick until SIGTERM/SIGINT, then stop as the module docstring says."""
        def stop(signum: int, _frame: Any) -> None:
            if not self.stopping.is_set():
                self.log(f"{signal.Signals(signum).name}: stopping")
            self.stopping.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop)
        n = schedules.abandon_running(self.store, self.clock.now())
        if n:
            self.log(f"{n} run(s) of a previous daemon were left running: marked abandoned")
        self.log(f"running the schedules of {self.db}")
        while not self.stopping.is_set():
            try:
                self.tick()
            except PosError as e:
                self.log(f"tick: {e.message}")
            except Exception as e:     # a store busy or broken for a moment: next tick retries
                self.log(f"tick: {type(e).__name__}: {e}")
            self.stopping.wait(poll_s)
        self.shutdown(grace_s)

    def shutdown(self, grace_s: float) -> None:
        """Let running snapshots finish for `grace_s`, then abandon them and wait."""
        deadline = time.monotonic() + grace_s
        if self.jobs:
            self.log(f"waiting up to {grace_s:.0f} s for {len(self.jobs)} snapshot(s)")
        while self.jobs:
            if time.monotonic() > deadline:
                for job in self.jobs.values():
                    if not job.stopped:
                        self.log(f"schedule {job.schedule.id}: abandoning the snapshot of "
                                 f"PID {job.pid}")
                        job.stopped = True
                        job.worker.terminate()
            for sid in list(self.jobs):
                self._reap(self.jobs[sid], self.clock.now())
            time.sleep(0.1)
        self.log("stopped")


def lock(db: str) -> Any:
    """One daemon per store: an exclusive lock on DB.daemon.lock, held while the file is open."""
    path = f"{db}.daemon.lock"
    try:
        f = open(path, "a+")
    except OSError as e:
        raise BadInput(f"cannot open {path} ({e.strerror})",
                       "give a writable store with --db or POS_DB") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        raise BadInput(f"another pos daemon runs on {db} (PID {f.read().strip() or '?'})",
                       "stop it first, or give another --db") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f
