"""Launches recorded before their kernel's layout was known, completed once it is.

At start-up a job looks its kernels up and launches them within microseconds, while pos is still
parsing the module images that hold their layouts (seconds for PyTorch's libraries). While a
layout may still come, the probes record such a launch as 8-byte slots plus a capture
(pos/bpf/common.h: capture): the parameters' addresses and up to two windows of the memory
around them, all read at the call. Captures are paid from a credit that each drain refills, so
that a storm of such launches cannot flood the ring: a launch that found it spent has no capture
and keeps its slots (`pos trace` counts them as launches that lost their capture). When the trace
ends, each captured launch whose kernel has a layout by then gets the bytes at its layout's
offsets from the capture: the bytes the probe would have copied had it known the layout. A
launch with a parameter outside the captured memory keeps its slots (layout_known stays false);
nothing is guessed. A launch of the `extra` form has its packed buffer recorded, which lies as
the layout says: it only waits for the layout.

Every launch that ends the trace without its layout gets the reason in `launches.missing` (and,
for a parameter outside the capture, how far outside in `missing_bytes`), and the trace's row
the counts: what a run needs to tell why its share of launches with a layout fell short.
"""

import json
import struct
from dataclasses import asdict, dataclass
from typing import Optional, Union, cast

from sqlalchemy import Engine, bindparam, case, func, select, update

from pos.store.models import Function, Launch, Trace, to_signed

PACKED = bytes(8)   # the capture of an `extra`-form launch: its buffer is laid out already
WINDOWS = 2         # POS_CAPTURE_WINDOWS of pos/bpf/events.h
COUNT = struct.Struct("<Q")                     # a capture's address count
WINDOW = struct.Struct("<QQ")                   # a window's start and length

# Why a launch ended the trace without its layout (launches.missing; Completion counts each as
# "missing_" + the reason), and how `pos trace`'s closing line says it.
NO_LAYOUT, AMBIGUOUS, NO_CAPTURE, OUTSIDE, FEW_ADDRESSES = (
    "no_layout", "ambiguous", "no_capture", "outside", "few_addresses")
REASONS = {
    NO_LAYOUT: "no layout for the kernel",          # none came in the whole trace
    AMBIGUOUS: "handle with two layouts",           # reused after a module unload
    NO_CAPTURE: "no capture",                       # the layout came; the launch kept no capture
    OUTSIDE: "parameter outside the capture",
    FEW_ADDRESSES: "too few parameter addresses",   # k < the kernel's parameters
}


@dataclass(frozen=True)
class Miss:
    """Why a captured launch could not be completed; for OUTSIDE, `by` says how far its
    farthest parameter lay from the nearest captured byte (negative: below the memory kept),
    None when no memory was kept at all."""

    reason: str
    by: Optional[int] = None


@dataclass
class Completion:
    """What `complete` found for a trace's launches without a layout: how many it completed,
    and why the others stay without one (the `traces` columns of the same names)."""

    completed: int = 0
    missing_no_layout: int = 0
    missing_ambiguous: int = 0
    missing_no_capture: int = 0
    missing_outside: int = 0
    missing_outside_bytes: int = 0   # the farthest of those parameters, in bytes either way
    missing_few_addresses: int = 0

    def count(self, miss: Miss, n: int = 1) -> None:
        setattr(self, "missing_" + miss.reason, getattr(self, "missing_" + miss.reason) + n)
        if miss.by is not None:
            self.missing_outside_bytes = max(self.missing_outside_bytes, abs(miss.by))

    def reasons(self) -> dict[str, int]:
        """The counts by reason (launches.missing), those that are not 0."""
        return {r: n for r in REASONS if (n := getattr(self, "missing_" + r))}


def _outside_by(address: int, size: int, windows: list[tuple[int, memoryview]]) -> Optional[int]:
    """How far the parameter [address, address + size) lies from the nearest window: negative
    when it starts below it, positive when it ends above it; None without windows."""
    best: Optional[int] = None
    for start, memory in windows:
        by = address - start if address < start else address + size - (start + len(memory))
        if best is None or abs(by) < abs(best):
            best = by
    return best


