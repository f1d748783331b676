"""pos/operation/hostroom.py, and what each engine asks it: the host memory that the driver's
checkpoint needs for the device memory it saves, checked before the job is held."""

from pathlib import Path

import pytest

from pos.agent.control import Gate, Status
from pos.concurrent import checkpoint
from pos.errors import BadInput
from pos.operation import hostroom

GIB = 1 << 30
FIX = "free host memory"


def _status(foreign: int, peer: int = 0) -> Status:
    gate = Gate.from_reply({"held": 0, "held_s": 0.0, "held_max_s": 0.0, "passed": 0})
    return Status(1, "idle", 0, 0, 1, foreign, True, 0, gate, peer_bytes=peer)


def test_what_the_driver_brings_is_what_the_concurrent_engine_neither_owns_nor_takes() -> None:
    statuses = {1: _status(10 * GIB, peer=GIB), 2: _status(3 * GIB)}
    assert checkpoint.driver_bytes(statuses, 4 * GIB) == 8 * GIB
    assert checkpoint.driver_bytes(statuses, 20 * GIB) == 0


@pytest.mark.parametrize("in_memory, spare, refused", [
    (False, 11 * GIB, False), (False, 9 * GIB, True),
    (True, 21 * GIB, False), (True, 19 * GIB, True)])
def test_a_host_that_cannot_hold_it_is_refused(in_memory: bool, spare: int,
                                               refused: bool) -> None:
    """10 GiB brought into the job: that much where the image goes to a disk, twice that where
    CRIU writes it again into an image kept in memory."""
    if not refused:
        hostroom.check(10 * GIB, "the job's device memory", in_memory, spare, FIX)
        return
    with pytest.raises(BadInput) as e:
        hostroom.check(10 * GIB, "the job's device memory", in_memory, spare, FIX)
    said = str(e.value)
    assert "\n" not in said and said.endswith(f": {FIX}.")
    assert said.startswith("the driver's checkpoint would bring 10.0 GiB of the job's device "
                           "memory into host memory")
    assert f"{(20 if in_memory else 10)}.0 GiB, where the host has {spare / GIB:.1f} GiB" in said
    assert ("CRIU would write it again" in said) is in_memory


def test_what_pos_copies_into_host_memory_counts_beside_what_the_driver_brings() -> None:
    """The job's own memory that the GPU has no room for is copied into host memory while the
    job is held: counted with the driver's, once (each piece is let go once in the image),
    and named apart in the sentence."""
    hostroom.check(4 * GIB, "pools", False, 10 * GIB, FIX, copied=6 * GIB)
    with pytest.raises(BadInput) as e:
        hostroom.check(4 * GIB, "pools", False, 10 * GIB - 1, FIX, copied=6 * GIB)
    assert str(e.value).startswith("the driver's checkpoint would bring 4.0 GiB of pools into "
                                   "host memory and pos would copy 6.0 GiB of the job's own "
                                   "memory")
    hostroom.check(0, "pools", True, 6 * GIB, FIX, copied=6 * GIB)
    with pytest.raises(BadInput) as e:
        hostroom.check(0, "pools", True, 5 * GIB, FIX, copied=6 * GIB)
    said = str(e.value)
    assert said.startswith("pos would copy 6.0 GiB") and "6.0 GiB, where the host" in said


def test_nothing_brought_is_never_refused() -> None:
    hostroom.check(0, "the job's device memory", True, -GIB, FIX)


def test_the_stop_the_world_engine_asks_before_the_job_is_locked(
        monkeypatch, tmp_path: Path) -> None:
    """A job whose device memory the host cannot hold twice over, with its image in memory, is
    refused before the driver is asked anything (the lock would come first)."""
    from pos.engines import stopworld
    from pos.operation.engine import Save
    from pos.settings import Settings

    monkeypatch.setattr(stopworld.restorable, "tree", lambda pid: ([pid], [pid]))
    monkeypatch.setattr(stopworld.restorable, "require", lambda cuda, fix: {})
    monkeypatch.setattr(stopworld.criu_mod, "find", lambda settings: None)
    monkeypatch.setattr(stopworld.nvml, "gpus_of", lambda cuda: {"GPU-0": 90 * GIB})
    monkeypatch.setattr(stopworld.host, "in_memory", lambda path: True)
    monkeypatch.setattr(stopworld.host, "memory_available", lambda: 120 * GIB)
    monkeypatch.setattr(stopworld.cudackpt, "lock",
                        lambda *a: pytest.fail("the driver was asked to lock the job"))
    with pytest.raises(BadInput, match=r"180\.0 GiB, where the host has 120\.0 GiB"):
        stopworld.checkpoint(4242, tmp_path / "img", Save(), Settings())
