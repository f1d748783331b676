"""Which images of a schedule to keep: the N newest, none older than an age, at most so many
bytes in all (sizes from the manifests). Only complete images count and only they are deleted:
a DIR.partial is a snapshot in progress (or an interrupted one, for its owner to clean up), a
folder without a manifest is not pos's to remove, and an image the store does not record as the
schedule's own (`owned`: pos.store.schedules.made_by) is neither counted nor deleted.
"""

import re
import shutil
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Optional

from pos.errors import BadInput, PosError
from pos import image
from pos.image import names
from pos.operation import oplock

_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_UNITS_B = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


@dataclass(frozen=True)
class Policy:
    keep: Optional[int] = None          # the newest N
    max_age_s: Optional[float] = None
    max_bytes: Optional[int] = None

    def __str__(self) -> str:
        parts = [f"keep {self.keep}" if self.keep is not None else "",
                 f"max-age {format_duration(self.max_age_s)}" if self.max_age_s is not None
                 else "",
                 f"max-bytes {format_bytes(self.max_bytes)}" if self.max_bytes is not None
                 else ""]
        return ", ".join(p for p in parts if p) or "keep all"


@dataclass(frozen=True)
class Kept:
    """A complete image on disk."""

    path: Path
    created: datetime
    size: int


def parse_duration(text: str, option: str = "--max-age") -> float:
    """'90s', '30m', '12h', '7d', '2w' (or plain seconds) -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text.lower())
    if not m or float(m.group(1)) <= 0:
        raise BadInput(f"{option} '{text}' is not a duration",
                       "give a positive number with s, m, h, d or w, e.g. 7d")
    return float(m.group(1)) * _UNITS_S[m.group(2) or "s"]


def parse_bytes(text: str, option: str = "--max-bytes") -> int:
    """'500M', '20G', '1T', '4096' (binary units) -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", text.lower())
    if not m or float(m.group(1)) <= 0:
        raise BadInput(f"{option} '{text}' is not a size",
                       "give a positive number with K, M, G or T (powers of 1024), e.g. 50G")
    return int(float(m.group(1)) * _UNITS_B[m.group(2)])


def format_duration(seconds: float) -> str:
    for unit in ("w", "d", "h", "m"):
        if seconds >= _UNITS_S[unit] and seconds % _UNITS_S[unit] == 0:
            return f"{int(seconds // _UNITS_S[unit])}{unit}"
    return f"{seconds:g}s"


def format_bytes(n: int) -> str:
    for unit in ("T", "G", "M", "K"):
        if n >= _UNITS_B[unit.lower()]:
            return f"{n / _UNITS_B[unit.lower()]:.1f}{unit}"
    return f"{n}B"


def images_in(folder: Path, owned: Optional[set[str]] = None) -> list[Kept]:
    """The complete images directly under `folder` (of those, only the paths in `owned` when
    given), oldest first."""
    out: list[Kept] = []
    if not folder.is_dir():
        return out
    for entry in folder.iterdir():
        if not entry.is_dir() or names.is_partial(entry.name):
            continue
        if owned is not None and str(entry) not in owned:
            continue
        try:
            m = image.load(entry)
        except PosError:
            continue
        created = datetime.fromisoformat(m.created_at)
        out.append(Kept(entry, created.astimezone(timezone.utc), m.size_bytes))
    return sorted(out, key=lambda k: (k.created, k.path.name))


def select(images: list[Kept], policy: Policy, now: datetime) -> list[Kept]:
    """The images to delete (oldest first). The newest image is always kept: a snapshot is never
    deleted by the retention that runs right after it."""
    newest_first = sorted(images, key=lambda k: (k.created, k.path.name), reverse=True)
    drop: set[Path] = set()
    if policy.keep is not None:
        drop.update(k.path for k in newest_first[max(policy.keep, 1):])
    if policy.max_age_s is not None:
        limit = now - timedelta(seconds=policy.max_age_s)
        drop.update(k.path for k in newest_first[1:] if k.created < limit)
    if policy.max_bytes is not None:
        total = 0
        for i, k in enumerate(newest_first):
            total += k.size if k.path not in drop else 0
            if i > 0 and total > policy.max_bytes:
                drop.add(k.path)
                total -= k.size
    return [k for k in reversed(newest_first) if k.path in drop]


def prune(folder: Path, owned: set[str], policy: Policy, now: datetime,
          dry_run: bool = False) -> list[Kept]:
    """Delete what `select` picks among the images under `folder` that are in `owned`, but an
    image a restore reads now (the next prune takes it); the deleted (or, dry, the doomed)
    images."""
    doomed = select(images_in(folder, owned), policy, now)
    if dry_run:
        return doomed
    gone = []
    for k in doomed:
        with oplock.deletable(k.path) as free:
            if free:
                shutil.rmtree(k.path)
                gone.append(k)
    return gone
