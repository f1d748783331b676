"""CRIU's stats-dump read through protobuf (pos/image/criustats.py), on files made with the same
library as CRIU writes them: the frozen time's split in seconds, CRIU's other fields skipped,
and a file that says nothing usable read as none. (A real CRIU's file: tests/engines/
test_criu_cpu.py.)"""

import struct
from pathlib import Path
from typing import Any, Optional

import pytest

from pos.image import criustats, names
from pos.image.criustats import DumpStats

PAGES_LAZY = b"\x48\x05"      # CRIU's dump_stats_entry field 9 (pages_lazy) = 5: not described


def entry(**dump: int) -> Any:
    e = criustats.stats_entry()()
    for k, v in dump.items():
        setattr(e.dump, k, v)
    return e


def stats_file(folder: Path, body: bytes, head: Optional[tuple[int, int, int]] = None) -> None:
    magics = head or (criustats.IMG_SERVICE_MAGIC, criustats.STATS_MAGIC, len(body))
    (folder / names.STATS_DUMP).write_bytes(struct.pack("<III", *magics) + body)


def test_the_frozen_time_and_the_pages(tmp_path: Path) -> None:
    e = entry(freezing_time=1500, frozen_time=640_000, memdump_time=120_000,
              memwrite_time=310_000, pages_scanned=9000, pages_written=8192)
    e.dump.MergeFromString(PAGES_LAZY)          # CRIU writes more than pos describes
    stats_file(tmp_path, e.SerializeToString())
    stats = criustats.dump_stats(tmp_path)
    assert stats == DumpStats(0.0015, 0.64, 0.12, 0.31, 9000, 8192)
    assert stats.timings() == {"frozen": 0.0015 + 0.64, "criu_memdump": 0.12,
                               "criu_memwrite": 0.31, "criu_written_mib": 32.0}


def test_fields_absent_but_the_frozen_time_read_zero(tmp_path: Path) -> None:
    stats_file(tmp_path, entry(freezing_time=1, frozen_time=2).SerializeToString())
    assert criustats.dump_stats(tmp_path) == DumpStats(1e-6, 2e-6, 0.0, 0.0, 0, 0)


@pytest.mark.parametrize("case", ["no file", "other magic", "cut short", "not protobuf",
                                  "no dump", "no frozen time"])
def test_a_file_that_says_nothing_usable_is_none(tmp_path: Path, case: str) -> None:
    whole = entry(freezing_time=1, frozen_time=2).SerializeToString()
    if case == "other magic":
        stats_file(tmp_path, whole, (criustats.IMG_SERVICE_MAGIC, 0x12345678, len(whole)))
    elif case == "cut short":
        stats_file(tmp_path, whole[:-1], (criustats.IMG_SERVICE_MAGIC, criustats.STATS_MAGIC,
                                          len(whole)))
    elif case == "not protobuf":
        stats_file(tmp_path, b"\xff\xff\xff")
    elif case == "no dump":
        stats_file(tmp_path, b"")
    elif case == "no frozen time":
        stats_file(tmp_path, entry(freezing_time=1).SerializePartialToString())
    assert criustats.dump_stats(tmp_path) is None
