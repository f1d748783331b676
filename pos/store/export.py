"""`pos export`: a recorded trace as JSON lines or as a Perfetto (Chrome JSON) trace.

Events are read table by table in (ts_ns, id) order through the (trace_id, ts_ns) indexes and
merged, so the output is in time order without loading a trace into memory. Kernel names and
layouts are resolved as the merge goes: a launch gets the name of the last lookup of its
handle before it, which is what the process itself used.
"""

import heapq
import json
from collections.abc import Iterator
from typing import Any, Optional, TextIO

from sqlalchemy import Engine, func, select

from pos.errors import BadInput
from pos.store.models import EVENT_MODELS, Trace

# Table -> the `kind` of its events when the row has no kind column of its own.
KINDS = {"launches": "launch", "syncs": "sync", "modules": "module", "functions": "function"}


def _hex(v: Optional[int]) -> Optional[str]:
    return None if v is None else f"0x{v:x}"


def resolve_trace(engine: Engine, trace_id: Optional[int]) -> int:
    """The trace to export: `trace_id`, or the latest; one clear error when there is none."""
    with engine.connect() as c:
        if trace_id is None:
            trace_id = c.scalar(select(func.max(Trace.id)))
            if trace_id is None:
                raise BadInput("the store holds no trace", "record one with `pos trace PID --db FILE`")
        elif c.scalar(select(Trace.id).where(Trace.id == trace_id)) is None:
            raise BadInput(f"the store has no trace {trace_id}", "omit --trace for the latest")
    return trace_id


def events(engine: Engine, trace_id: int) -> Iterator[tuple[str, dict[str, Any]]]:
    """(table, row) of every event of the trace, in time order."""
    with engine.connect() as c:
        def rows(rank: int, table: str) -> Iterator[tuple[int, int, str, Any]]:
            t = EVENT_MODELS[table].__table__
            for r in c.execute(select(t).where(t.c.trace_id == trace_id)
                               .order_by(t.c.ts_ns, t.c.id)).mappings():
                yield r["ts_ns"], rank, table, r

        # the rank breaks ties: a kernel lookup sorts before a launch of the same nanosecond
        streams = [rows(-1 if table == "functions" else rank, table)
                   for rank, table in enumerate(EVENT_MODELS)]
        for _ts, _rank, table, row in heapq.merge(*streams, key=lambda e: e[:2]):
            yield table, dict(row)


def split_params(params: bytes, layout: Optional[list[list[int]]]) -> list[bytes]:
    """A launch's captured bytes as one bytes object per parameter (8-byte slots without a layout)."""
    if layout is None:
        return [params[i:i + 8] for i in range(0, len(params), 8)]
    return [params[off:off + size] for off, size in layout]


def json_events(engine: Engine, trace_id: int) -> Iterator[dict[str, Any]]:
    """The events as the JSON objects `pos export --format jsonl` prints (their fields:
    docs/tracing.md)."""
    names: dict[int, str] = {}
    layouts: dict[int, list[list[int]]] = {}
    for table, r in events(engine, trace_id):
        e: dict[str, Any] = {"kind": r.get("kind") or KINDS[table], "api": r["api"],
                             "ts_ns": r["ts_ns"], "pid": r["pid"], "tid": r["tid"]}
        if table == "allocations":
            e.update(ptr=_hex(r["ptr"]), size=r["size"])
        elif table == "launches":
            known = r["layout_known"] and r["function"] in layouts
            e.update(function=_hex(r["function"]), name=names.get(r["function"]),
                     grid=[r["grid_x"], r["grid_y"], r["grid_z"]],
                     block=[r["block_x"], r["block_y"], r["block_z"]],
                     shared_mem=r["shared_mem"], stream=_hex(r["stream"]),
                     params=[p.hex() for p in split_params(
                         r["params"], layouts[r["function"]] if known else None)],
                     layout_known=bool(known), truncated=bool(r["truncated"]))
        elif table == "copies":
            e.update(dst=_hex(r["dst"]), size=r["size"], stream=_hex(r["stream"]))
            if r["kind"] == "memcpy":
                e.update(src=_hex(r["src"]), direction=r["direction"])
            else:
                e.update(value=r["value"])
        elif table == "syncs":
            e.update(handle=_hex(r["handle"]))
        elif table == "modules":
            e.update(handle=_hex(r["handle"]), image_size=r["image_size"], kernels=r["kernels"],
                     note=r["note"])
        else:
            names[r["handle"]] = r["name"]
            layout = None if r["layout"] is None else json.loads(r["layout"])
            if layout is not None:
                layouts[r["handle"]] = layout
            e.update(handle=_hex(r["handle"]), name=r["name"], layout=layout)
        yield e


def export_jsonl(engine: Engine, out: TextIO, trace_id: Optional[int] = None) -> int:
    """One JSON object per line, in time order; returns how many."""
    n = 0
    for n, e in enumerate(json_events(engine, resolve_trace(engine, trace_id)), 1):
        out.write(json.dumps(e, separators=(",", ":")) + "\n")
    return n


def export_perfetto(engine: Engine, out: TextIO, trace_id: Optional[int] = None) -> int:
    """A Chrome JSON trace (opens in ui.perfetto.dev): one track per thread of the process,
    and one per stream, in a second process row "GPU streams", for what was queued on it."""
    trace_id = resolve_trace(engine, trace_id)
    with engine.connect() as c:
        pid = c.scalar(select(Trace.pid).where(Trace.id == trace_id)) or 0
        comm = c.scalar(select(Trace.comm).where(Trace.id == trace_id)) or ""
    gpu_pid = pid + 1_000_000_000   # a pseudo-process for the stream tracks
    stream_tids: dict[str, int] = {}
    threads: set[int] = set()
    out.write('{"displayTimeUnit":"ns","traceEvents":[\n')
    meta = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"{comm} ({pid})"}},
            {"ph": "M", "name": "process_name", "pid": gpu_pid, "args": {"name": "GPU streams"}}]
    out.write(",\n".join(json.dumps(m) for m in meta))
    n = 0
    for e in json_events(engine, trace_id):
        label = e["name"] or e["api"] if e["kind"] == "launch" else e["api"]
        args = {k: v for k, v in e.items() if k not in ("kind", "ts_ns", "pid", "tid", "api")}
        common = {"name": label, "cat": e["kind"], "ph": "i", "s": "t", "ts": e["ts_ns"] / 1000,
                  "args": args}
        if e["tid"] not in threads:
            threads.add(e["tid"])
            out.write(",\n" + json.dumps({"ph": "M", "name": "thread_name", "pid": pid,
                                          "tid": e["tid"], "args": {"name": f"thread {e['tid']}"}}))
        out.write(",\n" + json.dumps({**common, "pid": pid, "tid": e["tid"]}))
        stream = e.get("stream")
        if stream is not None and e["kind"] in ("launch", "memcpy", "memset"):
            if stream not in stream_tids:
                stream_tids[stream] = len(stream_tids) + 1
                out.write(",\n" + json.dumps({"ph": "M", "name": "thread_name", "pid": gpu_pid,
                                              "tid": stream_tids[stream],
                                              "args": {"name": f"stream {stream}"}}))
            out.write(",\n" + json.dumps({**common, "pid": gpu_pid, "tid": stream_tids[stream]}))
        n += 1
    out.write("\n]}\n")
    return n

