"""The restore's fill through each thread's ring of pinned pieces, against the fake driver: every
byte lands at its address whatever the chunk's length (tails of 1-7 bytes, words that make no
group of four), the checksums are those the writer made, and a corrupt chunk is refused before
its buffer is counted back."""

import ctypes as C
import os
from pathlib import Path

import numpy as np
import pytest

from pos.agent.control import Buffer
from pos.driver import CUdeviceptr, CUstream
from pos.errors import BadInput
from pos.image import gpu as gpuimage
from pos.image.gpuindex import Saved

CHUNK = 1 << 16
SIZES = [5 * CHUNK + 123, 3 * CHUNK + 40, 77, CHUNK]   # tails: 123, 40, 77 bytes


def image(folder: Path) -> tuple[list[Buffer], dict[int, Saved], list[np.ndarray]]:
    rng = np.random.default_rng(11)
    datas = [rng.integers(0, 256, n, np.uint8) for n in SIZES]
    bases = [0x7000_0000_0000 + i * (1 << 24) for i in range(len(SIZES))]
    # one buffer's words point into another's: the handout must learn it
    datas[1][:8] = np.frombuffer(np.uint64(bases[2] + 5).tobytes(), np.uint8)
    w = gpuimage.Writer(folder, compress=False)
    for base, data in zip(bases, datas):
        for off in range(0, len(data), CHUNK):
            w.put(base, off, data[off:off + CHUNK].copy())
    w.close()
    saved = {base: Saved(folder, len(data), w.chunks_of(base)) for base, data in zip(bases, datas)}
    table = [Buffer(base, len(data), len(data), 0, True) for base, data in zip(bases, datas)]
    return table, saved, datas


def device_memory(drv, table: list[Buffer]) -> list[int]:
    dest = []
    for b in table:
        p = CUdeviceptr()
        drv.cuMemAlloc_v2(C.byref(p), b.size)
        dest.append(p.value)
    return dest


def fill(drv, table: list[Buffer], saved: dict[int, Saved], piece: int, depth: int,
         mapped: bool = False, threads: int = 3):
    from pos.concurrent import gpucopy
    from pos.concurrent.fill import fill
    from pos.concurrent.handout import Handout

    dest = device_memory(drv, table)
    handout = Handout(table)
    rings = gpucopy.Rings(drv, threads, piece, depth)
    try:
        error = None
        try:
            fill(drv, table, dest, saved, streams=threads, handout=handout, rings=rings,
                 mapped=mapped)
        except BadInput as e:
            error = e
    finally:
        rings.close()
    back = []
    for b, d in zip(table, dest):
        out = np.empty(b.size, np.uint8)
        drv.cuMemcpyDtoH_v2(out.ctypes.data, d, b.size)
        back.append(out)
        drv.cuMemFree_v2(d)
    return back, handout, error


@pytest.mark.parametrize("mapped", [False, True], ids=["read", "mapped"])
@pytest.mark.parametrize("piece,depth", [(4096, 2), (1 << 16, 4), (32, 8)])
def test_the_ring_fill_puts_every_byte_back(drv, tmp_path: Path, piece: int, depth: int,
                                            mapped: bool) -> None:
    table, saved, datas = image(tmp_path)
    back, handout, error = fill(drv, table, saved, piece, depth, mapped)
    assert error is None
    for data, got in zip(datas, back):
        assert (got == data).all()
    assert handout.back == set(range(len(table)))
    assert handout.refers[1] == {2}


def test_a_piece_that_does_not_divide_the_arena_is_refused(drv) -> None:
    from pos.concurrent import gpucopy

    with pytest.raises(ValueError):
        gpucopy.Rings(drv, 2, 96, 1)


@pytest.mark.parametrize("mapped", [False, True], ids=["read", "mapped"])
def test_a_corrupt_chunk_is_refused_and_its_buffer_never_counted_back(drv, tmp_path: Path,
                                                                      mapped: bool) -> None:
    table, saved, _datas = image(tmp_path)
    bad = saved[table[0].va].chunks[2]
    path = tmp_path / bad.file
    raw = bytearray(path.read_bytes())
    raw[bad.at + 1000] ^= 0x5A
    path.write_bytes(bytes(raw))
    _back, handout, error = fill(drv, table, saved, 4096, 2, mapped)
    assert error is not None and "does not match its checksum" in error.message
    assert 0 not in handout.back


@pytest.mark.parametrize("mapped", [False, True], ids=["read", "mapped"])
def test_a_short_data_file_is_refused_as_truncated(drv, tmp_path: Path, mapped: bool) -> None:
    table, saved, _datas = image(tmp_path)
    last = max((c for s in saved.values() for c in s.chunks), key=lambda c: c.at)
    os.truncate(tmp_path / last.file, last.at + 10)
    _back, handout, error = fill(drv, table, saved, 4096, 2, mapped)
    assert error is not None and "is truncated" in error.message


def test_a_gate_that_raises_stops_the_fill(drv, tmp_path: Path) -> None:
    """The restore's gate raises once the restore has failed: no more chunks are copied."""
    from pos.concurrent import gpucopy
    from pos.concurrent.fill import fill
    from pos.concurrent.handout import Handout
    from pos.errors import PosError

    table, saved, _datas = image(tmp_path)
    calls = []

    def gate() -> None:
        calls.append(1)
        if len(calls) > 2:
            raise PosError("the restore failed before its fill ended", "see its error")

    dest = device_memory(drv, table)
    handout = Handout(table)
    rings = gpucopy.Rings(drv, 1, 4096, 2)
    try:
        with pytest.raises(PosError):
            fill(drv, table, dest, saved, streams=1, handout=handout, rings=rings, gate=gate)
    finally:
        rings.close()
        for d in dest:
            drv.cuMemFree_v2(d)
    assert handout.back != set(range(len(table)))


