"""The speculation rule of access.py again, in plain Python, for the agreement check only
(tests and bench/analyze_bench.py): written from the rule's statement, with a dict of live
allocations and `bisect`, sharing nothing with the numba code but the inputs' meaning."""

import bisect
import struct

from pos.analyzer.access import COPY_DST, COPY_SRC
from pos.analyzer.demangle import CONST_PTR, PTR, SCALAR
from pos.analyzer.ops import (DST_DEVICE, OP_ALLOC, OP_FREE, OP_LAUNCH, OP_MEMCPY, SRC_DEVICE,
                              Ops)

Row = tuple[int, int, int, int, bool]   # allocation id, param (or copy side), word, offset, write


def reference_evidence(ops: Ops, first: int = 0, last: int = -1) -> list[list[Row]]:
    """Evidence rows of ops[first:last] (the whole trace's allocations are replayed first)."""
    last = len(ops.kind) if last < 0 else last
    live: dict[int, tuple[int, int]] = {}       # base -> (end, allocation id)
    bases: list[int] = []
    out: list[list[Row]] = []
    data = ops.pbytes.tobytes()

    def holding(v: int) -> int:
        i = bisect.bisect_right(bases, v) - 1
        return i if i >= 0 and v < live[bases[i]][0] else -1

    def overlapping(lo: int, size: int, side: int, write: bool) -> list[Row]:
        return [(live[b][1], side, -1, max(lo - b, 0), write) for b in reversed(bases)
                if size and b < lo + size and live[b][0] > lo]

    for i in range(last):
        kind = int(ops.kind[i])
        rows: list[Row] = []
        if kind == OP_ALLOC:
            base = int(ops.a[i])
            if base not in live:
                bisect.insort(bases, base)
            live[base] = (base + int(ops.b[i]), int(ops.c[i]))
        elif kind == OP_FREE:
            base = int(ops.a[i])
            if base in live:
                del live[base]
                bases.remove(base)
        elif kind == OP_LAUNCH and i >= first:
            s = int(ops.sig[i])
            blob = data[ops.pstart[i]:ops.pstart[i] + ops.plen[i]]
            for p in range(int(ops.sig_start[s + 1] - ops.sig_start[s])):
                q = int(ops.sig_start[s]) + p
                kind_p, off, size = int(ops.sig_kind[q]), int(ops.sig_off[q]), int(ops.sig_size[q])
                if kind_p == SCALAR:
                    continue
                words = ([0] if size >= 8 else []) if kind_p in (CONST_PTR, PTR) \
                    else range(0, size - 7, 8)
                for w in words:
                    if off + w + 8 > len(blob):      # truncated capture
                        break
                    (v,) = struct.unpack_from("<Q", blob, off + w)
                    j = holding(v)
                    if j >= 0:
                        end, aid = live[bases[j]]
                        rows.append((aid, p, w, v - bases[j], kind_p != CONST_PTR))
        elif kind == OP_MEMCPY and i >= first:
            if int(ops.sig[i]) & SRC_DEVICE:
                rows += overlapping(int(ops.b[i]), int(ops.c[i]), COPY_SRC, False)
            if int(ops.sig[i]) & DST_DEVICE:
                rows += overlapping(int(ops.a[i]), int(ops.c[i]), COPY_DST, True)
        elif i >= first and kind != OP_LAUNCH and kind != OP_MEMCPY:
            rows += overlapping(int(ops.a[i]), int(ops.c[i]), COPY_DST, True)
        if i >= first:
            out.append(rows)
    return out
