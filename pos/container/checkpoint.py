"""`pos container checkpoint`: a running container whose job was started with pos's agent (CDI
device pos.dev/agent) saved whole while it runs.

The concurrent engine's whole-process checkpoint does it (pos/concurrent/): the cut,
the job's memory taken and hoisted, the driver's checkpoint of its now small context; only the
dump differs: podman's own checkpoint of the container (CRIU underneath, run by runc), so that
the image holds what podman needs to make a container again (its configuration, its changed
files, its namespaces). CRIU's plugin hooks run nothing once the tasks are thawed, so pos's copy
of the GPU memory, which goes on while the job runs, cannot live inside the runtime's own
checkpoint: it stays pos's, beside podman's export, in one sealed image."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from pos.container import ARCHIVE, podman
from pos.container.cdi import AGENT, QUALIFIED
from pos.errors import BadInput
from pos.process import procs
from pos.operation.engine import Report, Save
from pos.settings import Settings
from pos.operation.steps import Echo, Guard


def checkpoint(name: str, directory: Path, leave_running: bool, settings: Settings,
               echo: Echo = lambda _: None) -> Report:
    """The container NAME into the image `directory`; stopped once the image is sealed unless
    `leave_running`. A failure leaves it running as it was (the engine's undo)."""
    from pos import concurrent

    c = podman.inspect(name)
    if not c.running or not c.pid:
        raise BadInput(f"container {name} is not running", "start it, or restore it from an "
                       "image with `pos container restore`")
    if not any(procs.maps_library(p, AGENT) for p in procs.tree(c.pid)):
        raise BadInput(f"container {name} has no pos agent", f"start it with `--device "
                       f"{QUALIFIED}` (after `pos cdi`)")
    # podman writes its archive, not CRIU's files: no staging of them in pos's tmpfs
    settings = replace(settings, dump_staging=False)

    def dump(g: Guard, folder: Path) -> None:
        # the undo waits for a running podman as for pos's own CRIU (pos/operation/watchdog.py)
        try:
            podman.checkpoint(c.id, folder / ARCHIVE,
                              lambda pid: g.step(g.plan.step, criu_pid=pid))
        finally:
            g.step(g.plan.step, criu_pid=None)

    # podman's checkpoint leaves the container running (the engine's thaw), and pos stops it
    # only once the image is sealed: until then a failure lets it run on
    report = concurrent.checkpoint_full(c.pid, directory, Save(leave_running=True), echo,
                                        settings, dump)
    if not leave_running:
        podman.stop(c.id)
    return report
