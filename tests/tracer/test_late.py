"""Completing launches recorded before their layout was known (pos/tracer/late.py), and the
reasons given for those that cannot be."""

import json
import struct
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from sqlalchemy import insert, select

from pos.store.db import open_db
from pos.store.models import Function, Launch, Trace
from pos.tracer.late import (AMBIGUOUS, FEW_ADDRESSES, NO_CAPTURE, NO_LAYOUT, OUTSIDE, PACKED,
                             Completion, Miss, complete, rebuild)


def capture(addresses: list[int], *windows: tuple[int, bytes]) -> bytes:
    """What the probe keeps after its slots: the parameters' addresses, then two windows'
    starts and lengths (0: unused) and their memory."""
    heads = list(windows) + [(0, b"")] * (2 - len(windows))
    return (struct.pack(f"<{len(addresses) + 1}Q", len(addresses), *addresses)
            + b"".join(struct.pack("<QQ", start, len(m)) for start, m in heads)
            + b"".join(m for _, m in windows))


def test_parameters_are_taken_from_the_captured_memory_at_their_addresses() -> None:
    memory = bytes(range(256)) * 8                    # 2 KiB from 0x7000
    # a 4-byte int at 0x7010, a 24-byte struct at 0x7100, a pointer at 0x7008
    cap = capture([0x7010, 0x7100, 0x7008], (0x7000, memory))
    layout = [[0, 4], [8, 24], [32, 8]]
    out = rebuild(bytes(24), cap, layout)
    assert out == memory[0x10:0x14] + bytes(4) + memory[0x100:0x118] + memory[0x8:0x10]


def test_a_struct_away_from_the_other_parameters_comes_from_the_second_window() -> None:
    # a 3 KiB by-value struct on the heap, a float on the stack: one window each
    heap, stack = bytes(i * 7 % 256 for i in range(3072)), bytes(range(64))
    cap = capture([0x5550000, 0x7ff000 + 8], (0x7ff000, stack), (0x5550000, heap))
    assert rebuild(bytes(16), cap, [[0, 3072], [3072, 4]]) == heap + stack[8:12]


def test_addresses_beyond_the_layout_are_ignored() -> None:
    # the probe reads 64 addresses: those past the kernel's parameters are not its own
    memory = bytes(range(64))
    cap = capture([0x1000, 0x1008, 0xdead0000], (0x1000, memory))
    assert rebuild(bytes(24), cap, [[0, 8], [8, 8]]) == memory[:16]


def test_a_parameter_outside_the_capture_says_how_far() -> None:
    memory = bytes(64)
    # a 16-byte struct at 0x1038 ends 8 bytes above the window
    assert rebuild(bytes(16), capture([0x1000, 0x1038], (0x1000, memory)),
                   [[0, 8], [8, 16]]) == Miss(OUTSIDE, 8)
    # below the window: negative; the farthest of two parameters outside counts
    assert rebuild(bytes(16), capture([0xff0, 0x800], (0x1000, memory)),
                   [[0, 8], [8, 8]]) == Miss(OUTSIDE, -0x800)
    # the nearest window counts
    assert rebuild(bytes(8), capture([0x3000], (0x1000, memory), (0x2000, memory)),
                   [[0, 8]]) == Miss(OUTSIDE, 0x3008 - 0x2040)
    assert rebuild(bytes(8), capture([0x1000]), [[0, 8]]) == Miss(OUTSIDE, None)   # no memory


def test_a_capture_without_every_parameter_address_says_so() -> None:
    memory = bytes(64)
    assert rebuild(bytes(8), capture([0x1000], (0x1000, memory)),
                   [[0, 8], [8, 8]]) == Miss(FEW_ADDRESSES)
    assert rebuild(bytes(8), capture([0x1000] * 3)[:24], [[0, 8]]) == Miss(FEW_ADDRESSES)  # cut
    assert rebuild(bytes(16), b"short", [[0, 8]]) == Miss(FEW_ADDRESSES)


def test_a_kernel_with_more_parameters_than_slots_is_completed() -> None:
    # 20 parameters, 8 bytes each, back to back: only 16 fit the slots, all 20 the capture
    memory = bytes(range(160))
    cap = capture([0x2000 + 8 * i for i in range(20)] + [0] * 44, (0x2000, memory))
    assert rebuild(bytes(128), cap, [[8 * i, 8] for i in range(20)]) == memory


