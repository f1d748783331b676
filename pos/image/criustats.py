"""CRIU's stats-dump: how long its last dump kept the tree frozen, and where that time went.

The file is a CRIU service image: two u32 magics (service, stats), then one entry, a u32
length and a protobuf `stats_entry` (CRIU's images/stats.proto). The messages are described
here once, as protobuf describes messages (a FileDescriptorProto: CRIU's names, numbers and
types, for the fields pos reads), and decoded by the `protobuf` library, which keeps CRIU's
other fields as unknown ones. protobuf is imported at the first read, after a dump: a restore
never loads it.
"""

import functools
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pos.image import names

IMG_SERVICE_MAGIC, STATS_MAGIC = 0x55105940, 0x57093306
_HEAD = struct.Struct("<III")       # the two magics, then the entry's length

# CRIU's dump_stats_entry, the fields pos reads: name, number, type; times in microseconds.
# Freezing and frozen are required (a dump without them says nothing); the rest read 0 if absent.
_DUMP_FIELDS = (("freezing_time", 1, "uint32", True), ("frozen_time", 2, "uint32", True),
                ("memdump_time", 3, "uint32", False), ("memwrite_time", 4, "uint32", False),
                ("pages_scanned", 5, "uint64", False), ("pages_written", 7, "uint64", False))


@functools.cache
def stats_entry() -> Any:
    """CRIU's stats_entry (its field 1, `dump`, a dump_stats_entry), as a protobuf message class
    built in a descriptor pool of its own."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    field = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="pos-criu-stats.proto", syntax="proto2")
    dump = proto.message_type.add(name="dump_stats_entry")
    for name, number, kind, required in _DUMP_FIELDS:
        dump.field.add(name=name, number=number, type=getattr(field, f"TYPE_{kind.upper()}"),
                       label=field.LABEL_REQUIRED if required else field.LABEL_OPTIONAL)
    proto.message_type.add(name="stats_entry").field.add(
        name="dump", number=1, type=field.TYPE_MESSAGE, label=field.LABEL_OPTIONAL,
        type_name=".dump_stats_entry")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("stats_entry"))


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
    from google.protobuf.message import DecodeError

    try:
        raw = (Path(images) / names.STATS_DUMP).read_bytes()
        magic, kind, size = _HEAD.unpack_from(raw)
        body = raw[_HEAD.size:_HEAD.size + size]
        if (magic, kind) != (IMG_SERVICE_MAGIC, STATS_MAGIC) or len(body) != size:
            return None
        entry = stats_entry().FromString(body)
    except (OSError, struct.error, DecodeError):
        return None
    if not entry.HasField("dump") or not entry.IsInitialized():    # parsing leaves that to us
        return None
    d = entry.dump
    return DumpStats(d.freezing_time / 1e6, d.frozen_time / 1e6, d.memdump_time / 1e6,
                     d.memwrite_time / 1e6, d.pages_scanned, d.pages_written)
