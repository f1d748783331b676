"""The names of an image's files (pos/image/names.py), as images on disk have them: what pos
wrote before keeps being found, and each name's rule reads back what it makes."""

from pathlib import Path

from pos.image import names


def test_the_names_on_disk() -> None:
    """Changing one of these makes pos blind to images it wrote before (docs/image-format.md)."""
    assert (names.MANIFEST, names.INVENTORY, names.STATS_DUMP) == \
        ("pos-manifest.json", "inventory.img", "stats-dump")
    assert (names.DUMP_LOG, names.RESTORE_LOG, names.PAGE_SERVER_LOG) == \
        ("criu-dump.log", "criu-restore.log", "criu-page-server.log")
    assert names.partial(Path("/i/2026")) == Path("/i/2026.partial")
    assert (names.index_name(), names.index_name(77)) == ("gpu-index.json", "gpu-index-77.json")
    assert names.data_name(names.data_prefix(), 3) == "gpu-data-03.bin"
    assert names.data_name(names.data_prefix(77), 12) == "gpu-data-77-12.bin"


def test_each_rule_reads_back_what_it_makes() -> None:
    assert names.rank_of(names.index_name(4242)) == 4242
    for other in (names.INDEX, "gpu-index-.json", "gpu-index-12a.json", "gpu-index-12.json.tmp",
                  names.MANIFEST):
        assert names.rank_of(other) is None
    for prefix in (names.data_prefix(), names.data_prefix(9)):
        assert names.is_gpu_data(names.data_name(prefix, 0))
    assert not any(names.is_gpu_data(n) for n in (names.INDEX, names.index_name(9),
                                                  "pages-1.img", names.MANIFEST))
    assert all(names.checked_as_read(n) for n in (names.data_name(names.data_prefix(), 0),
                                                  names.own_memory_part(9, 0),
                                                  names.own_memory_part(None, 3)))
    assert not any(names.checked_as_read(n) for n in (names.own_memory(9)[0], names.INDEX,
                                                      "pages-1.img", names.MANIFEST))
    assert names.is_partial(names.partial(Path("img")).name) and not names.is_partial("img")
