"""Image checksums (pos/image/__init__.py, filehash.py): a digest per chunk, computed by a
thread pool, and verification that names the bad file (and its bytes) for a flipped byte, a
truncated file, an extra or missing file, and refuses a manifest format it does not read. No
CRIU needed: the images here are folders of plain files sealed by the same writer as every
image. Each hash's own cases, and images of format 2: tests/image/test_filehash.py."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from pos.errors import BadInput
from pos import image
from pos.image import filehash, names
from pos.image.checksum import fold
from tests.image.conftest import make_image

DATA = names.data_name(names.data_prefix(), 0)     # a GPU data file


def fold_of(data: bytes, seed: int) -> int:
    return fold(np.frombuffer(data, np.uint8), seed)


def test_manifest_records_chunk_digests_and_their_digest(tmp_path: Path, small_chunks: int):
    """fold64: each chunk's fold seeded with its index and length, the file's the fold of the
    chunk digests (8 bytes each, as their hex reads) seeded with its size."""
    size = 5 * small_chunks + 123
    img = make_image(tmp_path, {"pages-1.img": size, "core-1.img": 10, "empty.img": 0})
    m = image.verify(img)
    assert m.format == image.FORMAT == 3 and m.chunk_bytes == small_chunks
    data = (img / "pages-1.img").read_bytes()
    want = [fold_of(data[at:at + small_chunks], i << 40 | len(data[at:at + small_chunks]))
            for i, at in enumerate(range(0, size, small_chunks))]
    rec = m.files["pages-1.img"]
    assert rec["size"] == size and rec["hash"] == "fold64" and "sha256" not in rec
    assert rec["chunks"] == [f"{d:016x}" for d in want]
    assert rec["digest"] == f"{fold_of(b''.join(d.to_bytes(8, 'big') for d in want), size):016x}"
    assert m.files["empty.img"]["chunks"] == [f"{fold_of(b'', 0):016x}"]
    assert m.hashes() == ["fold64"]
    assert json.loads((img / names.MANIFEST).read_text())["chunk_bytes"] == small_chunks
    assert {p.stat().st_mode & 0o777 for p in img.iterdir()} == {0o600}


def test_a_flipped_byte_in_the_middle_of_a_big_file_names_its_chunk(tmp_path: Path) -> None:
    """At the real chunk size: a 3-chunk file, one byte flipped inside the second chunk."""
    chunk = image.CHUNK_BYTES
    img = make_image(tmp_path, {"pages-1.img": 2 * chunk + 4096, "core-1.img": 100})
    pages = img / "pages-1.img"
    at = chunk + chunk // 2
    with open(pages, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(BadInput) as e:
        image.verify(img)
    assert e.value.message == (f"image {img} is corrupt: bytes {chunk}-{2 * chunk - 1} of "
                               "pages-1.img do not match their checksum in the manifest: take a "
                               "new checkpoint.")


def test_the_last_short_chunk_is_named_with_its_real_end(tmp_path: Path, small_chunks: int):
    size = 3 * small_chunks + 10
    img = make_image(tmp_path, {"pages-1.img": size})
    with open(img / "pages-1.img", "r+b") as f:
        f.seek(size - 1)
        last = f.read(1)
        f.seek(size - 1)
        f.write(bytes([last[0] ^ 0x80]))
    with pytest.raises(BadInput, match=rf"bytes {3 * small_chunks}-{size - 1} of pages-1.img "):
        image.verify(img)


def test_a_truncated_file_is_named_with_both_sizes(tmp_path: Path, small_chunks: int) -> None:
    size = 4 * small_chunks
    img = make_image(tmp_path, {"pages-1.img": size, "core-1.img": 10})
    os.truncate(img / "pages-1.img", size - 1)
    with pytest.raises(BadInput) as e:
        image.verify(img)
    assert e.value.message == (f"image {img} is corrupt: pages-1.img has {size - 1} bytes, the "
                               f"manifest says {size}: take a new checkpoint.")


def test_an_extra_file_and_a_missing_file_are_refused(tmp_path: Path, small_chunks: int):
    img = make_image(tmp_path, {"pages-1.img": small_chunks, "core-1.img": 10})
    (img / "extra.bin").write_bytes(b"x")
    with pytest.raises(BadInput) as e:
        image.verify(img)
    assert e.value.message == (f"image {img} holds extra.bin, which its manifest does not list: "
                               "remove what was added, or take a new checkpoint.")
    (img / "extra.bin").unlink()
    image.verify(img)
    (img / "core-1.img").unlink()
    with pytest.raises(BadInput, match=r"is incomplete: core-1.img is missing"):
        image.verify(img)


def test_a_manifest_of_another_format_is_refused_in_one_sentence(tmp_path: Path) -> None:
    img = make_image(tmp_path, {"core-1.img": 10})
    for fmt in (1, 99):
        d = json.loads((img / names.MANIFEST).read_text())
        d["format"] = fmt
        (img / names.MANIFEST).write_text(json.dumps(d))
        with pytest.raises(BadInput) as e:
            image.verify(img)
        assert e.value.message == (f"{img} is an image of format {fmt}, this pos reads 2 and "
                                   "3: restore it with the pos version that wrote it.")


@pytest.mark.parametrize("edit", [
    lambda d: d.update(chunk_bytes=0),
    lambda d: d["files"]["core-1.img"].pop("chunks"),
    lambda d: d["files"]["core-1.img"]["chunks"].append("00"),
    lambda d: d["files"].update({"core-1.img": "x"}),
    lambda d: d["files"]["core-1.img"].update(hash="md5"),
    lambda d: d["files"]["core-1.img"].pop("digest"),
    lambda d: d["files"]["core-1.img"].pop("hash"),      # format 2's form, with no sha256
])
def test_a_malformed_manifest_is_refused_in_one_sentence(tmp_path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    img = make_image(tmp_path, {"core-1.img": 10})
    d = json.loads((img / names.MANIFEST).read_text())
    edit(d)
    (img / names.MANIFEST).write_text(json.dumps(d))
    with pytest.raises(BadInput) as e:
        image.verify(img)
    assert e.value.message == (f"{img / names.MANIFEST} is not a valid pos manifest (its file "
                               "list is malformed): the image is corrupt: take a new checkpoint.")


def test_hashing_uses_one_worker_per_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert filehash.workers() == 16
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert filehash.workers() == 1


def received(tmp_path: Path, small_chunks: int) -> tuple[Path, image.Manifest]:
    """A sealed image's files copied into a new DIR.partial, as `pos migrate --listen` gets
    them, and the sender's manifest."""
    sent = make_image(tmp_path, {"pages-1.img": 3 * small_chunks + 5, DATA: 77})
    partial = image.prepare(tmp_path / "in", 0)
    for name in ("pages-1.img", DATA):
        (partial / name).write_bytes((sent / name).read_bytes())
    return partial, image.load(sent)


