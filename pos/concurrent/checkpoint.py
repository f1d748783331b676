"""A concurrent checkpoint of the whole process (`checkpoint_full`; the GPU state alone:
gpuonly.py), whose phases are the methods of `_Whole`, in the order `run` calls them:

  refuse     before anything is touched: no CUDA state, no agent, memory the driver cannot
             restore (pos/operation/restorable.py)
  prepare    each job's device shadow and page-locked arena (its ring: the rest is locked
             once the job runs again) (saver.Saver.prepare)
  predump    where the kernel and the tree let it, CRIU copies the tree's host memory while
             it runs (pos/concurrent/predump.py), for an incremental frozen dump
  cut        every job held, on a connection made just before it (saver.Saver.reconnect; a
             job of several: each just before the same collective,
             pos/concurrent/collective.py), asked again whether it maps a peer's memory; each
             import of another's memory matched with its owner (pos/agent/peers.py)
  take       each job's memory exported, imported by pos, shadowed; its copy begins; the
             descriptors handed to the watchdog (the jobs side by side, a thread each)
  hoist      the imports taken down; each job's own cuMem memory (NCCL's buffers) copied and
             given up (pos/concurrent/ownmem.py); the jobs give their physical memory up (pos
             holds it)
  freeze     the driver locks and checkpoints the now small contexts; CRIU dumps the tree
  thaw       --leave-running: the driver restores and unlocks, each job maps its memory again,
             the imports are put back, and it is released, gated; otherwise CRIU left the
             tree stopped
  seal       the copy ends, the GPU indexes and the manifest are written, the image sealed;
             without --leave-running the tree ends
"""

from __future__ import annotations

import functools
import os
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from pos import host, image, nvml
from pos.agent import peers
from pos.agent.control import Agent, Cut, Gate, Hoist, Remap, Status
from pos.concurrent import ownmem, predump, staging
from pos.concurrent.crew import side_by_side
from pos.concurrent.copier import host_room, host_spare
from pos.concurrent.saver import (DEFAULT_CHUNK_MB, SAVE_STREAMS, STALL_S, Saver, Taken,
                                   reconnected, timings_of)
from pos.errors import BadInput, PosError
from pos.image import filehash, names
from pos.image.kinds import ImageKind
from pos.operation import hostroom, restorable, steps
from pos.operation.engine import DeviceCopy, Operation, RankSaved, Report, Save
from pos.operation.manifest import new_manifest
from pos.operation.plan import CheckpointPlan
from pos.operation.steps import Echo, Guard
from pos.process import criu as criu_mod
from pos.process import cudackpt, kdat, procs
from pos.settings import Settings

if TYPE_CHECKING:     # numpy's import (0.15 s) is left to the copy
    from pos.concurrent.copier import Copied

# What dumps the tree once its jobs are small: `dump(guard, folder)` writes into `folder` (the
# default is pos's CRIU; a container's runtime dumps its container instead: pos/container/)
Dump = Callable[[Guard, Path], None]


def checkpoint_full(pid: int, directory: Path, save: Save, echo: Echo = lambda _: None,
                    settings: Optional[Settings] = None, dump: Optional[Dump] = None) -> Report:
    """A whole-process image of the tree of `pid`, whose CUDA processes are `pos run` jobs (see
    the module docstring), restorable into new processes by concurrent.restore.restore_full.
    `dump`: what dumps the tree in place of pos's CRIU (see Dump)."""
    return _Whole(pid, Path(directory), save, echo, settings or Settings.from_env(), dump).run()


