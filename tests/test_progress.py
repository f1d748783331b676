"""The progress line's units and the checksum's counter (CPU only; tests/engines has the
drawn line end to end)."""

from pathlib import Path

import pytest

from pos.image import filehash
from pos.progress import _bar


def test_bytes_are_counted_in_the_units_of_the_summaries() -> None:
    """The summaries say MiB and GiB: the progress line counts in the same units."""
    bar = _bar()
    task = bar.add_task("checkpoint PID 1: checksum", total=3 << 20, completed=1 << 20)
    shown = str(bar.columns[3].render(bar.tasks[task]))
    assert shown == "1.0/3.0 MiB", shown


def test_the_checksum_counter_advances_with_every_read(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks are hashed at once by a pool of threads: counted per chunk, every chunk of a
    large file ended together and the counter jumped from nothing to the end. It counts each
    read now."""
    monkeypatch.setattr(filehash, "READ_BYTES", 4096)
    size = 10 * 4096 + 7
    (tmp_path / "pages.img").write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
    told: list[int] = []
    files = {"pages.img": (size, filehash.WRITTEN)}
    digests = filehash.chunk_digests(tmp_path, files, 64 << 20, told.append)
    assert sum(told) == size and len(told) == 11
    assert digests == filehash.chunk_digests(tmp_path, files, 64 << 20)
