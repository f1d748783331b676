"""Which restored buffers a job may use: those whose pointers (kept in their own bytes) lead only
to buffers that are back too, through any chain or cycle."""

from pos.scheduler.concurrent import usable


def test_a_buffer_without_pointers_is_usable_once_back() -> None:
    assert usable({0, 1}, {}, set()) == {0, 1}
    assert usable({0, 1}, {}, {0}) == {1}            # what the agent was told is not told again


def test_a_buffer_waits_for_every_buffer_its_pointers_reach() -> None:
    refers = {0: {1}, 1: {2}}                        # 0 -> 1 -> 2: an array of arrays
    assert usable({0, 1}, refers, set()) == set()    # 2 not back: neither 1 nor 0
    assert usable({0, 1, 2}, refers, set()) == {0, 1, 2}
    assert usable({0, 2}, refers, set()) == {2}      # 1 not back (its pointers unknown yet)


def test_buffers_that_point_at_each_other_come_together() -> None:
    refers = {0: {1}, 1: {0}, 2: {0}}
    assert usable({0}, refers, set()) == set()
    assert usable({0, 1}, refers, set()) == {0, 1}
    assert usable({0, 1, 2}, refers, {0, 1}) == {2}
