"""Opening the store: one SQLite file in WAL mode, readable by root only.

The path is `--db`, else `POS_DB`, else /var/lib/pos/pos.db. Pragmas are set on every
connection (a connect-event listener), because SQLite forgets them between connections.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import stat
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from pos.errors import BadInput

if TYPE_CHECKING:      # imported by open_db: `check` alone needs none of SQLAlchemy
    from sqlalchemy import Engine
    from sqlalchemy.orm import Session

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
    # the highest schedule ID ever given, so that an ID is never given twice; a store of
    # version 7 knows only the IDs it still holds
    7: ("ALTER TABLE runs ADD COLUMN directory TEXT",
        "INSERT OR REPLACE INTO meta (key, value) SELECT 'schedule_id_high', CAST(MAX("
        "COALESCE((SELECT MAX(id) FROM schedules), 0), COALESCE((SELECT MAX(schedule_id) "
        "FROM runs), 0)) AS TEXT)"),
}


def default_db_path() -> str:
    return os.environ.get("POS_DB") or DEFAULT_DB


def open_store(path: Optional[str]) -> Engine:
    """An engine on the store at `path` (`--db`), or at the default path when it is None."""
    return open_db(path or default_db_path())


def open_existing(path: Optional[str]) -> Optional[Engine]:
    """The store at `path` (or the default path) if there is one, else None: the commands that
    only read the store (`pos images`, `pos schedule ls`) must not make one."""
    p = path or default_db_path()
    try:
        os.lstat(p)
    except FileNotFoundError:
        return None
    except OSError:     # cannot tell (a folder this user may not search): open_db says why
        pass
    return open_db(p)


def _pragmas(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")   # commits are batched by the writer
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.close()


def check(path: str, create: bool = True) -> None:
    """Refuse, in one sentence, a path that cannot be a pos store: missing (unless `create`,
    which makes it, 0600 in a 0700 folder), not open to this user, not SQLite, or SQLite without
    pos's tables (an empty file too, unless `create`, which fills it). With sqlite3 alone, so
    that `pos restore` checks its --db before it starts a job, without waiting for SQLAlchemy
    to import."""
    p = Path(path)
    # stat and access, never open: closing any descriptor of an SQLite file drops the locks
    # that this process's connections hold on it (POSIX locks are per process and file); SQLite's
    # own connection below is the exception (it keeps such a descriptor open until they end)
    try:
        is_dir = stat.S_ISDIR(p.stat().st_mode)
    except FileNotFoundError:
        if not create:
            raise BadInput(f"{path} is not a pos store",
                           "give the file that `pos trace --db` wrote") from None
        _create(p)
        is_dir = False
    except OSError as e:
        raise _denied(path, e, create, "open") from None
    if is_dir:
        raise BadInput(f"{path} is a folder, not a pos store",
                       "give the file that `pos trace --db` wrote, or a new path")
    if not os.access(p, os.R_OK | (os.W_OK if create else 0)):   # used as pos will use it
        denied = PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        raise _denied(path, denied, create, "open")
    # read-write where this user may write: a store left by a pos killed mid-transaction (a hot
    # journal) is rolled back by the first connection that reads it, which a read-only one cannot
    mode = "rw" if os.access(p, os.W_OK) else "ro"
    try:
        with closing(sqlite3.connect(f"file:{p}?mode={mode}", uri=True)) as c:
            tables = {n for (n,) in c.execute("SELECT name FROM sqlite_master "
                                                "WHERE type = 'table'")}
    except sqlite3.Error as e:
        raise BadInput(f"{path} is not a usable pos store ({e})",
                       "give the file that `pos trace --db` wrote, or a new path") from None
    if tables and "meta" not in tables:
        raise BadInput(f"{path} is not a usable pos store (an SQLite file without pos's tables)",
                       "give the file that `pos trace --db` wrote, or a new path")
    if not tables and not create:
        raise BadInput(f"{path} is not a pos store (an empty file)",
                       "give the file that `pos trace --db` wrote")


def _create(p: Path) -> None:
    """A new store file at `p`. Only the default store's folder is made: any other path names a
    folder that must exist (a mistyped --db must not leave folders behind)."""
    if not p.parent.is_dir() and p.absolute() != Path(DEFAULT_DB):
        raise BadInput(f"the folder of the store {p} does not exist",
                       "create it first, or give --db a file in an existing folder")
    try:
        p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o600))
    except OSError as e:
        raise _denied(str(p), e, True, "create") from None


def _denied(path: str, e: OSError, create: bool, doing: str) -> BadInput:
    """The store at `path` cannot be opened or made (`doing`): for lack of privileges, or of a
    writable place."""
    if e.errno in (errno.EACCES, errno.EPERM) and os.geteuid() != 0:
        return BadInput(f"cannot {doing} the store {path} as this user ({e.strerror})",
                        "run pos as root (sudo)" + (", or give a store of your own with --db "
                                                    "or POS_DB" if create else ""))
    return BadInput(f"cannot {doing} the store {path} ({e.strerror})",
                    "give a writable path with --db or POS_DB" if create
                    else "give the file that `pos trace --db` wrote")


def open_db(path: str, create: bool = True) -> Engine:
    """An engine on the store at `path` (see `check`), its tables made and its schema brought
    up to this pos's."""
    from sqlalchemy import create_engine, event, select
    from sqlalchemy.exc import DatabaseError, OperationalError
    from sqlalchemy.orm import Session

    from pos.store.models import SCHEMA_VERSION, Base, Meta

    check(path, create)
    engine = create_engine(f"sqlite:///{Path(path)}")
    event.listen(engine, "connect", _pragmas)
    try:
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
    from sqlalchemy import text, update

    from pos.store.models import SCHEMA_VERSION, Meta

    while version < SCHEMA_VERSION and version in MIGRATIONS:
        for statement in MIGRATIONS[version]:
            s.execute(text(statement))
        version += 1
        s.execute(update(Meta).where(Meta.key == "schema_version").values(value=str(version)))
        s.commit()
    return str(version)
