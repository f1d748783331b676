"""The checkpoint's page-locked arena (pos/concurrent/gpucopy.Pinned): the part before the cut
is waited for, the rest is locked once asked (the job runs again) and handed to the copy part
by part; a part that will not lock leaves the arena as what was locked."""

import threading

import pytest

from pos.concurrent import gpucopy
from tests.concurrent.test_copier import _HostDriver
from tests.conftest import wait_for

PART = 1 << 20


class _Locking(_HostDriver):
    """cuMemHostRegister as the driver's: each call locks one part; the first `free` go at
    once, the others wait for `go`; call number `fail_at` (from 1) fails."""

    def __init__(self, free: int = 1 << 30, fail_at: int = 0) -> None:
        super().__init__()
        self.free, self.fail_at = free, fail_at
        self.go = threading.Event()
        self.calls = 0
        self.locked: set[int] = set()
        self.lock = threading.Lock()

    def cuMemHostRegister_v2(self, p: int, n: int, _flags: int) -> int:
        with self.lock:
            self.calls += 1
            k = self.calls
        if k == self.fail_at:
            raise RuntimeError("CUDA_ERROR_OUT_OF_MEMORY")
        if k > self.free:
            self.go.wait(10)
        with self.lock:
            self.locked.add(p)
        return 0

    def cuMemHostUnregister(self, p: int) -> int:
        with self.lock:
            self.locked.remove(p)
        return 0


@pytest.fixture(autouse=True)
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpucopy.Pinned, "PIECE", PART)


def test_only_the_part_ahead_is_waited_for_and_the_rest_comes_behind() -> None:
    drv = _Locking(free=1)
    arena = gpucopy.Pinned(drv, 6 * PART, ahead=PART)  # type: ignore[arg-type]
    try:
        assert arena.pinned_bytes == PART and arena.all_s is None
        parts: list[tuple[int, int]] = []
        arena.subscribe(lambda at, n: parts.append((at, n)))
        assert parts == [(0, PART)]              # what was locked before, told at once
        arena.lock_rest()
        drv.go.set()
        wait_for(lambda: arena.all_s is not None, 10, "the rest of the arena")
        assert sorted(parts) == [(k * PART, PART) for k in range(6)]
        assert arena.pinned_bytes == 6 * PART and arena.error is None
    finally:
        arena.close()
    assert drv.locked == set()                   # every part let go


def test_a_part_that_will_not_lock_ends_the_locking_with_what_was_locked(monkeypatch) -> None:
    monkeypatch.setattr(gpucopy.Pinned, "REGISTERERS", 1)     # one part after the other
    drv = _Locking(fail_at=3)
    arena = gpucopy.Pinned(drv, 6 * PART, ahead=PART)  # type: ignore[arg-type]
    try:
        arena.lock_rest()
        wait_for(lambda: arena.error is not None, 10, "the failed part")
        assert arena._behind is not None
        arena._behind.join(10)
        assert arena.pinned_bytes == 2 * PART and arena.all_s is None
        assert "OUT_OF_MEMORY" in str(arena.error)
    finally:
        arena.close()
    assert drv.locked == set()


def test_when_the_part_ahead_will_not_lock_the_arena_is_refused() -> None:
    drv = _Locking(fail_at=1)
    with pytest.raises(RuntimeError, match="OUT_OF_MEMORY"):
        gpucopy.Pinned(drv, 4 * PART, ahead=PART)  # type: ignore[arg-type]
    assert drv.locked == set()


def test_all_ahead_waits_for_the_whole_arena() -> None:
    drv = _Locking()
    arena = gpucopy.Pinned(drv, 5 * PART)  # type: ignore[arg-type]
    try:
        assert arena.pinned_bytes == 5 * PART and len(drv.locked) == 5
    finally:
        arena.close()


