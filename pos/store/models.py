"""The store's tables: SQLAlchemy 2.0 typed models over one SQLite file.

One row per traced event, each table indexed by (trace_id, ts_ns) so that exports and the
analyzer read a trace in time order without sorting in Python. Pointers and handles are
unsigned 64-bit values; SQLite integers are signed, so `U64` stores them two's-complement and
gives them back unsigned (order is kept for every value below 2**63, i.e. every user-space
address).
"""

from datetime import datetime
from typing import Any, Optional

from sqlalchemy import BigInteger, ForeignKey, Index, LargeBinary, String, Text, TypeDecorator
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

SCHEMA_VERSION = 8   # 2: images; 3: schedules, runs; 4: schedules.criu_options;
                     # 5: launches.capture; 6: traces.captures_dropped;
                     # 7: launches.missing(_bytes), traces.completed and missing_*;
                     # 8: runs.directory, meta's schedule_id_high


def to_signed(value: Any) -> Any:
    """An unsigned 64-bit value as SQLite's signed INTEGER stores it (other values unchanged)."""
    return value - (1 << 64) if isinstance(value, int) and value >= 1 << 63 else value


class U64(TypeDecorator[int]):
    """An unsigned 64-bit integer in SQLite's signed INTEGER."""

    impl = BigInteger
    cache_ok = True

    def process_bind_param(self, value: Optional[int], dialect: Any) -> Optional[int]:
        return to_signed(value)

    def process_result_value(self, value: Optional[int], dialect: Any) -> Optional[int]:
        return value + (1 << 64) if value is not None and value < 0 else value


class Base(DeclarativeBase):
    pass


class Meta(Base):
    """Key/value facts about the file itself (the schema version)."""

    __tablename__ = "meta"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class Trace(Base):
    """One `pos trace` run: which process, which library, how it ended."""

    __tablename__ = "traces"
    id: Mapped[int] = mapped_column(primary_key=True)
    pid: Mapped[int]
    comm: Mapped[str] = mapped_column(Text)
    cmdline: Mapped[str] = mapped_column(Text)
    library: Mapped[str] = mapped_column(Text)
    started_at: Mapped[datetime]
    ended_at: Mapped[Optional[datetime]]
    probes: Mapped[int]
    status: Mapped[str] = mapped_column(String(32))    # running, done, stopped, target-exited, failed
    lost_events: Mapped[int] = mapped_column(default=0)
    captures_dropped: Mapped[int] = mapped_column(default=0)   # launches that lost their capture
    # launches recorded before their layout, completed when the trace ended (pos/tracer/late.py);
    # then the launches left without a layout, by reason (launches.missing)
    completed: Mapped[int] = mapped_column(default=0)
    missing_no_layout: Mapped[int] = mapped_column(default=0)
    missing_ambiguous: Mapped[int] = mapped_column(default=0)
    missing_no_capture: Mapped[int] = mapped_column(default=0)
    missing_outside: Mapped[int] = mapped_column(default=0)
    missing_outside_bytes: Mapped[int] = mapped_column(default=0)   # the farthest, either way
    missing_few_addresses: Mapped[int] = mapped_column(default=0)


class _Event:
    """Columns every event has: which trace, when (CLOCK_MONOTONIC), who, through which call."""

    id: Mapped[int] = mapped_column(primary_key=True)
    trace_id: Mapped[int] = mapped_column(ForeignKey("traces.id", ondelete="CASCADE"))
    ts_ns: Mapped[int] = mapped_column(BigInteger)
    pid: Mapped[int]
    tid: Mapped[int]
    api: Mapped[str] = mapped_column(String(64))


def _time_index(table: str) -> tuple[Index, ...]:
    return (Index(f"ix_{table}_trace_ts", "trace_id", "ts_ns"),)


class Allocation(_Event, Base):
    """alloc/free of device memory, and the VMM steps (reserve, create, release, unreserve)."""

    __tablename__ = "allocations"
    __table_args__ = _time_index("allocations")
    kind: Mapped[str] = mapped_column(String(16))
    ptr: Mapped[int] = mapped_column(U64)           # address, or the VMM handle for create/release
    size: Mapped[Optional[int]] = mapped_column(U64)
    stream: Mapped[Optional[int]] = mapped_column(U64)  # cuMemMap: the VMM handle mapped


class Launch(_Event, Base):
    """A kernel launch with the bytes of its parameters (at the layout's offsets, or 8-byte
    slots when `layout_known` is false)."""

    __tablename__ = "launches"
    __table_args__ = _time_index("launches") + (Index("ix_launches_function", "trace_id", "function"),)
    function: Mapped[int] = mapped_column(U64)
    stream: Mapped[int] = mapped_column(U64)
    grid_x: Mapped[int]
    grid_y: Mapped[int]
    grid_z: Mapped[int]
    block_x: Mapped[int]
    block_y: Mapped[int]
    block_z: Mapped[int]
    shared_mem: Mapped[int]
    params: Mapped[bytes] = mapped_column(LargeBinary)
    layout_known: Mapped[bool]
    truncated: Mapped[bool]
    # a launch recorded before its layout was known: what pos/tracer/late.py completes it from
    capture: Mapped[Optional[bytes]] = mapped_column(LargeBinary)
    # why the launch ended the trace without its layout (late.py's reasons), and for a parameter
    # outside the capture how far outside, in bytes (negative: below the captured memory)
    missing: Mapped[Optional[str]] = mapped_column(String(16))
    missing_bytes: Mapped[Optional[int]] = mapped_column(BigInteger)


