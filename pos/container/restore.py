"""`pos container restore`: a container image (pos/container/checkpoint.py) back as a new
container, its job running at once and its GPU memory filled while it runs.

The concurrent engine's restore does it (pos/concurrent/restore.py); only the tree
differs: podman makes the new container from its export (CRIU underneath) in new namespaces,
so one image gives as many containers as wanted, at once, each under its own name. The image's
checksums are verified before podman starts; anything that fails after removes the new
container, and so does a guard (podman.Guard) if pos is killed: none is left half restored."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from pos import image, nvml
from pos.driver import driver
from pos.container import ARCHIVE, podman
from pos.errors import BadInput
from pos.image.kinds import ImageKind
from pos.image.opened import open_image
from pos.process import procs
from pos.restore import preflight
from pos.restore.tree import Splice, TreeRequest, driver_back
from pos.operation.engine import Operation, Report
from pos.settings import Settings
from pos.operation.steps import Echo, Guard
from pos.operation.plan import RestorePlan


def restore(directory: Path, name: str, settings: Settings, echo: Echo = lambda _: None
            ) -> Report:
    """The image in `directory` as the new container NAME."""
    from pos import concurrent

    img = open_image(directory)         # not an image at all: that is the sentence
    if img.kind is not ImageKind.CONTAINER:
        raise BadInput(f"{img.path} is not a container's image (it has no {ARCHIVE})",
                       "restore it with `pos restore -D DIR`")
    if podman.exists(name):
        raise BadInput(f"a container named {name} exists", "choose another --name, or remove "
                       f"it with `podman rm -f {name}`")
    return concurrent.restore_full(img, echo=echo, settings=settings,
                                   tree=_Tree(name).restore)


class _Tree:
    """The processes back as the container NAME, as restore_tree brings a tree back (a
    tree_restore.Tree: the same request, the same splice; --inherit-fd is not asked)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def restore(self, request: TreeRequest, splice: Optional[Splice],
                echo: Echo = lambda _: None) -> Report:
        t = time.monotonic()
        img, check, gpu_pairs = request.image, request.check, request.gpu_pairs
        directory, manifest = img.path, img.manifest
        image.check_sums(directory, manifest, check)    # podman runs only a sound image
        if manifest.gpu_pids:
            driver()                        # no driver here: said before podman starts
            preflight.same_driver(img)
            preflight.same_model(img, {g.uuid: g for g in nvml.gpus()}, dict(gpu_pairs))
        if splice is not None:
            splice.checked()
        echo(f"restoring container {self.name} from {directory}")
        plan = RestorePlan([], [], images=str(directory), hoisted=splice is not None,
                           verify=None if check is None else list(check))
        guard = podman.Guard(self.name)
        try:
            with Guard(plan, echo, request.settings) as g:
                g.timings["prepare"] = time.monotonic() - t
                g.step("podman-restore")
                c = g.timed("podman_restore", lambda: podman.restore(directory / ARCHIVE,
                                                                     self.name))
                live = procs.restored_pids(c.pid, manifest.pids, manifest.inner_pids)
                cuda = [live[p] for p in manifest.gpu_pids]
                g.step("verify", pids=list(live.values()), gpu_pids=cuda)
                driver_back(g, cuda, gpu_pairs, splice, live)
            guard.done()
        except BaseException:
            podman.remove(self.name)
            raise
        finally:
            guard.close()
        return Report("concurrent", Operation.RESTORE, str(directory), manifest, timings=g.timings,
                      restored_pid=c.pid)