def test_the_first_failure_stops_the_fill(drv, tmp_path: Path) -> None:
    """One thread, the smallest buffer (filled first) corrupt: no other chunk is copied."""
    table, saved, _datas = image(tmp_path)
    first = min(range(len(table)), key=lambda i: table[i].size)
    bad = saved[table[first].va].chunks[0]
    path = tmp_path / bad.file
    raw = bytearray(path.read_bytes())
    raw[bad.at + 3] ^= 0x5A
    path.write_bytes(bytes(raw))
    _back, handout, error = fill(drv, table, saved, 4096, 2, threads=1)
    assert error is not None and "does not match its checksum" in error.message
    assert handout.back == set()


def test_the_failure_said_is_the_one_that_stopped_the_fill(drv, tmp_path: Path,
                                                          monkeypatch) -> None:
    """A fill thread may take a chunk, then find the fill stopped by a chunk submitted after
    it; the caller waits for the chunks in submission order, so the first error it meets is
    that "stopped". The chunks run here last to first (the corrupt one, last, fails first):
    the user is told of the corrupt chunk, not of a stop."""
    from pos.concurrent import gpucopy

    table, saved, _datas = image(tmp_path)
    last = max(range(len(table)), key=lambda i: table[i].size)    # filled last
    bad = saved[table[last].va].chunks[-1]
    path = tmp_path / bad.file
    raw = bytearray(path.read_bytes())
    raw[bad.at + 3] ^= 0x5A
    path.write_bytes(bytes(raw))

    def backwards(drv, work, buffers, workers, one, buffer_done=lambda _i: None,  # type: ignore
                  order=None):
        errors = {}
        stream = CUstream()
        for k in reversed(range(len(work))):
            try:
                one(stream, *work[k])
            except BaseException as e:      # noqa: BLE001 (kept, raised in submission order)
                errors[k] = e
        for k in range(len(work)):
            if k in errors:
                raise errors[k]
        return 0.0

    monkeypatch.setattr(gpucopy, "run_chunks", backwards)
    _back, handout, error = fill(drv, table, saved, 4096, 2, threads=1)
    assert error is not None and "does not match its checksum" in error.message


def test_rings_refuse_more_threads_than_they_were_made_for(drv) -> None:
    import threading

    from pos.concurrent import gpucopy

    rings = gpucopy.Rings(drv, 1, 4096, 2)
    errors: list[BaseException] = []
    ctx = gpucopy.current(drv)

    def take() -> None:
        drv.cuCtxSetCurrent(ctx)
        try:
            rings.mine(CUstream())
        except ValueError as e:
            errors.append(e)

    try:
        for _ in range(2):
            t = threading.Thread(target=take)
            t.start()
            t.join()
    finally:
        rings.close()
    assert len(errors) == 1


def test_an_unknown_fill_start_is_one_sentence(tmp_path: Path, monkeypatch) -> None:
    from pos.settings import Settings

    monkeypatch.setenv("POS_FILL_FROM", "later")
    with pytest.raises(BadInput, match="POS_FILL_FROM=later is not one of pause, start"):
        Settings.from_env()          # read first by every restore


@pytest.mark.parametrize("kib", ["100", "3000", "8192", "2m"])
def test_a_bad_fill_piece_is_one_sentence(tmp_path: Path, monkeypatch, kib: str) -> None:
    from pos.settings import Settings

    monkeypatch.setenv("POS_FILL_PIECE_KIB", kib)
    with pytest.raises(BadInput, match=f"POS_FILL_PIECE_KIB={kib} is not a power of two"):
        Settings.from_env()          # read first by every restore


@pytest.mark.parametrize("kib, piece", [("2048", 2 << 20), ("256", 256 << 10), ("4096", 4 << 20)])
def test_the_fill_piece_from_the_environment(kib: str, piece: int) -> None:
    from pos.settings import Settings

    assert Settings.from_env({"POS_FILL_PIECE_KIB": kib}).fill_piece_bytes == piece


def test_the_buffers_the_job_used_after_its_checkpoint_are_filled_first(tmp_path: Path) -> None:
    from dataclasses import replace

    from pos.concurrent.fill import fill_order

    table, saved, _ = image(tmp_path)
    table[1] = replace(table[1], touched=True)        # the second biggest, used at once
    _chunks, work = fill_order(table, saved)
    firsts = list(dict.fromkeys(i for i, _off, _n in work))
    assert firsts == [1, 2, 3, 0]      # then the smaller buffers first, as before


@pytest.mark.parametrize("raw, trim", [(None, True), ("1", True), ("0", False)])
def test_the_heap_trim_from_the_environment(raw: str, trim: bool) -> None:
    from pos.settings import Settings

    assert Settings.from_env({} if raw is None else {"POS_TRIM_HEAP": raw}).trim_heap is trim


def test_a_bad_heap_trim_is_one_sentence() -> None:
    from pos.settings import Settings

    with pytest.raises(BadInput, match="POS_TRIM_HEAP=yes is not 0 or 1"):
        Settings.from_env({"POS_TRIM_HEAP": "yes"})
