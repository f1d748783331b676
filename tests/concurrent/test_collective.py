"""The collective cut's choice of the point and its tries (pos/concurrent/collective.py), with
stand-in agents: every rank cut at the same point, the ranks held let go when one is past it,
and one sentence when they never come there."""

from dataclasses import dataclass, field
from typing import Optional

import pytest

from pos.agent.control import Cut, Refused
from pos.concurrent import collective
from pos.errors import PosError


@dataclass
class Rank:
    """A stand-in agent: its NCCL count, and how far it runs on between the reading and the
    asking (`runs`, per try)."""

    made: int
    runs: list[int] = field(default_factory=list)
    reach: bool = True           # comes to any point ahead of it
    cuts: list[Optional[int]] = field(default_factory=list)
    ended: int = 0
    pid: int = 1

    def status(self):  # noqa: ANN201  (what the engine reads of it)
        return type("S", (), {"nccl_launches": self.made})()

    def cut(self, at: Optional[int]) -> Cut:
        self.cuts.append(at)
        self.made += self.runs.pop(0) if self.runs else 0
        if at is not None and self.made > at:
            raise Refused(self.pid, {"error": "past", "past": self.made})
        if at is not None and not self.reach:
            raise Refused(self.pid, {"error": "not reached", "past": self.made})
        if at is not None:
            self.made = at + 1
        return Cut(0.0, 0.0, 1, 1)

    def end(self) -> None:
        self.ended += 1


def cut(ranks: list[Rank]) -> list[Cut]:
    return collective.cut_together(ranks, lambda i, at: ranks[i].cut(at), reach_s=1)


def test_every_rank_is_cut_at_the_same_point_past_the_highest_count() -> None:
    ranks = [Rank(10), Rank(12)]
    assert len(cut(ranks)) == 2
    assert ranks[0].cuts == ranks[1].cuts == [12 + collective.AHEAD]


def test_a_rank_past_the_point_lets_the_others_go_and_they_try_further_on() -> None:
    ranks = [Rank(10), Rank(10, runs=[50])]
    cut(ranks)
    _first, second = ranks[0].cuts
    assert ranks[0].ended == 1                    # held at the first point, then let go
    assert second >= 60 and ranks[1].cuts[1] == second


def test_a_process_that_made_no_collective_is_cut_at_once() -> None:
    launcher, r0, r1 = Rank(0), Rank(7), Rank(7)
    cut([launcher, r0, r1])
    assert launcher.cuts == [None] and r0.cuts == r1.cuts == [7 + collective.AHEAD]


def test_ranks_that_never_come_there_are_let_go_with_one_sentence() -> None:
    ranks = [Rank(5), Rank(5, reach=False)]
    with pytest.raises(PosError, match="made no NCCL collective within 1 s"):
        cut(ranks)
    assert ranks[0].ended == 1


def test_ranks_always_past_the_point_give_up_after_the_tries() -> None:
    ranks = [Rank(5), Rank(5, runs=[10 ** 6] * collective.TRIES)]
    with pytest.raises(PosError, match="did not stop before the same NCCL collective"):
        cut(ranks)
    assert ranks[0].ended == collective.TRIES
