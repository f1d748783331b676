"""Retention: keep N newest, max age, max bytes; complete images only, never a .partial."""

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from pos.errors import BadInput
from pos import image
from pos.cron import retention
from pos.image import Manifest
from pos.cron.retention import Policy
from pos.operation import oplock
from pos.image import names

NOW = datetime(2025, 3, 2, 12, 0, 0, tzinfo=timezone.utc)


def make_image(folder: Path, age_min: int, size: int) -> Path:
    """A complete image (manifest only) taken `age_min` minutes before NOW."""
    created = NOW - timedelta(minutes=age_min)
    d = folder / created.strftime("%Y%m%dT%H%M%SZ")
    d.mkdir(parents=True)
    m = Manifest(pid=1, pids=[1], gpu_pids=[], comm="c", cmdline="c",
                 created_at=created.isoformat(timespec="seconds"), host="h", kernel="k",
                 criu_version="4", criu_options={}, leave_running=True, size_bytes=size)
    image.write_manifest(d, m)
    return d


@pytest.fixture
def five(tmp_path: Path) -> list[Path]:
    """Images 50, 40, 30, 20, 10 minutes old, 100 bytes each (oldest first)."""
    return [make_image(tmp_path, age, 100) for age in (50, 40, 30, 20, 10)]


def owned(folder: Path) -> set[str]:
    """Every image under `folder`, as the store would record them for their schedule."""
    return {str(p) for p in folder.iterdir()}


def named(kept: list[retention.Kept]) -> list[str]:
    return [k.path.name for k in kept]


def test_keep_newest(tmp_path: Path, five: list[Path]) -> None:
    gone = retention.prune(tmp_path, owned(tmp_path), Policy(keep=2), NOW)
    assert named(gone) == [p.name for p in five[:3]]
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for p in five[3:]]


def test_max_age(tmp_path: Path, five: list[Path]) -> None:
    gone = retention.prune(tmp_path, owned(tmp_path), Policy(max_age_s=25 * 60), NOW)
    assert named(gone) == [p.name for p in five[:3]]


def test_max_bytes_counts_from_the_newest(tmp_path: Path, five: list[Path]) -> None:
    gone = retention.prune(tmp_path, owned(tmp_path), Policy(max_bytes=250), NOW)
    assert named(gone) == [p.name for p in five[:3]]


def test_the_newest_image_is_always_kept(tmp_path: Path) -> None:
    only = make_image(tmp_path, 600, 10_000)
    assert retention.prune(tmp_path, owned(tmp_path), Policy(keep=1, max_age_s=60, max_bytes=1), NOW) == []
    assert only.is_dir()


def test_partials_and_foreign_folders_are_never_touched(tmp_path: Path, five) -> None:
    partial = names.partial(tmp_path / "20250101T000000Z")
    partial.mkdir()
    foreign = tmp_path / "notes"
    foreign.mkdir()
    retention.prune(tmp_path, owned(tmp_path), Policy(keep=1), NOW)
    assert partial.is_dir() and foreign.is_dir()
    assert len(retention.images_in(tmp_path)) == 1


def test_images_the_schedule_did_not_make_are_neither_counted_nor_deleted(
        tmp_path: Path, five: list[Path]) -> None:
    """Images of the folder that the store does not record as the schedule's (left by a removed
    schedule, or put there by hand) stay, and do not count against its retention."""
    mine = {str(p) for p in five[3:]}
    assert named(retention.prune(tmp_path, mine, Policy(keep=1), NOW)) == [five[3].name]
    assert all(p.is_dir() for p in five[:3]) and five[4].is_dir() and not five[3].exists()
    assert retention.prune(tmp_path, set(), Policy(keep=1), NOW) == []


def test_an_image_a_restore_reads_is_kept_until_it_has_read_it(tmp_path: Path,
                                                                five: list[Path]) -> None:
    """A restore reads its image until its fill ends, after `pos restore` returned (the
    restore service's): the prune leaves it, and the next one takes it."""
    with oplock.reading(five[0]):
        gone = retention.prune(tmp_path, owned(tmp_path), Policy(keep=2), NOW)
        assert named(gone) == [p.name for p in five[1:3]]
        assert five[0].is_dir() and not five[1].exists()
    assert named(retention.prune(tmp_path, owned(tmp_path), Policy(keep=2), NOW)) == [five[0].name]


def test_dry_run_deletes_nothing(tmp_path: Path, five: list[Path]) -> None:
    assert len(retention.prune(tmp_path, owned(tmp_path), Policy(keep=1), NOW, dry_run=True)) == 4
    assert all(p.is_dir() for p in five)


@pytest.mark.parametrize("text,seconds", [("90", 90), ("90s", 90), ("30m", 1800),
                                          ("12h", 43200), ("7d", 604800), ("1.5h", 5400)])
def test_durations(text: str, seconds: float) -> None:
    assert retention.parse_duration(text) == seconds


@pytest.mark.parametrize("text,n", [("4096", 4096), ("500M", 500 << 20), ("2G", 2 << 30),
                                    ("1TiB", 1 << 40), ("1.5k", 1536)])
def test_sizes(text: str, n: int) -> None:
    assert retention.parse_bytes(text) == n


@pytest.mark.parametrize("fn,text", [(retention.parse_duration, "soon"),
                                     (retention.parse_duration, "0d"),
                                     (retention.parse_bytes, "lots"),
                                     (retention.parse_bytes, "-5G")])
def test_bad_values_are_one_sentence(fn, text: str) -> None:
    with pytest.raises(BadInput, match=f"'{text}' is not a"):
        fn(text)
