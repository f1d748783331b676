"""pos/concurrent/ownmem.py: its setting, an image whose own-memory files do not agree, and the
copy a take makes, against the fake driver. The whole cycle runs in
tests/agent/test_own_fake.py and tests/agent/test_peer_checkpoint_fake.py."""

import json
import os
from pathlib import Path

import pytest

from pos.agent.control import Agent
from pos.concurrent import gpucopy, ownmem
from pos.errors import BadInput
from pos.image import names
from pos.settings import Settings
from tests.agent.test_peer_fake import SEVEN


@pytest.mark.parametrize("value, taken", [(None, 4 << 30), ("0", 0), ("8", 8 << 30),
                                          ("0.5", 1 << 29)])
def test_the_setting_bounds_what_is_taken(value, taken) -> None:
    env = {} if value is None else {"POS_OWN_MEMORY_MAX_GIB": value}
    assert Settings.from_env(env).own_memory_max_bytes == taken


@pytest.mark.parametrize("value", ["-1", "lots", "inf"])
def test_a_bad_setting_is_refused_in_one_sentence(value) -> None:
    with pytest.raises(BadInput, match="POS_OWN_MEMORY_MAX_GIB"):
        Settings.from_env({"POS_OWN_MEMORY_MAX_GIB": value})


def test_an_image_without_own_memory_lists_none(tmp_path: Path) -> None:
    assert ownmem.saved(tmp_path, 7) == []


def test_own_memory_whose_bytes_do_not_match_its_index_is_refused(tmp_path: Path) -> None:
    index, data = names.own_memory(7)
    (tmp_path / index).write_text(json.dumps([{"va": 1 << 40, "size": 2 << 20, "device": 0}]))
    (tmp_path / data).write_bytes(b"\0" * (1 << 20))
    with pytest.raises(BadInput, match="does not hold what"):
        ownmem.saved(tmp_path, 7)
    (tmp_path / data).unlink()
    with pytest.raises(BadInput, match="does not hold what"):
        ownmem.saved(tmp_path, 7)
    (tmp_path / index).write_text("[{")
    with pytest.raises(BadInput, match="is damaged"):
        ownmem.saved(tmp_path, 7)


@pytest.mark.parametrize("room", [True, False], ids=["device", "host"])
def test_the_image_gets_the_bytes_of_the_take_written_after_it(peer_job, drv, tmp_path: Path,
                                                              monkeypatch, room: bool) -> None:
    """The take copies the memory while the job is held (to the device where pos's shadow rule
    leaves room, else to host memory); the image is written later, once the job runs and writes
    its memory again: it gets the bytes of the take."""
    if not room:
        monkeypatch.setattr(gpucopy, "shadow_room", lambda _drv: 0)
    owner = peer_job("own")
    agent = Agent(owner.pid)
    agent.cut(5)
    taken = ownmem.take(agent, drv, 0)
    try:
        assert (taken.shadow is not None, taken.host is not None) == (room, not room)
        agent.stamp(taken.regions[0].va, os.urandom(16))     # the job writes after the take
        taken.write(drv, tmp_path, 7)
        agent.unstamp()
        assert ownmem.saved(tmp_path, 7) == taken.regions
        data = (tmp_path / names.own_memory(7)[1]).read_bytes()
        assert len(data) == taken.bytes and data[:16] == SEVEN
        assert (taken.shadow, taken.host) == (None, None)      # pos's copy let go
    finally:
        taken.close()
        agent.end()
        agent.close()


@pytest.mark.parametrize("sizes", [(3 << 18, 1 << 19, 1 << 18), (3 << 18, 5 << 20, 1 << 18)],
                         ids=["each-below-a-piece", "one-of-several-pieces"])
def test_allocations_of_several_sizes_are_written_each_whole_in_order(drv, tmp_path: Path,
                                                                       monkeypatch, sizes) -> None:
    """NCCL's buffers come in several sizes, most below a piece: each is written whole, in the
    index's order, whether the take left its copy on the device or in host memory."""
    import ctypes as C

    monkeypatch.setattr(ownmem, "PIECE", 1 << 20)
    regions = [ownmem.Region((i + 1) << 40, n, 0) for i, n in enumerate(sizes)]
    want = os.urandom(sum(sizes))
    for where in ("device", "host"):
        taken = ownmem.Taken(regions, [])
        if where == "device":
            taken.shadow = gpucopy.Shadow(drv, len(want))
            drv.cuMemcpyHtoD_v2(taken.shadow.ptr, C.c_char_p(want), len(want))
        else:
            taken.host = bytearray(want)
        taken.write(drv, tmp_path, None)
        assert ownmem.saved(tmp_path, None) == regions
        assert (tmp_path / names.own_memory(None)[1]).read_bytes() == want, where
