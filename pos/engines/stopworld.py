"""The stop-the-world engine: the CUDA driver's checkpoint, then CRIU, as ordered steps with
their undo (pos/operation/steps.py). lock (with a timeout) -> driver checkpoint -> criu dump ->
[--leave-running: driver restore -> unlock] -> seal the image (checksums, manifest,
DIR.partial -> DIR) -> [without --leave-running: end the tree, which CRIU left stopped: until
the seal it can run on]. Its images come back through pos/restore/tree.py. Processes
without CUDA state skip the driver steps: CRIU alone.

With --leave-running, a process that the driver cannot give its GPU state back in place, at
the first try and again, can never run again (the driver refuses every restore after a failed
one: NVIDIA's cuda-checkpoint issue 44). Its image is whole by then: pos seals it, ends the
job rather than leave it stuck, and says so, naming the image (which the driver may refuse
too) and the concurrent engine.
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pos import host, image, nvml
from pos.errors import PosError
from pos.image import names
from pos.image.kinds import ImageKind
from pos.operation import hostroom, restorable
from pos.operation.engine import Operation, Report, Save
from pos.operation.manifest import new_manifest
from pos.operation.plan import CheckpointPlan
from pos.operation.steps import Echo, Guard, folder_bytes
from pos.process import criu as criu_mod
from pos.process import cudackpt, kdat, procs
from pos.progress import QUIET, Progress
from pos.settings import Settings

MAPPED_BACK_FIX = ("checkpoint it with `pos checkpoint --concurrent` (to move it: copy that image "
                   "and `pos restore -D` it on the other host)")


@dataclass(frozen=True)
class Stuck:
    """The processes that the driver could not give their GPU state back in place, and why."""

    pids: list[int]
    cause: str


def back_in_place(g: Guard, cuda: list[int]) -> Optional[Stuck]:
    """--leave-running: every CUDA process back on the GPU, unlocked. A restore that fails is
    tried once more, as the undo would; if that gets every process back, the first failure is
    raised (the undo unlocks them: they run on, and the image is dropped, as before). Those it
    fails for twice are returned (see the module's docstring)."""
    try:
        g.each("restore", cuda, cudackpt.restore)
    except PosError as first:
        stuck = []
        for p in cuda:
            if procs.alive(p) and cudackpt.cuda_state(p) == "checkpointed":
                try:
                    cudackpt.restore(p)
                except PosError:
                    stuck.append(p)
        if not stuck:
            raise
        return Stuck(stuck, first.cause)
    g.each("unlock", cuda, cudackpt.unlock)
    return None


def checkpoint(pid: int, directory: Path, save: Save, settings: Settings,
               echo: Echo = lambda _: None, progress: Progress = QUIET) -> Report:
    """Checkpoint the tree rooted at `pid` into `directory` as `save` asks (see the module
    docstring)."""
    leave_running, page_server = save.leave_running, save.page_server
    pids, cuda = restorable.tree(pid)
    criu = criu_mod.find(settings)
    agents = restorable.require(cuda, MAPPED_BACK_FIX)
    options = save.options.fitted(pids)
    gpu_use = nvml.gpus_of(cuda) if cuda else {}
    # pages at least as large as what is resident, plus the device memory the dump will hold;
    # a page server takes the pages elsewhere
    needed = 0 if page_server else procs.resident_bytes(pids) + sum(gpu_use.values())
    hostroom.check(sum(gpu_use.values()), "the job's device memory",
                   not page_server and host.in_memory(Path(directory)),
                   host.memory_available(), "free host memory, write the image to a disk, or "
                   "save the job with `pos checkpoint --concurrent`, which leaves the driver "
                   "only its small context")
    manifest = new_manifest(pid, pids, cuda, criu.version_text, options, leave_running, gpu_use)
    comm = manifest.comm
    plan = CheckpointPlan(pids, cuda, images=str(names.partial(Path(directory).absolute())))
    partial = image.prepare(directory, needed)    # just before the watchdog, which knows it
    with Guard(plan, echo, settings, progress) as g:
        echo(f"checkpointing PID {pid} ({comm}): {len(pids)} process(es), {len(cuda)} with "
             "CUDA state")
        # CRIU's probes of the kernel kept before the job is held (pos/process/kdat.py)
        g.timed("criu_cache", lambda: kdat.keep(criu.path, criu.version_text))
        start = time.monotonic()
        g.each("lock", cuda, lambda p: cudackpt.lock(p, save.lock_timeout_ms))
        restorable.recheck_locked(cuda, agents)
        g.each("checkpoint", cuda, cudackpt.checkpoint)
        progress.phase("dump", poll=lambda: folder_bytes(partial))
        g.step("dump")
        manifest.logs = procs.logs(pids)
        argv = criu.dump_argv(pid, partial, options, leave_running, page_server)
        g.dump(criu, argv, partial)     # without --leave-running: the tree stays, stopped
        stuck: Optional[Stuck] = None
        if leave_running:
            stuck = back_in_place(g, cuda)
            manifest.stall_s = time.monotonic() - start if cuda else g.timings.get("frozen")
        g.step("seal")
        manifest.timings = g.timings
        progress.phase("checksum", total=folder_bytes(partial))
        final = g.timed("checksum", lambda: image.seal(partial, manifest, progress.advance))
        if not leave_running or stuck:
            g.end()
    manifest.timings = g.timings
    image.write_manifest(final, manifest)     # with the checksum's own time
    if stuck:
        raise PosError(f"the CUDA driver could not give PID {', '.join(map(str, stuck.pids))} "
                       f"its GPU state back in place ({stuck.cause}), and refuses every later "
                       f"try, so pos ended the job; its image {final} is whole and sealed, "
                       "but holds the GPU state the driver refused",
                       f"try `pos restore -D {final}` (the driver may refuse it the same way), "
                       "and save this job with `pos checkpoint --concurrent`, which leaves the "
                       "driver only the job's small context")
    return Report(ImageKind.STOP_THE_WORLD.value, Operation.CHECKPOINT, str(final), manifest,
                  timings=g.timings)
