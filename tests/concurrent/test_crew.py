"""The threads a checkpoint's copy runs on (concurrent/crew.py): started ahead of their work
(Spares), each runs the one task it is handed, under the crew's name; a crew short of spares
starts the rest itself; spares never handed a task end at `close`; a failure is the crew's."""

import threading

import pytest

from pos.concurrent.crew import Crew, Spares


def test_a_crew_runs_on_spares_and_starts_the_rest_itself() -> None:
    spares = Spares(2, "t")
    ran: list[str] = []
    lock = threading.Lock()

    def task(name: str):
        def run() -> None:
            with lock:
                ran.append(threading.current_thread().name)
        return name, run

    spare = [t for t in threading.enumerate() if t.name.startswith("t-spare-")]
    crew = Crew("copy")
    crew.run([task("a"), task("b"), task("c")], spares)
    assert sorted(ran) == ["copy-a", "copy-b", "copy-c"]
    assert len(spare) == 2 and not any(t.is_alive() for t in spare)    # each ran one, ended
    assert not [t for t in threading.enumerate() if t.name.startswith("copy-")]
    assert spares.hand("late", lambda: None) is None      # none is left


def test_spares_never_handed_a_task_end_at_close() -> None:
    spares = Spares(3, "idle")
    threads = [t for t in threading.enumerate() if t.name.startswith("idle-spare-")]
    assert len(threads) == 3
    spares.close()
    for t in threads:
        t.join(timeout=5)
        assert not t.is_alive()


def test_a_failure_on_a_spare_is_the_crews() -> None:
    def fails() -> None:
        raise OSError("disk full")

    crew = Crew("copy")
    with pytest.raises(OSError, match="disk full"):
        crew.run([("w", fails)], Spares(1, "f"))
    assert crew.stopped.is_set()
