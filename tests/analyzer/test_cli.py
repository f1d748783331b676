"""`pos analyze` on bad input: one sentence naming cause and fix, exit 2, no traceback; and
on a store written by the store's own writer, the report and the JSON fields."""

import json
import sqlite3
import struct
from pathlib import Path

from click.testing import CliRunner
from sqlalchemy.orm import Session

from pos.cli import cli
from pos.store.db import open_db
from pos.store.models import Allocation, Function, Launch, Trace


def run(*args: str):
    return CliRunner().invoke(cli, ["analyze", *args])


def assert_bad_input(r, words: str) -> None:
    assert r.exit_code == 2, r.output
    assert words in r.output
    assert "Traceback" not in r.output and isinstance(r.exception, SystemExit)
    assert len(r.output.strip().splitlines()) == 1


def test_missing_file(tmp_path: Path) -> None:
    assert_bad_input(run(str(tmp_path / "nope.db")), "is not a pos store")


def test_not_a_pos_store(tmp_path: Path) -> None:
    p = tmp_path / "x.db"
    p.write_text("hello, not sqlite\n" * 100)
    assert_bad_input(run(str(p)), "is not a usable pos store")
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as c:
        c.execute("create table t (x)")
    assert_bad_input(run(str(other)), "is not a usable pos store")


def test_store_without_trace_and_empty_trace(tmp_path: Path) -> None:
    db = str(tmp_path / "t.db")
    engine = open_db(db)
    assert_bad_input(run(db), "the store holds no trace")
    from datetime import datetime, timezone
    with Session(engine) as s:
        s.add(Trace(pid=1, comm="x", cmdline="x", library="libcuda.so.1",
                    started_at=datetime.now(timezone.utc), probes=1, status="done"))
        s.commit()
    assert_bad_input(run(db), "holds no kernel launch, copy or set")
    assert_bad_input(run(db, "--trace", "9"), "has no trace 9")


def test_bad_validation_table(tmp_path: Path) -> None:
    p = tmp_path / "v.json"
    p.write_text("[1, 2]")
    assert_bad_input(run(str(tmp_path / "t.db"), "--validation", str(p)), "is not a validation table")


def test_report_and_json_of_a_written_store(tmp_path: Path) -> None:
    """A store made through the models (as pos trace writes it), pointers above 2**63 included."""
    from datetime import datetime, timezone
    db = str(tmp_path / "t.db")
    engine = open_db(db)
    hi = 0xFFFF_8000_0000_0000
    with Session(engine) as s:
        t = Trace(pid=1, comm="x", cmdline="x", library="libcuda.so.1",
                  started_at=datetime.now(timezone.utc), probes=1, status="done")
        s.add(t)
        s.flush()
        common = {"trace_id": t.id, "pid": 1, "tid": 1}
        s.add(Allocation(ts_ns=1, api="cuMemAlloc_v2", kind="alloc", ptr=hi, size=4096, **common))
        s.add(Allocation(ts_ns=2, api="cuMemAlloc_v2", kind="alloc", ptr=0x1000, size=4096, **common))
        s.add(Function(ts_ns=3, api="cuModuleGetFunction", handle=7, module=1,
                       name="_Z4axpyfPKfPfi", layout="[[0,4],[8,8],[16,8],[24,4]]", **common))
        for i in range(12):
            s.add(Launch(ts_ns=10 + i, api="cuLaunchKernel", function=7, stream=0, grid_x=1,
                         grid_y=1, grid_z=1, block_x=1, block_y=1, block_z=1, shared_mem=0,
                         params=struct.pack("<f4xQQi4x", 1.0, hi + 8, 0x1000, 3),
                         layout_known=True, truncated=False, **common))
        s.commit()
    r = run(db, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert len(doc["launches"]) == 12
    assert doc["launches"][0]["reads"] == [f"0x{hi:x}", "0x1000"]
    assert doc["launches"][0]["writes"] == ["0x1000"]
    assert doc["iterations"]["detected"] and doc["iterations"]["ops_per_iteration"] == 1
    buffers = {b["ptr"]: b for b in doc["buffers"]}
    assert buffers["0x1000"]["writes_per_iteration"] == 1.0
    assert buffers[f"0x{hi:x}"]["writes_per_iteration"] == 0.0
    assert doc["checkpoint"]["copy_order"] == ["0x1000", f"0x{hi:x}"]
    report = CliRunner(env={"COLUMNS": "80"}).invoke(cli, ["analyze", db])
    assert report.exit_code == 0
    assert "12 launches" in report.output and "axpy" in report.output
    # 80 columns: lines wrap between words, the parameters' types are whole
    assert max(len(line.rstrip()) for line in report.output.splitlines()) <= 80, report.output
    assert "scalar const-pointer pointer scalar" in report.output, report.output
    unvalidated = [ln for ln in report.output.splitlines() if "validation" in ln or "validator" in ln]
    assert unvalidated[-1].rstrip().endswith("run-time validator)"), report.output
    # --dot is checked before the analysis: one sentence, no report
    r = run(db, "--dot", str(tmp_path / "no" / "dag.svg"))
    assert r.exit_code == 2
    assert r.output == (f"Error: cannot write {tmp_path / 'no' / 'dag.svg'} (no folder "
                        f"{tmp_path / 'no'}): give a writable path to --dot.\n")
    assert_bad_input(run(db, "--dot", str(tmp_path)), "is a directory: give a file, not a folder")
