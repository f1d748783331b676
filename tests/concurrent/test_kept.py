"""Arenas kept for the next checkpoint (pos/concurrent/kept.py, POS_PIN_KEEP=1): a file serves
one arena at a time; the next arena on it finds the same memory there and faults none of it in
again; the host's room counts it beside what the host has available."""

import os
from pathlib import Path

import pytest

from pos import host
from pos.concurrent import copier, gpucopy, kept
from pos.settings import Settings
from tests.concurrent.test_pinned import PART, _Locking

GIB = 1 << 30


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The kept files' folder, on whatever file system the tests' temporary folder is."""
    monkeypatch.setattr(host, "mount_tmpfs", lambda _root, _options: None)
    monkeypatch.setattr(gpucopy.Pinned, "PIECE", PART)
    return tmp_path


def test_each_file_serves_one_arena_at_a_time(root: Path) -> None:
    a, b = kept.take(root), kept.take(root)
    assert a is not None and b is not None and a.path != b.path
    assert (a.present, b.present) == (0, 0)
    assert os.stat(a.path).st_mode & 0o777 == 0o600
    a.close()
    again = kept.take(root)
    assert again is not None and again.path == a.path      # free again once let go
    again.close()
    b.close()


def test_the_next_arena_finds_the_memory_and_faults_none_of_it_in(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    drv = _Locking()
    first = gpucopy.Pinned(drv, 4 * PART, kept=kept.take(root))   # type: ignore[arg-type]
    first.view(0, 4 * PART)[:] = 7                   # what a copy left in it
    first.close()
    assert not drv.locked                            # unregistered, the file kept
    faulted: list[tuple[int, int]] = []
    fault = gpucopy.Pinned._fault
    monkeypatch.setattr(gpucopy.Pinned, "_fault",
                        lambda self, part: (faulted.append(part), fault(self, part)))
    again = kept.take(root)
    assert again is not None and again.present == 4 * PART
    second = gpucopy.Pinned(drv, 6 * PART, kept=again)   # type: ignore[arg-type]
    try:
        assert second.pinned_bytes == 6 * PART and len(drv.locked) == 6
        assert (second.view(0, 4 * PART) == 7).all()          # the same memory
        assert (second.view(4 * PART, 2 * PART) == 0).all()    # the new part, faulted in
    finally:
        second.close()
    assert len(faulted) == 6        # asked of each part; only the two new ones were written
    last = kept.take(root)
    assert last is not None and last.present == 6 * PART
    last.close()


def test_a_file_fits_what_its_file_system_has_room_for(root: Path) -> None:
    k = kept.take(root)
    assert k is not None
    try:
        st = os.statvfs(root)
        assert k.fits(st.f_bavail * st.f_frsize) and not k.fits(st.f_blocks * st.f_frsize * 2)
    finally:
        k.close()


def test_the_hosts_room_counts_the_kept_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kept file's memory is not in MemAvailable: an arena that fits in it is not refused
    for want of available memory, and leaves the room to the others."""
    monkeypatch.setattr(host, "memory_available", lambda: 3 * GIB)     # 1 GiB to spare
    room = copier.HostRoom(ring=0)
    chunk = 64 << 20
    assert room.arena(20 * GIB, chunk, 0, kept=20 * GIB) == 20 * GIB
    assert room.arena(1 * GIB, chunk, 0) == 1 * GIB
    assert room.left == 0


@pytest.mark.parametrize("value, keep", [("", False), ("0", False), ("1", True)])
def test_keeping_is_a_setting(value: str, keep: bool) -> None:
    assert Settings.from_env({"POS_PIN_KEEP": value}).pin_keep is keep


def test_a_bad_keep_setting_is_one_sentence() -> None:
    from pos.errors import BadInput

    with pytest.raises(BadInput, match="POS_PIN_KEEP=yes is not 0 or 1"):
        Settings.from_env({"POS_PIN_KEEP": "yes"})
