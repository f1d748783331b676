"""The image's chunk writer and reader on the CPU alone: chunks that complete out of order, on
several writer threads, land where they belong; a corrupt chunk is refused."""

import ctypes as C
import os
import random
import signal
import threading
from pathlib import Path

import numpy as np
import pytest

from pos.errors import BadInput
from pos.image import gpu as gpuimage
from pos.image import names

CHUNK = 1 << 16


@pytest.mark.parametrize("compress", [False, True])
def test_chunks_written_out_of_order_by_several_threads_read_back_in_place(
        tmp_path: Path, compress: bool, fds: dict[str, int]) -> None:
    rng = np.random.default_rng(3)
    buffers = {0x7000_0000: rng.integers(0, 256, 5 * CHUNK + 123, np.uint8),
               0x7100_0000: rng.integers(0, 256, 3 * CHUNK, np.uint8)}
    work = [(base, off) for base, data in buffers.items()
            for off in range(0, len(data), CHUNK)]
    random.Random(5).shuffle(work)                       # completion order: any
    w = gpuimage.Writer(tmp_path, compress)
    lanes = [work[i::3] for i in range(3)]

    def writer(items: list[tuple[int, int]]) -> None:
        for base, off in items:
            staging = buffers[base][off:off + CHUNK].copy()   # what a staging buffer holds
            w.put(base, off, staging)

    threads = [threading.Thread(target=writer, args=(lane,)) for lane in lanes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.close()
    assert len(list(tmp_path.glob(names.data_prefix() + "*"))) == 3
    for base, data in buffers.items():
        chunks = w.chunks_of(base)
        assert [c.offset for c in chunks] == list(range(0, len(data), CHUNK))
        back = np.zeros(len(data), np.uint8)
        for c in chunks:
            out = np.empty(CHUNK, np.uint8)
            gpuimage.read_chunk_into(tmp_path, c, out, fds)
            back[c.offset:c.offset + c.raw] = out[:c.raw]
        assert (back == data).all()
    # a flipped byte in a data file is caught by the chunk's checksum
    c = w.chunks_of(0x7100_0000)[0]
    path = tmp_path / c.file
    raw = bytearray(path.read_bytes())
    raw[c.at + 7] ^= 0xFF
    path.write_bytes(bytes(raw))
    expected = Exception if compress else BadInput     # zstd may refuse the frame itself
    with pytest.raises(expected):
        gpuimage.read_chunk_into(tmp_path, c, np.empty(CHUNK, np.uint8), fds)
    if not compress:
        with pytest.raises(BadInput, match="does not match its checksum"):
            gpuimage.read_chunk_into(tmp_path, c, np.empty(CHUNK, np.uint8), fds)


def test_a_chunk_read_in_pieces_by_compiled_code_is_exact_and_checked(
        tmp_path: Path, monkeypatch, fds: dict[str, int]) -> None:
    """Pieces smaller than the chunk, a tail short of a hash group: the bytes and the checksum
    come out as when read whole; a file cut short is refused in one sentence."""
    monkeypatch.setattr(gpuimage, "PIECE", 4096)
    data = np.random.default_rng(9).integers(0, 256, 3 * 4096 + 77, np.uint8)
    w = gpuimage.Writer(tmp_path, False)
    w.put(0x7000_0000, 0, data)
    w.close()
    chunk, = w.chunks_of(0x7000_0000)
    out = np.zeros(len(data), np.uint8)
    gpuimage.read_chunk_into(tmp_path, chunk, out, fds)
    assert (out == data).all()
    path = tmp_path / chunk.file
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(BadInput, match="is truncated"):
        gpuimage.read_chunk_into(tmp_path, chunk, out, fds)


@pytest.mark.parametrize("compress", [False, True])
def test_a_chunk_read_says_which_buffers_its_words_point_into(tmp_path: Path, monkeypatch,
                                                              compress: bool,
                                                              fds: dict[str, int]) -> None:
    """Addresses inside buffers 0 and 2 (their start, an interior one, in different pieces),
    one just past the end of buffer 1, small numbers and floats: buffers 0 and 2 are named."""
    monkeypatch.setattr(gpuimage, "PIECE", 4096)
    targets = gpuimage.Targets([(0x7F00_0000_0000, 0x7F00_0020_0000),
                                (0x7F00_0040_0000, 0x7F00_0060_0000),
                                (0x7F00_0080_0000, 0x7F00_00A0_0000)])
    words = np.random.default_rng(2).random(3 * 512 + 3).astype(np.float32).view(np.uint32)
    data = np.zeros(3 * 4096 + 5, np.uint8)
    data[:len(words) * 4] = words.view(np.uint8)
    body = data[:3 * 4096].view(np.uint64)
    body[10] = 0x7F00_0000_0000             # buffer 0, its start
    body[700] = 0x7F00_0060_0000            # just past buffer 1
    body[1100] = 0x7F00_0091_2345           # inside buffer 2, in the third piece
    body[5] = 42
    w = gpuimage.Writer(tmp_path, compress)
    w.put(0x7000_0000, 0, data)
    w.close()
    chunk, = w.chunks_of(0x7000_0000)
    out = np.zeros(len(data), np.uint8)
    assert list(gpuimage.read_chunk_into(tmp_path, chunk, out, fds, targets)) == [0, 2]
    assert (out == data).all()
    assert list(gpuimage.read_chunk_into(tmp_path, chunk, out, fds)) == []   # no targets given


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("n", [8, 100, 4096 * 3 + 40, (1 << 16) + 13])
def test_a_chunk_saved_in_one_pass_is_hashed_and_scanned_as_checksum_points_says(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compress: bool, n: int,
        fds: dict[str, int]) -> None:
    """put_scanned (each piece hashed, scanned and written in turn) records the checksum and
    marks the targets that checksum_points gives for the whole chunk, whatever its length
    against the pieces and the hash's groups; the chunk reads back exact, after another."""
    monkeypatch.setattr(gpuimage, "PIECE", 4096)
    targets = gpuimage.Targets([(0x7F00_0000_0000, 0x7F00_0020_0000),
                                (0x7F00_0040_0000, 0x7F00_0060_0000),
                                (0x7F00_0080_0000, 0x7F00_00A0_0000)])
    data = np.random.default_rng(n).integers(0, 256, n, np.uint8)
    words = data[:n // 8 * 8].view(np.uint64)
    if len(words) > 2:
        words[-1] = 0x7F00_0091_2345                  # buffer 2, in the last piece
        words[1] = 0x7F00_0000_0000                   # buffer 0, its start
    want_h, want_hits = gpuimage.checksum_points(data, targets)
    w = gpuimage.Writer(tmp_path, compress)
    w.put(0x7000_0000, 0, data[::-1].copy())          # the file holds another chunk first
    hits = w.put_scanned(0x7000_0000, n, data, targets)
    w.close()
    assert list(hits) == list(want_hits)
    assert list(hits.nonzero()[0]) == ([0, 2] if len(words) > 2 else [])
    chunk = w.chunks_of(0x7000_0000)[1]
    assert (chunk.offset, chunk.raw, chunk.hash) == (n, n, want_h)
    out = np.zeros(n, np.uint8)
    gpuimage.read_chunk_into(tmp_path, chunk, out, fds)
    assert (out == data).all()


def test_a_chunk_that_cannot_be_written_says_which_file(tmp_path: Path) -> None:
    """A data file the kernel refuses to grow (here: its size limit) is an OSError naming it,
    not a short chunk recorded as whole."""
    import resource
    w = gpuimage.Writer(tmp_path, False)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    was = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, old[1]))
    try:
        with pytest.raises(OSError, match="writing .*" + names.data_prefix()):
            w.put_scanned(0x7000_0000, 0, np.ones(3 * 4096, np.uint8), gpuimage.NO_TARGETS)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, was)
        w.close()
    assert w.chunks_of(0x7000_0000) == ()


