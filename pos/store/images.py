"""Queries over the store's `images`: what `pos checkpoint` wrote and `pos images` lists."""

from datetime import datetime, timezone
from typing import Optional, Sequence

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from pos.scheduler.image import Manifest
from pos.store.db import open_store
from pos.store.models import Image


def record(db: Optional[str], path: str, manifest: Manifest) -> int:
    """Add one image row; its id."""
    engine = open_store(db)
    with Session(engine) as s:
        row = Image(path=path, pid=manifest.pid, comm=manifest.comm, cmdline=manifest.cmdline,
                    created_at=datetime.fromisoformat(manifest.created_at),
                    gpu=bool(manifest.gpu_pids), driver_version=manifest.driver_version,
                    size_bytes=manifest.size_bytes, stall_s=manifest.stall_s,
                    manifest=manifest.to_json())
        s.add(row)
        s.commit()
        return row.id


def mark_restored(db: Optional[str], path: str) -> None:
    engine = open_store(db)
    with Session(engine) as s:
        s.execute(update(Image).where(Image.path == path)
                  .values(restored_at=datetime.now(timezone.utc)))
        s.commit()


def list_images(db: Optional[str]) -> Sequence[Image]:
    """Every recorded image, newest first (an empty store lists nothing)."""
    engine = open_store(db)
    with Session(engine) as s:
        return s.scalars(select(Image).order_by(Image.created_at.desc(), Image.id.desc())).all()


def forget(db: Optional[str], paths: list[str]) -> None:
    """Drop the rows of images that were deleted (by retention)."""
    engine = open_store(db)
    with Session(engine) as s:
        s.execute(delete(Image).where(Image.path.in_(paths)))
        s.commit()
