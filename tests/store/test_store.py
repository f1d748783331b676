"""The store: schema, the batched writer, and both export formats, without eBPF."""

import io
import json
import os
import sqlite3
import stat
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import select
from sqlalchemy.orm import Session

from pos.cli import cli
from pos.errors import BadInput
from pos.store.db import open_db
from pos.store.export import export_jsonl, export_perfetto, split_params
from pos.store.models import Allocation, Meta, Trace
from pos.store.writer import TraceWriter

BIG = 0xFFFF_8000_0000_1234     # above 2**63: must survive SQLite's signed integers


def _trace(engine, pid: int = 42) -> int:
    with Session(engine) as s:
        t = Trace(pid=pid, comm="app", cmdline="app --x", library="/lib/libcuda.so.1",
                  started_at=datetime.now(timezone.utc), probes=3, status="running")
        s.add(t)
        s.commit()
        return t.id


def _hdr(ts: int, api: str, tid: int = 7) -> dict:
    return {"ts_ns": ts, "pid": 42, "tid": tid, "api": api}


@pytest.fixture
def recorded(tmp_path: Path):
    engine = open_db(str(tmp_path / "t.db"))
    tid = _trace(engine)
    w = TraceWriter(engine, tid)
    # added out of time order on purpose: the export merges by ts_ns
    w.add("launches", {**_hdr(300, "cuLaunchKernel"), "function": 0xF1, "stream": 0x5,
                       "grid_x": 2, "grid_y": 1, "grid_z": 1, "block_x": 128, "block_y": 1,
                       "block_z": 1, "shared_mem": 0,
                       "params": bytes.fromhex("0000803f00000000" "1000000000000000"),
                       "layout_known": True, "truncated": False})
    w.add("launches", {**_hdr(400, "cuLaunchKernel_ptsz", tid=8), "function": 0xF2, "stream": 0,
                       "grid_x": 1, "grid_y": 1, "grid_z": 1, "block_x": 1, "block_y": 1,
                       "block_z": 1, "shared_mem": 16, "params": bytes(range(16)),
                       "layout_known": False, "truncated": False})
    w.add("allocations", {**_hdr(100, "cuMemAlloc_v2"), "kind": "alloc", "ptr": BIG, "size": 4096,
                          "stream": 0})
    w.add("functions", {**_hdr(200, "cuModuleGetFunction"), "handle": 0xF1, "module": 0xA,
                        "name": "_Z4axpyfPKfPfi", "layout": "[[0, 4], [8, 8]]"})
    w.add("copies", {**_hdr(500, "cuMemcpyHtoD_v2"), "kind": "memcpy", "dst": BIG, "src": 0x10,
                     "size": 64, "value": None, "stream": 0, "direction": "HtoD"})
    w.add("copies", {**_hdr(600, "cuMemsetD32_v2"), "kind": "memset", "dst": BIG, "src": None,
                     "size": 64, "value": 7, "stream": 0, "direction": None})
    w.add("syncs", {**_hdr(700, "cuCtxSynchronize"), "handle": 0})
    w.add("allocations", {**_hdr(800, "cuMemFree_v2"), "kind": "free", "ptr": BIG, "size": None,
                          "stream": 0})
    w.update_trace(status="done", lost_events=0)
    w.close()
    assert w.written == 8
    return engine, tid


def test_store_file_is_root_only_and_u64_round_trips(recorded, tmp_path: Path) -> None:
    engine, tid = recorded
    assert stat.S_IMODE(os.stat(tmp_path / "t.db").st_mode) == 0o600
    with Session(engine) as s:
        assert s.scalars(select(Allocation.ptr)).all() == [BIG, BIG]
        assert s.get(Trace, tid).status == "done"


