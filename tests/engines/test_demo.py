"""The demo (workloads/demo.py, what scripts/demo.sh runs) works the same whether its output
goes to a terminal, a file or a pipe, and ends everything it started, even when it is ended
itself half-way (real eBPF and real CRIU over the fake driver; root)."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.engines.conftest import wait_for

DEMO = [sys.executable, "-m", "workloads.demo"]


def left_running(out: Path) -> list[str]:
    """The processes still running whose command line names the demo's folder (its jobs, the
    traced workload, pos and its watchdog all do)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if str(out) in cmdline:
                found.append(f"{entry.name}: {cmdline}")
    return found


def finished(out: Path, text: str) -> None:
    """The demo went through: the restored job went on, nothing of it runs, no zombie left."""
    assert "demo: done" in text and "Traceback" not in text, text
    pid = int(re.search(r"restored PID (\d+)", text).group(1))
    assert not Path(f"/proc/{pid}").exists(), f"the restored job {pid} is left"
    assert left_running(out) == []


@pytest.fixture
def demo_ready(bpf_ready: None, fakegpu: dict[str, Path], criu_ready: None) -> None:
    """The prerequisites of the demo's fake-driver path."""


@pytest.mark.parametrize("where", ["terminal", "file", "pipe"])
def test_demo_output_anywhere(where: str, tmp_path: Path, demo_ready: None) -> None:
    out = tmp_path / "out"
    out.mkdir()
    argv = [*DEMO, "--db", str(out / "demo.db"), "--out", str(out)]
    if where == "terminal":
        if shutil.which("script") is None:
            pytest.skip("script (util-linux) is needed for a pseudo-terminal")
        cmd = " ".join(argv)
        r = subprocess.run(["script", "-qec", cmd, "/dev/null"], cwd=ROOT, capture_output=True,
                           text=True, stdin=subprocess.DEVNULL, timeout=300)
        text = r.stdout
    elif where == "file":
        log = tmp_path / "demo.log"
        with open(log, "w") as f:    # `> demo.log 2>&1`
            r = subprocess.run(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, timeout=300)
        text = log.read_text()
    else:
        r = subprocess.run(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, text=True, timeout=300)
        text = r.stdout
    assert r.returncode == 0, text
    finished(out, text)


def test_demo_ended_half_way_ends_what_it_started(tmp_path: Path, demo_ready: None) -> None:
    out = tmp_path / "out"
    out.mkdir()
    demo = subprocess.Popen([*DEMO, "--db", str(out / "demo.db"), "--out", str(out)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True)
    seen = []
    for line in demo.stdout:
        seen.append(line)
        if line.startswith("demo: $ pos checkpoint"):   # its job runs, pos is checkpointing
            break
    assert left_running(out), "".join(seen)
    demo.send_signal(signal.SIGTERM)
    rest = demo.communicate(timeout=60)[0]
    assert demo.returncode == 1 and "demo: interrupted" in rest, "".join(seen) + rest
    assert "Traceback" not in rest, rest
    wait_for(lambda: left_running(out) == [], timeout=10, what="the demo's processes to end")
    time.sleep(0.5)     # a time, not a wait: nothing it started comes back in it
    assert left_running(out) == []
