"""Queries over the store's `images`: what `pos checkpoint` wrote and `pos images` lists."""

import json
from datetime import datetime, timezone
from typing import Optional, Sequence

from sqlalchemy import Engine, delete, select, update
from sqlalchemy.orm import Session

from pos.store.db import open_existing, open_store
from pos.store.models import Image


def record(db: Optional[str], path: str, manifest_json: str) -> int:
    """Add one image row from the text of its manifest (pos.image.Manifest.to_json,
    passed as text so that the store does not depend on the engines); its id."""
    m = json.loads(manifest_json)
    engine = open_store(db)
    with Session(engine) as s:
        row = Image(path=path, pid=m["pid"], comm=m["comm"], cmdline=m["cmdline"],
                    created_at=datetime.fromisoformat(m["created_at"]),
                    gpu=bool(m["gpu_pids"]), driver_version=m.get("driver_version"),
                    size_bytes=m.get("size_bytes", 0), stall_s=m.get("stall_s"),
                    manifest=manifest_json)
        s.add(row)
        s.commit()
        return row.id


def mark_restored(db: Optional[str], path: str, engine: Optional[Engine] = None) -> None:
    """Stamp the row of the image at `path` (if any) with the time of its restore. `engine`:
    the store at `db`, opened already."""
    engine = engine or open_store(db)
    with Session(engine) as s:
        s.execute(update(Image).where(Image.path == path)
                  .values(restored_at=datetime.now(timezone.utc)))
        s.commit()


def list_images(db: Optional[str]) -> Sequence[Image]:
    """Every recorded image, newest first (an empty store lists nothing, and no store is made
    where there is none)."""
    engine = open_existing(db)
    if engine is None:
        return []
    with Session(engine) as s:
        return s.scalars(select(Image).order_by(Image.created_at.desc(), Image.id.desc())).all()


def recorded(db: Optional[str], paths: list[str]) -> set[str]:
    """Which of `paths` have a row."""
    engine = open_store(db)
    with Session(engine) as s:
        return set(s.scalars(select(Image.path).where(Image.path.in_(paths))))


def forget(db: Optional[str], paths: list[str]) -> None:
    """Drop the rows of images that were deleted (by retention)."""
    engine = open_store(db)
    with Session(engine) as s:
        s.execute(delete(Image).where(Image.path.in_(paths)))
        s.commit()
