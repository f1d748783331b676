"""Drive a workload process and `pos trace` as a user would: shared by the demo, bench/ and
tests/gpu. A workload prints `READY <pid>` before it initialises its GPU, then answers each
command line on stdin with one JSON line."""

import json
import os
import sqlite3
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Callable, Optional

from pos.tracer.late import REASONS

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "workloads" / "torch_job.py"
MARK_BEGIN, MARK_END = 0x05EB0001, 0x05EB0002   # the markers torch_job.py memsets


def pinned(cpus: Optional[set[int]]) -> Optional[Callable[[], None]]:
    """A preexec_fn that confines the child (and all it starts) to `cpus`; None: no pinning."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def split_cpus() -> tuple[set[int], set[int]]:
    """(one core for a workload, the CPUs of every other core for pos): measurements of the
    tracer's cost must not share a core (or its SMT sibling) between the two."""
    cpus = sorted(os.sched_getaffinity(0))
    siblings = Path(f"/sys/devices/system/cpu/cpu{cpus[0]}/topology/thread_siblings_list")
    try:
        text = siblings.read_text().strip()
        core = {int(x) for part in text.split(",") for x in
                (range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1))}
    except (OSError, ValueError):
        core = {cpus[0]}
    rest = set(cpus) - core
    return {cpus[0]}, rest or set(cpus)


class Job:
    """A workload process that speaks the READY / one-JSON-line-per-phase protocol."""

    def __init__(self, argv: list[str], cpus: Optional[set[int]] = None,
                 stderr: Optional[IO] = None) -> None:
        """`stderr`: where the workload's stderr goes (default: ours)."""
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  stderr=stderr, preexec_fn=pinned(cpus))
        line = self.p.stdout.readline()
        if not line.startswith("READY"):
            raise RuntimeError(f"workload did not start: {line!r}")
        self.pid = int(line.split()[1])

    def run(self, cmd: str) -> dict:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"workload died during {cmd!r}")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.p.stdin.write("exit\n")
            self.p.stdin.close()
        except BrokenPipeError:  # it had finished on its own
            pass
        self.p.wait(timeout=120)


class PosTrace:
    """`pos trace PID` as a user runs it, waiting until its probes are attached."""

    def __init__(self, pid: int, db: str, cpus: Optional[set[int]] = None,
                 options: tuple[str, ...] = ()) -> None:
        self.p = subprocess.Popen([sys.executable, "-m", "pos.cli", "trace", str(pid), "--db", db,
                                   "--quiet", *options], stderr=subprocess.PIPE, text=True,
                                  cwd=ROOT, preexec_fn=pinned(cpus))
        self.log = []
        while True:
            line = self.p.stderr.readline()
            self.log.append(line)
            if not line:
                raise RuntimeError("pos trace failed: " + "".join(self.log))
            if line.startswith("pos: tracing"):
                break

    def stop(self) -> str:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGINT)
        rest = self.p.communicate(timeout=120)[1]
        return "".join(self.log) + rest


def q(db: str, sql: str, *args: object) -> list:
    """Rows of one SQL query on a pos store (plain sqlite3: raw unsigned columns stay signed)."""
    with sqlite3.connect(db) as c:
        return c.execute(sql, args).fetchall()


def count_run(db: str, steps: int) -> dict:
    """Trace a fresh torch_job from before CUDA starts; between two marker memsets, compare the
    launches pos recorded with the kernels torch.profiler (CUPTI) saw, and report the share of
    launches with a kernel name and a known parameter layout; for the launches without one, why
    (pos/tracer/late.py's reasons): over the whole trace, and in the window by kernel."""
    job = Job([sys.executable, str(JOB)])
    tr = PosTrace(job.pid, db)
    init = job.run("init")
    prof = job.run(f"count {steps}")
    job.close()
    log = tr.stop()
    tid = q(db, "select max(id) from traces")[0][0]
    marks = dict(q(db, "select value, ts_ns from copies where trace_id=? and kind='memset' "
                       "and value in (?, ?)", tid, MARK_BEGIN, MARK_END))
    lo, hi = marks[MARK_BEGIN], marks[MARK_END]
    launches = q(db, "select count(*), sum(layout_known), sum(f.name is not null and f.name != '') "
                     "from launches l left join (select handle, max(name) name from functions "
                     "where trace_id=? group by handle) f on f.handle = l.function "
                     "where l.trace_id=? and l.ts_ns > ? and l.ts_ns < ?", tid, tid, lo, hi)[0]
    n, known, named = launches[0], launches[1] or 0, launches[2] or 0
    apis = dict(q(db, "select api, count(*) from launches where trace_id=? and ts_ns > ? and "
                      "ts_ns < ? group by api", tid, lo, hi))
    missing = [f"missing_{r}" for r in REASONS] + ["missing_outside_bytes"]
    lost, dropped, completed, *why = q(db, f"select lost_events, captures_dropped, completed, "
                                           f"{', '.join(missing)} from traces where id=?", tid)[0]
    # where layouts came from, and which kernels went without one
    modules = q(db, "select api, count(*), sum(kernels), group_concat(distinct note) from modules "
                    "where trace_id=? group by api", tid)
    unresolved = q(db, "select api, count(*) from functions where trace_id=? and layout is null "
                       "group by api", tid)
    # [name, reason, launches, least and most bytes outside (negative: below the capture)]
    unknown = q(db, "select f.name, l.missing, count(*), min(l.missing_bytes), "
                    "max(l.missing_bytes) from launches l left join (select handle, max(name) "
                    "name from functions where trace_id=? group by handle) f on f.handle = "
                    "l.function where l.trace_id=? and l.ts_ns > ? and l.ts_ns < ? and "
                    "not l.layout_known group by 1, 2 order by 3 desc limit 12", tid, tid, lo, hi)
    return {"modules_by_api": modules, "functions_without_layout_by_api": unresolved,
            "top_kernels_without_layout": unknown, "init": init, "steps": steps, "profiler_kernels": prof["profiler_kernels"],
            "traced_launches": n, "launch_apis": apis, "equal": n == prof["profiler_kernels"],
            "named_share": named / n if n else 0, "layout_known_share": known / n if n else 0,
            "lost_events": lost, "captures_dropped": dropped, "completed": completed,
            "missing": dict(zip(missing, why)),
            "trace_log": log.strip().splitlines()[-1:]}
