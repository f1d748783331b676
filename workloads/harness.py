"""Drive a workload process and `pos trace` as a user would: shared by the demo, bench/ and
tests/gpu. A workload prints `READY <pid>` before it initialises its GPU, then answers each
command line on stdin with one JSON line."""

import json
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Job:
    """A workload process that speaks the READY / one-JSON-line-per-phase protocol."""

    def __init__(self, argv: list[str]) -> None:
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
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

    def __init__(self, pid: int, db: str) -> None:
        self.p = subprocess.Popen([sys.executable, "-m", "pos.cli", "trace", str(pid), "--db", db,
                                   "--quiet"], stderr=subprocess.PIPE, text=True, cwd=ROOT)
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
