"""`pos trace`'s start and stop on the fake driver: the compiled probes kept for the next run,
the symbols' offsets, the stop that records everything before it, the duration that counts
from the attach, and the perf-event attach where uprobe_multi links are not used.

No timing is asserted here (bench/trace_startup.py measures it): these tests speak to what
each run does and records.
"""

import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import ROOT, wait_for_rows
from tests.fakegpu.ticker import Ticker
from workloads.harness import PosTrace

pytestmark = pytest.mark.bpf
@pytest.fixture
def ticker(fakegpu: dict[str, Path], tmp_path: Path) -> Iterator[Ticker]:
    t = Ticker(fakegpu["libcuda"], tmp_path / "calls.txt")
    yield t
    t.stop()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache of compiled probes for this test's `pos trace` runs."""
    monkeypatch.setenv("POS_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "bpf"


def syncs(db: Path) -> list[int]:
    with sqlite3.connect(db) as c:
        return [r[0] for r in c.execute("select ts_ns from syncs order by ts_ns")]


def test_symbol_offsets_are_those_bcc_finds(fakegpu: dict[str, Path], bpf_ready: None) -> None:
    """One pass over the symbol table gives each symbol the file offset bcc's own resolution
    gives it (bcc reads the ELF file again for every probe)."""
    from bcc import BPF

    from pos.tracer.probes import CUDA
    from pos.tracer.program import symbol_offsets

    path = str(fakegpu["libcuda"])
    offsets = symbol_offsets(path, CUDA.symbols)
    assert len(offsets) > 40
    for sym, off in offsets.items():
        assert BPF._check_path_symbol(path.encode(), sym.encode(), None, -1)[1] == off, sym


def test_the_second_trace_loads_the_probes_without_compiling(
        ticker: Ticker, cache: Path, tmp_path: Path, bpf_ready: None) -> None:
    """The first trace on a host compiles the probes and says so while it waits; the next one
    finds them compiled and records just the same. A cache file that cannot be read is
    compiled again."""
    logs = []
    for n in range(3):
        db = tmp_path / f"t{n}.db"
        tr = PosTrace(ticker.pid, str(db))
        wait_for_rows(db, "select count(*) from syncs", 3, "syncs")
        logs.append(tr.stop())
        if n == 1:
            for f in cache.iterdir():
                f.write_text("{not json")
    assert "pos: compiling the cuda probes for this kernel" in logs[0], logs[0]
    assert "compiling" not in logs[1], logs[1]
    assert "compiling" in logs[2], logs[2]
    assert [f.suffix for f in cache.iterdir()] == [".json"]


def test_ctrl_c_keeps_every_call_made_before_it(ticker: Ticker, cache: Path, tmp_path: Path,
                                                bpf_ready: None) -> None:
    """The probes are detached first, then the ring is drained: every call the target made
    before Ctrl-C, since the first one traced, is in the store."""
    db = tmp_path / "t.db"
    tr = PosTrace(ticker.pid, str(db))
    wait_for_rows(db, "select count(*) from syncs", 20, "syncs")
    sigint = time.monotonic_ns()
    log = tr.stop()
    made = ticker.stop()
    seen = syncs(db)
    assert re.search(rf"^traced {ticker.pid} for [0-9.]+ s \(stopped\): ", log, re.M), log
    before = [t for t in made if seen[0] < t < sigint]
    assert len(before) >= 19
    assert len([t for t in seen if t > seen[0]]) >= len(before)


def test_duration_counts_from_the_attach(ticker: Ticker, cache: Path, tmp_path: Path,
                                         bpf_ready: None) -> None:
    """--duration is the time the probes are attached, compiling aside; the summary says it."""
    r = subprocess.run([sys.executable, "-m", "pos.cli", "trace", str(ticker.pid), "--quiet",
                        "--duration", "0.5", "--db", str(tmp_path / "t.db")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    said = re.search(rf"^traced {ticker.pid} for ([0-9.]+) s \(done\): ", r.stderr, re.M)
    assert said, r.stderr
    assert 0.5 <= float(said.group(1)) < 1.5
    assert "compiling" in r.stderr      # the compilation did not count
    assert len(syncs(tmp_path / "t.db")) > 0


def test_perf_event_probes_where_uprobe_multi_is_not_used(
        ticker: Ticker, cache: Path, tmp_path: Path, bpf_ready: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels before 6.6 attach each probe as a perf event (bcc's way): the same recording."""
    monkeypatch.setenv("POS_UPROBE_MULTI", "0")
    db = tmp_path / "t.db"
    tr = PosTrace(ticker.pid, str(db))
    wait_for_rows(db, "select count(*) from syncs", 3, "syncs")
    log = tr.stop()
    assert "(stopped)" in log and "0 lost" in log, log
