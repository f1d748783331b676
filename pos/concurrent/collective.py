"""The cut of a job of several CUDA processes (DDP's ranks, each under `pos run` with its own
agent): every process held just before the same collective.

A rank held after launching collective k while a peer is held before launching it never
finishes synchronising: collective k waits for that peer. Every rank launches the same NCCL
collectives in the same order, and each agent counts its NCCL kernel launches from the job's
start (pos/agent/hook/cut.c: the collective cut). So pos reads every rank's count and asks
each to hold just before the launch past the highest count plus a margin; the ranks run on
meanwhile, each until it comes there, and every collective before that point completes. A rank
already past the point (it ran on between the reading and the asking) makes pos let the others
go and ask again, further on. A process that has made no collective (torchrun's launcher, which
initialised CUDA but trains nothing) is cut at once.
"""

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

from pos.agent.control import Agent, Cut, Refused
from pos.errors import PosError

AHEAD = 2         # launches past the highest count: room for ranks that run on meanwhile,
TRIES = 5         # four times more at each try
REACH_S = 30.0    # how long a rank may take to come to the point (a training step or more)


def cut_together(agents: Sequence[Agent], cut: Callable[[int, Optional[int]], Cut],
                 reach_s: float = REACH_S) -> list[Cut]:
    """Every agent's job held before the same NCCL launch and drained; `cut(i, at)` cuts
    agents[i] there (None: now; the caller times it). A failure other than a rank being past
    the point is raised, with every rank let go first."""
    seen = 0
    for attempt in range(TRIES):
        made = [a.status().nccl_launches for a in agents]
        at = max([seen, *made]) + AHEAD * 4 ** attempt
        with ThreadPoolExecutor(len(agents), thread_name_prefix="pos-cut") as pool:
            tries = [pool.submit(cut, i, at if n or seen else None) for i, n in enumerate(made)]
            errors = [f.exception() for f in tries]
        if not any(errors):
            return [f.result() for f in tries]
        for agent, error in zip(agents, errors):
            if error is None:
                agent.end()                    # held: it runs on
        past = [e.past for e in errors if isinstance(e, Refused) and e.past > at]
        other = [e for e in errors
                 if e is not None and not (isinstance(e, Refused) and e.past > at)]
        if other:
            first = other[0]
            if isinstance(first, Refused) and first.past >= 0:
                raise PosError(f"a process of the job made no NCCL collective within "
                               f"{reach_s:.0f} s ({first.cause})", "checkpoint the job while it "
                               "trains: pos cuts a job of several processes only just before "
                               "a collective, which every rank makes at the same point") from None
            raise first
        seen = max(past)
    raise PosError(f"the {len(agents)} processes of the job did not stop before the same NCCL "
                   f"collective in {TRIES} tries (each ran past the point pos asked for)",
                   "try again; if it persists, checkpoint it stop-the-world: "
                   "`pos checkpoint PID -D DIR --tcp-established`")