@pytest.mark.parametrize("env, ahead", [({}, None), ({"POS_PIN_RING_GIB": "3"}, None),
                                        ({"POS_PIN_AHEAD_GIB": "all"}, 1 << 62),
                                        ({"POS_PIN_AHEAD_GIB": "2"}, 2 << 30)])
def test_what_is_locked_before_the_cut_is_pos_s_choice_or_a_setting(env, ahead) -> None:
    """None: the saver's choice (Saver._prepare: what the shadow cannot hold, and a part)."""
    from pos.settings import Settings

    assert Settings.from_env(env).pin_ahead_bytes == ahead


def test_a_bad_ahead_setting_is_one_sentence() -> None:
    from pos.errors import BadInput
    from pos.settings import Settings

    with pytest.raises(BadInput, match="POS_PIN_AHEAD_GIB=some is not a number of GiB above 0, "
                                       "or all"):
        Settings.from_env({"POS_PIN_AHEAD_GIB": "some"})


def test_nothing_beyond_the_part_ahead_is_touched_until_the_rest_is_asked_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Locked while the job was held, the rest's registrations slowed the job's export and pos's
    import 2-4x (the take 0.06-0.16 s to 0.43-0.69 s on the H200 host): until `lock_rest()` no
    page of it is faulted in or registered; a second call locks nothing twice."""
    import ctypes
    import time

    monkeypatch.setattr(gpucopy.Pinned, "FAULT_STEP", PART // 4)
    real = ctypes.memset
    steps: list[int] = []

    def memset(ptr: int, value: int, n: int) -> int:
        steps.append(ptr)
        return real(ptr, value, n)

    monkeypatch.setattr(gpucopy.C, "memset", memset)
    drv = _Locking()
    arena = gpucopy.Pinned(drv, 3 * PART, ahead=PART)  # type: ignore[arg-type]
    try:
        time.sleep(0.2)
        assert len(steps) == 4 and drv.calls == 1 and arena.all_s is None
        assert arena.pinned_bytes == PART
        arena.lock_rest()
        arena.lock_rest()
        wait_for(lambda: arena.all_s is not None, 10, "the rest of the arena")
        assert sorted(steps) == [arena.ptr + k * PART // 4 for k in range(12)]
        assert drv.calls == 3 and arena.pinned_bytes == 3 * PART
    finally:
        arena.close()
    assert drv.locked == set()


def test_an_arena_closed_before_its_rest_was_asked_for_locks_nothing_more() -> None:
    drv = _Locking()
    arena = gpucopy.Pinned(drv, 3 * PART, ahead=PART)  # type: ignore[arg-type]
    arena.close()
    arena.lock_rest()
    assert drv.calls == 1 and drv.locked == set() and arena._behind is None


def test_the_part_before_the_cut_is_faulted_in_by_several_threads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The steps, not the parts, are shared among the threads: the one part locked before the
    cut is not left to one thread (which faulted its 1 GiB in 0.2-0.4 s of the wait on the H200
    host). Each step here waits until four are being faulted in at once."""
    import ctypes

    monkeypatch.setattr(gpucopy.Pinned, "FAULT_STEP", PART // 4)
    monkeypatch.setattr(gpucopy.Pinned, "FAULTERS", 4)
    monkeypatch.setattr(gpucopy.os, "cpu_count", lambda: 4)
    real = ctypes.memset
    together = threading.Barrier(4)
    by: dict[int, int] = {}

    def memset(ptr: int, value: int, n: int) -> int:
        together.wait(10)          # broken, and the arena refused, unless four run at once
        by[ptr] = threading.get_ident()
        return real(ptr, value, n)

    monkeypatch.setattr(gpucopy.C, "memset", memset)
    arena = gpucopy.Pinned(_Locking(), PART, ahead=PART)  # type: ignore[arg-type]
    try:
        assert arena.pinned_bytes == PART and arena.all_s is not None
        assert sorted(by) == [arena.ptr + k * PART // 4 for k in range(4)]
        assert len(set(by.values())) == 4
    finally:
        arena.close()
