"""The one writer of a trace: a thread that drains a queue into batched inserts.

It runs in the tracer's sink process (pos/tracer/sink.py), whose decode loop must never wait
for SQLite, so `add` only appends to a deque (atomic under the GIL); the thread takes up to
BATCH rows at a time, groups them by table and inserts each group with one executemany, one
commit per batch (trace-row updates in the same transaction, in order). `close` drains
everything first.
The volume (hundreds of thousands of launches a second) is why this is plain SQL on the DBAPI
connection: SQLAlchemy's per-row processing costs ten times the decoding of an event.
"""

import threading
import time
from collections import defaultdict, deque
from typing import Any, Optional

from sqlalchemy import Engine, update

from pos.store.models import EVENT_MODELS, Trace, to_signed

BATCH = 20000
IDLE_S = 0.05
_TRACE = "__trace__"   # a queue item that updates the trace row, in order with the events


class TraceWriter:
    """Records events of one trace; `add(table, row)` with the decoder's table names."""

    def __init__(self, engine: Engine, trace_id: int) -> None:
        self.engine = engine
        self.trace_id = trace_id
        self.written = 0
        self._queue: deque[tuple[str, dict[str, Any]]] = deque()
        self._stop = threading.Event()
        self._error: Optional[BaseException] = None
        self._sql: dict[str, str] = {}
        self._thread = threading.Thread(target=self._run, name="pos-store-writer", daemon=True)
        self._thread.start()

    def add(self, table: str, row: dict[str, Any]) -> None:
        self._queue.append((table, row))

    def update_trace(self, **values: Any) -> None:
        self._queue.append((_TRACE, values))

    def _run(self) -> None:
        try:
            while True:
                if not self._queue:
                    if self._stop.is_set():
                        return
                    time.sleep(IDLE_S)
                    continue
                self._write_batch()
        except BaseException as e:  # reported by close(); the tracer goes on draining meanwhile
            self._error = e

    def _write_batch(self) -> None:
        groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
        trace_updates: list[dict[str, Any]] = []
        for _ in range(min(BATCH, len(self._queue))):
            table, row = self._queue.popleft()
            if table == _TRACE:
                trace_updates.append(row)
            else:
                row["trace_id"] = self.trace_id
                groups[table].append(row)
        with self.engine.begin() as conn:
            cur = conn.connection.cursor()
            for table, rows in groups.items():
                sql = self._sql.get(table) or self._insert_sql(table, rows[0])
                try:
                    cur.executemany(sql, rows)
                except OverflowError:   # a value >= 2**63: store it as U64 does
                    cur.executemany(sql, [{k: to_signed(v) for k, v in r.items()} for r in rows])
                self.written += len(rows)
            for values in trace_updates:
                conn.execute(update(Trace).where(Trace.id == self.trace_id).values(**values))

    def _insert_sql(self, table: str, row: dict[str, Any]) -> str:
        """INSERT for the decoder's row keys, checked once against the model's columns."""
        columns = EVENT_MODELS[table].__table__.columns
        unknown = [k for k in row if k not in columns]
        if unknown:
            raise ValueError(f"{table} has no column {unknown[0]}")
        sql = (f"INSERT INTO {table} ({', '.join(row)}) "
               f"VALUES ({', '.join(':' + k for k in row)})")
        self._sql[table] = sql
        return sql

    def close(self) -> None:
        """Write everything queued, then stop; raises what the writer thread failed with."""
        self._stop.set()
        self._thread.join()
        if self._error is not None:
            raise self._error
