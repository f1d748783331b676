"""Each hash of an image's files (pos/image/filehash.py) against damage: fold64, which new
images are written with (format 3), and sha256, which images of format 2 carry and which is
still read as it was written. A flipped byte, a truncated file and a swapped chunk are refused
by either, in the same words; the chunk pieces folded one by one hash as the whole chunk."""

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from pos import image
from pos.errors import BadInput, PosError
from pos.image import filehash, names
from pos.image.checksum import Folding, checksum
from tests.image.conftest import MiB, make_image, manifest
from tests.image.damage import record_as_is

PAGES = "pages-1.img"


def as_format_2(img: Path) -> None:
    """Rewrite the image's manifest as pos wrote it before fold64: format 2, each file's sha256
    of every chunk and the sha256 of those digests (stated here with hashlib alone)."""
    path = img / names.MANIFEST
    d = json.loads(path.read_text())
    chunk = d["chunk_bytes"]
    for name, rec in d["files"].items():
        data = (img / name).read_bytes()
        digests = [hashlib.sha256(data[at:at + chunk]).digest()
                   for at in range(0, max(len(data), 1), chunk)]
        d["files"][name] = {"size": len(data), "chunks": [x.hex() for x in digests],
                            "sha256": hashlib.sha256(b"".join(digests)).hexdigest()}
    d["format"] = 2
    path.write_text(json.dumps(d))


@pytest.fixture(params=["fold64", "sha256"])
def img(request: pytest.FixtureRequest, tmp_path: Path, small_chunks: int) -> Path:
    """A sealed image of a 4.5-chunk file and a small one, by each hash (sha256: format 2)."""
    made = make_image(tmp_path, {PAGES: 4 * small_chunks + small_chunks // 2, "core-1.img": 10})
    if request.param == "sha256":
        as_format_2(made)
    assert image.verify(made).hashes() == [request.param]
    return made


def refused(img: Path) -> str:
    with pytest.raises(BadInput) as e:
        image.verify(img)
    return e.value.message


def bytes_refused(img: Path, first: int, last: int) -> str:
    return (f"image {img} is corrupt: bytes {first}-{last} of {PAGES} do not match their "
            "checksum in the manifest: take a new checkpoint.")


def file_refused(img: Path) -> str:
    return (f"image {img} is corrupt: the checksum of {PAGES} does not match its manifest: "
            "take a new checkpoint.")


def swap_chunks(path: Path, chunk: int, a: int, b: int) -> None:
    data = bytearray(path.read_bytes())
    one, two = data[a * chunk:(a + 1) * chunk], data[b * chunk:(b + 1) * chunk]
    data[a * chunk:(a + 1) * chunk], data[b * chunk:(b + 1) * chunk] = two, one
    path.write_bytes(bytes(data))


def test_an_image_of_format_2_verifies_by_sha256(tmp_path: Path, small_chunks: int) -> None:
    img = make_image(tmp_path, {PAGES: 3 * small_chunks + 7, "core-1.img": 10, "empty.img": 0})
    as_format_2(img)
    m = image.verify(img)
    assert m.format == 2 and m.hashes() == ["sha256"] and "hash" not in m.files[PAGES]


def test_a_new_image_names_fold64_in_every_entry(tmp_path: Path) -> None:
    img = make_image(tmp_path, {PAGES: 100, "core-1.img": 10})
    d = json.loads((img / names.MANIFEST).read_text())
    assert d["format"] == 3
    assert {r["hash"] for r in d["files"].values()} == {"fold64"}
    assert all(len(r["digest"]) == 16 and "sha256" not in r for r in d["files"].values())


def test_a_flipped_byte_names_its_chunk(img: Path, small_chunks: int) -> None:
    at = 2 * small_chunks + 12345
    with open(img / PAGES, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))
    assert refused(img) == bytes_refused(img, 2 * small_chunks, 3 * small_chunks - 1)


def test_a_truncated_file_is_refused_by_its_size(img: Path, small_chunks: int) -> None:
    size = (img / PAGES).stat().st_size
    os.truncate(img / PAGES, 3 * small_chunks)
    assert refused(img) == (f"image {img} is corrupt: {PAGES} has {3 * small_chunks} bytes, the "
                            f"manifest says {size}: take a new checkpoint.")


def test_a_truncated_file_whose_size_was_edited_names_its_last_chunk(img: Path,
                                                                      small_chunks: int):
    """The manifest made to agree on the size: the checksum of the cut chunk refuses it."""
    os.truncate(img / PAGES, 3 * small_chunks + 50)
    record_as_is(img, PAGES, sizes_only=True)
    assert refused(img) == bytes_refused(img, 3 * small_chunks, 3 * small_chunks + 49)


def test_a_file_cut_at_a_chunk_whose_size_was_edited_fails_its_digest(img: Path,
                                                                       small_chunks: int):
    """Every chunk left is whole and matches: the file's digest, made of all of them, fails."""
    os.truncate(img / PAGES, 3 * small_chunks)
    record_as_is(img, PAGES, sizes_only=True)
    assert refused(img) == file_refused(img)


def test_a_file_cut_by_a_zero_byte_whose_size_was_edited_is_refused(img: Path,
                                                                     small_chunks: int):
    """The fold pads a tail of 1-7 bytes with zeros: without the chunk's length in its seed, a
    last chunk cut by a zero byte of its tail would hash as before."""
    size = (img / PAGES).stat().st_size - 5                  # 3 bytes past a whole word
    os.truncate(img / PAGES, size)
    with open(img / PAGES, "r+b") as f:
        f.seek(size - 1)
        f.write(b"\0")
    record_as_is(img, PAGES)
    image.verify(img)
    os.truncate(img / PAGES, size - 1)
    record_as_is(img, PAGES, sizes_only=True)
    assert refused(img) == bytes_refused(img, 4 * small_chunks, size - 2)


def test_a_swapped_chunk_is_named(img: Path, small_chunks: int) -> None:
    swap_chunks(img / PAGES, small_chunks, 1, 2)
    assert refused(img) == bytes_refused(img, small_chunks, 2 * small_chunks - 1)


def test_swapped_chunks_are_refused_with_their_digests_swapped_too(img: Path,
                                                                    small_chunks: int):
    """fold64 binds each digest to its chunk's place (the index in its seed): the chunk
    itself fails; sha256's chunk digests match anywhere, the file's digest fails."""
    swap_chunks(img / PAGES, small_chunks, 1, 2)
    path = img / names.MANIFEST
    d = json.loads(path.read_text())
    chunks = d["files"][PAGES]["chunks"]
    chunks[1], chunks[2] = chunks[2], chunks[1]
    path.write_text(json.dumps(d))
    if image.load(img).hashes() == ["fold64"]:
        assert refused(img) == bytes_refused(img, small_chunks, 2 * small_chunks - 1)
    else:
        assert refused(img) == file_refused(img)


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 96, 4096 + 13, (1 << 20) + 7])
def test_a_chunk_folded_piece_by_piece_hashes_as_the_whole(n: int) -> None:
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    for piece in (32, 96, 4096):
        f = Folding(n)
        at = 0
        while n - at > piece:
            f.add(data[at:at + piece])
            at += piece
        assert f.close(data[at:]) == checksum(data), (n, piece)


