"""Which of the job's buffers its agent may let calls use during a concurrent operation, told as
pos learns it: one rule for the restore (a buffer is *back* once filled from the image) and for
the checkpoint (a buffer is *back* once its bytes as of the cut are in host memory, or, one pos
shadowed, once the GPU has scanned its shadow: copier.py).

A kernel reaches the buffers its parameter words point into (the agent's gate checks those),
and through them the buffers whose addresses they hold: so a buffer is handed out only once
every buffer reachable from it through the addresses in its bytes is back too. A checkpoint
learns a buffer's addresses as it scans its copy; until then, what the buffer points to is
unknown, and it waits. Once every buffer whose bytes are not yet in host memory (`captured`) is
one pos shadowed at the cut (`safe`: its bytes are kept, whatever the job does), no call can
spoil the image, and everything is handed out.

A checkpoint also tells the agent which buffers' own bytes are safe already (shadowed, or in
host memory: `saved`), whatever they point into: a kernel that writes only at the addresses
of its parameters (PyTorch's elementwise kernels, reductions and foreach kernels, hook/gate.c)
need not wait for more. On the H200 a fill kernel on a 786 MiB shadowed buffer waited 1.53 s
after a 60% job's release for what the buffer's words point into (bench/results/2026-11-30.md,
perf run 13). A checkpoint's report says, of each buffer its gate's waits named, what it
reached so (`waited_for`).
"""

import threading
import time
from collections.abc import Iterable, Iterator
from typing import Optional

from pos.agent.control import Agent, Buffer
from pos.operation.engine import WaitedFor


def not_back(start: Iterable[int], back: set[int], refers: dict[int, set[int]]
             ) -> Iterator[int]:
    """The buffers not back among `start` and among those reachable from them through the
    pointers their bytes hold (`refers`), as the walk finds them."""
    todo = list(start)
    seen = set(todo)
    while todo:
        i = todo.pop()
        if i not in back:
            yield i
        for j in refers.get(i, ()):
            if j not in seen:
                seen.add(j)
                todo.append(j)


def usable(back: set[int], refers: dict[int, set[int]], told: set[int]) -> set[int]:
    """The buffers back but not yet `told` that the job may use now: every buffer reachable
    from one through the pointers its bytes hold (`refers`) is back too. A kernel that reads
    an array of addresses out of a buffer then finds what they point to in place."""
    return {i for i in back - told if next(not_back([i], back, refers), None) is None}


class Handout:
    """Tells the job's agent which buffers its calls may use, as they come back."""

    def __init__(self, table: list[Buffer], safe: Iterable[int] = ()) -> None:
        self.table = table
        self.safe = set(safe)
        self.lock = threading.Lock()
        self.back: set[int] = set()
        self.refers: dict[int, set[int]] = {}     # buffer -> the others its words point into
        self.told: set[int] = set()
        self.told_saved: set[int] = set()         # told their own bytes are safe (saved)
        self.kept: set[int] = set()               # a checkpoint's: bytes in host memory
        self.agent: Optional[Agent] = None
        # when (time.monotonic) each buffer came back, and was handed to the job
        self.back_at: dict[int, float] = {}
        self.told_at: dict[int, float] = {}

    def points(self, i: int, into: Iterable[int]) -> None:
        """Buffer i's words (one chunk's) point into these buffers (table indices)."""
        with self.lock:
            self.refers.setdefault(i, set()).update(int(j) for j in into if j != i)

    def captured(self, i: int) -> None:
        """A checkpoint has buffer i's bytes as of the cut in host memory (its addresses may
        not be known yet)."""
        with self.lock:
            self.kept.add(i)
            self._tell()

    def came_back(self, i: int) -> None:
        with self.lock:
            self.back.add(i)
            self.back_at.setdefault(i, time.monotonic())
            self._tell()

    def needed(self, buffers: Iterable[int]) -> list[int]:
        """What the job's calls on these buffers wait for: each of them not back, and each
        buffer not back that one reaches through the addresses in their bytes (a shadowed
        buffer, back, may point into one that is not)."""
        with self.lock:
            return list(not_back(buffers, self.back, self.refers))

    def waited_for(self, va: int, t0: float) -> Optional[WaitedFor]:
        """What a call that waited on the address `va` (a tensor's: perhaps inside a buffer)
        waited for, the times from t0 (None: in no buffer of the table's): when the buffer's
        own addresses were known and when all it reaches was back, which tell a wait for the
        shadow's scan from one for the copy."""
        with self.lock:
            i = next((k for k, b in enumerate(self.table) if b.va <= va < b.va + b.size), None)
            if i is None:
                return None
            reach = set(not_back([i], set(), self.refers)) - {i}
            told, back = self.told_at.get(i), self.back_at.get(i)
            reach_back = [self.back_at[j] for j in reach if j in self.back_at]
            return WaitedFor(va, self.table[i].size, i in self.safe, len(reach),
                             sum(self.table[j].size for j in reach),
                             None if told is None else told - t0,
                             None if back is None else back - t0,
                             max(reach_back) - t0 if reach and len(reach_back) == len(reach)
                             else None)

    def rest_at(self, t0: float) -> dict[str, float]:
        """From t0: when every buffer but the biggest (the ones most calls wait for) was back,
        and handed to the job; and when all of them were back."""
        rest = sorted(range(len(self.table)), key=lambda i: self.table[i].size)[:-1]
        return {"rest_back_at": max((self.back_at.get(i, t0) for i in rest), default=t0) - t0,
                "rest_told_at": max((self.told_at.get(i, t0) for i in rest), default=t0) - t0,
                "all_back_at": max(self.back_at.values(), default=t0) - t0}

    def attach(self, agent: Agent) -> None:
        """The job (in its gate) may use the buffers usable so far, and the rest as they
        come."""
        with self.lock:
            self.agent = agent
            self._tell()

    def _tell(self) -> None:
        if self.agent is None:
            return
        if set(range(len(self.table))) - self.back - self.kept <= self.safe:
            now = set(range(len(self.table))) - self.told
        else:
            now = usable(self.back, self.refers, self.told)
        self.told |= now
        self.told_at.update((i, time.monotonic()) for i in now)
        saved = (self.safe | self.kept) - self.told - self.told_saved
        self.told_saved |= saved
        if saved:
            self.agent.saved([self.table[i].va for i in sorted(saved)])
        if now:
            self.agent.done([self.table[i].va for i in sorted(now)])
