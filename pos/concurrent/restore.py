"""A whole-process concurrent image back, into new processes (`restore_full`: CRIU and the
driver's restore of the small context, then the job's memory mapped at the same addresses and
filled while it runs, a call waiting only for the buffers not back yet; a GPU-only image goes
back into its live job: gpuonly.py)."""

from __future__ import annotations

import os
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from pos.agent import peers
from pos.agent.control import Agent, Gate, Remap
from pos.concurrent import devices
from pos.concurrent.crew import side_by_side
from pos.concurrent.fill import FILL_STREAMS
from pos.concurrent.prefetch import Prefetch
from pos.errors import BadInput, PosError
from pos.image import names
from pos.image.kinds import ImageKind
from pos.image.opened import Opened
from pos.operation.engine import DeviceCopy, Hold, OnRun, Operation, RankBack, Report
from pos.operation.steps import Echo, Guard
from pos.restore import tree as tree_restore
from pos.settings import Settings

if TYPE_CHECKING:
    from pos.concurrent import gpucopy
    from pos.operation.gpumap import Onto


def ranks_of(img: Opened) -> tuple[Optional[int], ...]:
    """The jobs of a whole-process image (Opened.ranks); none is refused."""
    if not img.ranks:
        raise BadInput(f"{img.path} holds no GPU index", "give the -D of a `pos checkpoint "
                       "--concurrent`")
    return img.ranks


class _Refill:
    """The concurrent engine's part of a tree's restore (tree_restore.Splice): each job's CUDA
    context is made at once, beside the checks; its device memory only once the image and this
    host passed them (`checked`), so that a refusal leaves none behind; the fill pauses for
    the driver's restore; at the end the jobs map their memory back and run (`finish`), and
    `running` is told so while the fill goes on. What it brought back stays here, for the
    report."""

    def __init__(self, img: Opened, pres: list[Prefetch], links: list[peers.Link],
                 ready: threading.Event, t0: float, early: dict[str, Any],
                 running: Optional[OnRun]) -> None:
        self.img, self.pres, self.links, self.ready, self.t0 = img, pres, links, ready, t0
        self.early, self.running = early, running     # `early`: timings from before the tree
        self.release_s = self.ended_at = 0.0
        self.copies: list[gpucopy.Copy] = []
        self.gates: list[Gate] = []

    def checked(self) -> None:
        self.ready.set()

    def before_driver(self) -> None:
        for pre in self.pres:
            pre.pause()

    def finish(self, g: Guard, live: dict[int, int]) -> None:
        """The restored jobs map the other processes' memory they imported (its owners export
        it again) and the memory pos made for them, and run; the fill goes on."""
        g.step("remap")
        for pre in self.pres:      # pos's new device memory (made during CRIU's part)
            g.timed("memory", pre.ready.wait)
            if pre.error is not None:
                raise pre.error
        agents: list[Agent] = []
        try:
            for pre in self.pres:
                agents.append(Agent(live[pre.pid]))
                table = agents[-1].table()
                if [(b.va, b.size) for b in table] != [(b.va, b.size) for b in pre.table]:
                    raise PosError(f"the restored job's allocations do not match "
                                   f"{self.img.path}'s GPU index", "take a new checkpoint")
            owners = [(made, agent) for pre, agent in zip(self.pres, agents)
                      if (made := pre.own) is not None]
            if owners:         # before the imports: the peers import this memory again
                # beside CRIU's restore: the memory made and mapped, then filled from the image
                g.timings["own_make"] = max(made.make_s for made, _ in owners)
                g.timings["own_fill"] = max(made.fill_s for made, _ in owners)
                back: list[int] = []
                g.timed("own_up", lambda: side_by_side(
                    "pos-own-up", owners, lambda own: own[0].hand_over(own[1]), back.append))
                g.timings["own_back_bytes"] = sum(back)
            renamed = peers.renamed(self.links, live)
            if renamed:        # every job held still (hoisted): none runs before they are back
                g.timed("peers_up", lambda: peers.put_back(agents, renamed))
            remapped: list[Remap] = []      # every job at once
            g.timed("remap", lambda: side_by_side(
                "pos-remap", list(zip(self.pres, agents)),
                lambda pa: pa[1].remap(pa[0].fds, restore=True), remapped.append))
            g.timings["stack_back"] = max(r.stack_s for r in remapped)
            self.release_s = time.monotonic() - self.t0
            for pre, agent in zip(self.pres, agents):
                pre.handout.attach(agent)
                pre.resume()
            g.step("fill")
            if self.running is not None:
                try:
                    self.running(self._running(g, live))
                except Exception:  # noqa: BLE001  (a notice: the job runs on, the fill goes on)
                    traceback.print_exc()
            self.copies = [pre.join() for pre in self.pres]
            self.gates = [agent.end() for agent in agents]
            self.ended_at = time.monotonic() - self.t0
            g.step("done", hoisted=False)
        finally:
            for agent in agents:
                agent.close()

    def _running(self, g: Guard, live: dict[int, int]) -> Report:
        """What the restore has done by its job's release, its memory still coming back: the
        steps so far, and the device memory it fills in all (no rate, no gate yet)."""
        m = self.img.manifest
        timings: dict[str, Any] = {**g.timings, **self.early}
        return Report(ImageKind.CONCURRENT.value, Operation.RESTORE, str(self.img.path), m,
                      timings=timings,
                      restored_pid=live[m.pid], filling=True, filler_pid=os.getpid(),
                      device=DeviceCopy(
                          sum(len(pre.table) for pre in self.pres),
                          sum(b.size for pre in self.pres for b in pre.table), None, None,
                          release_s=self.release_s))