class _Whole:
    """One whole-process concurrent checkpoint, phase by phase."""

    def __init__(self, pid: int, directory: Path, save: Save, echo: Echo, settings: Settings,
                 dump: Optional[Dump] = None) -> None:
        self.pid, self.directory, self.options = pid, directory, save.options
        self.leave_running, self.lock_timeout_ms = save.leave_running, save.lock_timeout_ms
        self.streams = save.streams or SAVE_STREAMS
        self.chunk = (save.chunk_mb or DEFAULT_CHUNK_MB) << 20
        self.echo, self.settings = echo, settings
        self._plan: Optional[CheckpointPlan] = None     # made by prepare
        self.started = time.monotonic()
        # before the cut, timed before the guard's timings exist: the command's start-up (its
        # age now), the refusals' questions
        self.early: dict[str, float] = {"to_start": host.age(os.getpid()) or 0.0}
        self.agents: list[Agent] = []
        self.statuses: dict[int, Status] = {}     # each agent's, before anything is touched
        self.savers: list[Saver] = []
        self.taken: list[Taken] = []
        self.cuts: list[Cut] = []
        self.gates: list[Optional[Gate]] = []
        self.copies: list[Copied] = []
        self.release_s = 0.0
        self.cut_at = 0.0                     # when the cut was (time.monotonic)
        self.links: list[peers.Link] = []     # imports of other processes' memory, taken down
        self.held: dict[int, Status] = {}         # each agent's status once its job was held
        self.own: dict[int, ownmem.Taken] = {}    # each job's own cuMem memory pos took, by PID
        self.own_ready: dict[int, ownmem.Ready] = {}   # made for it before the cut, by PID
        self.written: dict[str, filehash.Written] = {}  # image files hashed as written
        self.own_first: frozenset[int] = frozenset()   # own_plan by the statuses of `refuse`
        self.driver_bytes = 0       # device memory the driver's checkpoint brings into the jobs'
        # whether a rank's NCCL leaves NVLink SHARP on: asked before the cut, kept for the
        # cut's own check, where the ranks are held
        self.nvls = functools.cache(restorable.nvls_on)
        self.dump = dump

    def run(self) -> Report:
        try:
            return self._run()
        except PosError:
            if procs.alive(self.pid):
                raise
            step = self._plan.step if self._plan is not None and self._plan.step else "prepare"
            raise PosError(f"PID {self.pid} ended while pos was checkpointing it (at step "
                           f"{step}), so nothing was saved",
                           "see how the job ended (its exit status, its standard error), and "
                           "checkpoint a job that runs on") from None

    def _run(self) -> Report:
        steps.timed(self.early, "refuse", self.refuse)
        try:
            self.prepare()
            with Guard(self.plan, self.echo, self.settings) as g:
                stage = staging.directory(self.directory.name, self.partial,
                                          self.resident + self.driver_bytes,
                                          self.settings.dump_staging)
                self.predump(g, stage)
                t0 = self.cut_at = self.cut(g, stage)
                self.take(g)
                self.hoist(g)
                self.freeze(g, stage or self.partial)
                self.thaw(g)
                self.release_s = time.monotonic() - t0
                if stage is not None:
                    g.timed("move", lambda: staging.move_into(stage, self.partial))
                    g.step(g.plan.step, staging="")
                final = self.seal(g)
            self.manifest.timings = {**timings_of(self.savers), **g.timings}
            image.write_manifest(final, self.manifest)
        finally:
            self.close()
        return self.report(final)

    @property
    def plan(self) -> CheckpointPlan:
        """What the watchdog follows (prepare made it)."""
        assert self._plan is not None
        return self._plan

    @property
    def several(self) -> bool:
        return len(self.savers) > 1

    def refuse(self) -> None:
        """What cannot be saved this way, said before anything is touched; the agents."""
        pid = self.pid
        self.pids, self.cuda = restorable.tree(pid)
        self.criu = criu_mod.find(self.settings)
        self.options = self.options.fitted(self.pids)
        if not self.cuda:
            Agent(pid).close()             # no agent: that is the sentence to say
            raise BadInput(f"the tree of PID {pid} has no CUDA state", "checkpoint it with `pos "
                           "checkpoint PID -D DIR` (the concurrent engine saves `pos run` jobs)")
        try:
            for p in self.cuda:            # no agent: one sentence, before anything is touched
                self.agents.append(Agent(p))
            self.statuses = {a.pid: a.status() for a in self.agents}
            restorable.peer_memory(self.cuda, self.statuses, taken_down=True, nvls=self.nvls)
        except BaseException:
            self.close()
            raise

    def prepare(self) -> None:
        """The savers (page-locked arenas, shadows), the partial image, its manifest, and the
        plan the watchdog follows. The arenas share the checkpoint's bounds: one ring among the
        processes with device memory, and POS_PIN_MAX_GIB in all (HostRoom). The savers are
        prepared side by side, on threads, but for the locking of their arenas, which takes
        turns (HostRoom): one after another, the contexts (0.66 s each) and arenas (1.16 s) of
        the 4 ranks of the Llama2-13B-shaped job made its wait before the cut 6.95 s, against
        1.65 s at one rank (bench/results/2026-11-28-multigpu, run19). Should one fail, those
        made are closed (`close`) and the first failure is raised."""
        self.resident = procs.resident_bytes(self.pids)      # what CRIU will write, about
        taking = self.own_first = own_plan(self.statuses, self.settings)
        own_bytes = {pid: self.statuses[pid].own_bytes or 0 for pid in taking}
        # each saver's, and the jobs' own memory that pos takes
        owned = sum(st.owned_bytes for st in self.statuses.values()) + sum(own_bytes.values())
        room = host_room(self.settings, self.directory, self.resident + owned,
                         sum(1 for st in self.statuses.values() if st.owned_bytes),
                         self.resident if self.settings.dump_staging else 0)
        side_by_side("pos-prepare", self.agents, lambda a: Saver.prepare(
            a, self.settings, self.streams, self.chunk, gpu_only=False,
            ranks=len(self.agents), host_room=room, status=self.statuses[a.pid],
            take_own=a.pid in taking), self.savers.append)
        steps.timed(self.early, "own_reserve", self.reserve_own)
        self.driver_bytes = driver_bytes(self.statuses, sum(r.bytes for r in
                                                            self.own_ready.values()))
        # what the takes will copy into host memory, where the GPU has no room for it
        on_device = {pid: r.shadow.size if r.shadow is not None else 0
                     for pid, r in self.own_ready.items()}
        self.early["own_host_planned_bytes"] = own_host = sum(
            max(0, n - on_device.get(pid, 0)) for pid, n in own_bytes.items())
        hostroom.check(self.driver_bytes, "the job's device memory that pos does not take "
                       "(stream-ordered pools, managed memory)",
                       host.in_memory(self.directory), host_spare(),
                       "free host memory, or GPU memory for pos's copy of the job's own memory, "
                       "or write the image to a disk", own_host)
        steps.timed(self.early, "own_map_ahead", self.map_own)
        # CRIU's probes of the kernel out of the frozen dump (pos/process/kdat.py), made here
        # where /run cannot keep them: 0.06 s of the 30% job's stall on an H200 host
        steps.timed(self.early, "criu_cache", lambda: kdat.keep(self.criu.path,
                                                                 self.criu.version_text))
        self.early["anon_prepared_bytes"] = procs.anonymous_bytes(self.pids)
        self.partial = image.prepare(self.directory, self.resident + owned)
        self.manifest = new_manifest(self.pid, self.pids, self.cuda, self.criu.version_text,
                                     self.options, self.leave_running, nvml.gpus_of(self.cuda))
        self._plan = CheckpointPlan(self.pids, self.cuda, images=str(self.partial))
        self.echo(f"checkpointing PID {self.pid} ({self.manifest.comm}) concurrently: "
                  f"{owned / 2**30:.2f} GiB of device memory"
                  + (f" in {len(self.savers)} processes" if self.several else ""))

    def predump(self, g: Guard, stage: Optional[Path]) -> None:
        """CRIU's pre-dump of the running tree into the folder CRIU will dump into, where it
        can be (predump.why_not); whether it was used, and why not, in the manifest."""
        why = predump.why_not(self.criu, self.pids, self.settings.predump) \
            if self.dump is None else "the container's runtime dumps it whole, once"
        if why is None:
            g.step("predump", staging=str(stage or ""))
            self.pre = predump.run(g, self.criu, self.pid, stage or self.partial, self.options)
        else:
            self.pre = predump.Predump(False, why)
        self.manifest.predumped, self.manifest.predump_note = self.pre.used, self.pre.note

    def cut(self, g: Guard, stage: Optional[Path]) -> float:
        """Every job held, each on a connection made just now; when the cut began (the jobs'
        stall counts from there)."""
        g.step("reconnect", staging=str(stage or ""))
        self.agents = [reconnected(s, self.echo) for s in self.savers]
        t0 = time.monotonic()
        g.timings.update(self.early, to_cut=host.age(os.getpid()) or 0.0)   # from its start
        g.step("cut", staging=str(stage or ""))
        if self.several:
            from pos.concurrent import collective

            # timed whole (each rank's `cut` is its own); the marks below place the rest: at
            # 2 ranks the check after it had taken 0.18 s, the ranks held (self.nvls;
            # bench/results/2026-11-29-multigpu, runs 15 and 17)
            savers = self.savers
            self.cuts = g.timed("cut_together", lambda: collective.cut_together(
                self.agents, lambda i, at: savers[i].cut(
                    at, STALL_S if at is None else collective.REACH_S)))
        else:
            self.cuts = [self.savers[0].cut()]
        g.mark("held")
        # held now, every rank: nothing maps a peer's memory until they go on
        statuses = g.timed("held_status", lambda: {a.pid: a.status() for a in self.agents})
        self.held = statuses
        restorable.peer_memory(self.cuda, statuses, taken_down=True, nvls=self.nvls)
        g.mark("checked")
        if any(s.peer_maps for s in statuses.values()):
            self.links = g.timed("peers_match", lambda: peers.match(self.agents))
        return t0

    def take(self, g: Guard) -> None:
        """Every job's memory taken at once, on threads (each makes its job's context current
        on its own): one after another, the takes held the 4 ranks of the Llama2-13B-shaped job
        most of the 3.0 s between its cut and its hoist (bench/results/2026-11-28-multigpu,
        run14). The copies begin once every take is done: at 4 ranks the longest import took
        0.66 s against 0.013 s at one rank (run22), most likely beside the copies of the ranks
        done before it. What was taken is the watchdog's even where another take failed; the
        first failure is raised then."""
        def keep(t: Taken) -> None:
            self.taken.append(t)
            g.hold(t.pid, t.fds)       # while the job is held, its memory still

        g.timed("take", lambda: side_by_side(
            "pos-take", self.savers,
            lambda s: s.take(s.pid if self.several else None), keep))
        def start_copies() -> None:
            for t in self.taken:
                t.start(self.partial)

        g.timed("copy_starts", start_copies)
        g.mark("copying")

    def hoist(self, g: Guard) -> None:
        if self.links:
            agents = [s.connected() for s in self.savers]
            g.timings["peers_down_bytes"] = g.timed(
                "peers_down", lambda: peers.take_down(agents, self.links))
            g.mark("down")
            peers.write(self.partial, self.links)
        g.step("hoist", hoisted=True)
        self.take_own(g)
        # every job at once: one after another, the 5 processes of the 4-rank Llama job took
        # 0.27 s (bench/results/2026-11-28-multigpu, run23); the copy held meanwhile, as
        # around the driver's other calls in the job (Taken.paused)
        hoists: list[Hoist] = []
        g.timed("hoist", lambda: side_by_side(
            "pos-hoist", list(zip(self.savers, self.taken)),
            lambda st: st[1].paused(lambda: st[0].connected().hoist(
                self.settings.hoist_stack, self.settings.trim_heap)),
            hoists.append))
        for h in hoists:
            g.timings["stack_was_bytes"], g.timings["stack_rc"] = h.stack, h.stack_rc
            g.timings["trim"] = max(g.timings.get("trim", 0.0), h.trim_s)
            g.timings["hoist_loop"] = max(g.timings.get("hoist_loop", 0.0), h.loop_s)

    def owning(self, plan: frozenset[int]) -> list[Saver]:
        """The jobs whose own cuMem memory `plan` takes, of those with a context."""
        return [s for s in self.savers if s.context is not None and s.pid in plan]

    def reserve_own(self) -> None:
        """What each take needs made now (ownmem.ready): the device memory it will copy its
        job's own memory into, as much as the GPU has room for, and that memory exported and
        mapped."""
        for s in self.owning(self.own_first):
            s.use()
            assert s.context is not None     # owning: a job with a context
            self.own_ready[s.pid] = ownmem.ready(
                s.connected(), s.drv, s.context.device, self.statuses[s.pid].own_bytes or 0,
                functools.partial(steps.timed, self.early))
        self.early["own_reserved_bytes"] = sum(r.shadow.size for r in self.own_ready.values()
                                               if r.shadow is not None)
        self.early["own_ready_bytes"] = sum(r.bytes for r in self.own_ready.values())

    def map_own(self) -> None:
        """Each take's exported memory mapped in pos, and the host memory its copy goes into
        faulted in from now until the take (unless POS_OWN_HOST_AHEAD is 0), once the host is
        known to have room for it."""
        for s in self.owning(self.own_first):
            s.use()
            self.own_ready[s.pid].map(s.drv, functools.partial(steps.timed, self.early),
                                      self.settings.own_host_ahead)

    def take_own(self, g: Guard) -> None:
        """Each job's own cuMem memory (NCCL's buffers) copied and given up (ownmem; written
        into the image at the seal), every job held and every import of it down, for the jobs
        `owning` names; the rest is left to the driver's checkpoint. From here on a job runs
        only once its memory is back (own-up): should pos fail before that, the undo maps it
        back from the descriptors the watchdog holds too (and where even that fails, the job's
        agent ends it rather than let it run without)."""
        mine = self.owning(own_plan(self.held, self.settings))
        if not mine:
            return

        def take(s: Saver) -> tuple[int, ownmem.Taken]:
            s.use()
            assert s.context is not None     # mine: a job with a context
            return s.pid, ownmem.take(s.connected(), s.drv, s.context.device, s.timed,
                                      self.own_ready.pop(s.pid, None))

        def keep(kept: tuple[int, ownmem.Taken]) -> None:
            self.own[kept[0]] = kept[1]
            g.hold(kept[0], kept[1].fds, own=True)     # the undo maps it back (own-up)

        g.timed("own_take", lambda: side_by_side("pos-own", mine, take, keep))
        g.timings["own_taken_bytes"] = sum(t.bytes for t in self.own.values())
        g.timings["own_host_bytes"] = sum(t.bytes - t.on_device for t in self.own.values())
        g.timings["own_faulted_bytes"] = sum(t.faulted for t in self.own.values())
        behind = [t.fault_s for t in self.own.values() if t.fault_s is not None]
        if behind:          # faulted in from before the cut until the take
            g.timings["own_fault"] = max(behind)
        g.timed("own_down", lambda: side_by_side("pos-own-down", mine,
                                                 lambda s: s.connected().own_down(),
                                                 lambda _: None))

    def freeze(self, g: Guard, dumped: Path) -> None:
        """The driver's checkpoint of every job at once, then CRIU's dump into `dumped`."""
        for s, t in zip(self.savers, self.taken):
            s.connected().close()          # CRIU dumps no socket connected to pos
            t.freeze()
        by_pid = {t.pid: t for t in self.taken}
        g.each("lock", self.cuda, lambda p: cudackpt.lock(p, self.lock_timeout_ms))
        g.each("checkpoint", self.cuda, lambda p: by_pid[p].driver(
            "driver_checkpoint", lambda: cudackpt.checkpoint(p)))
        # against anon_prepared_bytes: what the hoist's trim gave back and the driver's
        # checkpoint added, which CRIU writes while the job is frozen (/proc reads, < 1 ms)
        g.timings["anon_frozen_bytes"] = procs.anonymous_bytes(self.pids)
        g.step("dump")
        dump = self.dump
        with ExitStack() as alone:        # every job's copy savers held for it (Taken)
            for t in self.taken:
                alone.enter_context(t.criu_alone())
            if dump is not None:
                g.timed("dump", lambda: dump(g, dumped))
                return
            g.dump(self.criu, self.criu.dump_argv(
                self.pid, dumped, self.options, self.leave_running,
                parent=names.PARENT if self.pre.used else None), dumped)

    def thaw(self, g: Guard) -> None:
        """--leave-running: the jobs back on the GPU with their memory, released. Otherwise
        CRIU left them stopped, their memory pos's: should anything fail before the image is
        sealed the undo lets them run on; after, they end."""
        if not self.leave_running:
            for s, t in zip(self.savers, self.taken):
                s.agent = None
                t.thaw()
            g.step("copy")
            return
        by_pid = {t.pid: t for t in self.taken}
        g.each("restore", self.cuda,
               lambda p: by_pid[p].driver("driver_restore", lambda: cudackpt.restore(p)))
        g.each("unlock", self.cuda, cudackpt.unlock)

        connect: list[float] = []

        def remap(st: tuple[Saver, Taken]) -> Remap:
            s, t = st
            t0 = time.monotonic()
            s.agent = Agent(s.pid)
            connect.append(time.monotonic() - t0)
            return t.paused(lambda: s.connected().remap(t.fds))

        backs: list[Remap] = []       # every job at once (one after another: 0.17 s at 4 ranks)
        g.timed("remap", lambda: side_by_side("pos-remap", list(zip(self.savers, self.taken)),
                                              remap, backs.append))
        g.timings["stack_back"] = max(b.stack_s for b in backs)
        # where the remap's time goes, the slowest job's: pos's new connection to its agent,
        # the descriptors' passage, the driver's calls for each buffer (bench/vmm_probe.py)
        g.timings["remap_connect"] = max(connect, default=0.0)
        g.timings["remap_rx"] = max(b.rx_s for b in backs)
        g.timings["remap_loop"] = max(b.loop_s for b in backs)
        if self.own:           # before the imports: the peers import this memory again
            owners = [s for s in self.savers if s.pid in self.own and self.own[s.pid].fds]
            g.timed("own_up", lambda: side_by_side(
                "pos-own-up", owners, lambda s: s.connected().own_up(self.own[s.pid].fds),
                lambda _: None))
        if self.links:         # every job held still: none runs before its imports are back
            agents = [s.connected() for s in self.savers]
            g.timed("peers_up", lambda: peers.put_back(agents, self.links))
        g.step("copy", hoisted=False)
        for t in self.taken:
            t.thaw()
        for t in self.taken:
            t.release()

    def seal(self, g: Guard) -> Path:
        for t in self.taken:
            t.wait_copied()
        if self.own:
            g.timed("own_write", self.write_own)
        self.gates = [s.agent.end() if s.agent is not None else None for s in self.savers]
        g.step("seal")
        self.copies = [t.write(self.partial) for t in self.taken]
        self.manifest.timings = {**timings_of(self.savers), **g.timings}
        self.manifest.stall_s = self.release_s if self.leave_running else None
        final: Path = g.timed("checksum", lambda: image.seal(self.partial, self.manifest,
                                                            written=self.written))
        g.timings["sealed_s"] = time.monotonic() - self.started
        if not self.leave_running:
            g.end(hoisted=False)       # the image holds the job now
        return final

    def write_own(self) -> None:
        """The own memory each job's take copied, into the image, the jobs side by side, hashed
        as written (`written`)."""
        def write(s: Saver) -> None:
            s.use()
            self.written.update(
                self.own[s.pid].write(s.drv, self.partial, s.pid if self.several else None))

        side_by_side("pos-own-write", [s for s in self.savers if s.pid in self.own], write,
                     lambda _: None)

    def close(self) -> None:
        for t in self.taken:
            t.close()
        for s in self.savers:
            if s.pid in self.own or s.pid in self.own_ready:
                s.use()               # the context its shadow and mapping were made in
            if s.pid in self.own:
                self.own[s.pid].close()
            if s.pid in self.own_ready:
                self.own_ready.pop(s.pid).close()
        for s in self.savers:
            s.close()
        for a in self.agents:
            a.close()
        for s in self.savers:
            if s.agent is not None:
                s.agent.close()

    def report(self, final: Path) -> Report:
        copied = sum(c.bytes for c in self.copies)
        d2h_s = max(c.d2h_s for c in self.copies)
        held = [(x.held_max_s, j) for j, x in enumerate(self.gates) if x is not None]
        worst_job = max(held)[1] if held else None      # whose gate held a call longest
        worst = self.gates[worst_job] if worst_job is not None else None
        ranks = ([RankSaved(s.pid, s.gpu, c.bytes, cut, x, dict(s.timings))
                  for s, c, cut, x in zip(self.savers, self.copies, self.cuts, self.gates)]
                 if self.several else [])
        return Report(ImageKind.CONCURRENT.value, Operation.CHECKPOINT, str(final),
                      self.manifest, timings=self.manifest.timings, device=DeviceCopy(
                          sum(len(t.table) for t in self.taken), copied, self.cuts[0], worst,
                          sum(t.shadow_bytes for t in self.taken), self.release_s,
                          copied / d2h_s / 1e9 if d2h_s else None, None,
                          sum(s.foreign_bytes for s in self.savers), ranks,
                          self.taken[worst_job].waited_for(worst, self.cut_at)
                          if worst_job is not None else []))


