"""A recorded trace as the flat numpy arrays the numba passes replay (access.py, dag.py).

Operations (allocations, frees, launches, copies, sets) in the store's time order, with each
launch's captured bytes in one byte array and its parameter layout as a *signature*: one per
distinct (kernel name, layout), holding each parameter's offset, size and kind (demangle.py).
A launch without a known layout gets the signature of its byte count in 8-byte slots, every
slot scanned (docs/tracing.md: such launches are recorded as 8-byte slots).
"""

import heapq
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from sqlalchemy import Engine

from pos.analyzer.demangle import SCAN, parameter_kinds
from pos.analyzer.ops import (DST_DEVICE, OP_ALLOC, OP_FREE, OP_LAUNCH, OP_MEMCPY, OP_MEMSET,
                              SRC_DEVICE, Ops)
from pos.errors import BadInput
from pos.store.export import resolve_trace

U64 = 1 << 64
# Which sides of a memcpy are device memory, by the direction pos trace recorded.
COPY_FLAGS = {"HtoD": DST_DEVICE, "DtoH": SRC_DEVICE, "DtoD": DST_DEVICE | SRC_DEVICE,
              "HtoH": 0, "default": DST_DEVICE | SRC_DEVICE}


@dataclass
class OpsBuilder:
    """Appends operations in time order; `finish` gives the arrays. Used by the store loader,
    the tests and the benchmark alike, so that all three feed the passes the same way."""

    _ops: list[tuple[int, int, int, int, int, int, int, int, str]] = field(default_factory=list)
    _bytes: list[bytes] = field(default_factory=list)
    _nbytes: int = 0
    _sigs: dict[tuple[Optional[str], Optional[tuple[tuple[int, int], ...]], int], int] = \
        field(default_factory=dict)
    _sig_params: list[list[tuple[int, int, int]]] = field(default_factory=list)
    _sig_meta: list[tuple[Optional[str], bool, bool]] = field(default_factory=list)
    _allocs: list[list[int]] = field(default_factory=list)
    _live: dict[int, int] = field(default_factory=dict)     # base -> allocation id

    def alloc(self, ts: int, base: int, size: int, api: str = "cuMemAlloc_v2") -> int:
        aid = len(self._allocs)
        self._allocs.append([base, size, len(self._ops), -1])
        self._live[base] = aid
        self._ops.append((OP_ALLOC, base, size, aid, 0, 0, 0, ts, api))
        return aid

    def free(self, ts: int, base: int, api: str = "cuMemFree_v2") -> None:
        aid = self._live.pop(base, None)
        if aid is not None:
            self._allocs[aid][3] = len(self._ops)
        self._ops.append((OP_FREE, base, 0, 0, 0, 0, 0, ts, api))

    def signature(self, name: Optional[str], layout: Optional[list[list[int]]], nbytes: int) -> int:
        """The signature of a launch of `name` with `layout` (None: unknown, 8-byte slots)."""
        key_layout = tuple((int(o), int(s)) for o, s in layout) if layout is not None else None
        key = (name, key_layout, 0 if layout is not None else nbytes)
        sig = self._sigs.get(key)
        if sig is None:
            if key_layout is None:
                params = [(o, min(8, nbytes - o), SCAN) for o in range(0, nbytes, 8)]
                types_known = False
            else:
                kinds, types_known = parameter_kinds(name, len(key_layout))
                params = [(o, s, k) for (o, s), k in zip(key_layout, kinds)]
            sig = self._sigs[key] = len(self._sig_params)
            self._sig_params.append(params)
            self._sig_meta.append((name, key_layout is not None, types_known))
        return sig

    def launch(self, ts: int, name: Optional[str], layout: Optional[list[list[int]]],
               params: bytes, api: str = "cuLaunchKernel") -> None:
        sig = self.signature(name, layout, len(params))
        self._ops.append((OP_LAUNCH, 0, 0, 0, sig, self._nbytes, len(params), ts, api))
        self._bytes.append(params)
        self._nbytes += len(params)

    def memcpy(self, ts: int, dst: int, src: int, size: int, direction: str,
               api: str = "cuMemcpy") -> None:
        self._ops.append((OP_MEMCPY, dst, src, size, COPY_FLAGS.get(direction, 3), 0, 0, ts, api))

    def memset(self, ts: int, dst: int, size: int, api: str = "cuMemset") -> None:
        self._ops.append((OP_MEMSET, dst, 0, size, 0, 0, 0, ts, api))

    def finish(self) -> Ops:
        ops = self._ops
        col = list(zip(*ops)) if ops else [()] * 9
        params = [p for ps in self._sig_params for p in ps]
        sig_start = np.zeros(len(self._sig_params) + 1, np.int64)
        sig_start[1:] = np.cumsum([len(ps) for ps in self._sig_params], dtype=np.int64)
        allocs = np.array(self._allocs, dtype=object).reshape(-1, 4)
        return Ops(
            kind=np.array(col[0], np.int8), a=np.array(col[1], np.uint64),
            b=np.array(col[2], np.uint64), c=np.array(col[3], np.uint64),
            sig=np.array(col[4], np.int64), pstart=np.array(col[5], np.int64),
            plen=np.array(col[6], np.int64), ts=np.array(col[7], np.int64), api=list(col[8]),
            pbytes=np.frombuffer(b"".join(self._bytes), np.uint8).copy(),
            sig_start=sig_start,
            sig_off=np.array([p[0] for p in params], np.int64),
            sig_size=np.array([p[1] for p in params], np.int64),
            sig_kind=np.array([p[2] for p in params], np.int8),
            sig_name=[m[0] for m in self._sig_meta],
            sig_layout_known=[m[1] for m in self._sig_meta],
            sig_types_known=[m[2] for m in self._sig_meta],
            alloc_base=np.array(allocs[:, 0], np.uint64), alloc_size=np.array(allocs[:, 1], np.uint64),
            alloc_op=np.array(allocs[:, 2], np.int64), free_op=np.array(allocs[:, 3], np.int64))


