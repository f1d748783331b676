"""The checkpoint's copy (pos/concurrent/copier.py): how much page-locked host memory it sets
aside, its order, and what it copies while the job is frozen."""

import contextlib
import ctypes
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import numpy as np
import pytest

from pos import host as pos_host
from pos.agent.control import Buffer
from pos.concurrent import copier, gpucopy
from pos.concurrent.handout import Handout
from pos.concurrent.saver import Taken
from pos.errors import BadInput
from pos.image.gpu import Targets
from pos.settings import Settings
from tests.conftest import wait_for

GIB, CHUNK = 1 << 30, 64 << 20


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    def available(gib: float) -> None:
        monkeypatch.setattr(pos_host, "memory_available", lambda: int(gib * GIB))
    return available


def test_the_whole_job_where_the_host_can_spare_it(host) -> None:
    host(100)
    assert copier.arena_bytes(30 * GIB + 1, CHUNK) == 30 * GIB + CHUNK   # whole chunks


def test_what_the_host_can_spare_otherwise(host) -> None:
    host(20.5)                          # 2 GiB stay for everything else
    assert copier.arena_bytes(60 * GIB, CHUNK) == 18 * GIB + 8 * CHUNK


def test_at_most_the_limit_set(host) -> None:
    host(100)
    cap = Settings.from_env({"POS_PIN_MAX_GIB": "8"}).pin_max_bytes
    assert copier.arena_bytes(60 * GIB, CHUNK, cap) == 8 * GIB


@pytest.mark.parametrize("gib, limit, says", [
    (2.5, None, "this host has 0.50 GiB to spare"),
    (100, "0.5", "POS_PIN_MAX_GIB=0.5 is under the 1.00 GiB"),
    (100, "lots", "POS_PIN_MAX_GIB=lots is not a number of GiB"),
])
def test_too_little_is_refused_in_one_sentence(host, gib: float, limit, says: str) -> None:
    host(gib)
    with pytest.raises(BadInput, match=says):
        cap = Settings.from_env({"POS_PIN_MAX_GIB": limit} if limit else {}).pin_max_bytes
        copier.arena_bytes(60 * GIB, CHUNK, cap)


