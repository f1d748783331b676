"""The GPU-only engine: the GPU state of a `pos run` job at one instant, taken while it runs
(`checkpoint_gpu`: the concurrent engine's cut, export and copy, without CRIU or the driver's
checkpoint), and put back into the live job it was taken of (`restore_gpu`: the job's own
buffers filled on demand, each chunk through a fill thread's ring)."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

from pos import image, nvml
from pos.agent.control import Agent
from pos.concurrent import devices
from pos.concurrent.copier import host_room
from pos.concurrent.fill import FILL_DEPTH, FILL_STREAMS, fill
from pos.concurrent.handout import Handout
from pos.concurrent.saver import (DEFAULT_CHUNK_MB, SAVE_STREAMS, STALL_S, Saver, Taken,
                                  reconnected)
from pos.errors import BadInput
from pos.image import gpuindex
from pos.image.kinds import ImageKind
from pos.image.opened import Opened
from pos.operation.engine import DeviceCopy, Operation, Report
from pos.operation.manifest import new_manifest
from pos.operation.steps import Echo
from pos.process.criu import Options
from pos.settings import Settings


def checkpoint_gpu(pid: int, directory: Path, streams: int = SAVE_STREAMS,
                   chunk_mb: int = DEFAULT_CHUNK_MB, echo: Echo = lambda _: None,
                   settings: Optional[Settings] = None) -> Report:
    """The GPU state of `pid` at one instant, taken while it runs (rolls back only into a live
    job: restore_gpu)."""
    settings = settings or Settings.from_env()
    with Agent(pid) as first:
        status = first.status()
        saver = Saver.prepare(first, settings, streams, chunk_mb << 20, gpu_only=True,
                              status=status, host_room=host_room(settings, Path(directory),
                                                                 status.owned_bytes))
        taken: Optional[Taken] = None
        try:
            partial = image.prepare(Path(directory), saver.owned_bytes)
            echo(f"checkpointing the GPU state of PID {pid} concurrently: "
                 f"{saver.owned_bytes / 2**30:.2f} GiB of device memory")
            try:
                agent = reconnected(saver, echo)
                t0 = time.monotonic()
                cut = saver.cut()
                taken = saver.take()
                taken.start(partial)
                taken.release()
                release_s = time.monotonic() - t0
                taken.wait_copied()
                gate = agent.end()
                waited = taken.waited_for(gate, t0)
                manifest = new_manifest(pid, [pid], [pid], "", Options(), True,
                                        nvml.gpus_of([pid]))
                copy = taken.write(partial)
                manifest.timings = saver.timings
                manifest.stall_s = gate.held_max_s
                final = image.seal(partial, manifest)
            except BaseException:
                image.discard(partial)
                raise
        finally:
            if taken is not None:
                taken.close()
            saver.close()
            if saver.agent is not None:
                saver.agent.close()
    device = DeviceCopy(len(taken.table), copy.bytes, cut, gate, taken.shadow_bytes, release_s,
                        copy.bytes / copy.d2h_s / 1e9 if copy.d2h_s else None, None,
                        saver.foreign_bytes, waited_for=waited)
    return Report(ImageKind.GPU_ONLY.value, Operation.CHECKPOINT, str(final), manifest,
                  timings=saver.timings, device=device)


def restore_gpu(pid: int, img: Opened, streams: int = FILL_STREAMS,
                echo: Echo = lambda _: None, settings: Optional[Settings] = None) -> Report:
    """Put a GPU image back into the live job `pid`, on demand (the chunks as they were
    saved, each through a fill thread's ring); its index is read once the checksums of the
    image's own files passed."""
    from pos.concurrent import gpucopy

    settings = settings or Settings.from_env()
    directory, manifest = img.path, img.manifest
    image.check_sums(directory, manifest, img.checked_by_restore)
    echo(f"restoring the GPU state of PID {pid} from {directory}")
    index = img.index()
    saved, hot = gpuindex.saved(directory, index), index.hot
    with Agent(pid) as agent, gpucopy.Context(devices.device_of(pid)) as context:
        drv = context.drv
        rings = gpucopy.Rings(drv, streams, settings.fill_piece_bytes, FILL_DEPTH)
        try:
            t0 = time.monotonic()
            cut = agent.cut(STALL_S)
            table = [replace(b, touched=b.va in hot) for b in agent.table()]
            missing = [b for b in table if b.va not in saved or saved[b.va].size != b.size]
            if missing or len(saved) != len(table):
                agent.end()
                raise BadInput(f"the image {directory} does not hold the buffers process {pid} "
                               f"has now ({len(missing)} of {len(table)} differ)", "restore into "
                               "the job the image was taken of, in the same phase of its work")
            fds = agent.export().fds
            try:
                mem = gpucopy.Imported(drv, table, fds)
            finally:
                for fd in fds:
                    os.close(fd)
            try:
                agent.restore()
                release_s = time.monotonic() - t0
                handout = Handout(table)
                handout.attach(agent)
                copy = fill(drv, table, mem.local, saved, streams=streams, handout=handout,
                            rings=rings, mapped=settings.fill_mapped)
                gate = agent.end()
            finally:
                mem.close()   # on failure the agent ends a half-restored job as pos goes
        finally:
            rings.close()
    device = DeviceCopy(len(table), copy.bytes, cut, gate, 0, release_s, None, copy.gbps)
    return Report(ImageKind.GPU_ONLY.value, Operation.RESTORE, str(directory), manifest,
                  timings={"h2d": copy.seconds}, device=device)