def test_jsonl_is_in_time_order_with_names_and_split_params(recorded) -> None:
    engine, tid = recorded
    out = io.StringIO()
    assert export_jsonl(engine, out) == 8
    ev = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [e["ts_ns"] for e in ev] == [100, 200, 300, 400, 500, 600, 700, 800]
    assert [e["kind"] for e in ev] == ["alloc", "function", "launch", "launch", "memcpy",
                                        "memset", "sync", "free"]
    assert ev[0]["ptr"] == hex(BIG) and ev[0]["size"] == 4096
    assert ev[1] == {"kind": "function", "api": "cuModuleGetFunction", "ts_ns": 200, "pid": 42,
                     "tid": 7, "handle": "0xf1", "name": "_Z4axpyfPKfPfi",
                     "layout": [[0, 4], [8, 8]]}
    launch = ev[2]
    assert launch["name"] == "_Z4axpyfPKfPfi" and launch["function"] == "0xf1"
    assert launch["params"] == ["0000803f", "1000000000000000"]   # at the layout's offsets
    assert launch["grid"] == [2, 1, 1] and launch["block"] == [128, 1, 1]
    assert launch["layout_known"] is True and launch["stream"] == "0x5"
    unknown = ev[3]
    assert unknown["name"] is None and unknown["layout_known"] is False
    assert unknown["params"] == [bytes(range(8)).hex(), bytes(range(8, 16)).hex()]
    assert ev[4]["direction"] == "HtoD" and ev[4]["src"] == "0x10"
    assert ev[5]["value"] == 7 and ev[5]["size"] == 64
    assert ev[6]["handle"] == "0x0"


def test_perfetto_has_thread_and_stream_tracks(recorded) -> None:
    engine, _ = recorded
    out = io.StringIO()
    export_perfetto(engine, out)
    doc = json.loads(out.getvalue())
    names = {(e["pid"], e.get("tid"), e["args"]["name"]) for e in doc["traceEvents"]
             if e["ph"] == "M"}
    assert (42, None, "app (42)") in names
    assert {(42, 7, "thread 7"), (42, 8, "thread 8")} <= names
    streams = {n for p, _t, n in names if n.startswith("stream ")}
    assert streams == {"stream 0x5", "stream 0x0"}
    launches = [e for e in doc["traceEvents"] if e.get("cat") == "launch"]
    assert len(launches) == 4      # each on its thread and on its stream
    assert launches[0]["name"] == "_Z4axpyfPKfPfi" and launches[0]["ts"] == 0.3


def test_split_params() -> None:
    assert split_params(bytes(range(10)), [[0, 2], [4, 4]]) == [b"\0\1", b"\4\5\6\7"]
    assert split_params(bytes(range(10)), None) == [bytes(range(8)), b"\x08\x09"]


def test_open_db_rejects_what_is_not_a_store(tmp_path: Path) -> None:
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(BadInput, match="not a usable pos store"):
        open_db(str(junk), create=False)
    with pytest.raises(BadInput, match="is not a pos store"):
        open_db(str(tmp_path / "missing.db"), create=False)


def test_checking_a_store_keeps_the_locks_of_this_process(tmp_path: Path) -> None:
    """Closing any descriptor of a file drops the POSIX locks the process holds on it: a check
    that opened the store itself would let another process write under a live transaction
    (the daemon's test saw "disk I/O error")."""
    from pos.store.db import check

    db = tmp_path / "t.db"
    mine = sqlite3.connect(db, isolation_level=None)
    mine.execute("BEGIN IMMEDIATE")          # this process holds the write lock
    check(str(db))
    other = subprocess.run([sys.executable, "-c", "import sqlite3, sys; sqlite3.connect("
                            "sys.argv[1], timeout=0).execute('BEGIN IMMEDIATE')", str(db)],
                           capture_output=True, text=True)
    mine.rollback()
    mine.close()
    assert other.returncode == 1 and "database is locked" in other.stderr, other.stderr


def test_an_empty_file_is_not_a_store_to_read(tmp_path: Path) -> None:
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    for command in ("export", "analyze"):
        r = CliRunner().invoke(cli, [command, str(empty)])
        assert r.exit_code == 2
        assert r.output == (f"Error: {empty} is not a pos store (an empty file): give the file "
                            "that `pos trace --db` wrote.\n")
    r = CliRunner().invoke(cli, ["images", "--db", str(empty)])     # a store to write: made
    assert r.exit_code == 0 and r.output.split()[:2] == ["ID", "CREATED"]


