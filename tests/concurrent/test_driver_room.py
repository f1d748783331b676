"""pos/concurrent/checkpoint.py: the host memory that the driver's checkpoint needs for the device
memory pos does not take, checked before the cut (a job with PyTorch's expandable segments whose
memory the GPU had no room to copy)."""

from pathlib import Path

import pytest

from pos import host
from pos.agent.control import Gate, Status
from pos.concurrent import checkpoint
from pos.errors import BadInput

GIB = 1 << 30


def _status(foreign: int, peer: int = 0) -> Status:
    gate = Gate.from_reply({"held": 0, "held_s": 0.0, "held_max_s": 0.0, "passed": 0})
    return Status(1, "idle", 0, 0, 1, foreign, True, 0, gate, peer_bytes=peer)


def test_what_the_driver_brings_is_what_pos_neither_owns_nor_takes() -> None:
    statuses = {1: _status(10 * GIB, peer=GIB), 2: _status(3 * GIB)}
    assert checkpoint.driver_bytes(statuses, 4 * GIB) == 8 * GIB
    assert checkpoint.driver_bytes(statuses, 20 * GIB) == 0


@pytest.mark.parametrize("in_memory, spare, refused", [
    (False, 11 * GIB, False), (False, 9 * GIB, True),
    (True, 21 * GIB, False), (True, 19 * GIB, True)])
def test_a_host_that_cannot_hold_it_is_refused_before_the_cut(
        monkeypatch, tmp_path: Path, in_memory: bool, spare: int, refused: bool) -> None:
    """10 GiB brought into the job: that much where the image goes to a disk, twice that where
    CRIU writes it again into an image kept in memory."""
    monkeypatch.setattr(host, "in_memory", lambda _path: in_memory)
    if not refused:
        checkpoint.check_host_room(10 * GIB, tmp_path, spare)
        return
    with pytest.raises(BadInput) as e:
        checkpoint.check_host_room(10 * GIB, tmp_path, spare)
    assert "\n" not in str(e.value) and e.value.fix == ("free host memory, or GPU memory for "
                                                      "pos's copy of the job's own memory, or "
                                                      "write the image to a disk")
    assert f"{(20 if in_memory else 10)}.0 GiB, where the host has {spare / GIB:.1f} GiB" \
        in str(e.value)
    assert ("CRIU would write it again" in str(e.value)) is in_memory


def test_nothing_brought_is_never_refused(tmp_path: Path) -> None:
    checkpoint.check_host_room(0, tmp_path, -GIB)
