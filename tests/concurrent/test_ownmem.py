"""pos/concurrent/ownmem.py apart from a job: its setting, and an image whose own-memory files
do not agree. The taking itself runs against the fake driver in
tests/agent/test_own_fake.py and tests/agent/test_peer_checkpoint_fake.py."""

import json
from pathlib import Path

import pytest

from pos.concurrent import ownmem
from pos.errors import BadInput
from pos.image import names
from pos.settings import Settings


@pytest.mark.parametrize("value, taken", [(None, 0), ("0", 0), ("4", 4 << 30),
                                          ("0.5", 1 << 29)])
def test_the_setting_bounds_what_is_taken_and_is_off_by_default(value, taken) -> None:
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
