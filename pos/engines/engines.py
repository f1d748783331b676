"""The engines behind one small interface: `pos checkpoint`, `pos restore`, `pos migrate` and
the daemon choose an engine once (`for_checkpoint`, `for_image`, `by_name`) and then only call
it. Each one checkpoints, restores and moves a job onto other GPUs, and answers with one
`Report` (pos/operation/engine.py, with the requests and the protocol):

  StopTheWorld   the CUDA driver's checkpoint, then CRIU (any process; stopworld.py)
  Concurrent     a `pos run` job saved whole while it runs (pos/concurrent/)
  GpuOnly        a `pos run` job's GPU state alone, rolled back into the live job
                 (pos/concurrent/gpuonly.py)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from pos.image.kinds import ImageKind
from pos.image.opened import Opened, open_image
from pos.errors import BadInput, PosError
from pos.operation.engine import Engine, Load, Operation, Report, Save
from pos.operation.steps import Echo
from pos.progress import QUIET, Progress
from pos.operation.oplock import one_at_a_time, reads_image
from pos.settings import Settings

if TYPE_CHECKING:
    from pos.operation.gpumap import Onto


@dataclass
class _Base:
    settings: Settings
    echo: Echo = lambda _: None
    progress: Progress = QUIET


class StopTheWorld(_Base):
    name = ImageKind.STOP_THE_WORLD.value
    sends_pages = True

    @one_at_a_time
    def checkpoint(self, pid: int, directory: Path, save: Save) -> Report:
        from pos.engines import stopworld

        return stopworld.checkpoint(pid, directory, save, self.settings, self.echo,
                                    self.progress)

    @reads_image
    def restore(self, img: Opened, load: Load) -> Report:
        from pos.restore.tree import TreeRequest, restore_tree

        pairs: list[tuple[str, str]] = []
        if load.to_gpu is not None:
            from pos.operation import gpumap

            pairs = gpumap.onto(img.gpus, load.to_gpu)[0]
        return restore_tree(TreeRequest(img, self.settings, load.inherit_fds, tuple(pairs),
                                        hold=load.hold), echo=self.echo, progress=self.progress)

    @one_at_a_time
    def move(self, pid: int, onto: Onto, save: Save, keep: Optional[Path]) -> Report:
        """The driver's own move: checkpoint, then restore onto the other GPUs; no image."""
        from pos.engines import migrate

        timings = migrate.to_gpu(pid, onto, save.lock_timeout_ms, self.echo, self.progress,
                                 self.settings)
        return Report(self.name, Operation.MOVE, "", None, timings=timings)


class Concurrent(_Base):
    name = ImageKind.CONCURRENT.value
    sends_pages = False

    @one_at_a_time
    def checkpoint(self, pid: int, directory: Path, save: Save) -> Report:
        from pos import concurrent

        return concurrent.checkpoint_full(pid, directory, save, self.echo, self.settings)

    @reads_image
    def restore(self, img: Opened, load: Load) -> Report:
        from pos import concurrent

        return concurrent.restore_full(img, load.inherit_fds, echo=self.echo,
                                       to_gpu=load.to_gpu, settings=self.settings,
                                       started_s=load.started_s, hold=load.hold,
                                       running=load.running)

    @one_at_a_time
    def move(self, pid: int, onto: Onto, save: Save, keep: Optional[Path]) -> Report:
        """A whole-process image (the job frozen only for the driver's small checkpoint and
        CRIU's dump), restored onto the GPUs in a new process, its memory filled there while it
        runs. This works where the driver's own move cannot: its restore fails for memory that
        pos mapped back into the job. The image goes to `keep`, kept; without it to a temporary
        folder, removed once the job runs there, kept (and named) when the restore fails."""
        import shutil

        from pos.engines import migrate
        from pos.operation import gpumap
        from pos.process import procs

        procs.require_checkpointable(pid)
        gpumap.of_process([pid], onto)          # before the job is touched
        t0 = time.monotonic()
        folder = keep or migrate.image_dir(pid)
        saved = self.checkpoint(pid, folder, replace(save, leave_running=False,
                                                     page_server=None))
        t1 = time.monotonic()
        fix = f"its image stays in {saved.path} for `pos restore -D {saved.path} --to-gpu {onto}`"
        try:
            back = self.restore(open_image(Path(saved.path)), Load(to_gpu=onto))
        except PosError as e:
            raise type(e)(f"PID {pid} was saved but not restored onto GPU {onto}: {e.cause}",
                          f"{e.fix}; {fix}" if e.fix else fix) from None
        except Exception as e:
            raise PosError(f"PID {pid} was saved but not restored onto GPU {onto} ({e!r})",
                           fix) from e
        if keep is None:
            shutil.rmtree(saved.path, ignore_errors=True)
        self.echo(f"PID {pid} now runs on GPU {onto} as PID {back.restored_pid}")
        release = back.device.release_s if back.device else 0.0
        return Report(self.name, Operation.MOVE, saved.path if keep else "", back.manifest,
                      timings={"checkpoint": t1 - t0, "restore": time.monotonic() - t1,
                               "restore_release": release},
                      restored_pid=back.restored_pid or pid)


