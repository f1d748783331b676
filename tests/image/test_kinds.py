"""What kind of image a directory holds (pos/image/kinds.py), from its files alone, and which of
its files a restore checks before it runs the job."""

from pathlib import Path

import pytest

from pos.image import kinds, names
from pos.image.kinds import ImageKind
from pos.image.opened import open_image
from tests.image.test_seal import make_image

CRIU = ["pages-1.img", "core-7.img", names.INVENTORY, names.STATS_DUMP, names.DUMP_LOG]


@pytest.mark.parametrize("files,kind", [
    (CRIU, ImageKind.STOP_THE_WORLD),
    (CRIU + [names.INDEX, names.data_name(names.data_prefix(), 0)], ImageKind.CONCURRENT),
    (CRIU + [names.index_name(7), names.index_name(8)], ImageKind.CONCURRENT),
    ([names.INDEX, names.data_name(names.data_prefix(), 0)], ImageKind.GPU_ONLY),
    # a whole-process image that lost its inventory: the stop-the-world path's checks say so
    ([names.index_name(7), "pages-1.img"], ImageKind.STOP_THE_WORLD),
    ([], ImageKind.STOP_THE_WORLD),
])
def test_the_kind_comes_from_the_files(tmp_path: Path, files: list[str], kind: ImageKind) -> None:
    for name in files:
        (tmp_path / name).write_text("")
    assert kinds.kind(tmp_path) is kind


def test_a_missing_directory_is_taken_for_stop_the_world(tmp_path: Path) -> None:
    assert kinds.kind(tmp_path / "nothing") is ImageKind.STOP_THE_WORLD


def test_a_restore_checks_every_file_but_the_device_memory(tmp_path: Path) -> None:
    """The GPU data and the data parts of the job's own memory are checked chunk by chunk as
    the restore reads them; their indexes, as the rest, before the job runs."""
    data = [names.data_name(names.data_prefix(), 0), names.data_name(names.data_prefix(7), 1),
            names.own_memory(7)[1], names.own_memory_part(7, 1), names.own_memory_part(None, 2)]
    first = CRIU + [names.INDEX, names.index_name(7), names.own_memory(7)[0]]
    img = make_image(tmp_path, {n: 10 for n in first + data})
    assert sorted(open_image(img).checked_by_restore) == sorted(first)
