"""events.h (the probes' side) and events.py (the decoder) describe the same bytes."""

import shutil
import subprocess
from pathlib import Path

from pos.tracer import events, late
from pos.tracer.probes import API_IDS, API_NAMES, FAMILIES, RETURNS, bpf_text
from tests.conftest import need

PROBE = r"""
#include <stdio.h>
#include <stddef.h>
typedef unsigned long long u64; typedef unsigned int u32; typedef unsigned short u16;
typedef unsigned char u8;
#include "events.h"
int main(void) {
  printf("%zu %zu %zu %zu %zu %d %zu\n", sizeof(struct pos_hdr), sizeof(struct pos_small),
         offsetof(struct pos_launch, params), offsetof(struct pos_function, name),
         sizeof(((struct pos_layout *)0)->offset) / sizeof(u16), POS_CAPTURE_WINDOWS,
         sizeof(struct pos_layout));
  return 0;
}
"""


def test_layouts_match(tmp_path: Path) -> None:
    need(shutil.which("gcc") is not None, "gcc is needed to compile events.h")
    src = tmp_path / "probe.c"
    src.write_text(PROBE)
    include = Path(events.__file__).parent.parent / "bpf"
    subprocess.run(["gcc", f"-I{include}", str(src), "-o", str(tmp_path / "probe")], check=True)
    out = subprocess.run([str(tmp_path / "probe")], capture_output=True, text=True, check=True)
    hdr, small, params_at, name_at, max_params, windows, layout = map(int, out.stdout.split())
    assert hdr == events.HDR.size
    assert small == events.SMALL_SIZE
    assert params_at == events.LAUNCH_PARAMS_AT
    assert name_at == events.FUNCTION_NAME_AT
    assert max_params == events.MAX_PARAMS
    assert layout == events.LAYOUT.size
    assert windows == late.WINDOWS      # the capture's layout (pos/tracer/late.py: rebuild)


def test_decode_launch_and_memset() -> None:
    api = API_IDS["cuLaunchKernel"]
    params = bytes(range(12))
    raw = (events.HDR.pack(123, 10, 11, events.LAUNCH_KIND, api, events.LAUNCH_PARAMS_AT + 12)
           + events.LAUNCH.pack(0xdead, 0x5, 1, 2, 3, 4, 5, 6, 7, 12, 1, 0) + params)
    table, row = events.decode(raw)
    assert table == "launches"
    assert row == {"ts_ns": 123, "pid": 10, "tid": 11, "api": "cuLaunchKernel",
                   "function": 0xdead, "stream": 5, "grid_x": 1, "grid_y": 2, "grid_z": 3,
                   "block_x": 4, "block_y": 5, "block_z": 6, "shared_mem": 7, "params": params,
                   "layout_known": True, "truncated": False, "capture": None}
    # without a layout: 8-byte slots, then to the event's end the capture (pos/tracer/late.py)
    capture = bytes(range(100, 140))
    raw = (events.HDR.pack(123, 10, 11, events.LAUNCH_KIND, api, events.LAUNCH_PARAMS_AT + 56)
           + events.LAUNCH.pack(0xdead, 0x5, 1, 2, 3, 4, 5, 6, 7, 16, 0, 0) + params + bytes(4)
           + capture)
    _, row = events.decode(raw)
    assert row["params"] == params + bytes(4) and row["capture"] == capture
    assert row["layout_known"] is False
    raw = (events.HDR.pack(1, 2, 3, events.MEMSET, API_IDS["cuMemsetD32_v2"], events.SMALL_SIZE)
           + events.SMALL.pack(0x1000, 64, 7, 0, 4))
    assert events.decode(raw) == ("copies", {
        "ts_ns": 1, "pid": 2, "tid": 3, "api": "cuMemsetD32_v2", "kind": "memset", "dst": 0x1000,
        "src": None, "size": 64, "value": 7, "stream": 0, "direction": None})


def test_probe_table_matches_the_c_text() -> None:
    """Every symbol of the table has its C function(s), and api ids are unique."""
    assert len(set(API_NAMES)) == len(API_NAMES)
    for family in FAMILIES:
        text = bpf_text(family, 64)
        for sym in family.symbols:
            has_entry = f"on_{sym}(" in text or "on_##sym" in text and (
                f"({sym}," in text or f"({sym})" in text)
            assert has_entry, f"{family.source} has no entry probe for {sym}"
            if sym in RETURNS:
                assert f"ret_{sym}(" in text or "ret_##sym" in text, sym
