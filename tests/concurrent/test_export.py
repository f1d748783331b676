"""A checkpoint's export (concurrent/saver.py export): where the agent lacks the device memory
to move a buffer the driver will not export (hook/export.c: reseat), pos gives its shadow back and
asks once more; any other refusal, or a second one, is the checkpoint's failure. And what the
export's copy needs is imported before the cut."""

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pos.agent.control import Exported, Refused, Room
from pos.concurrent.saver import FD_MARGIN, export

NEED = 4 << 20


class QuietAgent:
    """An agent that answers its status (its job owns `owned` bytes of device memory, 8 MiB
    unless said, in 4 buffers), makes room in its job's table of descriptors (`rooms`: for how
    many it was asked) and lets go."""

    pid = 4242

    def __init__(self, owned: int = 8 << 20) -> None:
        self.owned = owned
        self.rooms: list[int] = []

    def status(self) -> SimpleNamespace:
        return SimpleNamespace(owning=True, owned_bytes=self.owned, foreign_bytes=0,
                               foreign_allocs=0, own_bytes=0, own_kept=0,
                               buffers=4 if self.owned else 0)

    def room(self, n: int) -> Room:
        self.rooms.append(n)
        return Room(10, 10 + n, True, 0.003)

    def close(self) -> None:
        return None


class RefusingAgent(QuietAgent):
    """An agent whose first `refusals` exports fail, lacking NEED bytes (or, need=0, not that)."""

    def __init__(self, refusals: int, need: int = NEED) -> None:
        super().__init__()
        self.refusals, self.need, self.asked = refusals, need, 0

    def export(self) -> Exported:
        self.asked += 1
        if self.asked <= self.refusals:
            raise Refused(self.pid, {"ok": False, "need": self.need,
                                     "error": "exporting the buffer at 0x7000 failed"})
        return Exported([7, 8], reseated=1, reseated_bytes=NEED, reseat_s=0.01, leaked=1)


