"""Shared by the image tests."""

import os
from pathlib import Path
from typing import Iterator

import pytest

from pos import image
from pos.image import filehash

MiB = 1 << 20


def manifest() -> image.Manifest:
    return image.Manifest(pid=1, pids=[1], gpu_pids=[], comm="t", cmdline="t",
                          created_at="2026-11-23T00:00:00+00:00", host="h", kernel="k",
                          criu_version="n/a", criu_options={}, leave_running=True)


def make_image(tmp_path: Path, files: dict[str, int]) -> Path:
    """An image of files with random contents of the given sizes, sealed as pos seals one."""
    partial = image.prepare(tmp_path / "img", 0)
    for name, size in files.items():
        (partial / name).write_bytes(os.urandom(size))
    return image.seal(partial, manifest())


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    """1 MiB chunks read 256 KiB at a time, so that small files span many chunks and reads."""
    monkeypatch.setattr(image, "CHUNK_BYTES", MiB)
    monkeypatch.setattr(filehash, "READ_BYTES", 256 << 10)
    return MiB


@pytest.fixture
def fds() -> Iterator[dict[str, int]]:
    """The data files a reader keeps open across chunks (pos/image/gpu.py), closed after the
    test: the test process must not hold an image's files once it is gone."""
    opened: dict[str, int] = {}
    yield opened
    for fd in opened.values():
        os.close(fd)
