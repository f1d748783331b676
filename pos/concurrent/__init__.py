"""The concurrent engine: checkpoint and restore a `pos run` job while it runs, from outside it.

Checkpoint (the GPU state alone: gpuonly.py; the whole process: checkpoint.py):
 1. before the cut: page-locked host memory (as much as the job, where the host can spare it)
    and a device shadow (what is free) are set aside (saver.py);
 2. the cut (the agent holds the job's calls, drains those inside the driver, synchronises);
 3. the agent exports its allocations; pos imports them and copies what fits device-to-device
    into its shadow (milliseconds at HBM speed), then starts copying everything to host memory
    and the image's files (pos/concurrent/copier.py) on threads of its own;
 4. whole process: the job gives its physical memory up (pos holds it), the driver checkpoints
    the now small CUDA context, CRIU dumps the process (into pos's huge-page tmpfs,
    pos/concurrent/staging.py; only what changed since its pre-dump before the cut, where the
    kernel and the job allow one: pos/concurrent/predump.py), the driver restores and unlocks
    it, and the job maps its memory again at the same addresses; without --leave-running CRIU
    leaves the job stopped instead, and pos ends it once the image is sealed (until then a
    failure lets it run on);
 5. the job is released: a call waits only if it may write a buffer not saved yet
    (pos/concurrent/handout.py says when each is safe to write);
 6. once every buffer is in host memory pos lets go of the job's memory and its shadow, and
    once every chunk is written it seals the image.
Restore into a new process (restore.py), or of the GPU state alone into the live job
(gpuonly.py, the GPU-only engine, which checkpoints too): the job runs as soon as its
memory is mapped (prefetch.py makes and fills it); a call waits only for the buffers it may
touch that are not back yet, and pos fills them buffer by buffer (fill.py).

If pos dies, the agent releases a held job when its connection closes; while the job's memory
is pos's (step 4's hoist to remap) the watchdog holds it too and gives it back.
"""

from pos.concurrent.checkpoint import checkpoint_full
from pos.concurrent.gpuonly import checkpoint_gpu, restore_gpu
from pos.concurrent.restore import restore_full

__all__ = ["checkpoint_full", "checkpoint_gpu", "restore_full", "restore_gpu"]