@pytest.fixture
def saver(fakegpu: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("POS_LIBCUDA", str(fakegpu["libcuda"]))
    monkeypatch.setenv("POS_FAKECUDA_STATE_DIR", str(tmp_path / "fakecuda"))
    from pos.concurrent import gpucopy
    from pos.concurrent.saver import Saver
    from pos.settings import Settings

    def make(agent: RefusingAgent) -> Saver:
        s = Saver(agent, Settings(), 2, 1 << 20)   # type: ignore[arg-type]
        s.shadow = gpucopy.Shadow(s.drv, 8 << 20)
        made.append(s)
        return s

    made: list = []
    yield make
    for s in made:
        s.shadow.close()


def test_a_reseat_short_of_memory_gets_the_shadow_and_a_second_try(saver) -> None:
    s = saver(RefusingAgent(refusals=1))
    assert export(s) == [7, 8] and s.agent.asked == 2
    assert s.shadow.size == 0 and s.shadow.ptr == 0          # given back: nothing shadowed
    assert s.timings["shadow_given_back_bytes"] == NEED
    assert (s.timings["reseated_bytes"], s.timings["leaked_closed_n"]) == (NEED, 1)


@pytest.mark.parametrize("refusals, need", [(2, NEED), (1, 0)])
def test_another_refusal_fails_the_checkpoint(saver, refusals: int, need: int) -> None:
    """Twice short of memory, or refused for another reason (need 0: the shadow is kept)."""
    s = saver(RefusingAgent(refusals, need))
    with pytest.raises(Refused, match="refused: exporting the buffer at 0x7000 failed"):
        export(s)
    assert s.agent.asked == refusals and (s.shadow.size == 0) == bool(need)


def test_the_cut_waits_for_the_copys_modules(saver, monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy and the copy's modules are imported beside the pin (import_for_copy): the cut's
    own connection is made once they are in, so that the held job never waits for them."""
    import pos.concurrent.saver as mod

    imported = threading.Event()

    def slowly() -> None:
        time.sleep(0.3)
        imported.set()

    monkeypatch.setattr(mod, "import_for_copy", slowly)
    monkeypatch.setattr(mod, "Agent", lambda pid: QuietAgent())
    s = saver(QuietAgent())
    assert not imported.is_set()           # the pin goes on beside the import
    assert s.reconnect() is None and imported.is_set()


@pytest.mark.parametrize("cores, ranks, writers", [(64, 1, 64), (64, 4, 16), (3, 4, 1)])
def test_ranks_saved_at_once_share_the_hosts_cores(fakegpu: dict[str, Path], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch, cores: int,
                                                   ranks: int, writers: int) -> None:
    """Each saver of a several-rank checkpoint copies with its share of the cores (its savers,
    and the spare threads started for them), all in one process."""
    monkeypatch.setenv("POS_LIBCUDA", str(fakegpu["libcuda"]))
    monkeypatch.setenv("POS_FAKECUDA_STATE_DIR", str(tmp_path / "fakecuda"))
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    from pos import nvml
    from pos.concurrent import devices
    from pos.concurrent.copier import threads
    from pos.concurrent.saver import Saver
    from pos.settings import Settings

    monkeypatch.setattr(nvml, "gpus_of", lambda pids: {"GPU-job": 5 << 20})
    monkeypatch.setattr(devices, "cuda_device", lambda gpu: 0)
    s = Saver(QuietAgent(), Settings(), 2, 1 << 20, ranks)   # type: ignore[arg-type]
    try:
        assert s.writers == writers
        assert len(s.spares) == threads(2, writers)
        # NVML's count of the job's device memory, for the report (the driver's share: it
        # less what pos owns)
        assert s.gpu == "GPU-job" and s.timings["gpu_used_bytes"] == 5 << 20
    finally:
        s.close()


def test_savers_prepared_side_by_side_lock_their_arenas_in_turn(
        fakegpu: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Locking an arena is page-table work in pos's one process: several at once went slower
    than one after another (copier.HostRoom), so the savers' contexts and shadows are made at
    once and their arenas locked in turn."""
    monkeypatch.setenv("POS_LIBCUDA", str(fakegpu["libcuda"]))
    monkeypatch.setenv("POS_FAKECUDA_STATE_DIR", str(tmp_path / "fakecuda"))
    from concurrent.futures import ThreadPoolExecutor

    from pos.concurrent import copier, gpucopy
    from pos.concurrent.saver import Saver
    from pos.settings import Settings

    locking, most = [0], [0]
    lock = threading.Lock()

    class Recorded:
        PIECE = 1 << 30
        pinned_bytes, all_s, error = 0, 0.0, None

        def __init__(self, _drv: Any, _size: int, **_: Any) -> None:
            with lock:
                locking[0] += 1
                most[0] = max(most[0], locking[0])
            time.sleep(0.2)
            with lock:
                locking[0] -= 1

        def close(self) -> None:
            return None

    monkeypatch.setattr(gpucopy, "Pinned", Recorded)
    room = copier.HostRoom()

    def prepare(_: int) -> Saver:
        agent: Any = QuietAgent()
        return Saver.prepare(agent, Settings(), 2, 1 << 20, gpu_only=False, ranks=3,
                             host_room=room)

    with ThreadPoolExecutor(3) as pool:
        savers = list(pool.map(prepare, range(3)))
    for s in savers:
        s.close()
    assert most[0] == 1 and all(s.timings["pin"] >= 0.2 for s in savers)


@pytest.mark.parametrize("free_mib, env, ahead_mib", [
    (1024 + 100, {}, 1),                    # all 8 MiB shadowed: a part ahead, the rest later
    (1024 + 3, {}, 5 + 1),                  # 5 MiB the shadow cannot hold, and a part
    (1024 + 100, {"POS_PIN_AHEAD_GIB": "all"}, 1 << 42),
])
def test_before_the_cut_the_arena_locks_what_the_job_may_wait_for(
        fakegpu: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        free_mib: int, env: dict, ahead_mib: int) -> None:
    """The job's writes to a buffer the shadow could not hold wait until it is in host memory:
    that much of the arena is locked before the cut, with one part for the copy to begin with;
    the rest of the ring (the shadow's copies alone use it) once the job runs again."""
    monkeypatch.setenv("POS_LIBCUDA", str(fakegpu["libcuda"]))
    monkeypatch.setenv("POS_FAKECUDA_STATE_DIR", str(tmp_path / "fakecuda"))
    from pos.concurrent import gpucopy
    from pos.concurrent.saver import Saver
    from pos.settings import Settings

    asked: list = []

    class Recorded:
        PIECE = 1 << 20
        pinned_bytes, all_s, error = 0, 0.0, None

        def __init__(self, _drv: Any, size: int, ahead: Any = None, **_: Any) -> None:
            asked.append((size, ahead))

        def close(self) -> None:
            return None

    class Shadow:
        def __init__(self, _drv: Any, size: int) -> None:
            self.size, self.ptr = size, 0

        def close(self) -> None:
            return None

    monkeypatch.setattr(gpucopy, "Pinned", Recorded)
    monkeypatch.setattr(gpucopy, "Shadow", Shadow)
    monkeypatch.setattr(gpucopy, "free_device_bytes", lambda drv: free_mib << 20)
    agent: Any = QuietAgent()
    s = Saver.prepare(agent, Settings.from_env(env), 2, 1 << 20, gpu_only=False)
    s.close()
    assert asked == [(8 << 20, ahead_mib << 20)]


class EmptyAgent(QuietAgent):
    """torchrun's own process: CUDA initialised, no device memory."""

    def __init__(self) -> None:
        super().__init__(owned=0)

    def table(self) -> list:
        return []


def test_a_process_without_device_memory_gets_no_context_nor_arena(
        fakegpu: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing to copy: no context on its GPU (0.5 GB of it, and 0.13-0.66 s at the H200
    hosts' checkpoints), no shadow, no page-locked arena, no copy threads; its take and its
    copy are empty, and its GPU index (which its restore needs) is written."""
    monkeypatch.setenv("POS_LIBCUDA", str(fakegpu["libcuda"]))
    monkeypatch.setenv("POS_FAKECUDA_STATE_DIR", str(tmp_path / "fakecuda"))
    from pos import nvml
    from pos.concurrent import gpucopy
    from pos.concurrent.saver import Saver
    from pos.image import gpuindex
    from pos.settings import Settings

    def no_context(*_: Any) -> None:
        raise AssertionError("a context was made")

    monkeypatch.setattr(gpucopy, "Context", no_context)
    monkeypatch.setattr(gpucopy, "Pinned", no_context)
    monkeypatch.setattr(nvml, "gpus_of", lambda pids: {})
    agent: Any = EmptyAgent()
    s = Saver.prepare(agent, Settings(), 2, 1 << 20, gpu_only=False)
    try:
        assert s.context is None and s.host is None and s.shadow is None
        assert len(s.spares) == 0 and s.owned_bytes == 0
        t = s.take(4242)
        t.start(tmp_path)
        t.freeze()
        assert t.paused(lambda: "called") == "called"
        t.thaw()
        t.wait_copied()
        assert t.write(tmp_path).bytes == 0
        assert gpuindex.read(tmp_path, 4242).buffers == ()
        t.close()
    finally:
        s.close()


def test_the_ranks_copies_begin_once_every_take_is_done(tmp_path: Path) -> None:
    """At 4 ranks a rank's import took 0.66 s against 0.013 s at one rank, most likely beside
    the copies of the ranks taken before it: every take comes first, then every copy."""
    from types import SimpleNamespace

    from pos.concurrent.checkpoint import _Whole

    events: list[str] = []
    lock = threading.Lock()

    def said(what: str) -> None:
        with lock:
            events.append(what)

    class Taken:
        def __init__(self, pid: int) -> None:
            self.pid, self.fds = pid, [pid]
            time.sleep(0.05 * (pid % 3))        # the takes end at different times
            said(f"take {pid}")

        def start(self, folder: Path) -> None:
            assert folder == tmp_path
            said(f"copy {self.pid}")

    savers = [SimpleNamespace(pid=p, take=lambda rank: Taken(rank)) for p in (10, 11, 12, 13)]
    held: list[int] = []
    guard = SimpleNamespace(timed=lambda _name, fn: fn(), hold=lambda pid, _fds: held.append(pid),
                            mark=lambda _name: None)
    whole = _Whole.__new__(_Whole)
    whole.savers, whole.taken, whole.partial = savers, [], tmp_path
    whole.take(guard)
    assert sorted(events[:4]) == [f"take {p}" for p in (10, 11, 12, 13)]
    assert events[4:] == [f"copy {p}" for p in (10, 11, 12, 13)]
    assert held == [10, 11, 12, 13]


def test_the_rest_of_the_arena_is_locked_once_the_job_runs_again() -> None:
    """Not while the job is held or frozen (the driver's registrations slowed its take 3-4x):
    from the frozen part's end (the job runs next, or is stopped for good), or, for the GPU
    state alone, which has no frozen part, from the release."""
    from pos.concurrent.saver import Taken
    from pos.settings import Settings

    calls: list[str] = []

    class Copier:
        def __getattr__(self, name: str) -> Any:
            return lambda *_: calls.append(name)

    agent = SimpleNamespace(copy=lambda: calls.append("job goes on"))
    t = Taken.__new__(Taken)
    t.copier = Copier()  # type: ignore[assignment]
    t.saver = SimpleNamespace(connected=lambda: agent, timings={},  # type: ignore[assignment]
                              settings=Settings())
    t.handout = SimpleNamespace(attach=lambda _agent: None)  # type: ignore[assignment]
    t.freeze()
    assert "lock_rest" not in calls
    t.thaw()
    assert calls[-1] == "lock_rest"
    calls.clear()
    t.release()
    assert calls == ["job goes on", "watch", "lock_rest"]


def test_a_saver_decides_from_the_status_the_checkpoint_read_first(
        fakegpu: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ring's split among the processes (HostRoom) counts from the checkpoint's reading of
    each agent's status; the saver's context and arena come from that reading too, not from a
    second one, which a job allocating between the two would make disagree."""
    monkeypatch.setenv("POS_LIBCUDA", str(fakegpu["libcuda"]))
    monkeypatch.setenv("POS_FAKECUDA_STATE_DIR", str(tmp_path / "fakecuda"))
    from pos import nvml
    from pos.concurrent import gpucopy
    from pos.concurrent.saver import Saver
    from pos.settings import Settings

    class Grown(EmptyAgent):
        def status(self) -> SimpleNamespace:       # allocated since the checkpoint asked
            return QuietAgent().status()

    monkeypatch.setattr(gpucopy, "Context", lambda *_: pytest.fail("a context was made"))
    monkeypatch.setattr(nvml, "gpus_of", lambda pids: {})
    first: Any = EmptyAgent().status()
    s = Saver.prepare(Grown(), Settings(), 2, 1 << 20, gpu_only=False,  # type: ignore[arg-type]
                      status=first)
    try:
        assert s.status is first and s.owned_bytes == 0 and s.context is None
    finally:
        s.close()


class OldAgent(QuietAgent):
    """The agent of a job started under a pos from before the `room` request."""

    def room(self, n: int) -> Room:
        raise Refused(self.pid, {"ok": False, "error": "unknown request"})


@pytest.mark.parametrize("agent_class", [QuietAgent, OldAgent])
def test_before_the_cut_both_tables_have_room_for_the_descriptors(
        fakegpu: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        agent_class: type) -> None:
    """The export's descriptors and the remap's are made while the job is held, where each
    growth of a table that threads share waits for an RCU grace period (fdroom.py): so room
    for them is made beforehand, in pos's table for every rank prepared beside this one, and
    in the job's. An agent from before the request leaves its table to grow, as before."""
    monkeypatch.setenv("POS_LIBCUDA", str(fakegpu["libcuda"]))
    monkeypatch.setenv("POS_FAKECUDA_STATE_DIR", str(tmp_path / "fakecuda"))
    from pos.concurrent import gpucopy
    from pos.concurrent.saver import Saver
    from pos.process import fdroom
    from pos.settings import Settings

    class Unlocked:
        PIECE = 1 << 20
        pinned_bytes, all_s, error = 0, 0.0, None

        def __init__(self, *_: Any, **__: Any) -> None:
            return None

        def close(self) -> None:
            return None

    made: list[int] = []
    monkeypatch.setattr(gpucopy, "Pinned", Unlocked)
    monkeypatch.setattr(fdroom, "make", made.append)
    agent: Any = agent_class()
    s = Saver.prepare(agent, Settings(), 2, 1 << 20, gpu_only=False, ranks=3)
    s.close()
    n = 4 + FD_MARGIN
    assert made == [3 * n]
    if agent_class is QuietAgent:
        assert agent.rooms == [n] and s.timings["fd_room"] == 0.003
    else:
        assert "fd_room" not in s.timings
