"""CRIU's pre-dump for a whole-process concurrent checkpoint: the tree's host memory copied while
the job runs, so that the frozen dump writes only the pages written since (CRIU's iterative
migration: `criu pre-dump --track-mem`, then `criu dump --track-mem --prev-images-dir`).

When pos tries it (`why_not` says why it does not), from CRIU 4.2's source and the runs here:
- The kernel must keep soft-dirty bits (CONFIG_MEM_SOFT_DIRTY): a pre-dump tracks memory always.
  Without them CRIU refuses --track-mem ("Tracking memory is not available") and, asked without
  it, aborts (BUG at criu/mem.c:46) after its parasite code was in the target: seen with CRIU
  4.2.1 on the 6.18 development VM, whose process ran on with CRIU's code still mapped. So pos
  asks CRIU first (`criu check --feature mem_dirty_track`) and never pre-dumps without them.
  None of the kernels pos was tested on has them (docs/engines.md says which).
- No process of the tree may map a device file (other than /dev/zero): a pre-dump reads the
  mappings as a dump does and refuses one that no plugin takes ("Can't handle non-regular
  mapping"), and CRIU's CUDA plugin turns itself off for pre-dumps (CRIU commit 82b03429b, its
  issue 2654: a CUDA process's /dev/nvidia0 mapping fails the pre-dump). A CUDA process maps
  /dev/nvidia* until the driver's checkpoint, which comes later, in the freeze: with CRIU <= 4.2
  no `pos run` job on a real GPU is pre-dumped. The fake driver of the tests maps none.

The pre-dump writes into the folder names.PARENT of the folder CRIU dumps into: the final dump
names it as its --prev-images-dir, relative, and makes no link since the folder has the link's
name; CRIU's restore reads the pages the final dump left there through it. So the image stays
one folder that seals, checksums and moves whole. The pre-dump freezes the tree too, while
CRIU finds its pages (`predump_frozen`), before the cut: that is not in the checkpoint's stall.
Any failure of the pre-dump leaves the frozen dump whole, and the note says why.
"""

import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

from pos.errors import PosError
from pos.image import criustats, names
from pos.operation.steps import Guard
from pos.process import procs
from pos.process.criu import Criu, Options

NO_SOFT_DIRTY = ("this kernel does not track dirty pages (soft-dirty), so CRIU cannot copy a "
                 "job's host memory before the freeze")
FIX_SOFT_DIRTY = "run a kernel built with CONFIG_MEM_SOFT_DIRTY=y"


@dataclass(frozen=True)
class Predump:
    """Whether the frozen dump was made incremental against a pre-dump; `note`: why not."""

    used: bool
    note: str = ""


@lru_cache(maxsize=None)
def tracks_dirty_pages(criu_path: str) -> Optional[bool]:
    """CRIU's own answer, `criu check --feature mem_dirty_track` (once per process: the kernel
    does not change under it); None when CRIU could not say (it needs root, or
    CAP_CHECKPOINT_RESTORE, to check)."""
    try:
        r = subprocess.run([criu_path, "check", "--feature", "mem_dirty_track"],
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode == 0:
        return True
    return False if "Dirty tracking is OFF" in r.stdout + r.stderr else None


def why_not(criu: Criu, pids: list[int], enabled: bool) -> Optional[str]:
    """Why the tree `pids` is not pre-dumped (see the module docstring); None: it is tried."""
    if not enabled:
        return "turned off (POS_PREDUMP=0)"
    tracks = tracks_dirty_pages(criu.path)
    if tracks is None:
        return f"{criu.path} could not say whether this kernel tracks dirty pages"
    if not tracks:
        return f"{NO_SOFT_DIRTY} ({FIX_SOFT_DIRTY})"
    for pid in pids:
        device = procs.device_mapping(pid)
        if device is not None:
            return (f"PID {pid} maps {device}, which CRIU's pre-dump cannot save (CRIU issue "
                    "2654); only the frozen dump, after the driver's checkpoint, can")
    return None


def run(g: Guard, criu: Criu, pid: int, dumped: Path, options: Options) -> Predump:
    """The pre-dump of the running tree of `pid` into `dumped`/PARENT, timed (`predump`; the
    time it froze the tree, `predump_frozen`; what it wrote, `predump_mib`), in the step that
    the caller began. A failure of it is a note: its folder goes, and the dump into `dumped`
    will be whole."""
    folder = dumped / names.PARENT
    folder.mkdir(mode=0o700)
    try:
        g.timed("predump", lambda: g.run_criu(criu, criu.predump_argv(pid, folder, options),
                                              "pre-dump", folder / names.PREDUMP_LOG))
    except PosError as e:
        shutil.rmtree(folder, ignore_errors=True)
        return Predump(False, e.message)
    stats = criustats.dump_stats(folder)
    if stats is not None:
        g.timings["predump_frozen"] = stats.freezing_s + stats.frozen_s
        g.timings["predump_mib"] = stats.pages_written * 4096 / 2**20
    return Predump(True)