def test_an_image_received_whole_keeps_its_senders_checksums(tmp_path: Path,
                                                             small_chunks: int) -> None:
    """Sealed without hashing again: the sender's manifest as it was, files root-only, and
    `verify` (what `pos inspect --verify` runs) holds over every byte."""
    partial, sent = received(tmp_path, small_chunks)
    final = image.adopt(partial, sent)
    assert final == tmp_path / "in" and not partial.exists()
    assert image.load(final).files == sent.files
    assert all((final / n).stat().st_mode & 0o777 == 0o600 for n in sent.files)
    image.verify(final)


@pytest.mark.parametrize("damage, says", [("truncate", "has 70 bytes, the manifest says 77"),
                                          ("remove", f"{DATA} is missing"),
                                          ("add", "holds extra.bin, which its manifest")])
def test_an_image_received_short_is_refused_before_it_is_sealed(tmp_path: Path,
                                                                small_chunks: int, damage: str,
                                                                says: str) -> None:
    partial, sent = received(tmp_path, small_chunks)
    data = partial / DATA
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[:70])
    elif damage == "remove":
        data.unlink()
    else:
        (partial / "extra.bin").write_bytes(b"x")
    with pytest.raises(BadInput, match=says):
        image.adopt(partial, sent)
    assert partial.exists() and not (tmp_path / "in").exists()


def test_a_manifest_rewrite_cut_short_leaves_the_image_whole(tmp_path: Path) -> None:
    """A pos killed while it rewrote a sealed image's manifest (the checkpoint's own timings)
    leaves the rewrite's temporary beside it: the image is still whole, and still verifies;
    anything else that was not sealed is still refused."""
    final = make_image(tmp_path, {"a.img": 1000})
    (final / names.MANIFEST_TMP).write_text('{"partly": ')
    image.verify(final)
    (final / "b.img").write_bytes(b"x")
    with pytest.raises(BadInput, match="holds b.img"):
        image.verify(final)
