"""Launches recorded before their kernel's layout was known, completed once it is.

At start-up a job looks its kernels up and launches them within microseconds, while pos is still
parsing the module images that hold their layouts (seconds for PyTorch's libraries). While a
layout may still come, the probes record such a launch as 8-byte slots plus a capture
(pos/bpf/common.h: capture): the base address, the parameters' addresses, and the memory from
the base, all read at the call. Captures are paid from a credit that each drain refills, so that
a storm of such launches cannot flood the ring: a launch that found it spent has no capture and
keeps its slots (`pos trace` counts them as launches that lost their capture). When the trace
ends, each captured launch whose kernel has a layout by then gets the bytes at its layout's
offsets from the capture: the bytes the probe would have copied had it known the layout. A
launch with a parameter outside the captured memory keeps its slots (layout_known stays false);
nothing is guessed. A launch of the `extra` form has its packed buffer recorded, which lies as
the layout says: it only waits for the layout.
"""

import json
import struct
from typing import Optional

from sqlalchemy import Engine, bindparam, select, update

from pos.store.models import Function, Launch


PACKED = bytes(8)   # the capture of an `extra`-form launch: its buffer is laid out already
HEAD = struct.Struct("<QQ")   # a capture's base and address count


def rebuild(params: bytes, capture: bytes, layout: list[list[int]]) -> Optional[bytes]:
    """The parameter bytes laid out at `layout`'s [offset, size] pairs, from the slots
    (`params`) and capture of a launch; None when the capture does not hold every parameter.
    The capture (pos/bpf/common.h: capture) is u64 base, u64 k, k parameter addresses (entries
    past the kernel's own parameters are whatever followed its array), the memory from base."""
    end = max((off + size for off, size in layout), default=0)
    if capture == PACKED:
        return params if len(params) >= end else None
    if len(capture) < HEAD.size:
        return None
    base, k = HEAD.unpack_from(capture)
    head = HEAD.size + 8 * k
    if len(layout) > k or len(capture) < head:
        return None
    addresses = struct.unpack_from(f"<{len(layout)}Q", capture, HEAD.size)
    memory = memoryview(capture)[head:]
    out = bytearray(end)
    for (off, size), address in zip(layout, addresses):
        at = address - base
        if at < 0 or at + size > len(memory):
            return None
        out[off:off + size] = memory[at:at + size]
    return bytes(out)


def complete(engine: Engine, trace_id: int) -> int:
    """Complete the trace's captured launches from their kernels' layouts, drop the captures;
    returns how many launches were completed. A handle with more than one layout in the trace
    (reused after a module unload) is left alone: which one applied is not known."""
    texts: dict[int, set[str]] = {}
    with engine.begin() as c:
        for handle, layout in c.execute(select(Function.handle, Function.layout).where(
                Function.trace_id == trace_id, Function.layout.is_not(None))):
            texts.setdefault(handle, set()).add(layout)
        layouts = {h: json.loads(t.pop()) for h, t in texts.items() if len(t) == 1}
        done = []
        for id_, function, params, capture in c.execute(
                select(Launch.id, Launch.function, Launch.params, Launch.capture).where(
                    Launch.trace_id == trace_id, Launch.capture.is_not(None))):
            if function not in layouts:
                continue
            rebuilt = rebuild(params, capture, layouts[function])
            if rebuilt is not None:
                done.append({"launch": id_, "bytes": rebuilt})
        if done:
            c.execute(update(Launch).where(Launch.id == bindparam("launch"))
                      .values(params=bindparam("bytes"), layout_known=True),
                      done, execution_options={"synchronize_session": False})
        c.execute(update(Launch).where(Launch.trace_id == trace_id, Launch.capture.is_not(None))
                  .values(capture=None))
    return len(done)
