"""The chunk checksum (pos/image/checksum.py): the numba hash against a plain-Python statement
of it, and the hash of pieces taken as read against checksum() of the whole chunk."""

import numpy as np
import pytest

from pos.image.checksum import GROUP, absorb, checksum, finish, start

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


@pytest.mark.parametrize("n", [0, 1, 7, 8, 31, 32, 33, 100, 257, 4096 + 13])
def test_checksum_is_the_specified_hash(n: int) -> None:
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert checksum(data) == reference(data.tobytes())


@pytest.mark.parametrize("n,piece", [(0, 64), (5, 64), (64, 64), (1000, 64), (4096 + 13, 96),
                                     (10_000, 4096), (10_007, 32)])
def test_lanes_run_over_pieces_then_finished_equal_the_whole(n: int, piece: int) -> None:
    """What a reader does: the lanes over each piece's whole groups as it comes, then finish."""
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    lanes = start(n)
    whole = n // GROUP * GROUP
    for off in range(0, whole, piece):
        absorb(data[off:min(off + piece, whole)].view(np.uint64), lanes)
    assert finish(lanes, data) == checksum(data)
