"""The stop-the-world engine: the CUDA driver's checkpoint, then CRIU, as ordered steps with
their undo (pos/operation/steps.py). lock (with a timeout) -> driver checkpoint -> criu dump ->
[--leave-running: driver restore -> unlock] -> seal the image (checksums, manifest,
DIR.partial -> DIR) -> [without --leave-running: end the tree, which CRIU left stopped: until
the seal it can run on]. Its images come back through pos/restore/tree.py. Processes
without CUDA state skip the driver steps: CRIU alone.
"""

import time
from pathlib import Path

from pos import image, nvml
from pos.image import names
from pos.image.kinds import ImageKind
from pos.operation import restorable
from pos.operation.engine import Operation, Report, Save
from pos.operation.manifest import new_manifest
from pos.operation.plan import CheckpointPlan
from pos.operation.steps import Echo, Guard, folder_bytes
from pos.process import criu as criu_mod
from pos.process import cudackpt, procs
from pos.progress import QUIET, Progress
from pos.settings import Settings

MAPPED_BACK_FIX = ("checkpoint it with `pos checkpoint --concurrent` (to move it: copy that image "
                   "and `pos restore -D` it on the other host)")


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
    manifest = new_manifest(pid, pids, cuda, criu.version_text, options, leave_running, gpu_use)
    comm = manifest.comm
    plan = CheckpointPlan(pids, cuda, images=str(names.partial(Path(directory).absolute())))
    partial = image.prepare(directory, needed)    # just before the watchdog, which knows it
    with Guard(plan, echo, settings, progress) as g:
        echo(f"checkpointing PID {pid} ({comm}): {len(pids)} process(es), {len(cuda)} with "
             "CUDA state")
        start = time.monotonic()
        g.each("lock", cuda, lambda p: cudackpt.lock(p, save.lock_timeout_ms))
        restorable.recheck_locked(cuda, agents)
        g.each("checkpoint", cuda, cudackpt.checkpoint)
        progress.phase("dump", poll=lambda: folder_bytes(partial))
        g.step("dump")
        manifest.logs = procs.logs(pids)
        argv = criu.dump_argv(pid, partial, options, leave_running, page_server)
        g.dump(criu, argv, partial)     # without --leave-running: the tree stays, stopped
        if leave_running:
            g.each("restore", cuda, cudackpt.restore)
            g.each("unlock", cuda, cudackpt.unlock)
            manifest.stall_s = time.monotonic() - start if cuda else g.timings.get("frozen")
        g.step("seal")
        manifest.timings = g.timings
        progress.phase("checksum", total=folder_bytes(partial))
        final = g.timed("checksum", lambda: image.seal(partial, manifest, progress.advance))
        if not leave_running:
            g.end()
    manifest.timings = g.timings
    image.write_manifest(final, manifest)     # with the checksum's own time
    return Report(ImageKind.STOP_THE_WORLD.value, Operation.CHECKPOINT, str(final), manifest,
                  timings=g.timings)