class Copy(_Event, Base):
    """memcpy (dst, src, size, direction) and memset (dst, size in bytes, value)."""

    __tablename__ = "copies"
    __table_args__ = _time_index("copies")
    kind: Mapped[str] = mapped_column(String(16))
    dst: Mapped[int] = mapped_column(U64)
    src: Mapped[Optional[int]] = mapped_column(U64)
    size: Mapped[int] = mapped_column(U64)
    value: Mapped[Optional[int]] = mapped_column(U64)
    stream: Mapped[int] = mapped_column(U64)
    direction: Mapped[Optional[str]] = mapped_column(String(8))


class Sync(_Event, Base):
    """A synchronisation: stream, event, or the whole context (handle 0)."""

    __tablename__ = "syncs"
    __table_args__ = _time_index("syncs")
    handle: Mapped[int] = mapped_column(U64)


class Module(_Event, Base):
    """A module or library load, with what pos could read of its image."""

    __tablename__ = "modules"
    __table_args__ = _time_index("modules")
    handle: Mapped[int] = mapped_column(U64)
    image: Mapped[int] = mapped_column(U64)
    image_size: Mapped[Optional[int]]
    kernels: Mapped[Optional[int]]
    note: Mapped[Optional[str]] = mapped_column(Text)


class Function(_Event, Base):
    """A kernel lookup: handle -> mangled name, and the parameter layout pos found for it
    (JSON [[offset, size], ...])."""

    __tablename__ = "functions"
    __table_args__ = _time_index("functions") + (Index("ix_functions_handle", "trace_id", "handle"),)
    handle: Mapped[int] = mapped_column(U64)
    module: Mapped[Optional[int]] = mapped_column(U64)
    name: Mapped[str] = mapped_column(Text)
    layout: Mapped[Optional[str]] = mapped_column(Text)


# The event tables by the names the decoder (pos/tracer/events.py) gives them.
EVENT_MODELS: dict[str, type[Base]] = {
    m.__tablename__: m for m in (Allocation, Launch, Copy, Sync, Module, Function)}


class Image(Base):
    """A process image written by `pos checkpoint` (its manifest, pos-manifest.json, in full)."""

    __tablename__ = "images"
    __table_args__ = (Index("ix_images_created", "created_at"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    path: Mapped[str] = mapped_column(Text)
    pid: Mapped[int]
    comm: Mapped[str] = mapped_column(Text)
    cmdline: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime]
    gpu: Mapped[bool]                            # holds CUDA state
    driver_version: Mapped[Optional[str]] = mapped_column(String(32))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    stall_s: Mapped[Optional[float]]
    manifest: Mapped[str] = mapped_column(Text)  # JSON
    restored_at: Mapped[Optional[datetime]]


class Schedule(Base):
    """A cron-scheduled snapshot (`pos schedule add`): what, when, where, how many to keep."""

    __tablename__ = "schedules"
    id: Mapped[int] = mapped_column(primary_key=True)
    cron: Mapped[str] = mapped_column(Text)              # UTC
    target_kind: Mapped[str] = mapped_column(String(8))  # pid, match, name
    target: Mapped[str] = mapped_column(Text)
    root: Mapped[str] = mapped_column(Text)              # images go to ROOT/<id>/<UTC time>
    engine: Mapped[str] = mapped_column(String(16))      # auto, driver, concurrent, criu
    leave_running: Mapped[bool]
    criu_options: Mapped[str] = mapped_column(Text, default="{}")   # JSON of criu.Options
    keep: Mapped[Optional[int]]
    max_age_s: Mapped[Optional[float]]
    max_bytes: Mapped[Optional[int]] = mapped_column(BigInteger)
    created_at: Mapped[datetime]                         # UTC, as every time below
    next_run_at: Mapped[datetime]


class Run(Base):
    """One run of a schedule, recorded when it starts and completed when it ends."""

    __tablename__ = "runs"
    __table_args__ = (Index("ix_runs_schedule_started", "schedule_id", "started_at"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    schedule_id: Mapped[int] = mapped_column(ForeignKey("schedules.id", ondelete="CASCADE"))
    scheduled_for: Mapped[datetime]
    coalesced: Mapped[int] = mapped_column(default=1)   # fire times this run served
    started_at: Mapped[datetime]
    ended_at: Mapped[Optional[datetime]]
    pid: Mapped[Optional[int]]
    engine: Mapped[Optional[str]] = mapped_column(String(16))   # the one used: driver, criu
    # running, ok, failed, bad-input, no-target, abandoned
    outcome: Mapped[str] = mapped_column(String(16))
    path: Mapped[Optional[str]] = mapped_column(Text)
    # where the run was told to write its image: what proves an image there is the schedule's
    directory: Mapped[Optional[str]] = mapped_column(Text)
    bytes: Mapped[Optional[int]] = mapped_column(BigInteger)
    stall_s: Mapped[Optional[float]]
    error: Mapped[Optional[str]] = mapped_column(Text)
