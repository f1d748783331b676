"""Shared by the image tests."""

import os
from typing import Iterator

import pytest


@pytest.fixture
def fds() -> Iterator[dict[str, int]]:
    """The data files a reader keeps open across chunks (pos/image/gpu.py), closed after the
    test: the test process must not hold an image's files once it is gone."""
    opened: dict[str, int] = {}
    yield opened
    for fd in opened.values():
        os.close(fd)