def _u(v: Optional[int]) -> int:
    """A U64 column read raw from SQLite (signed) as the unsigned value."""
    return 0 if v is None else v + U64 if v < 0 else v


_QUERIES = {   # rank as in pos/store/export.py: a lookup sorts before a launch of its nanosecond
    "functions": (-1, "SELECT ts_ns, id, handle, name, layout FROM functions"),
    "allocations": (0, "SELECT ts_ns, id, kind, api, ptr, size FROM allocations"),
    "launches": (1, "SELECT ts_ns, id, api, function, params, layout_known FROM launches"),
    "copies": (2, "SELECT ts_ns, id, kind, api, dst, src, size, direction FROM copies"),
}


def _rows(cur_factory, trace_id: int) -> Iterator[tuple]:
    def table(name: str) -> Iterator[tuple]:
        rank, sql = _QUERIES[name]
        for r in cur_factory().execute(f"{sql} WHERE trace_id = ? ORDER BY ts_ns, id", (trace_id,)):
            yield (r[0], rank, r[1], name) + tuple(r[2:])
    return heapq.merge(*(table(n) for n in _QUERIES), key=lambda r: r[:3])


def load_trace(engine: Engine, trace_id: Optional[int] = None) -> tuple[int, Ops]:
    """(trace id, its operations); BadInput when the trace holds nothing to analyse."""
    trace_id = resolve_trace(engine, trace_id)
    b = OpsBuilder()
    functions: dict[int, tuple[str, Optional[list[list[int]]]]] = {}
    raw = engine.raw_connection()
    try:
        for r in _rows(raw.cursor, trace_id):
            ts, table = r[0], r[3]
            if table == "functions":
                handle, name, layout = _u(r[4]), r[5], r[6]
                old = functions.get(handle)
                functions[handle] = (name, json.loads(layout) if layout is not None
                                     else (old[1] if old and old[0] == name else None))
            elif table == "allocations":
                kind, api, ptr, size = r[4], r[5], _u(r[6]), _u(r[7])
                if kind == "alloc":
                    b.alloc(ts, ptr, size, api)
                elif kind == "free":
                    b.free(ts, ptr, api)
            elif table == "launches":
                api, handle, params, known = r[4], _u(r[5]), bytes(r[6]), bool(r[7])
                name, layout = functions.get(handle, (None, None))
                b.launch(ts, name, layout if known else None, params, api)
            else:
                kind, api, dst, src, size, direction = r[4], r[5], _u(r[6]), _u(r[7]), _u(r[8]), r[9]
                if kind == "memcpy":
                    b.memcpy(ts, dst, src, size, direction or "default", api)
                else:
                    b.memset(ts, dst, size, api)
    finally:
        raw.close()
    ops = b.finish()
    if not np.any((ops.kind == OP_LAUNCH) | (ops.kind == OP_MEMCPY) | (ops.kind == OP_MEMSET)):
        raise BadInput(f"trace {trace_id} holds no kernel launch, copy or set",
                       "trace the process while it runs GPU work (`pos trace PID`)")
    return trace_id, ops