class GpuOnly(_Base):
    name = ImageKind.GPU_ONLY.value
    sends_pages = False

    @one_at_a_time
    def checkpoint(self, pid: int, directory: Path, save: Save) -> Report:
        from pos import concurrent
        from pos.concurrent.saver import DEFAULT_CHUNK_MB, SAVE_STREAMS

        return concurrent.checkpoint_gpu(pid, directory, save.streams or SAVE_STREAMS,
                                         save.chunk_mb or DEFAULT_CHUNK_MB, self.echo,
                                         self.settings)

    @reads_image
    def restore(self, img: Opened, load: Load) -> Report:
        from pos import concurrent
        from pos.concurrent.fill import FILL_STREAMS

        if load.pid is None:    # its files were checked when it was opened: a whole-process
            # image that lost its inventory is refused there, not taken for a GPU-only one
            raise BadInput(f"{img.path} is a GPU-only image (no process in it)",
                           "roll a live `pos run` job back to it with `pos restore --gpu-only "
                           "PID -D DIR`")
        return concurrent.restore_gpu(load.pid, img, load.streams or FILL_STREAMS,
                                      self.echo, self.settings)

    def move(self, pid: int, onto: Onto, save: Save, keep: Optional[Path]) -> Report:
        raise BadInput("a GPU-only image cannot move a job", "move it with `pos migrate PID "
                       "--to-gpu N` (with --concurrent for a `pos run` job)")


# each engine by its name, which is the kind of image it makes
ENGINES: dict[str, Callable[[Settings, Echo, Progress], Engine]] = {
    e.name: e for e in (StopTheWorld, Concurrent, GpuOnly)}


def for_checkpoint(concurrent: bool, gpu_only: bool, settings: Settings,
                   echo: Echo = lambda _: None, progress: Progress = QUIET) -> Engine:
    """The engine that `pos checkpoint` (or `pos migrate`) with these flags asks for."""
    kind = GpuOnly if gpu_only else Concurrent if concurrent else StopTheWorld
    return kind(settings, echo, progress)


def by_name(name: str, settings: Settings, echo: Echo = lambda _: None,
            progress: Progress = QUIET) -> Engine:
    return ENGINES[name](settings, echo, progress)


def for_image(img: Opened, settings: Settings, echo: Echo = lambda _: None,
              progress: Progress = QUIET) -> Engine:
    """The engine that restores the image `img`: its kind decides (a container's image is its
    runtime's to bring back, through `pos container restore`)."""
    if img.kind is ImageKind.CONTAINER:
        raise BadInput(f"{img.path} is the image of a container",
                       f"restore it with `pos container restore -D {img.path} --name NEW`")
    return ENGINES[img.kind.value](settings, echo, progress)
