"""Decoding and storing events in a process of their own.

Decoding an event and inserting its row cost about 5 µs of Python; the drain must never wait for
that, or the ring buffer overflows under a launch storm. So the tracer process only drains the
ring (pos/tracer/ring.py) and handles the rare module and kernel-lookup events itself; the raw
batches go through a multiprocessing queue (its feeder thread never blocks the drain) to this
sink, which decodes them and feeds the store's batched writer. Rows the tracer builds itself
(modules, functions, layouts, trace status) travel through the same queue, in order.
"""

import multiprocessing as mp
import os
import signal
from queue import Empty
from typing import Any, Optional

import numpy as np

from pos.errors import PosError
from pos.store.db import open_db
from pos.store.writer import TraceWriter
from pos.tracer.events import Row, decode

_RAW, _ROW, _TRACE = "raw", "row", "trace"


def _serve(db: str, trace_id: int, queue: Any) -> None:
    """The sink process: decode and write until the None that ends the trace, or until the
    tracer is gone (SIGKILLed: what reached the sink is still stored). Ctrl-C reaches the whole
    process group; only the tracer acts on it, the sink finishes what it was sent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tracer = os.getppid()
    writer = TraceWriter(open_db(db), trace_id)
    try:
        while True:
            try:
                item = queue.get(timeout=1.0)
            except Empty:
                if os.getppid() != tracer:
                    return
                continue
            if item is None:
                return
            if item[0] == _RAW:
                data = memoryview(item[1])
                for at in np.frombuffer(item[2], np.int64).tolist():
                    writer.add(*decode(data, at))
            elif item[0] == _ROW:
                writer.add(item[1], item[2])
            else:
                writer.update_trace(**item[1])
    finally:
        writer.close()


class Sink:
    """The tracer's side of the sink process."""

    def __init__(self, db: str, trace_id: int) -> None:
        ctx = mp.get_context("spawn")   # the tracer holds BPF objects and threads: never fork it
        self._queue = ctx.Queue()
        self._proc: Optional[Any] = ctx.Process(target=_serve, args=(db, trace_id, self._queue),
                                                name="pos-trace-sink", daemon=True)
        self._proc.start()

    def raw(self, data: bytes, offsets: np.ndarray) -> None:
        """Records of a ring batch (payload offsets into `data`, int64 as the ring reader
        makes them) to decode and store."""
        if len(offsets):
            self._queue.put((_RAW, data, offsets.tobytes()))

    def add(self, table: str, row: Row) -> None:
        self._queue.put((_ROW, table, row))

    def update_trace(self, **values: Any) -> None:
        self._queue.put((_TRACE, values))

    def check(self) -> None:
        """Raise if the sink died (the store is then unreachable: stop tracing)."""
        if self._proc is not None and not self._proc.is_alive():
            raise PosError(f"the process writing the store exited with code {self._proc.exitcode}",
                           "check that the --db file's disk is writable and not full")

    def close(self) -> None:
        """Wait until everything queued is in the store."""
        if self._proc is None:
            return
        self._queue.put(None)
        self._queue.close()
        self._proc.join()
        code, self._proc = self._proc.exitcode, None
        if code != 0:
            raise PosError(f"the process writing the store failed (exit code {code})",
                           "check that the --db file's disk is writable and not full")
