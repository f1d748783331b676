"""What starting a thread costs beside threads that run Python: a concurrent checkpoint's copy
runs a thread per core twice, plus one per stream, and started them after the cut, with the
job held (`copy_start`: 0.19 s a rank on 2x H200, 32 cores). `Thread.start` returns once the
new thread has run, and the new thread waits for the GIL, which a busy thread gives up only
every switch interval (5 ms). No GPU needed:

    python3 bench/thread_start.py --out DIR [--threads 65,129] [--busy 0,1,3]

For each count of busy threads (each a Python loop) and of threads to start, --repeat times:
the seconds `threading.Thread.start` took for all of them, against handing the same number of
tasks to threads started before the busy ones were (crew.Spares, what the checkpoint does
since).
Writes DIR/threads.json.
"""

import argparse
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pos.concurrent.crew import Crew, Spares  # noqa: E402


def beside(busy: int, measure: Callable[[], float]) -> float:
    """`measure()` while `busy` threads run a Python loop."""
    stop = threading.Event()

    def loop() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    loops = [threading.Thread(target=loop, daemon=True) for _ in range(busy)]
    for t in loops:
        t.start()
    try:
        return measure()
    finally:
        stop.set()
        for t in loops:
            t.join()


def starting(n: int, spares: Optional[Spares] = None) -> Callable[[], float]:
    """n tasks, each waiting until all are running, started the way the copy starts them
    (Crew.start): on threads of their own, or handed to `spares`."""
    def measure() -> float:
        go = threading.Event()

        def task() -> None:
            go.wait()

        crew = Crew("bench")
        t = time.monotonic()
        crew.start([(str(k), task) for k in range(n)], spares)
        seconds = time.monotonic() - t
        go.set()
        crew.wait()
        return seconds
    return measure


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", default="65,129", help="threads to start, comma-separated")
    ap.add_argument("--busy", default="0,1,3", help="busy threads beside, comma-separated")
    ap.add_argument("--repeat", type=int, default=5, help="runs of each (the OS's scheduling "
                    "spreads them)")
    a = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for n in (int(x) for x in a.threads.split(",")):
        for busy in (int(x) for x in a.busy.split(",")):
            started, handed = [], []
            for _ in range(a.repeat):
                spares = Spares(n, "bench")       # before the busy threads, as in prepare
                started.append(round(beside(busy, starting(n)), 4))
                handed.append(round(beside(busy, starting(n, spares)), 4))
            row = {"threads": n, "busy": busy, "started_s": started,
                   "handed_to_spares_s": handed}
            rows.append(row)
            print("row", json.dumps(row), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "threads.json").write_text(json.dumps({
        "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(), "cores": os.cpu_count(),
        "switch_interval_s": sys.getswitchinterval(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