def test_an_image_kept_in_memory_leaves_its_room(host, monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    """An image written into a tmpfs takes the host's memory beside the arena (a 60% job's
    90 GB in /dev/shm beside its 39 GB arena ran a 126 GiB host out of memory), and drains the
    ring as fast as the copy fills it: all of the job streams through the ring alone."""
    host(124)
    settings = Settings.from_env({})
    monkeypatch.setattr(pos_host, "fs_magic", lambda p: pos_host.TMPFS_MAGIC)
    room = copier.host_room(settings, tmp_path / "img", 90 * GIB)
    assert room.arena(85 * GIB, CHUNK, 54 * GIB) == copier.DEFAULT_PIN_RING   # not 31 + 8
    assert copier.host_room(settings, tmp_path / "img", 117 * GIB).arena(
        85 * GIB, CHUNK, 54 * GIB) == 5 * GIB                       # 124 - 2 - 117
    with pytest.raises(BadInput, match=r"beside the 121\.50 GiB its image takes in host "
                                       r"memory \(its folder is a tmpfs\), and this host has "
                                       r"122\.00 GiB to spare"):
        copier.host_room(settings, tmp_path / "img", int(121.5 * GIB)).arena(
            85 * GIB, CHUNK, 54 * GIB)
    monkeypatch.setattr(pos_host, "fs_magic", lambda p: 0xEF53)        # ext4: on disk
    assert copier.host_room(settings, tmp_path / "img", 90 * GIB).arena(
        85 * GIB, CHUNK, 54 * GIB) == 31 * GIB + copier.DEFAULT_PIN_RING


def test_in_memory_asks_the_nearest_folder_that_exists(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    asked: list[Path] = []
    monkeypatch.setattr(pos_host, "fs_magic",
                        lambda p: asked.append(p) or pos_host.RAMFS_MAGIC)   # type: ignore
    assert pos_host.in_memory(tmp_path / "a" / "b")
    assert asked == [tmp_path]


def test_a_small_job_needs_only_itself(host) -> None:
    host(2.5)                           # half a GiB to spare: enough for 64 MiB
    assert copier.arena_bytes(10 << 20, CHUNK) == CHUNK


def test_the_buffers_calls_wait_for_are_copied_first() -> None:
    order = gpucopy.Order([(0, 0, 1), (0, 1, 1), (1, 0, 1), (2, 0, 1), (2, 1, 1)])
    assert order.take() == (0, 0, 1)
    order.want([2, 0])
    assert [order.take() for _ in range(4)] == [(2, 0, 1), (2, 1, 1), (0, 1, 1), (1, 0, 1)]
    assert order.take() is None


class _HostDriver:
    """The driver calls the copier makes, on host memory: a device address is a host one; the
    others (contexts, streams) do nothing."""

    def __init__(self) -> None:
        self.raw = self

    def cuMemcpyDtoHAsync_v2(self, dst: int, src: int, n: int, _stream: object) -> int:
        ctypes.memmove(dst, src, n)
        return 0

    def __getattr__(self, _name: str):  # type: ignore[no-untyped-def]
        return lambda *_a: 0


class _Arena:
    def __init__(self, size: int) -> None:
        self.bytes = np.zeros(size, np.uint8)
        self.ptr, self.size = self.bytes.ctypes.data, size

    def view(self, at: int, n: int) -> np.ndarray:
        return self.bytes[at:at + n]

    def subscribe(self, fn) -> None:  # type: ignore[no-untyped-def]
        fn(0, self.size)                # locked whole, before the copy

    def lock_rest(self) -> None:
        pass


class _Writer:
    def __init__(self) -> None:
        self.data: dict[tuple[int, int], bytes] = {}
        self.sums: dict[tuple[int, int], tuple[int, str]] = {}

    def put_scanned(self, va: int, off: int, view: np.ndarray, targets: Targets) -> np.ndarray:
        self.data[(va, off)] = view.tobytes()
        return targets.hits()

    def put(self, va: int, off: int, view: np.ndarray, h: int, kind: str) -> None:
        """A chunk the GPU hashed."""
        self.data[(va, off)] = view.tobytes()
        self.sums[(va, off)] = (h, kind)


class _Handout(Handout):
    def __init__(self, table: list[Buffer], safe: set[int]) -> None:
        super().__init__(table, safe)
        self.kept_at: dict[int, float] = {}

    def captured(self, i: int) -> None:
        self.kept_at[i] = time.monotonic()
        super().captured(i)


def test_while_frozen_only_what_pos_could_not_shadow_is_copied() -> None:
    chunk = 1 << 20
    memory = [np.full(2 * chunk, k + 1, np.uint8) for k in range(2)]
    table = [Buffer(m.ctypes.data, m.size, m.size, 0, True) for m in memory]
    shadowed = {0}
    handout, writer = _Handout(table, shadowed), _Writer()
    c = copier.Copier(_HostDriver(), table, [b.va for b in table], shadowed, _Arena(8 * chunk),
                      chunk, 2, writer, handout, 2)   # type: ignore[arg-type]
    c.hold_shadowed()
    c.start()
    try:
        wait_for(lambda: 1 in handout.kept_at, 10, "the copy of buffer 1")
        time.sleep(0.2)         # a time, not a wait: buffer 0, held, is not copied in it
        assert 0 not in handout.kept_at
        c.release_shadowed()
        c.wait_copied()
        assert c.join().bytes == 4 * chunk
    finally:
        c.close()
    assert {k: v[:1] for k, v in writer.data.items()} == {
        (table[i].va, off): bytes([i + 1]) for i in (0, 1) for off in (0, chunk)}


@contextlib.contextmanager
def _on_device(drv: Any, sizes: list[int]) -> Iterator[tuple[list[int], Any]]:
    """Buffers of these sizes on the (fake) device, zeroed, and pos's checksum kernel; freed
    and closed at the end."""
    import ctypes as C

    from pos.concurrent.gpuhash import Kernel
    from pos.driver import CUdeviceptr

    ptrs = []
    for size in sizes:
        p = CUdeviceptr()
        drv.cuMemAlloc_v2(C.byref(p), size)
        drv.cuMemsetD8_v2(p.value, 0, size)
        ptrs.append(p.value)
    kernel = Kernel(drv)
    try:
        yield ptrs, kernel
    finally:
        kernel.close()
        for p in ptrs:
            drv.cuMemFree_v2(p)


def _finish(c: copier.Copier) -> None:
    """Every part of the copy let go, and the copy to its end."""
    c.release_savers()
    c.release_shadowed()
    c.wait_copied()
    c.join()


class _Agent:
    """What the handout tells the job's agent."""

    def __init__(self) -> None:
        self.told: list[int] = []
        self.saved_told: list[int] = []

    def done(self, vas: list[int]) -> None:
        self.told += vas

    def saved(self, vas: list[int]) -> None:
        self.saved_told += vas


def test_the_gpu_scans_the_shadow_so_a_shadowed_buffer_waits_only_for_what_it_points_into(
        drv) -> None:
    """Buffers 0 and 1 shadowed, 2 not, and 0 holds an address in 2. With the shadow's copies
    and the savers held, and room in host memory for one chunk of 2's two, the GPU's scan of
    the shadow alone hands 1 to the job, while 0 waits for 2, which is what a call on 0 makes
    the copy take first; the shadow's chunks are then written with the scan's checksums, equal
    to the CPU's."""
    from pos.image import gpu as gpuimage

    chunk = 1 << 16
    rng = np.random.default_rng(5)
    datas = [rng.integers(0, 256, 2 * chunk, np.uint8) for _ in range(3)]
    with _on_device(drv, [2 * chunk] * 3) as (ptrs, kernel):
        datas[0][chunk + 64:chunk + 72].view(np.uint64)[0] = ptrs[2] + 8   # in 0's 2nd chunk
        for p, d in zip(ptrs, datas):
            drv.cuMemcpyHtoD_v2(p, d.ctypes.data, d.size)
        table = [Buffer(p, 2 * chunk, 2 * chunk, 0, True) for p in ptrs]
        handout, writer, agent = _Handout(table, {0, 1}), _Writer(), _Agent()
        handout.attach(agent)
        # one chunk of page-locked memory, the savers held: buffer 2 is never all in host memory
        c = copier.Copier(drv, table, ptrs, {0, 1}, _Arena(chunk), chunk, 2,
                          writer, handout, 2, kernel=kernel)   # type: ignore[arg-type]
        c.hold_shadowed()
        c.hold_savers()
        c.start()
        try:
            wait_for(lambda: ptrs[1] in agent.told, 10, "the scan of buffer 1's shadow")
            assert handout.needed([0, 1]) == [2]
            assert ptrs[0] not in agent.told and ptrs[2] not in agent.told
            c.release_savers()
            wait_for(lambda: ptrs[0] in agent.told, 10, "buffer 2's save")
            _finish(c)
        finally:
            c.close()
    targets = gpuimage.Targets(sorted((p, p + 2 * chunk) for p in ptrs))
    for p, d in zip(ptrs, datas):
        for off in (0, chunk):
            piece = d[off:off + chunk]
            assert writer.data[(p, off)] == piece.tobytes()
            assert writer.sums[(p, off)] == (gpuimage.blocks_points(piece, targets)[0], "blocks")


@pytest.mark.parametrize("gpu_scans", [True, False])
def test_a_buffer_the_gpu_scanned_is_back_once_in_host_memory(drv, gpu_scans: bool) -> None:
    """Buffers 0 and 1 of a chunk each, 0 holding an address in 1, and 2 of two chunks; none
    shadowed, room in host memory for two chunks, the savers held: 2 is never in host memory.
    Where the GPU hashes and scans each chunk, 0 and 1 are handed to the job as soon as they
    are in host memory, before a byte of them is written (a call on a buffer that points into
    another need not wait for the savers' queue); where the savers scan, nothing is handed out
    until they write."""
    chunk = 1 << 16
    with _on_device(drv, [chunk, chunk, 2 * chunk]) as (ptrs, kernel):
        word = np.array([ptrs[1] + 8], np.uint64)
        drv.cuMemcpyHtoD_v2(ptrs[0] + 64, word.ctypes.data, 8)
        table = [Buffer(p, n, n, 0, True) for p, n in zip(ptrs, [chunk, chunk, 2 * chunk])]
        handout, writer, agent = _Handout(table, set()), _Writer(), _Agent()
        handout.attach(agent)
        scans = kernel if gpu_scans else None
        c = copier.Copier(drv, table, ptrs, set(), _Arena(2 * chunk), chunk, 2,
                          writer, handout, 2, kernel=scans)   # type: ignore[arg-type]
        c.hold_savers()
        c.start()
        try:
            wait_for(lambda: set(handout.kept_at) == {0, 1}, 10, "buffers 0 and 1 copied")
            if gpu_scans:
                wait_for(lambda: set(agent.told) == set(ptrs[:2]), 10, "0 and 1 handed out")
                assert handout.refers.get(0) == {1}
            else:
                time.sleep(0.2)     # a time, not a wait: the savers, held, scan nothing in it
                assert agent.told == []
            assert writer.data == {} and 2 not in handout.kept_at
            _finish(c)
            assert set(agent.told) == set(ptrs) and len(writer.data) == 4
        finally:
            c.close()


class _Waiting(_Agent):
    """A job whose calls wait for the buffers at `vas`."""

    def __init__(self, vas: list[int]) -> None:
        super().__init__()
        self.vas = vas

    def wanted(self) -> list[int]:
        return self.vas


def test_the_scan_takes_first_the_shadowed_buffer_a_call_waits_for(drv) -> None:
    """Buffers 0-3 shadowed, 4 not, a call of the job waiting on 3, the last in the copy's
    order: the GPU's scan of the shadow hands 3 back to the job before the others. (Room in
    host memory for one chunk of 4's two, the savers held: 4 is never all in host memory,
    which would hand every shadowed buffer back at once.)"""
    chunk = 1 << 16
    sizes = [chunk] * 4 + [2 * chunk]
    with _on_device(drv, sizes) as (ptrs, kernel):     # zeroed: no word of them an address
        table = [Buffer(p, n, n, 0, True) for p, n in zip(ptrs, sizes)]
        shadowed = {0, 1, 2, 3}
        handout, writer, agent = _Handout(table, shadowed), _Writer(), _Waiting([ptrs[3]])
        handout.attach(agent)
        c = copier.Copier(drv, table, ptrs, shadowed, _Arena(chunk), chunk, 2,
                          writer, handout, 2, kernel=kernel)   # type: ignore[arg-type]
        c.hold_shadowed()
        c.hold_savers()
        c.pause()                   # the scan begins only once the call's wait is known
        c.watch(agent)
        c.start()
        try:
            wait_for(lambda: 3 in c.scan_order.wanted, 10, "the call's wait, learnt")
            c.resume()
            wait_for(lambda: set(ptrs[:4]) <= set(agent.told), 10, "the scan of the shadow")
            assert agent.told[0] == ptrs[3] and ptrs[4] not in agent.told, agent.told
            _finish(c)
        finally:
            c.close()


def test_the_baseline_copies_every_buffer_while_frozen() -> None:
    chunk = 1 << 20
    memory = [np.full(chunk, 7, np.uint8)]
    table = [Buffer(memory[0].ctypes.data, chunk, chunk, 0, True)]
    handout = _Handout(table, {0})
    c = copier.Copier(_HostDriver(), table, [table[0].va], {0}, _Arena(2 * chunk), chunk, 1,
                      _Writer(), handout, 1, "all")   # type: ignore[arg-type]
    c.hold_shadowed()
    c.start()
    try:
        c.wait_copied()
        assert 0 in handout.kept_at
    finally:
        c.close()


def test_a_bad_frozen_copy_setting_is_one_sentence() -> None:
    with pytest.raises(BadInput, match="POS_FROZEN_COPY=some is not one of unshadowed, all"):
        Settings.from_env({"POS_FROZEN_COPY": "some"})


def test_a_bad_savers_held_setting_is_one_sentence() -> None:
    with pytest.raises(BadInput, match="POS_SAVERS_HELD=dump is not one of criu, frozen"):
        Settings.from_env({"POS_SAVERS_HELD": "dump"})


@pytest.mark.parametrize("held, through_driver", [("frozen", False), ("criu", True)])
def test_the_savers_wait_through_the_frozen_part_or_for_criu_alone(held: str,
                                                                  through_driver: bool) -> None:
    """POS_SAVERS_HELD: the copy's savers wait from the freeze to the thaw (`frozen`), or only
    around CRIU's dump (`criu`): they then write what is in the ring while the driver's calls
    run. What they had written when the dump began is timed; after the thaw they run."""
    chunk = 1 << 20
    memory = np.full(4 * chunk, 5, np.uint8)
    table = [Buffer(memory.ctypes.data, memory.size, memory.size, 0, True)]
    writer = _Writer()
    c = copier.Copier(_HostDriver(), table, [table[0].va], set(), _Arena(8 * chunk), chunk, 1,
                      writer, _Handout(table, set()), 1)   # type: ignore[arg-type]
    taken = Taken.__new__(Taken)           # its copier and settings are all these steps use
    taken.copier = c
    taken.saver = SimpleNamespace(settings=Settings.from_env({"POS_SAVERS_HELD": held}),
                                  timings={})   # type: ignore[assignment]
    try:
        taken.freeze()
        c.start()
        c.wait_copied()                    # the unshadowed buffer, in the ring
        if through_driver:
            wait_for(lambda: c.saved_bytes == 4 * chunk, 10, "the savers during the freeze")
        else:
            time.sleep(0.2)    # a time, not a wait: held, the savers write nothing in it
            assert c.saved_bytes == 0
        with taken.criu_alone():
            assert not c.save_go.is_set()
        assert taken.saver.timings["saved_at_dump_bytes"] == (4 * chunk if through_driver
                                                              else 0)
        assert c.save_go.is_set() == through_driver
        taken.thaw()
        assert c.join().bytes == 4 * chunk
    finally:
        c.close()
    assert sorted(writer.data) == [(table[0].va, off) for off in range(0, 4 * chunk, chunk)]


def test_close_returns_when_everything_was_copied_with_the_savers_held() -> None:
    """A checkpoint that fails in its frozen part after the whole job reached host memory: the
    copy's threads, waiting for the scans to be let go, end all the same."""
    chunk = 1 << 20
    memory = [np.full(chunk, 3, np.uint8) for _ in range(2)]
    table = [Buffer(m.ctypes.data, chunk, chunk, 0, True) for m in memory]
    writer = _Writer()
    c = copier.Copier(_HostDriver(), table, [b.va for b in table], {0}, _Arena(4 * chunk), chunk,
                      2, writer, _Handout(table, {0}), 2)   # type: ignore[arg-type]
    c.hold_savers()
    c.start()
    c.wait_copied()
    closing = threading.Thread(target=c.close, daemon=True)
    closing.start()
    closing.join(10)
    assert not closing.is_alive()
    assert writer.data == {}               # a stopped copy writes nothing more


class _LateArena(_Arena):
    """An arena locked one chunk before the copy, the rest when the test says."""

    def __init__(self, size: int, chunk: int) -> None:
        super().__init__(size)
        self.chunk = chunk
        self.told = None

    def subscribe(self, fn) -> None:  # type: ignore[no-untyped-def]
        self.told = fn
        fn(0, self.chunk)

    def rest(self) -> None:
        assert self.told is not None
        self.told(self.chunk, self.size - self.chunk)


@pytest.mark.parametrize("rest_late", [False, True])
def test_the_copy_runs_in_the_part_locked_and_takes_the_rest_as_it_comes(rest_late) -> None:
    chunk = 1 << 20
    memory = [np.full(chunk, i + 1, np.uint8) for i in range(4)]
    table = [Buffer(m.ctypes.data, chunk, chunk, 0, True) for m in memory]
    writer, arena = _Writer(), _LateArena(4 * chunk, chunk)
    c = copier.Copier(_HostDriver(), table, [b.va for b in table], set(), arena, chunk, 2,
                      writer, _Handout(table, set()), 2)   # type: ignore[arg-type]
    c.start()
    try:
        if rest_late:
            arena.rest()
        c.wait_copied()                  # with one chunk of arena, every chunk in turn
        assert c.join().bytes == 4 * chunk
    finally:
        c.close()
    assert {k: v[:1] for k, v in writer.data.items()} == {
        (b.va, 0): bytes([i + 1]) for i, b in enumerate(table)}


def test_the_arena_holds_what_pos_cannot_shadow_and_a_ring_for_the_rest(host) -> None:
    host(500)
    assert copier.arena_bytes(100 * GIB, CHUNK, shadowed=95 * GIB) == \
        5 * GIB + copier.DEFAULT_PIN_RING
    assert copier.arena_bytes(100 * GIB, CHUNK, shadowed=100 * GIB) == copier.DEFAULT_PIN_RING
    assert copier.arena_bytes(4 * GIB, CHUNK, shadowed=4 * GIB) == 4 * GIB   # at most the job
    assert copier.arena_bytes(100 * GIB, CHUNK, shadowed=0) == 100 * GIB
    assert copier.arena_bytes(100 * GIB, CHUNK, shadowed=90 * GIB, ring=2 * GIB) == 12 * GIB


def test_arenas_sized_side_by_side_share_what_the_host_can_spare(host) -> None:
    """Savers prepared at once size their arenas before any is faulted in: the second gets
    what the first left, the third is refused."""
    host(32)                            # 30 GiB to spare
    room = copier.HostRoom(ring=0)
    assert room.arena(20 * GIB, CHUNK, 0) == 20 * GIB
    assert room.arena(20 * GIB, CHUNK, 0) == 10 * GIB
    with pytest.raises(BadInput, match="this host has 0.00 GiB to spare"):
        room.arena(20 * GIB, CHUNK, 0)


def test_the_ranks_share_one_ring(host) -> None:
    """POS_PIN_RING_GIB is the checkpoint's: 4 ranks whose memory pos shadows on their devices
    lock 2 GiB each of an 8 GiB ring (not 8 GiB each, for the one disk they drain to)."""
    host(512)
    room = copier.HostRoom(ring=8 * GIB, sharing=4)
    assert [room.arena(20 * GIB, CHUNK, 20 * GIB) for _ in range(4)] == [2 * GIB] * 4
    # what a rank could not shadow is its own, beside its share
    assert copier.HostRoom(ring=8 * GIB, sharing=4).arena(20 * GIB, CHUNK, 15 * GIB) == 7 * GIB


def test_pos_pin_max_gib_bounds_the_checkpoint(host) -> None:
    """... not each of its ranks: the second arena gets what the first left of it, the third
    is refused in one sentence."""
    host(512)
    room = copier.HostRoom(cap=30 * GIB, ring=0, sharing=3)
    assert room.arena(20 * GIB, CHUNK, 0) == 20 * GIB
    assert room.arena(20 * GIB, CHUNK, 0) == 10 * GIB
    with pytest.raises(BadInput, match="POS_PIN_MAX_GIB=0 is under"):
        room.arena(20 * GIB, CHUNK, 0)


def test_a_checkpoints_processes_share_one_room(tmp_path: Path, monkeypatch) -> None:
    """The whole-process checkpoint gives every saver one HostRoom with the settings' bounds,
    its ring split among the processes with device memory (torchrun's own has none), and room
    left for the image where its folder is a tmpfs."""
    from types import SimpleNamespace

    from pos.concurrent import checkpoint
    from pos.operation.engine import Save
    from pos.settings import Settings

    rooms: list[copier.HostRoom] = []

    def prepare(_cls: object, _agent: object, *_a: object, host_room: copier.HostRoom,
                **_k: object) -> None:
        rooms.append(host_room)
        raise BadInput("stop here", "")

    monkeypatch.setattr(checkpoint.Saver, "prepare", classmethod(prepare))
    whole = checkpoint._Whole(1, tmp_path / "img", Save(), lambda _: None,
                              Settings(pin_ring_bytes=8 * GIB, pin_max_bytes=30 * GIB))
    whole.agents = [SimpleNamespace(pid=p) for p in (1, 2, 3)]
    whole.pids = [1, 2, 3]
    whole.statuses = {p: SimpleNamespace(owned_bytes=n, own_bytes=None, own_kept=0, peer_maps=0)
                      for p, n in ((1, 0), (2, GIB), (3, GIB))}
    monkeypatch.setattr(checkpoint.procs, "resident_bytes", lambda pids: 3 << 20)
    monkeypatch.setattr(pos_host, "fs_magic", lambda p: pos_host.TMPFS_MAGIC)
    with pytest.raises(BadInput, match="stop here"):
        whole.prepare()
    assert len(rooms) == 3 and rooms[0] is rooms[1] is rooms[2]
    assert rooms[0].ring == 4 * GIB and rooms[0].cap_left == 30 * GIB
    assert rooms[0].held == 2 * GIB + 2 * (3 << 20)      # CRIU's part staged first


@pytest.mark.parametrize("paused, going", [("driver", False), ("never", True)])
def test_the_copy_waits_for_the_drivers_calls_unless_told_not_to(paused: str,
                                                                 going: bool) -> None:
    """POS_COPY_PAUSED: the copy to host memory is held while the driver checkpoints or restores
    the job (`driver`, the default), or goes on through them (`never`); either way it goes on
    after."""
    taken = Taken.__new__(Taken)           # its copier and settings are all paused uses
    taken.copier = SimpleNamespace(go=threading.Event())   # type: ignore[assignment]
    taken.copier.go.set()
    taken.copier.pause = taken.copier.go.clear
    taken.copier.resume = taken.copier.go.set
    taken.saver = SimpleNamespace(settings=Settings.from_env({"POS_COPY_PAUSED": paused}),
                                  timings={})   # type: ignore[assignment]
    assert taken.paused(taken.copier.go.is_set) is going
    assert taken.copier.go.is_set()


def test_a_bad_copy_paused_setting_is_one_sentence() -> None:
    with pytest.raises(BadInput, match="POS_COPY_PAUSED=always is not one of driver, never"):
        Settings.from_env({"POS_COPY_PAUSED": "always"})
    assert Settings.from_env({}).copy_paused == "driver"