def rebuild(params: bytes, capture: bytes, layout: list[list[int]]) -> Union[bytes, Miss]:
    """The parameter bytes laid out at `layout`'s [offset, size] pairs, from the slots
    (`params`) and capture of a launch, or why the capture does not hold every parameter.
    The capture (pos/bpf/common.h: capture) is u64 k, k parameter addresses (entries past the
    kernel's own parameters are whatever followed its array), WINDOWS times u64 start and u64
    length (0: unused), then the windows' bytes back to back."""
    end = max((off + size for off, size in layout), default=0)
    if capture == PACKED:
        return params if len(params) >= end else Miss(OUTSIDE, end - len(params))
    if len(capture) < COUNT.size:
        return Miss(FEW_ADDRESSES)
    k, = COUNT.unpack_from(capture)
    head = COUNT.size + 8 * k + WINDOW.size * WINDOWS
    if len(layout) > k or len(capture) < head:
        return Miss(FEW_ADDRESSES)
    addresses = struct.unpack_from(f"<{len(layout)}Q", capture, COUNT.size)
    windows = []
    at = head
    for start, length in WINDOW.iter_unpack(capture[head - WINDOW.size * WINDOWS:head]):
        if length:
            windows.append((start, memoryview(capture)[at:at + length]))
            at += length
    out = bytearray(end)
    farthest: Optional[Miss] = None
    for (off, size), address in zip(layout, addresses):
        memory = next((m[address - start:address - start + size] for start, m in windows
                       if start <= address and address + size <= start + len(m)), None)
        if memory is not None:
            out[off:off + size] = memory
            continue
        by = _outside_by(address, size, windows)
        if farthest is None or (by is not None and abs(by) > abs(farthest.by or 0)):
            farthest = Miss(OUTSIDE, by)
    return farthest or bytes(out)


def complete(engine: Engine, trace_id: int) -> Completion:
    """Complete the trace's captured launches from their kernels' layouts, drop the captures,
    and record why each launch left without a layout stays so (launches.missing, and the
    counts in the trace's row). A handle with more than one layout in the trace (reused after a
    module unload) is left alone: which one applied is not known."""
    result = Completion()
    texts: dict[int, set[str]] = {}
    with engine.begin() as c:
        for handle, layout in c.execute(select(Function.handle, Function.layout).where(
                Function.trace_id == trace_id, Function.layout.is_not(None))):
            texts.setdefault(handle, set()).add(cast(str, layout))     # not NULL: the where
        layouts = {h: json.loads(next(iter(t))) for h, t in texts.items() if len(t) == 1}

        def unknown(handle: int) -> Optional[Miss]:
            if handle in layouts:
                return None
            return Miss(AMBIGUOUS if handle in texts else NO_LAYOUT)

        # launches without a capture: one reason per kernel. Every statement here walks the
        # trace in time order (`ts_ns >= 0` has SQLite take that index): in kernel order (the
        # other index) they read the table at random, 5-10 times slower for a million launches.
        in_time = (Launch.trace_id == trace_id, Launch.ts_ns >= 0)
        uncaptured = (*in_time, Launch.layout_known.is_(False), Launch.capture.is_(None))
        by_reason: dict[str, list[int]] = {}
        for handle, n in c.execute(select(Launch.function, func.count()).where(*uncaptured)
                                   .group_by(Launch.function)):
            miss = unknown(handle) or Miss(NO_CAPTURE)
            result.count(miss, n)
            by_reason.setdefault(miss.reason, []).append(to_signed(handle))
        if by_reason:
            c.execute(update(Launch).where(*uncaptured).values(missing=case(
                *((Launch.function.in_(select(func.json_each(json.dumps(handles))
                                              .table_valued("value").c.value)), reason)
                  for reason, handles in by_reason.items()))))

        done, missed = [], []
        for id_, handle, params, capture in c.execute(
                select(Launch.id, Launch.function, Launch.params, Launch.capture).where(
                    *in_time, Launch.capture.is_not(None))):
            rebuilt = unknown(handle) or rebuild(params, cast(bytes, capture), layouts[handle])
            if isinstance(rebuilt, Miss):
                result.count(rebuilt)
                missed.append({"launch": id_, "reason": rebuilt.reason, "by": rebuilt.by})
            else:
                done.append({"launch": id_, "bytes": rebuilt})
        result.completed = len(done)
        if done:
            c.execute(update(Launch).where(Launch.id == bindparam("launch"))
                      .values(params=bindparam("bytes"), layout_known=True, capture=None),
                      done, execution_options={"synchronize_session": False})
        if missed:
            c.execute(update(Launch).where(Launch.id == bindparam("launch"))
                      .values(missing=bindparam("reason"), missing_bytes=bindparam("by"),
                              capture=None),
                      missed, execution_options={"synchronize_session": False})
        c.execute(update(Trace).where(Trace.id == trace_id).values(**asdict(result)))
    return result
