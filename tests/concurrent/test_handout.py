"""Which restored buffers a job may use: those whose pointers (kept in their own bytes) lead only
to buffers that are back too, through any chain or cycle."""

import time

from pos.agent.control import Buffer
from pos.concurrent.handout import Handout, usable


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


class _Agent:
    """What the handout tells the job's agent."""

    def __init__(self) -> None:
        self.told: list[int] = []
        self.saved_told: list[int] = []

    def done(self, vas: list[int]) -> None:
        self.told += vas

    def saved(self, vas: list[int]) -> None:
        self.saved_told += vas


def _table(n: int) -> list[Buffer]:
    return [Buffer(0x1000 * (i + 1), 0x100, 0x1000, 0, True) for i in range(n)]


def test_a_checkpoint_hands_out_everything_once_only_shadowed_buffers_are_left() -> None:
    # buffers 0 and 1 are shadowed (their bytes as of the cut are kept), 2 and 3 are copied
    # from the running job: while 3 is not saved, 0 (which holds an address in 3) must wait
    h, agent = Handout(_table(4), safe={0, 1}), _Agent()
    h.attach(agent)
    h.points(0, [3])
    h.came_back(0)
    h.came_back(2)
    assert agent.told == [0x3000]                    # 2: nothing it points into is pending
    h.came_back(3)                                   # all that is left is shadowed
    assert sorted(agent.told) == [0x1000, 0x2000, 0x3000, 0x4000]


def test_a_checkpoint_says_which_buffers_own_bytes_are_safe_whatever_they_point_into() -> None:
    # 0 shadowed (safe from the cut), 1 and 2 copied from the running job; 0 holds an address
    # in 1. 0's own bytes are safe at once, 1's once in host memory; neither is done before 1
    # is back (its addresses known), which 0 waits for
    h, agent = Handout(_table(3), safe={0}), _Agent()
    h.attach(agent)
    assert agent.saved_told == [0x1000] and agent.told == []
    h.points(0, [1])
    h.came_back(0)
    h.captured(1)
    assert agent.saved_told == [0x1000, 0x2000] and agent.told == []
    h.came_back(1)
    assert sorted(agent.told) == [0x1000, 0x2000] and agent.saved_told == [0x1000, 0x2000]


def test_a_restore_hands_out_nothing_before_it_is_back() -> None:
    h, agent = Handout(_table(2)), _Agent()
    h.came_back(0)
    h.attach(agent)
    assert agent.told == [0x1000]
    h.came_back(1)
    assert agent.told == [0x1000, 0x2000] and agent.saved_told == []


def test_a_call_on_a_buffer_waits_for_what_it_reaches_that_is_not_back() -> None:
    # 0 (shadowed, scanned: back) -> 1 (back) -> 2 (not back) -> 0; 3 not back, unreached
    h = Handout(_table(4), safe={0})
    h.points(0, [1])
    h.points(1, [2])
    h.points(2, [0])
    h.came_back(0)
    h.came_back(1)
    assert h.needed([0]) == [2]
    assert sorted(h.needed([0, 3])) == [2, 3]
    h.came_back(2)
    assert h.needed([0]) == []


def test_a_checkpoint_says_what_a_waited_for_buffer_reaches_and_when_the_job_had_it() -> None:
    # 0 shadowed, holding addresses in 1, which holds one in 2: a call on 0 that may read
    # addresses out of it waits for both; 3 points nowhere
    h, agent = Handout(_table(4), safe={0}), _Agent()
    h.points(0, [1])
    h.points(1, [2])
    h.attach(agent)
    t0 = time.monotonic()
    for i in (0, 3, 1, 2):
        h.came_back(i)
    why = h.waited_for(0x1000, t0)
    assert why is not None and (why.va, why.bytes, why.shadowed) == (0x1000, 0x100, True)
    assert (why.reaches, why.reaches_bytes) == (2, 0x200)
    assert why.told_s is not None and 0 <= why.told_s <= time.monotonic() - t0
    assert why.back_s is not None and why.reach_back_s is not None
    assert 0 <= why.back_s <= why.reach_back_s <= why.told_s     # 0 came back before 1 and 2
    plain = h.waited_for(0x4000, t0)
    assert plain is not None and (plain.shadowed, plain.reaches, plain.reaches_bytes) == (
        False, 0, 0) and plain.reach_back_s is None
    inside = h.waited_for(0x1080, t0)                # a tensor inside buffer 0
    assert inside is not None and (inside.va, inside.reaches) == (0x1080, 2)
    assert h.waited_for(0x1100, t0) is None          # past its end: no buffer of the job's
