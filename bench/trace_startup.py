#!/usr/bin/env python3
"""trace_startup: how long `pos trace` takes to start and to stop, as a user runs it.

The target calls the fake driver's cuCtxSynchronize every 5 ms (tests/fakegpu/ticker.py: real
uprobes on a fake libcuda.so.1, so no GPU is needed; the real libcuda has the same symbols to
probe). Each run starts `pos trace PID --quiet --db FILE` and times, from the command's start:
  attached_s     the line `pos: tracing ...` (the probes are attached);
  first_event_s  the first call the probes saw (their timestamp: CLOCK_MONOTONIC, as here);
  first_row_s    that event visible in the store (the sink's batching included);
then sends SIGINT, as Ctrl-C does, and times
  stop_s         from SIGINT to the command's exit (summary printed, store complete);
  missed         the target's calls made before the SIGINT that the store lacks (0 expected).
The first run starts with an empty cache of compiled probes (POS_CACHE_DIR): bcc compiles, as
on a host's first trace; the others find the cache. A last run traces with `--duration D` and
reports its wall time and the seconds its summary says the probes were attached.

USAGE: .venv/bin/python bench/trace_startup.py [--runs 5] [--duration 3] [--root DIR]... [--out FILE]
  --root DIR   time the `pos trace` of this pos checkout (its own code, this Python); given
               twice, the two checkouts' runs alternate, so that both see the same load: the
               figures before and after a change on a shared machine
"""

import argparse
import json
import os
import platform
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from datetime import date, datetime, timezone
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.fakegpu.ticker import Ticker  # noqa: E402


def first_sync(db: Path) -> Optional[int]:
    try:
        with sqlite3.connect(db) as c:
            return c.execute("select min(ts_ns) from syncs").fetchone()[0]
    except sqlite3.OperationalError:    # the tables are not there yet
        return None


def one_run(root: Path, libcuda: Path, work: Path, env: dict[str, str], n: str,
            traced_s: float) -> dict[str, Any]:
    db, calls = work / f"run{n}.db", work / f"calls{n}.txt"
    target = Ticker(libcuda, calls)
    try:
        t0 = time.monotonic_ns()
        p = subprocess.Popen([sys.executable, "-m", "pos.cli", "trace", str(target.pid), "--db",
                              str(db), "--quiet"], cwd=root, env=env, stderr=subprocess.PIPE,
                             text=True)
        log = []
        while not (line := p.stderr.readline()).startswith("pos: tracing"):
            log.append(line)
            if not line:
                raise RuntimeError("pos trace failed: " + "".join(log))
        attached = time.monotonic_ns()
        while (first := first_sync(db)) is None:
            time.sleep(0.005)
        first_row = time.monotonic_ns()
        time.sleep(traced_s)
        sigint = time.monotonic_ns()
        p.send_signal(signal.SIGINT)
        rest = p.communicate(timeout=120)[1]
        ended = time.monotonic_ns()
    finally:
        made = target.stop()
    with sqlite3.connect(db) as c:
        seen = [r[0] for r in c.execute("select ts_ns from syncs order by ts_ns")]
    # every call kept after the first one seen and before the SIGINT must be in the store
    expected = [t for t in made if first < t < sigint]
    missed = max(0, len(expected) - len([t for t in seen if t > first]))
    return {"compiled": any("compiling" in line for line in log),
            "attached_s": (attached - t0) / 1e9, "first_event_s": (first - t0) / 1e9,
            "first_row_s": (first_row - t0) / 1e9, "stop_s": (ended - sigint) / 1e9,
            "calls_before_sigint": len(expected), "missed": missed,
            "summary": rest.strip().splitlines()[-1]}


def duration_run(root: Path, libcuda: Path, work: Path, env: dict[str, str],
                 duration: float, n: str) -> dict[str, Any]:
    target = Ticker(libcuda, work / f"calls-duration{n}.txt")
    try:
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "pos.cli", "trace", str(target.pid), "--db",
                            str(work / f"duration{n}.db"), "--quiet", "--duration",
                            str(duration)],
                           cwd=root, env=env, capture_output=True, text=True, timeout=300)
        wall = time.monotonic() - t0
    finally:
        target.stop()
    summary = p.stderr.strip().splitlines()[-1]
    said = re.search(r"^traced \d+ for ([0-9.]+) s", summary, re.M)
    return {"duration_s": duration, "wall_s": wall,
            "attached_s_said": float(said.group(1)) if said else None, "summary": summary}


def commit(root: Path) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                          capture_output=True, text=True).stdout.strip()


def summarize(root: Path, runs: list[dict[str, Any]], timed: dict[str, Any]) -> dict[str, Any]:
    warm = runs[1:] or runs

    def spread(key: str) -> list[float]:
        values = sorted(r[key] for r in warm)
        return [round(values[0], 3), round(values[len(values) // 2], 3), round(values[-1], 3)]

    return {"commit": commit(root), "root": str(root), "cold": runs[0],
            "warm_min_median_max": {k: spread(k) for k in
                                    ("attached_s", "first_event_s", "first_row_s", "stop_s")},
            "missed_calls": sum(r["missed"] for r in runs), "runs": runs, "duration": timed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="runs with the cache (after a cold one)")
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--traced", type=float, default=0.5, help="seconds traced before SIGINT")
    ap.add_argument("--root", type=Path, action="append",
                    help="a pos checkout to time (repeatable: their runs alternate, so that "
                         "each sees the same load) [default: this one]")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    roots = [r.resolve() for r in args.root or [ROOT]]
    gpu = shutil.which("nvidia-smi") is not None
    out = args.out or ROOT / "bench" / "results" / str(date.today()) / \
        f"trace-startup{'' if gpu else '-vm'}.json"

    from tests.fakegpu.build import build

    with tempfile.TemporaryDirectory(prefix="pos-bench-trace-") as tmp:
        work = Path(tmp)
        libcuda = build(work / "fakegpu")["libcuda"]
        envs = [dict(os.environ, POS_CACHE_DIR=str(work / f"cache{i}"), PYTHONPATH=str(root))
                for i, root in enumerate(roots)]
        runs: list[list[dict[str, Any]]] = [[] for _ in roots]
        for n in range(args.runs + 1):
            for i, root in enumerate(roots):
                r = one_run(root, libcuda, work, envs[i], f"{i}-{n}", args.traced)
                print(json.dumps({"root": str(root), **{k: v for k, v in r.items()
                                                         if k != "summary"}}), flush=True)
                runs[i].append(r)
        timed = []
        for i, root in enumerate(roots):
            timed.append(duration_run(root, libcuda, work, envs[i], args.duration, str(i)))
            print(json.dumps({"root": str(root), **timed[-1]}), flush=True)

    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "machine": {"gpu": gpu, "cores": os.cpu_count(), "kernel": platform.release(),
                    "python": platform.python_version(),
                    "load_average_after": os.getloadavg()},
        "target": "tests/fakegpu/ticker.py: the fake libcuda's cuCtxSynchronize every 5 ms",
        "checkouts": [summarize(root, runs[i], timed[i]) for i, root in enumerate(roots)],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
