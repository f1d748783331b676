"""Damage done to an image by hand, as a disk, a copy or a person might: the tests of what a
restore makes of it (tests/restore/test_restore_bounds.py,
tests/concurrent/test_damaged_images.py)."""

import json
import os
from pathlib import Path

from pos.image import filehash, names

DAMAGES = ("truncate", "flip", "missing")


def largest(img: Path, pattern: str) -> Path:
    """The largest file of `img` whose name matches `pattern` (glob)."""
    return max(img.glob(pattern), key=lambda f: f.stat().st_size)


def damage(path: Path, how: str) -> None:
    """Cut the file to half its size, flip the byte in its middle, or remove it."""
    size = path.stat().st_size
    if how == "truncate":
        os.truncate(path, size // 2)
    elif how == "flip":
        with open(path, "r+b") as f:
            f.seek(size // 2)
            byte = f.read(1)[0]
            f.seek(size // 2)
            f.write(bytes([byte ^ 0xFF]))
    elif how == "missing":
        path.unlink()
    else:
        raise ValueError(how)


def record_as_is(img: Path, name: str, sizes_only: bool = False) -> None:
    """Make the manifest record the file `name` as it is now: its size only (its checksums stay
    those of the file as it was, so the check beside CRIU fails), or its size and checksums
    (pos then finds nothing wrong, and only CRIU meets the damage)."""
    path = img / names.MANIFEST
    manifest = json.loads(path.read_text())
    chunk = manifest["chunk_bytes"]
    if sizes_only:
        rec, size = manifest["files"][name], (img / name).stat().st_size
        rec["size"], rec["chunks"] = size, rec["chunks"][:max(1, -(-size // chunk))]
    else:
        manifest["files"][name] = filehash.checksums(img, [name], chunk)[name]
    path.write_text(json.dumps(manifest))
