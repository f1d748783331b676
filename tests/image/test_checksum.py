"""The chunk checksum (pos/image/checksum.py over chunks.c) against a plain-Python statement of
it, and the reader's hash of pieces taken as read against checksum() of the whole chunk."""

import numpy as np
import pytest

from pos.image import gpu as gpuimage
from pos.image.checksum import checksum, fold
from pos.image.gpuindex import ChunkRecord

M = (1 << 64) - 1
P1, P2 = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F


def words_hash(words: list[int], h: int) -> int:
    lanes = [h ^ (P2 * (j + 1) & M) for j in range(4)]
    n = len(words) // 4 * 4
    for i in range(0, n, 4):
        for j in range(4):
            x = (lanes[j] ^ words[i + j]) * P1 & M
            lanes[j] = x ^ (x >> 29)
    out = len(words) * P2 & M
    for lane in lanes:
        out = (out ^ lane) * P1 & M
    for w in words[n:]:
        out = (out ^ w) * P2 & M
        out ^= out >> 31
    return out


def reference(data: bytes) -> int:
    """The checksum as specified: the words hashed from the length, then the zero-padded tail."""
    n = len(data) // 8 * 8
    out = words_hash([int.from_bytes(data[i:i + 8], "little") for i in range(0, n, 8)], len(data))
    if len(data) % 8:
        out = words_hash([int.from_bytes(data[n:].ljust(8, b"\0"), "little")], out)
    return out


def reference_blocks(data: bytes) -> int:
    """The checksum of kind `blocks` as specified: each 4 KiB block's `reference`, folded in
    order into the length."""
    out = len(data)
    for at in range(0, len(data), 4096):
        out = (out ^ reference(data[at:at + 4096])) * P1 & M
        out ^= out >> 31
    return out


@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 3 * 4096 + 13, 1 << 16])
def test_the_blocks_checksum_is_the_specified_fold(n: int) -> None:
    """Kind `blocks`, on the CPU (how a restore checks what the GPU hashed at the checkpoint),
    and folded from the blocks' hashes (how a checkpoint takes the GPU's)."""
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    want = reference_blocks(data)
    assert gpuimage.blocks_points(np.frombuffer(data, np.uint8), gpuimage.NO_TARGETS)[0] == want
    hashes = np.array([reference(data[at:at + 4096]) for at in range(0, n, 4096)] or [0],
                      np.uint64)
    assert gpuimage.blocks_fold(hashes, n) == want


@pytest.mark.parametrize("n", [0, 1, 7, 8, 31, 32, 33, 100, 257, 4096 + 13])
def test_checksum_is_the_specified_hash(n: int) -> None:
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert checksum(data) == reference(data.tobytes())


def test_fold_continues_from_a_hash() -> None:
    data = np.random.default_rng(5).integers(0, 256, 1003, dtype=np.uint8)
    assert fold(data, 12345) != fold(data, 12346)
    assert fold(data, len(data)) == checksum(data) == reference(data.tobytes())


@pytest.mark.parametrize("n", [0, 5, 64, 1000, 4096 + 13, (1 << 20) + 7, 3 * (1 << 20) + 40])
def test_the_reader_hashing_piece_by_piece_equals_the_whole(tmp_path, monkeypatch, fds,
                                                             n: int) -> None:
    """What a restore does: read a chunk in pieces, hashing each as it comes; the same hash as
    checksum() of the whole (small pieces here, to cross many of them)."""
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    (tmp_path / "d.bin").write_bytes(b"x" * 7 + data.tobytes())
    chunk = ChunkRecord(offset=0, file="d.bin", at=7, stored=n, raw=n, hash=checksum(data),
                        zstd=False)
    blocks = ChunkRecord(offset=0, file="d.bin", at=7, stored=n, raw=n,
                         hash=reference_blocks(data.tobytes()), zstd=False, kind="blocks")
    for piece in (4096, 3 * 4096, 1 << 20):     # kind `blocks`: pieces of whole blocks
        monkeypatch.setattr(gpuimage, "PIECE", piece)
        out = np.zeros(n + 3, np.uint8)
        gpuimage.read_chunk_into(tmp_path, blocks, out, fds)
        assert (out[:n] == data).all()
    for piece in (32, 96, 1 << 20):
        monkeypatch.setattr(gpuimage, "PIECE", piece)
        out = np.zeros(n + 3, np.uint8)
        gpuimage.read_chunk_into(tmp_path, chunk, out, fds)
        assert (out[:n] == data).all()