def test_the_extra_form_needs_only_its_layout() -> None:
    packed = bytes(range(20))              # CU_LAUNCH_PARAM_BUFFER_POINTER: laid out already
    assert rebuild(packed, PACKED, [[0, 8], [8, 4], [16, 4]]) == packed
    assert rebuild(packed, PACKED, [[0, 8], [16, 8]]) == Miss(OUTSIDE, 4)   # shorter than it


# ---- complete(): every launch left without a layout gets its reason ---------------------------

A, B, C, D, E = 0xA000, 0xB000, 0xC000, 0xD000, 0xE000   # kernel handles
LAYOUT = [[0, 8], [8, 4]]


def _function(handle: int, layout: Optional[list[list[int]]]) -> dict:
    return {"trace_id": 1, "ts_ns": 0, "pid": 1, "tid": 1, "api": "cuModuleGetFunction",
            "handle": handle, "module": 1, "name": f"k{handle:x}",
            "layout": json.dumps(layout) if layout else None}


def _launch(handle: int, capture: Optional[bytes], params: bytes = bytes(16)) -> dict:
    return {"trace_id": 1, "ts_ns": 1, "pid": 1, "tid": 1, "api": "cuLaunchKernel",
            "function": handle, "stream": 0, "grid_x": 1, "grid_y": 1, "grid_z": 1,
            "block_x": 1, "block_y": 1, "block_z": 1, "shared_mem": 0, "params": params,
            "layout_known": False, "truncated": False, "capture": capture}


def test_complete_gives_each_launch_left_without_a_layout_its_reason(tmp_path: Path) -> None:
    engine = open_db(str(tmp_path / "t.db"))
    memory = bytes(range(64))
    with engine.begin() as c:
        c.execute(insert(Trace), [{"pid": 1, "comm": "job", "cmdline": "job", "library": "l",
                                   "started_at": datetime.now(timezone.utc), "probes": 1,
                                   "status": "done"}])
        c.execute(insert(Function), [
            _function(A, None), _function(A, LAYOUT),       # looked up before, resolved later
            _function(B, LAYOUT), _function(C, [[0, 8]]),   # C: two layouts (handle reused)
            _function(C, [[0, 4]]), _function(D, None), _function(E, LAYOUT)])
        c.execute(insert(Launch), [
            _launch(A, capture([0x1000, 0x1008], (0x1000, memory))),      # completed
            _launch(A, capture([0x1000, 0x1080], (0x1000, memory))),      # 0x1080: outside by 0x44
            _launch(A, capture([0x1000], (0x1000, memory))),              # too few addresses
            _launch(B, None), _launch(B, None),                           # no capture
            _launch(C, capture([0x1000], (0x1000, memory))), _launch(C, None),   # ambiguous
            _launch(D, None), _launch(D, capture([0x1000], (0x1000, memory))),   # no layout
            _launch(E, PACKED, bytes(range(12)))])                        # extra form: completed
    result = complete(engine, 1)
    assert result == Completion(completed=2, missing_no_layout=2, missing_ambiguous=2,
                                missing_no_capture=2, missing_outside=1,
                                missing_outside_bytes=0x44, missing_few_addresses=1)
    with engine.begin() as c:
        rows = c.execute(select(Launch.function, Launch.layout_known, Launch.missing,
                                Launch.missing_bytes, Launch.capture, Launch.params)
                         .order_by(Launch.id)).all()
        trace = c.execute(select(Trace.completed, Trace.missing_no_layout,
                                 Trace.missing_ambiguous, Trace.missing_no_capture,
                                 Trace.missing_outside, Trace.missing_outside_bytes,
                                 Trace.missing_few_addresses)).one()
    assert [(r.function, r.layout_known, r.missing, r.missing_bytes) for r in rows] == [
        (A, True, None, None), (A, False, OUTSIDE, 0x44), (A, False, FEW_ADDRESSES, None),
        (B, False, NO_CAPTURE, None), (B, False, NO_CAPTURE, None),
        (C, False, AMBIGUOUS, None), (C, False, AMBIGUOUS, None),
        (D, False, NO_LAYOUT, None), (D, False, NO_LAYOUT, None), (E, True, None, None)]
    assert rows[0].params == memory[:12] and rows[-1].params == bytes(range(12))
    assert all(r.capture is None for r in rows)
    assert tuple(trace) == (2, 2, 2, 2, 1, 0x44, 1)
    assert result.reasons() == {NO_LAYOUT: 2, AMBIGUOUS: 2, NO_CAPTURE: 2, OUTSIDE: 1,
                                FEW_ADDRESSES: 1}
