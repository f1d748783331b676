"""Opening the store: one SQLite file in WAL mode, readable by root only.

The path is `--db`, else `POS_DB`, else /var/lib/pos/pos.db. Pragmas are set on every
connection (a connect-event listener), because SQLite forgets them between connections.
"""

import os
import sqlite3
from pathlib import Path
from typing import Any, Optional

from sqlalchemy import Engine, create_engine, event, inspect, select, text, update
from sqlalchemy.exc import DatabaseError, OperationalError
from sqlalchemy.orm import Session

from pos.errors import BadInput
from pos.store.models import SCHEMA_VERSION, Base, Meta

DEFAULT_DB = "/var/lib/pos/pos.db"
# version -> the statements that bring a store of that version to the next one
MIGRATIONS: dict[int, tuple[str, ...]] = {
    3: ("ALTER TABLE schedules ADD COLUMN criu_options TEXT NOT NULL DEFAULT '{}'",),
    4: ("ALTER TABLE launches ADD COLUMN capture BLOB",),
    5: ("ALTER TABLE traces ADD COLUMN captures_dropped INTEGER NOT NULL DEFAULT 0",),
    6: ("ALTER TABLE launches ADD COLUMN missing VARCHAR(16)",
        "ALTER TABLE launches ADD COLUMN missing_bytes BIGINT",
        *(f"ALTER TABLE traces ADD COLUMN {c} INTEGER NOT NULL DEFAULT 0" for c in (
            "completed", "missing_no_layout", "missing_ambiguous", "missing_no_capture",
            "missing_outside", "missing_outside_bytes", "missing_few_addresses"))),
}


def default_db_path() -> str:
    return os.environ.get("POS_DB") or DEFAULT_DB


def open_store(path: Optional[str]) -> Engine:
    """An engine on the store at `path` (`--db`), or at the default path when it is None."""
    return open_db(path or default_db_path())


def _pragmas(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")   # commits are batched by the writer
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.close()


def open_db(path: str, create: bool = True) -> Engine:
    """An engine on the store at `path`, created (0600, in a 0700 folder) when `create`."""
    p = Path(path)
    if not create and not p.is_file():
        raise BadInput(f"{path} is not a pos store", "give the file that `pos trace --db` wrote")
    if create and not p.exists():
        try:
            p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o600))
        except OSError as e:
            raise BadInput(f"cannot create the store {path} ({e.strerror})",
                           "give a writable path with --db or POS_DB") from None
    engine = create_engine(f"sqlite:///{p}")
    event.listen(engine, "connect", _pragmas)
    try:
        tables = inspect(engine).get_table_names()
        if tables and Meta.__tablename__ not in tables:
            raise BadInput(f"{path} is not a usable pos store (an SQLite file without "
                           "pos's tables)",
                           "give the file that `pos trace --db` wrote, or a new path")
        if create:
            Base.metadata.create_all(engine)
        with Session(engine) as s:
            version = s.scalar(select(Meta.value).where(Meta.key == "schema_version"))
            if version is None and create:
                s.add(Meta(key="schema_version", value=str(SCHEMA_VERSION)))
                s.commit()
                version = str(SCHEMA_VERSION)
            elif version is not None and version.isdigit() and create:
                version = _migrate(s, int(version))
            if version != str(SCHEMA_VERSION):
                raise BadInput(f"{path} has store schema {version}, this pos reads "
                               f"{SCHEMA_VERSION}", "use the pos version that wrote it, or a new --db")
    except (DatabaseError, OperationalError) as e:
        raise BadInput(f"{path} is not a usable pos store ({e.orig})",
                       "give the file that `pos trace --db` wrote, or a new path") from None
    return engine


def _migrate(s: Session, version: int) -> str:
    """Bring an older store up to SCHEMA_VERSION, one version per transaction (its rows are
    kept); the version it has afterwards (unchanged when no migration leads from it)."""
    while version < SCHEMA_VERSION and version in MIGRATIONS:
        for statement in MIGRATIONS[version]:
            s.execute(text(statement))
        version += 1
        s.execute(update(Meta).where(Meta.key == "schema_version").values(value=str(version)))
        s.commit()
    return str(version)