def driver_bytes(statuses: dict[int, Status], taken: int) -> int:
    """Device memory that the driver's checkpoint brings into the jobs' host memory: what their
    agents could not own (`foreign_bytes`: stream-ordered pools, managed memory, the jobs' own
    VMM mappings) but the other processes' memory that pos takes down (`peer_bytes`) and the
    jobs' own that it takes (`taken`)."""
    return max(0, sum(st.foreign_bytes - (st.peer_bytes or 0) for st in statuses.values())
               - taken)


def own_plan(statuses: dict[int, Status], settings: Settings) -> frozenset[int]:
    """Whose own cuMem memory a checkpoint takes, by their agents' `statuses`: of those with
    some,
    - those to which an earlier checkpoint or restore mapped some back from pos's descriptors
      (own_kept), always: the driver cannot restore that memory;
    - in a tree whose processes map each other's memory (NCCL's P2P and SHM on cuMem: what was
      measured; an image with such links is not moved to other GPUs either), all where there
      is no more of it in all than POS_OWN_MEMORY_MAX_GIB;
    - else (more of it: a job with PyTorch's expandable segments, all of whose memory is its
      own) every process's, unless POS_OWN_MEMORY_ON_GPU is 0: the driver's checkpoint then
      copies it while the job is held (20 GB held the GPT-2 job 31 s on an H200,
      bench/results/2026-12-01.md), and the image of a process alone can move to other GPUs.
    The take copies it on the device as far as the GPU has room, the rest into host memory."""
    mine = frozenset(pid for pid, st in statuses.items() if st.own_bytes)
    total = sum(statuses[pid].own_bytes or 0 for pid in mine)
    if any(statuses[pid].own_kept for pid in mine):
        return mine
    if any(st.peer_maps for st in statuses.values()) and total <= settings.own_memory_max_bytes:
        return mine
    return mine if settings.own_memory_on_gpu else frozenset()
