"""Progress of `pos checkpoint` / `pos restore`: drawn on a terminal (its phases and bytes),
nothing of it in pipes; `--json` gives the report as one JSON object (real CRIU, root)."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engines.conftest import ROOT, Counter, lines, pos, wait_for


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"POS_DB": str(tmp_path / "pos.db"), "POS_WATCHDOG_LOG": str(tmp_path / "wd.log"),
            "POS_LOG_DIR": str(tmp_path / "logs")}


def test_json_reports_and_no_progress_in_pipes(tmp_path: Path, counters, env) -> None:
    c = Counter(tmp_path / "count")
    counters.append(c)
    img = tmp_path / "img"
    r = pos("checkpoint", str(c.pid), "-D", str(img), "--json", env=env)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)               # stdout is the one object, nothing else
    assert report["pid"] == c.pid and report["path"] == str(img)
    assert report["size_bytes"] > 0 and "dump" in report["timings"]
    assert f"checkpointing PID {c.pid}" in r.stderr      # the steps' lines went to stderr
    assert "\x1b[" not in r.stderr and f"checkpoint PID {c.pid}:" not in r.stderr
    c.reap_original()
    at_dump = len(lines(c.path))
    r = pos("restore", "-D", str(img), "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["restored_pid"] == c.pid
    assert "\x1b[" not in r.stderr
    wait_for(lambda: len(lines(c.path)) > at_dump + 10, what="the restored counter")


def test_progress_on_a_terminal(tmp_path: Path, counters, env) -> None:
    if shutil.which("script") is None:
        pytest.skip("script (util-linux) is needed for a pseudo-terminal")
    c = Counter(tmp_path / "count", ballast_mb=200)      # a dump that takes a while
    counters.append(c)
    img = tmp_path / "img"
    command = " ".join([*(f"{k}={v}" for k, v in env.items()), sys.executable, "-m", "pos.cli",
                        "checkpoint", str(c.pid), "-D", str(img)])
    r = subprocess.run(["script", "-qec", f"env {command}", "/dev/null"], cwd=ROOT, text=True,
                       capture_output=True, stdin=subprocess.DEVNULL, timeout=120)
    assert r.returncode == 0, r.stdout
    # rich drew the operation and its phases, then took its line away; the report stays
    assert f"checkpoint PID {c.pid}: dump" in r.stdout, r.stdout
    assert f"checkpoint PID {c.pid}: checksum" in r.stdout, r.stdout
    assert "\x1b[2K" in r.stdout
    shown = screen(r.stdout)
    # the steps' lines went above the progress line, never into it
    assert any(line.startswith(f"checkpointing PID {c.pid} (") for line in shown), shown
    assert not any("checkpointing PID" in line and not line.startswith("checkpointing")
                   for line in shown), shown
    summary = shown[shown.index(next(x for x in shown if x.startswith("saved PID"))):]
    assert summary[0].startswith(f"saved PID {c.pid} (python") and f"into {img}: " in summary[0]
    assert summary[1] == "it was ended once saved (restore it with `pos restore -D DIR`)"
    assert summary[2].startswith("longest steps: ")
    assert summary[3] == f"every field: pos inspect {img} (or --json)"


def screen(raw: str) -> list[str]:
    """The lines a terminal shows of `raw`: escape sequences dropped, each line what follows
    its last carriage return."""
    out = []
    for line in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw).split("\n"):
        parts = [p for p in line.split("\r") if p]
        if parts:
            out.append(parts[-1])
    return out