def test_a_piece_inside_a_group_must_be_the_last() -> None:
    f = Folding(0)
    f.add(np.zeros(40, np.uint8))
    with pytest.raises(ValueError):
        f.add(np.zeros(32, np.uint8))


@pytest.mark.parametrize("size", [0, 7, 3 * MiB, 4 * MiB + (1 << 17) + 5])
def test_a_file_hashed_as_written_seals_as_one_read_back(tmp_path: Path, small_chunks: int,
                                                       size: int) -> None:
    """Bytes folded in as they are written, in pieces that cross the chunks' edges, make the
    entry that reading the file back makes; the seal keeps it and reads the file no more."""
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    written = filehash.Written(size, small_chunks)
    for at in range(0, size, 96 << 10):
        written.add(data[at:at + (96 << 10)])
    partial = image.prepare(tmp_path / "img", 0)
    (partial / PAGES).write_bytes(data.tobytes())
    (partial / "core-1.img").write_bytes(b"x" * 10)
    read_back = filehash.checksums(partial, [PAGES], small_chunks)[PAGES]
    assert written.record() == read_back
    img = image.seal(partial, manifest(), written={PAGES: written})
    assert image.verify(img).files[PAGES] == read_back


def test_a_file_shorter_than_what_was_hashed_as_written_is_refused(tmp_path: Path,
                                                                 small_chunks: int) -> None:
    written = filehash.Written(2 * MiB, small_chunks)
    written.add(np.zeros(2 * MiB, np.uint8))
    partial = image.prepare(tmp_path / "img", 0)
    (partial / PAGES).write_bytes(bytes(MiB))
    with pytest.raises(PosError, match="does not hold the 2097152 bytes written into it"):
        image.seal(partial, manifest(), written={PAGES: written})
    with pytest.raises(ValueError):
        written.add(np.zeros(32, np.uint8))          # more than it announced


def test_a_chunk_read_and_checked_as_it_comes_fails_on_a_flipped_byte(img: Path,
                                                                     small_chunks: int) -> None:
    m = image.verify(img)
    sums = image.sums(img, m, PAGES)
    into = np.empty(small_chunks, np.uint8)
    fd = os.open(img / PAGES, os.O_RDONLY)
    try:
        assert sums.read(2, fd, into)
        assert into.tobytes() == (img / PAGES).read_bytes()[2 * MiB:3 * MiB]
        assert sums.read(4, fd, into)                   # the half chunk at the end
        with open(img / PAGES, "r+b") as f:
            f.seek(2 * MiB + 12345)
            flipped = bytes([f.read(1)[0] ^ 0xFF])
            f.seek(2 * MiB + 12345)
            f.write(flipped)
        assert not sums.read(2, fd, into)
        os.truncate(img / PAGES, 4 * MiB + 10)
        assert not sums.read(4, fd, into)               # cut short
    finally:
        os.close(fd)