# a ring whose "device" is host memory: the C loop's copy is a memmove, its events are no-ops
_COPY = C.CFUNCTYPE(C.c_int, C.c_uint64, C.c_void_p, C.c_size_t, C.c_void_p)(
    lambda dst, src, n, _stream: C.memmove(dst, src, n) and 0)
_RECORD = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p)(lambda _event, _stream: 0)
_WAIT = C.CFUNCTYPE(C.c_int, C.c_void_p)(lambda _event: 0)


@pytest.mark.parametrize("kind", ["words", "blocks"])
@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("n", [8, 100, 4096 * 3 + 40, (1 << 16) + 13])
def test_a_fill_through_a_ring_copies_hashes_and_marks_in_one_pass(tmp_path: Path, mapped: bool,
                                                                   n: int, kind: str) -> None:
    """The restore's fill loop (chunks.c: pass) on the CPU: every byte arrives, the checksum
    holds (either kind: the CPU's, or the GPU's blocks), and exactly the buffers that some
    8-byte word points into are named, pointers at a buffer's first and last byte included,
    one just past the end excluded."""
    from pos.concurrent.gpucopy import Ring

    rng = np.random.default_rng(n)
    ranges = [(0x7F00_0000_0000 + i * 0x10_0000, 0x7F00_0000_0000 + i * 0x10_0000 + 0x8000)
              for i in range(40)]
    targets = gpuimage.Targets(ranges)
    data = rng.integers(0, 256, n, np.uint8)
    words = data[:n // 8 * 8].view(np.uint64)
    picks = rng.choice(len(ranges), min(len(words), 6), replace=False)
    planted = zip(picks, ["start", "last", "past", "mid", "start", "last"])
    for slot, (i, where) in enumerate(planted):
        a, b = ranges[i]
        words[slot * len(words) // len(picks)] = {"start": a, "last": b - 1, "past": b,
                                                  "mid": (a + b) // 2}[where]
    inside = {int(i) for i, where in zip(picks, ["start", "last", "past", "mid", "start",
                                                 "last"]) if where != "past"}
    truth = [i for i, (a, b) in enumerate(ranges) if ((words >= a) & (words < b)).any()]
    w = gpuimage.Writer(tmp_path, False)
    w.put(0x7000_0000, 0, data, None if kind == "words" else
          gpuimage.blocks_points(data, gpuimage.NO_TARGETS)[0], kind)
    w.close()
    chunk, = w.chunks_of(0x7000_0000)
    assert chunk.kind == kind
    piece, depth = 4096, 3
    slots = np.zeros(piece * depth, np.uint8)
    events, pending = (C.c_void_p * depth)(), (C.c_ubyte * depth)()
    ring = Ring(slots.ctypes.data, piece, depth, C.addressof(events), C.addressof(pending), None,
                C.cast(_COPY, C.c_void_p), C.cast(_RECORD, C.c_void_p),
                C.cast(_WAIT, C.c_void_p), 0, 0)
    out = np.zeros(n + 8, np.uint8)
    maps, fds = gpuimage.Maps() if mapped else None, {}
    try:
        hits = gpuimage.fill_chunk(ring, tmp_path, chunk, out.ctypes.data, fds, targets, maps)
    finally:
        if maps is not None:
            maps.close()
        for fd in fds.values():
            os.close(fd)
    assert (out[:n] == data).all() and not out[n:].any()
    assert list(hits) == truth and inside <= set(truth)
    assert len(picks) < 3 or picks[2] not in truth       # just past its end


@pytest.mark.parametrize("compress", [False, True])
def test_a_damaged_chunk_of_blocks_is_refused(tmp_path: Path, compress: bool,
                                             fds: dict[str, int]) -> None:
    """A chunk whose checksum is of kind `blocks` (the GPU's) reads back exact, and one byte
    changed in its third block is refused, compressed or not."""
    data = np.random.default_rng(9).integers(0, 256, 5 * 4096 + 3, np.uint8)
    w = gpuimage.Writer(tmp_path, compress)
    w.put(0x7000_0000, 0, data, gpuimage.blocks_points(data, gpuimage.NO_TARGETS)[0], "blocks")
    w.close()
    chunk, = w.chunks_of(0x7000_0000)
    out = np.zeros(len(data), np.uint8)
    gpuimage.read_chunk_into(tmp_path, chunk, out, fds)
    assert (out == data).all()
    bad = data.copy()
    bad[2 * 4096 + 100] ^= 1
    w = gpuimage.Writer(tmp_path / "bad", compress)
    (tmp_path / "bad").mkdir()
    w.put(0x7000_0000, 0, bad, chunk.hash, "blocks")
    w.close()
    with pytest.raises(BadInput, match="does not match its checksum"):
        gpuimage.read_chunk_into(tmp_path / "bad", w.chunks_of(0x7000_0000)[0], out, fds)
