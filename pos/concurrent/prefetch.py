"""One job's device memory during a whole-process restore: made anew at the image's addresses
and filled from the image on a thread of its own while CRIU and the driver bring the process
back (they need no GPU copy), so that by the time the job maps the memory much of it is back.
The job's own cuMem memory that its checkpoint took (NCCL's buffers, pos/concurrent/ownmem.py)
is made and filled whole on the same thread first: the job maps it before it runs."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional, Sequence

from pos.agent.control import Buffer
from pos.concurrent import devices, ownmem
from pos.concurrent.fill import FILL_DEPTH, fill
from pos.concurrent.handout import Handout
from pos.errors import PosError
from pos.image import gpuindex
from pos.image.opened import Opened
from pos.settings import Settings

if TYPE_CHECKING:     # imported by the thread, beside CRIU: numpy's import takes 0.15 s
    from pos.concurrent import gpucopy


def fill_device(onto: Optional[str], taken_on: Optional[str], gpus: Sequence[dict[str, Any]]
                ) -> int:
    """CUDA's number of the GPU to fill: the one the job moves to (`onto`), else the one the
    image was taken on (asked of the driver alone: NVML's start-up is not on the way to the
    fill), else, where this host has not that GPU, device 0 (`gpus`: the image's manifest's,
    which NVML is asked about)."""
    from pos.concurrent import gpucopy

    if onto:
        return gpucopy.ordinal(onto)
    if taken_on:
        try:
            return gpucopy.ordinal(taken_on)
        except PosError:
            pass            # not seen by CUDA here: NVML says whether the host has it
    return devices.cuda_device(devices.home(gpus))


class Prefetch:
    """`handout.attach(agent)` lets the job's calls through for each buffer usable so far (see
    handout.usable), and for the rest as they come; `pause()`/`resume()` hold the fill around
    the driver's restore (Settings.fill_from); `join()` waits for it, `close()` lets pos's
    mapping and descriptors go (the job holds its own) whatever happened."""

    def __init__(self, img: Opened, streams: int, settings: Settings,
                 checked: threading.Event, onto: Optional[str] = None,
                 rank: Optional[int] = None, moved: Optional[dict[str, str]] = None) -> None:
        """`checked`: set once the restore's checks passed (the context is made before, the
        memory after)."""
        index = img.index(rank)
        self.img, self.streams, self.settings = img, streams, settings
        self.rank = rank        # one process of several: its PID (None: the image's one job)
        self.pid = index.pid    # the job's PID, which CRIU restores it with
        # the UUID of the GPU the job moves to (None: where it was); a process of several goes
        # where the map sends the GPU its index names
        gpu = index.gpu
        self.taken_on = gpu     # the UUID of the GPU the image was taken on
        self.onto = onto if rank is None else (moved or {}).get(gpu or "", gpu)
        self.saved = gpuindex.saved(img.path, index)
        self.table = sorted((Buffer(b.base, b.size, b.mapped, b.device, False, b.hot)
                             for b in index.buffers), key=lambda b: b.va)
        self.handout = Handout(self.table)
        self.context: Optional[gpucopy.Context] = None
        self.mem: Optional[gpucopy.Imported] = None
        self.own: Optional[ownmem.Made] = None     # its own cuMem memory, filled
        self.rings: Optional[gpucopy.Rings] = None
        self.fds: list[int] = []
        self.copy: Optional[gpucopy.Copy] = None
        self.error: Optional[BaseException] = None
        self.checked = checked
        self.ready = threading.Event()        # the memory exists (or creating it failed)
        self.go = threading.Event()           # the fill may go on
        self.released = False                 # the job was released (its restore succeeded)
        self.cancelled = False                # the restore failed: the fill stops
        if settings.fill_from != "release":
            self.go.set()
        # when (time.monotonic) the copier's modules were imported, the driver's context was
        # up, the memory existed, the staging was pinned, all was back
        self.imported_at = self.context_at = self.memory_at = self.pinned_at = 0.0
        self.own_at = 0.0         # when its own cuMem memory was made and filled
        self.started_at = self.filled_at = self.resumed_at = 0.0
        self.blocked_at = 0.0     # when the last fill thread stopped at the pause
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="pos-prefetch", daemon=True)

    def start(self) -> None:
        """Make the memory and fill it, on the thread of its own."""
        self.thread.start()

    def _run(self) -> None:
        try:
            from pos.concurrent import gpucopy     # here, beside CRIU: see the imports above

            self.imported_at = time.monotonic()
            own = ownmem.saved(self.img.path, self.rank)
            if not self.table and not own:   # a process of the tree with no device memory
                self._nothing()              # (torchrun's own): no context, no memory
                return
            device = fill_device(self.onto, self.taken_on, self.img.gpus)
            self.context = gpucopy.Context(device)
            drv = self.context.drv
            self.context_at = time.monotonic()
            self.checked.wait()
            if self.cancelled:
                return
            if own:
                self.own = ownmem.Made(drv, device, self.img.path, self.rank, own,
                                       self.img.manifest)
                self.own_at = time.monotonic()
            if not self.table:      # only its own cuMem memory
                self._no_fill(self.own_at)
                return
            mine = [replace(b, device=device) for b in self.table]
            self.mem, self.fds = gpucopy.Imported.create(drv, mine)
            self.memory_at = time.monotonic()
            self.ready.set()
            # the fill's staging: one arena pinned here, beside CRIU, rather than one per fill
            # thread at its first chunk, after the job's release
            self.rings = gpucopy.Rings(drv, self.streams, self.settings.fill_piece_bytes,
                                       FILL_DEPTH)
            self.pinned_at = time.monotonic()
            self._wait()
            self.started_at = time.monotonic()
            self.copy = fill(drv, self.table, self.mem.local, self.saved, streams=self.streams,
                             handout=self.handout, rings=self.rings,
                             mapped=self.settings.fill_mapped, gate=self._wait)
            self.filled_at = time.monotonic()
        except BaseException as e:      # raised in the caller's thread by join()
            self.error = e
        finally:
            self.ready.set()

    def _nothing(self) -> None:
        """Done at once: a context would cost the GPU 0.5 GB and the restore 0.6 s, beside
        NVML's start for the GPU to make it on."""
        self.context_at = self.imported_at
        self._no_fill(self.imported_at)

    def _no_fill(self, at: float) -> None:
        """No memory of the job's table to make or fill: all of it there `at` (time.monotonic)."""
        from pos.concurrent import gpucopy

        self.memory_at = self.pinned_at = self.started_at = self.filled_at = at
        self.copy = gpucopy.Copy(0, 0.0, 0.0)

    def pause(self) -> None:
        """Hold the fill after the chunks it is copying, until `resume`."""
        if self.settings.fill_from == "pause":
            self.go.clear()

    def resume(self) -> None:
        """The job is released: the fill goes on (or starts)."""
        self.released = True
        if not self.go.is_set():
            self.resumed_at = time.monotonic()
            self.go.set()

    def _wait(self) -> None:
        if not self.go.is_set():
            now = time.monotonic()
            with self.lock:
                self.blocked_at = max(self.blocked_at, now)
        self.go.wait()
        if self.cancelled:
            raise PosError("the restore failed before its fill ended", "see its error")

    def paused_s(self) -> float:
        """How long the pause held the whole fill: from when its last busy thread stopped at
        the pause (the chunks under way go on) until the release, if chunks were left."""
        if not self.blocked_at or not self.filled_at:
            return 0.0
        end = min(self.resumed_at or self.filled_at, self.filled_at)
        return max(0.0, end - max(self.blocked_at, self.started_at))

    def filled(self) -> None:
        """Until the fill has ended, where it runs before the job's release (Settings.fill_from
        is not `release`): a job held ready (a standby) is held with its memory all back."""
        if self.go.is_set():
            self.thread.join()

    def join(self) -> gpucopy.Copy:
        self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.copy is not None     # set by the thread, which raised otherwise
        return self.copy

    def close(self) -> None:
        """Wait for the fill, then let go of pos's mapping and descriptors (the job holds its
        own); after a failure the memory is freed."""
        if not self.released:      # the restore failed: the rest of the fill is not done
            self.cancelled = True
        self.checked.set()
        self.go.set()
        self.thread.join()
        if self.context is not None:
            self.context.use()
        if self.rings is not None:
            self.rings.close()
        if self.mem is not None:
            self.mem.close()
        if self.own is not None:
            self.own.close()
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        if self.context is not None:
            self.context.close()
