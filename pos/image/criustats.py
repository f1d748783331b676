"""CRIU's stats-dump: how long its last dump kept the tree frozen, and where that time went.

The file is a CRIU service image (pos/image/criuimg.py) of one entry, a protobuf `stats_entry`
(CRIU's images/stats.proto), described here for the fields pos reads. protobuf is imported at
the first read, after a dump.
"""

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pos.image import criuimg, names
from pos.image.criuimg import IMG_SERVICE_MAGIC, Field

STATS_MAGIC = 0x57093306

# CRIU's dump_stats_entry, the fields pos reads; times in microseconds. Freezing and frozen are
# required (a dump without them says nothing); the rest read 0 if absent.
_STATS = {
    "dump_stats_entry": (Field("freezing_time", 1, "uint32", "required"),
                         Field("frozen_time", 2, "uint32", "required"),
                         Field("memdump_time", 3, "uint32"), Field("memwrite_time", 4, "uint32"),
                         Field("pages_scanned", 5, "uint64"),
                         Field("pages_written", 7, "uint64")),
    "stats_entry": (Field("dump", 1, "dump_stats_entry"),),
}


@functools.cache
def stats_entry() -> Any:
    """CRIU's stats_entry (its field 1, `dump`, a dump_stats_entry), as a protobuf message
    class."""
    return criuimg.messages("pos-criu-stats.proto", _STATS)["stats_entry"]


@dataclass(frozen=True)
class DumpStats:
    """What CRIU's stats-dump says of the last dump: where its frozen time went."""
    freezing_s: float
    frozen_s: float
    memdump_s: float      # pages drained from the frozen tree (parasite, vmsplice)
    memwrite_s: float     # pages written to the image
    pages_scanned: int
    pages_written: int

    def timings(self) -> dict[str, float]:
        """The manifest's timings: `frozen` (freezing + frozen) and the page work within it."""
        return {"frozen": self.freezing_s + self.frozen_s, "criu_memdump": self.memdump_s,
                "criu_memwrite": self.memwrite_s,
                "criu_written_mib": self.pages_written * 4096 / 2**20}


def dump_stats(images: Path) -> Optional[DumpStats]:
    """The stats-dump of the dump in `images`, None when there is none or it cannot be read
    (the timings then lack CRIU's split; the dump itself is not in doubt)."""
    try:
        found = criuimg.entries(Path(images) / names.STATS_DUMP,
                                (IMG_SERVICE_MAGIC, STATS_MAGIC), stats_entry())
    except (OSError, criuimg.Unreadable):
        return None
    if len(found) != 1 or not found[0].HasField("dump") or not found[0].IsInitialized():
        return None
    d = found[0].dump
    return DumpStats(d.freezing_time / 1e6, d.frozen_time / 1e6, d.memdump_time / 1e6,
                     d.memwrite_time / 1e6, d.pages_scanned, d.pages_written)
