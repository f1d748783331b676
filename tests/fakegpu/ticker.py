"""A process that calls the fake driver's cuCtxSynchronize at a steady pace: a target for
`pos trace` whose every call is known (tests/tracer, bench/trace_startup.py).

USAGE: python tests/fakegpu/ticker.py LIBCUDA CALLS_FILE [INTERVAL_S]

Prints `READY <pid>` once the library is mapped, then calls cuCtxSynchronize every INTERVAL_S
(default 0.005). For each call it keeps CLOCK_MONOTONIC in ns just before the call; on SIGTERM
or SIGINT it writes them, one a line, to CALLS_FILE and exits 0. A probe's timestamp
(bpf_ktime_get_ns) is on the same clock, a little later than the one kept here.
"""

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class Ticker:
    """This script in a process of its own, started and ended from a test or a benchmark."""

    def __init__(self, libcuda: Path, calls: Path) -> None:
        self.calls = calls
        self.p = subprocess.Popen([sys.executable, __file__, str(libcuda), str(calls)],
                                  stdout=subprocess.PIPE, text=True)
        line = self.p.stdout.readline()
        if not line.startswith("READY"):
            raise RuntimeError(f"the ticker did not start: {line!r}")
        self.pid = int(line.split()[1])

    def stop(self) -> list[int]:
        """End it; the CLOCK_MONOTONIC time kept before each call it made."""
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
        self.p.wait(timeout=30)
        return [int(x) for x in self.calls.read_text().split()] if self.calls.exists() else []


def main() -> None:
    lib = ctypes.CDLL(sys.argv[1])
    calls_file = sys.argv[2]
    interval = float(sys.argv[3]) if len(sys.argv) > 3 else 0.005
    calls: list[int] = []
    done = False

    def stop(*_: object) -> None:
        nonlocal done
        done = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"READY {os.getpid()}", flush=True)
    while not done:
        calls.append(time.monotonic_ns())
        lib.cuCtxSynchronize()
        time.sleep(interval)
    with open(calls_file, "w") as f:
        f.write("".join(f"{t}\n" for t in calls))


if __name__ == "__main__":
    main()