def movable(folder: Path, moving: bool) -> list[peers.Link]:
    """The image's peer links; refused when it is to move to other GPUs and has some (said
    before this host's GPUs are looked at: no host could move it)."""
    links = peers.read(folder)
    if moving and (links or any(folder.glob(names.OWN_MEMORY_INDEXES))):
        raise BadInput(f"the processes of {folder} map each other's GPU memory (NCCL's P2P "
                       "or SHM on cuMem), whose access pos puts back only on the GPUs they had",
                       "restore it without --to-gpu, onto the GPUs it was taken on")
    return links


def restore_full(img: Opened, inherit_fds: tuple[str, ...] = (),
                 streams: int = FILL_STREAMS, echo: Echo = lambda _: None,
                 to_gpu: Optional[Onto] = None, settings: Optional[Settings] = None,
                 started_s: Optional[float] = None,
                 tree: tree_restore.Tree = tree_restore.restore_tree,
                 hold: Optional[Hold] = None, running: Optional[OnRun] = None) -> Report:
    """Start the job of a whole-process concurrent image again, in a new process: CRIU, the
    driver's restore of its small context, then new device memory at the same addresses, filled
    from the image while the job runs (its calls wait only for the buffers not back yet). A job
    of several CUDA processes gets each one's memory back beside the others'. `to_gpu`: onto
    that GPU of this host (NVML's index), or that map of GPUs, rather than where it was taken.
    `started_s`: the start-up of the command that asked for the restore, reported as
    timings["pos_started_s"] (the restore service's client's; None: this process's age).
    `tree`: what brings the processes back, with this engine's part spliced in (a container's
    runtime does for a container: pos/container/). `hold`: see pos/operation/engine.py Hold;
    called once the fill has ended too. `running`: see OnRun there."""
    from pos import host

    settings = settings or Settings.from_env()
    t0 = time.monotonic()
    # pos's own start-up, before the restore's clock
    started = host.age(os.getpid()) if started_s is None else started_s
    links = movable(img.path, to_gpu is not None)
    pairs: list[tuple[str, str]] = []
    where: list[str] = []         # the UUIDs of the GPUs it moves to
    if to_gpu is not None:
        from pos.operation import gpumap

        pairs, where = gpumap.onto(img.gpus, to_gpu)
    ranks = ranks_of(img)
    moved = dict(pairs)
    ready = threading.Event()
    pres = [Prefetch(img, streams, settings, ready, where[0] if where else None)] \
        if ranks == (None,) else \
        [Prefetch(img, streams, settings, ready, None, rank, moved) for rank in ranks]
    cuda_start = time.monotonic()
    devices.start_cuda([pre.onto or pre.taken_on for pre in pres if pre.table])
    cuda_start = time.monotonic() - cuda_start
    for pre in pres:
        pre.start()
    refill = _Refill(img, pres, links, ready, t0,
                     {"pos_started_s": started, "cuda_start": cuda_start}, running)

    def filled_then_held() -> None:
        for pre in pres:
            pre.filled()
        assert hold is not None
        hold()

    try:
        result = tree(tree_restore.TreeRequest(
            img, settings, inherit_fds, tuple(pairs), tuple(img.checked_by_restore),
            None if hold is None else filled_then_held), refill, echo)
    finally:       # every job's at once: one after another, 0.43-0.47 s at 4 ranks
        t1 = time.monotonic()
        side_by_side("pos-let-go", pres, Prefetch.close, lambda _: None)
        let_go = time.monotonic() - t1
    return _report(result, refill, t0, let_go)


def _report(result: Report, back: _Refill, t0: float, let_go: float) -> Report:
    from pos.concurrent import gpucopy     # imported by the fill by now

    pres = back.pres
    paused = [pre.paused_s() for pre in pres]     # the fill's own time and rate leave its pause
    own = [c.seconds - p for c, p in zip(back.copies, paused)]    # out; side by side
    copy = gpucopy.Copy(sum(c.bytes for c in back.copies), max(own),
                        sum(c.read_thread_s for c in back.copies))

    def last(at: float) -> float:
        return at - t0

    rest = [pre.handout.rest_at(t0) for pre in pres]
    # the refill's early timings: pos_started_s (None where no command started the restore,
    # JSON's null) and cuda_start
    timings: dict[str, Any] = {**result.timings, **back.early, "h2d": copy.seconds,
               "read_threads": copy.read_thread_s, "fill_paused": max(paused),
               # from the restore's start: the new memory made, all of it back, the job's gate
               # ended; and pos's own mapping of the memory let go of
               "imported_at": last(max(p.imported_at for p in pres)),
               "context_at": last(max(p.context_at for p in pres)),
               **({"own_at": last(max(p.own_at for p in pres))}
                  if any(p.own_at for p in pres) else {}),
               "memory_at": last(max(p.memory_at for p in pres)),
               "pinned_at": last(max(p.pinned_at for p in pres)),
               "filled_at": last(max(p.filled_at for p in pres)),
               **{k: max(r[k] for r in rest) for k in rest[0]},
               "ended_at": back.ended_at, "let_go": let_go}
    worst = max(back.gates, key=lambda x: x.held_max_s)
    several = [RankBack(pre.rank, pre.onto, c.bytes, x)
               for pre, c, x in zip(pres, back.copies, back.gates)] if len(pres) > 1 else []
    return Report(ImageKind.CONCURRENT.value, Operation.RESTORE, result.path, result.manifest,
                  timings=timings, restored_pid=result.restored_pid, device=DeviceCopy(
                      sum(len(pre.table) for pre in pres), copy.bytes, None, worst, 0,
                      back.release_s, None, copy.gbps, 0, several))
