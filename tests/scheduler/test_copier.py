"""How much page-locked host memory a checkpoint sets aside (pos/scheduler/copier.py)."""

import pytest

from pos import host as pos_host
from pos.errors import BadInput
from pos.scheduler import copier, gpucopy

GIB, CHUNK = 1 << 30, 64 << 20


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    def available(gib: float) -> None:
        monkeypatch.setattr(pos_host, "memory_available", lambda: int(gib * GIB))
    monkeypatch.delenv(copier.ARENA_ENV, raising=False)
    return available


def test_the_whole_job_where_the_host_can_spare_it(host) -> None:
    host(100)
    assert copier.arena_bytes(30 * GIB + 1, CHUNK) == 30 * GIB + CHUNK   # whole chunks


def test_what_the_host_can_spare_otherwise(host) -> None:
    host(20.5)                          # 2 GiB stay for everything else
    assert copier.arena_bytes(60 * GIB, CHUNK) == 18 * GIB + 8 * CHUNK


def test_at_most_the_limit_set(host, monkeypatch: pytest.MonkeyPatch) -> None:
    host(100)
    monkeypatch.setenv(copier.ARENA_ENV, "8")
    assert copier.arena_bytes(60 * GIB, CHUNK) == 8 * GIB


@pytest.mark.parametrize("gib, limit, says", [
    (2.5, None, "this host has 0.50 GiB to spare"),
    (100, "0.5", "POS_PIN_MAX_GIB=0.5 is under the 1.00 GiB"),
    (100, "lots", "POS_PIN_MAX_GIB=lots is not a number of GiB"),
])
def test_too_little_is_refused_in_one_sentence(host, monkeypatch: pytest.MonkeyPatch, gib: float,
                                               limit, says: str) -> None:
    host(gib)
    if limit:
        monkeypatch.setenv(copier.ARENA_ENV, limit)
    with pytest.raises(BadInput, match=says):
        copier.arena_bytes(60 * GIB, CHUNK)


def test_a_small_job_needs_only_itself(host) -> None:
    host(2.5)                           # half a GiB to spare: enough for 64 MiB
    assert copier.arena_bytes(10 << 20, CHUNK) == CHUNK


def test_the_buffers_calls_wait_for_are_copied_first() -> None:
    order = gpucopy.Order([(0, 0, 1), (0, 1, 1), (1, 0, 1), (2, 0, 1), (2, 1, 1)])
    assert order.take() == (0, 0, 1)
    order.want([2, 0])
    assert [order.take() for _ in range(4)] == [(2, 0, 1), (2, 1, 1), (0, 1, 1), (1, 0, 1)]
    assert order.take() is None
