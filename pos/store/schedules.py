"""Queries over the store's `schedules` and `runs`: what `pos schedule` edits and lists, and
what `pos daemon` reads at every tick and records for every run.

Times are UTC; SQLite keeps them without a zone, so they are given back timezone-aware.
"""

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Optional, Sequence, cast, overload

from sqlalchemy import CursorResult, Engine, delete, func, select, update
from sqlalchemy.orm import Session

from pos.errors import BadInput
from pos.store.models import Meta, Run, Schedule

ID_HIGH = "schedule_id_high"     # meta's key: the highest schedule ID ever given


@overload
def utc(t: datetime) -> datetime: ...
@overload
def utc(t: Optional[datetime]) -> Optional[datetime]: ...


def utc(t: Optional[datetime]) -> Optional[datetime]:
    """A time read from the store, as aware UTC (None, for a column that may hold none)."""
    return None if t is None else t.replace(tzinfo=timezone.utc)


def _plain(t: datetime) -> datetime:
    return t.astimezone(timezone.utc).replace(tzinfo=None)


def add(store: Engine, **fields: Any) -> Schedule:
    """Insert a schedule (the columns of `Schedule` as keywords, times aware); the new row.

    Its ID was never given before, not even to a schedule since removed: images go to
    ROOT/<id>, and a reused ID would make one schedule's folder another's."""
    fields = {k: _plain(v) if isinstance(v, datetime) else v for k, v in fields.items()}
    with Session(store, expire_on_commit=False) as s:
        high = s.get(Meta, ID_HIGH)
        given = int(high.value) if high is not None else 0
        new_id = max(given, s.scalar(select(func.max(Schedule.id))) or 0) + 1
        s.merge(Meta(key=ID_HIGH, value=str(new_id)))
        row = Schedule(id=new_id, **fields)
        s.add(row)
        s.commit()
        return row


def get(store: Engine, schedule_id: int) -> Schedule:
    """The schedule `schedule_id`; BadInput when there is none."""
    with Session(store) as s:
        row = s.get(Schedule, schedule_id)
    if row is None:
        raise no_such(schedule_id)
    return row


def no_such(schedule_id: int) -> BadInput:
    return BadInput(f"no schedule has ID {schedule_id}", "see `pos schedule ls` for the IDs there are")


def remove(store: Engine, schedule_id: int) -> Schedule:
    """Delete a schedule and its runs (its images stay on disk); the deleted row."""
    row = get(store, schedule_id)
    with Session(store) as s:
        s.execute(delete(Run).where(Run.schedule_id == schedule_id))
        s.execute(delete(Schedule).where(Schedule.id == schedule_id))
        s.commit()
    return row


def all_schedules(store: Engine) -> Sequence[Schedule]:
    with Session(store) as s:
        return s.scalars(select(Schedule).order_by(Schedule.id)).all()


def set_next(store: Engine, schedule_id: int, when: datetime) -> None:
    with Session(store) as s:
        s.execute(update(Schedule).where(Schedule.id == schedule_id)
                  .values(next_run_at=_plain(when)))
        s.commit()


def start_run(store: Engine, schedule_id: int, scheduled_for: datetime, started_at: datetime,
              coalesced: int, pid: Optional[int], directory: Optional[str] = None) -> int:
    """Record a run as it starts (outcome `running`), with the directory its image goes to;
    its id."""
    with Session(store) as s:
        row = Run(schedule_id=schedule_id, scheduled_for=_plain(scheduled_for),
                  started_at=_plain(started_at), coalesced=coalesced, pid=pid,
                  outcome="running", directory=directory)
        s.add(row)
        s.commit()
        return row.id


def finish_run(store: Engine, run_id: int, ended_at: datetime, outcome: str,
               **fields: Any) -> None:
    """Complete a run: outcome, and any of engine, path, bytes, stall_s, error."""
    with Session(store) as s:
        s.execute(update(Run).where(Run.id == run_id)
                  .values(ended_at=_plain(ended_at), outcome=outcome, **fields))
        s.commit()


def abandon_running(store: Engine, now: datetime) -> int:
    """Runs still `running` from a daemon that died: marked abandoned; how many."""
    with Session(store) as s:
        n = cast(CursorResult, s.execute(update(Run).where(Run.outcome == "running")
                      .values(outcome="abandoned", ended_at=_plain(now),
                              error="the daemon stopped during the run"))).rowcount
        s.commit()
    return n


def runs(store: Engine, schedule_id: Optional[int] = None) -> Sequence[Run]:
    """Runs, oldest first (of one schedule, or all)."""
    q = select(Run).order_by(Run.id)
    if schedule_id is not None:
        q = q.where(Run.schedule_id == schedule_id)
    with Session(store) as s:
        return s.scalars(q).all()


def made_by(store: Engine, schedule_id: int) -> set[str]:
    """The image directories the store records as written by the schedule's runs: the only
    images its retention may delete (a folder holds what it holds; the store proves whose)."""
    with Session(store) as s:
        rows = s.execute(select(Run.directory, Run.path)
                         .where(Run.schedule_id == schedule_id)).all()
    return {p for row in rows for p in row if p}


@dataclass
class Last:
    outcome: str
    started_at: datetime
    error: Optional[str]


def last_runs(store: Engine) -> dict[int, Last]:
    """schedule id -> its latest run."""
    latest = select(func.max(Run.id)).group_by(Run.schedule_id)
    with Session(store) as s:
        rows = s.scalars(select(Run).where(Run.id.in_(latest))).all()
    return {r.schedule_id: Last(r.outcome, utc(r.started_at), r.error) for r in rows}