def test_cli_export_errors_are_one_sentence(tmp_path: Path) -> None:
    runner = CliRunner()
    r = runner.invoke(cli, ["export", str(tmp_path / "missing.db")])
    assert r.exit_code == 2
    assert r.output.strip() == (f"Error: {tmp_path / 'missing.db'} is not a pos store: give the "
                                "file that `pos trace --db` wrote.")
    open_db(str(tmp_path / "empty.db"))
    r = runner.invoke(cli, ["export", str(tmp_path / "empty.db")])
    assert r.exit_code == 2 and "holds no trace" in r.output and "Traceback" not in r.output
    other = tmp_path / "other.db"
    c = sqlite3.connect(other)
    c.execute("CREATE TABLE things (a)")
    c.commit()
    c.close()
    r = runner.invoke(cli, ["images", "--db", str(other)])
    assert r.exit_code == 2
    assert r.output.strip() == (f"Error: {other} is not a usable pos store (an SQLite file "
                                "without pos's tables): give the file that `pos trace --db` "
                                "wrote, or a new path.")
    r = runner.invoke(cli, ["export", str(tmp_path / "empty.db"), "-o",
                            str(tmp_path / "no" / "out.json")])
    assert r.exit_code == 2
    assert r.output.strip() == (f"Error: cannot write {tmp_path / 'no' / 'out.json'} (No such "
                                "file or directory): give -o a file in an existing, writable "
                                "directory.")


def test_cli_export_writes_a_file(recorded, tmp_path: Path) -> None:
    r = CliRunner().invoke(cli, ["export", str(tmp_path / "t.db"), "--format", "perfetto",
                                 "-o", str(tmp_path / "p.json")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "p.json").read_text())["displayTimeUnit"] == "ns"


def test_a_store_in_a_missing_folder_is_refused_and_no_folder_is_made(tmp_path: Path) -> None:
    """`pos trace --db`, `pos daemon --db`, `pos schedule add --db` with a mistyped folder: one
    sentence, and no folder left behind (only the default store's folder is made)."""
    missing = tmp_path / "no" / "such" / "t.db"
    with pytest.raises(BadInput, match="the folder of the store .* does not exist"):
        open_db(str(missing))
    for args in (["daemon", "--db", str(missing)],
                 ["schedule", "add", "--cron", "* * * * *", "--name", "nothing-runs-this", "-D",
                  str(tmp_path), "--db", str(missing)]):
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 2, r.output
        assert r.output.strip() == (f"Error: the folder of the store {missing} does not exist: "
                                    "create it first, or give --db a file in an existing "
                                    "folder.")
    assert not (tmp_path / "no").exists()


def test_a_store_left_mid_transaction_by_a_killed_pos_is_rolled_back_and_used(
        tmp_path: Path) -> None:
    """pos killed while it wrote the store can leave a hot journal (a new store is switched to
    WAL through one): the next pos rolls it back, where a read-only look at it failed ("attempt
    to write a readonly database", pos killed during `pos checkpoint`'s first write)."""
    from pos.store.db import check

    db = tmp_path / "t.db"
    open_db(str(db)).dispose()
    killed = ("import os, sqlite3, sys\n"
              "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
              "c.execute('PRAGMA journal_mode=DELETE')\n"
              "c.execute('PRAGMA cache_size=1')\n"          # pages spill: the journal is hot
              "c.execute('BEGIN')\n"
              "for i in range(500):\n"
              "    c.execute('INSERT INTO meta (key, value) VALUES (?, ?)', (str(i), 'x' * 1000))\n"
              "os._exit(0)\n")
    subprocess.run([sys.executable, "-c", killed, str(db)], check=True)
    assert (tmp_path / "t.db-journal").stat().st_size > 0
    check(str(db), create=False)
    with Session(open_db(str(db), create=False)) as s:
        assert s.scalar(select(Meta.value).where(Meta.key == "schema_version")) is not None
        assert s.scalar(select(Meta.value).where(Meta.key == "499")) is None
