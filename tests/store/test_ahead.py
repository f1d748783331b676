"""The store opened ahead by a helper process: the restore's record, and nothing recorded for a
restore that did not end."""

import json
from pathlib import Path

import pytest

from pos.errors import PosError
from pos.store import images
from pos.store.ahead import Ahead


MANIFEST = json.dumps({"pid": 42, "comm": "app", "cmdline": "app", "gpu_pids": [],
                       "created_at": "2026-11-28T23:00:00+00:00"})


def _restored_at(db: str, path: str):
    return {i.path: i.restored_at for i in images.list_images(db)}[path]


def test_the_helper_marks_the_image_restored(tmp_path: Path) -> None:
    db, path = str(tmp_path / "pos.db"), str(tmp_path / "img")
    images.record(db, path, MANIFEST)
    with Ahead(db) as ahead:
        ahead.restored(path)
    assert ahead.proc.wait() == 0           # it answered, then ended on its own
    assert _restored_at(db, path) is not None


def test_a_restore_that_did_not_end_records_nothing(tmp_path: Path) -> None:
    db, path = str(tmp_path / "pos.db"), str(tmp_path / "img")
    images.record(db, path, MANIFEST)
    with pytest.raises(RuntimeError):
        with Ahead(db) as ahead:
            raise RuntimeError("the restore failed")
    assert ahead.proc.returncode == 0       # told there is nothing to record, it ended
    assert _restored_at(db, path) is None


def test_the_helpers_failure_is_pos_own_sentence(tmp_path: Path) -> None:
    db = tmp_path / "pos.db"
    db.write_bytes(b"not SQLite " * 200)     # refused by the helper as by pos's own process
    with pytest.raises(PosError) as here:
        images.mark_restored(str(db), str(tmp_path / "img"))
    with Ahead(str(db)) as ahead, pytest.raises(PosError) as helper:
        ahead.restored(str(tmp_path / "img"))
    assert helper.value.message == here.value.message
    assert helper.value.exit_code == here.value.exit_code == 2
