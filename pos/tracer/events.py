"""Decode the probes' events (layouts in pos/bpf/events.h) into store rows.

Each decoder returns (table, row) with the column names of pos/store/models.py. This runs once
per event, so it is plain struct unpacking and dictionary building, nothing more.
"""

import struct
from typing import Any

from pos.tracer.probes import API_NAMES

HDR = struct.Struct("<QIIHHI")          # ts_ns, pid, tid, kind, api, len
KIND_AT = 16                            # the low byte of `kind`: every kind is < 256
SMALL = struct.Struct("<5Q")
LAUNCH = struct.Struct("<QQ3I3IIHBB")   # function, stream, grid, block, shared_mem, nbytes, known, truncated
FUNCTION = struct.Struct("<QQ")         # handle, module; the name follows
LAUNCH_PARAMS_AT = HDR.size + LAUNCH.size
FUNCTION_NAME_AT = HDR.size + FUNCTION.size
SMALL_SIZE = HDR.size + SMALL.size
MAX_PARAMS = 64                         # POS_MAX_PARAMS
LAYOUT = struct.Struct(f"<HH{MAX_PARAMS}H{MAX_PARAMS}H")   # struct pos_layout: count, total, offsets, sizes

ALLOC, FREE, LAUNCH_KIND, MEMCPY, MEMSET, SYNC, MODULE, FUNCTION_KIND = range(1, 9)
RESERVE, UNRESERVE, CREATE, RELEASE = range(9, 13)

# The allocation-table kinds of the small events that describe memory.
MEMORY_KINDS = {ALLOC: "alloc", FREE: "free", RESERVE: "reserve", UNRESERVE: "unreserve",
                CREATE: "create", RELEASE: "release"}
DIRECTIONS = {1: "HtoD", 2: "DtoH", 3: "DtoD", 4: "HtoH", 5: "default"}

Row = dict[str, Any]


def decode(data: Any, at: int = 0) -> tuple[str, Row]:
    """The raw event at offset `at` of `data` (bytes or memoryview) -> (store table, row).
    Raises ValueError on a malformed event."""
    ts, pid, tid, kind, api, length = HDR.unpack_from(data, at)
    row: Row = {"ts_ns": ts, "pid": pid, "tid": tid, "api": API_NAMES[api]}
    if kind == LAUNCH_KIND:
        f, stream, gx, gy, gz, bx, by, bz, shmem, nbytes, known, trunc = LAUNCH.unpack_from(data, at + HDR.size)
        row.update(function=f, stream=stream, grid_x=gx, grid_y=gy, grid_z=gz, block_x=bx,
                   block_y=by, block_z=bz, shared_mem=shmem,
                   params=bytes(data[at + LAUNCH_PARAMS_AT:at + LAUNCH_PARAMS_AT + nbytes]),
                   layout_known=bool(known), truncated=bool(trunc),
                   capture=bytes(data[at + LAUNCH_PARAMS_AT + nbytes:at + length]) or None)
        return "launches", row
    if kind == FUNCTION_KIND:
        handle, module = FUNCTION.unpack_from(data, at + HDR.size)
        name = bytes(data[at + FUNCTION_NAME_AT:at + length]).split(b"\0", 1)[0].decode("utf-8", "replace")
        row.update(handle=handle, module=module, name=name, layout=None)
        return "functions", row
    a = SMALL.unpack_from(data, at + HDR.size)
    if kind in MEMORY_KINDS:
        row.update(kind=MEMORY_KINDS[kind], ptr=a[0], size=a[1] or None, stream=a[2])
        return "allocations", row
    if kind == MEMCPY:
        row.update(kind="memcpy", dst=a[0], src=a[1], size=a[2], stream=a[3],
                   direction=DIRECTIONS.get(a[4], "default"), value=None)
        return "copies", row
    if kind == MEMSET:
        row.update(kind="memset", dst=a[0], src=None, size=a[1], value=a[2], stream=a[3],
                   direction=None)
        return "copies", row
    if kind == SYNC:
        row.update(handle=a[0])
        return "syncs", row
    if kind == MODULE:
        row.update(handle=a[0], image=a[1], image_size=None, kernels=None, note=None)
        return "modules", row
    raise ValueError(f"unknown event kind {kind}")
