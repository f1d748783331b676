"""What an operation on a job is asked and what it answers, whichever engine runs it: the
requests (`Save`: how to checkpoint; `Load`: how to restore), the `Engine` protocol the engines
implement (pos/engines/engines.py), and the one typed `Report` they all answer with, which
says its `Operation` (checkpoint, restore or move) and whose JSON (`--json`, the daemon's
records) holds every field of every engine, absent ones null."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence, Union

from pos.agent.control import Cut, Gate
from pos.image import Manifest
from pos.image.opened import Opened
from pos.process.criu import Options, PageServer
from pos.settings import DEFAULT_LOCK_TIMEOUT_MS

if TYPE_CHECKING:
    from pos.operation.gpumap import Onto
    from pos.operation.steps import Echo


@dataclass(frozen=True)
class Save:
    """How to checkpoint: what the user asked for, whichever engine does it."""

    options: Options = field(default_factory=Options)
    leave_running: bool = False
    lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS
    streams: Optional[int] = None          # the concurrent engines' copy threads
    chunk_mb: Optional[int] = None
    page_server: Optional[PageServer] = None   # stop-the-world: the pages go there


Hold = Callable[[], None]
"""Where a restore may wait, its tree restored and checked but not yet run; it raises to end
the restore there (the tree, which never ran, is ended)."""

OnRun = Callable[["Report"], None]
"""Told once, with what the restore has done so far (a Report whose `filling` is set), when its
job runs while its device memory is still coming back (the concurrent engine's fill): the
restore service answers `pos restore` then, and fills the rest on its own."""


@dataclass(frozen=True)
class Load:
    """How to restore."""

    inherit_fds: tuple[str, ...] = ()
    to_gpu: Optional[Onto] = None
    pid: Optional[int] = None              # GPU-only: the live job rolled back
    streams: Optional[int] = None
    started_s: Optional[float] = None      # the start-up of the command that asked for the
                                           # restore (`pos restore`, served by the restore
                                           # service); None: this process's age at its start
    hold: Optional[Hold] = None            # a standby's (pos/engines/standby.py): called with
                                           # the tree restored and checked, before it runs
    running: Optional[OnRun] = None        # see OnRun


class Engine(Protocol):
    name: str
    sends_pages: bool     # its checkpoint can stream the pages to a page server (Save)

    @property
    def echo(self) -> Echo:
        """Where its steps' lines go (a field of the engine, read-only for its callers)."""
        ...

    def checkpoint(self, pid: int, directory: Path, save: Save) -> Report: ...

    def restore(self, img: Opened, load: Load) -> Report: ...

    def move(self, pid: int, onto: Onto, save: Save, keep: Optional[Path]) -> Report:
        """The job onto the GPUs `onto` names, on this host (`keep`: where an engine that goes
        through an image keeps it)."""
        ...


@dataclass
class RankSaved:
    """One process of a job of several (DDP's ranks), as a checkpoint saved it."""

    pid: int
    gpu: Optional[str]             # the GPU it ran on
    bytes: int                     # what pos copied of its device memory
    cut: Cut
    gate: Optional[Gate]           # its calls through the operation (None: it had no agent left)
    timings: dict[str, float] = field(default_factory=dict)    # its own copy's (the report's
    # timings hold the longest of the ranks')


@dataclass
class RankBack:
    """One process of a job of several (DDP's ranks), as a restore brought it back."""

    pid: Optional[int]             # its PID in the image
    gpu: Optional[str]             # the GPU it went onto
    bytes: int                     # what pos filled of its device memory
    gate: Gate


@dataclass
class WaitedFor:
    """A buffer the job's calls waited for in a checkpoint's copy, and why so long: its size,
    whether pos had shadowed it (its own bytes safe from the cut), and the buffers reachable
    through the addresses its words hold, which a call that may read addresses out of it
    waits for too."""

    va: int                        # the address the gate's wait named (in the buffer)
    bytes: int                     # the buffer's
    shadowed: bool
    reaches: int                   # other buffers reachable through its words
    reaches_bytes: int
    told_s: Optional[float]        # from the cut to when the job's calls could use it (None:
                                   # not before the copy's end)
    back_s: Optional[float]        # from the cut to when its own addresses were known
    reach_back_s: Optional[float]  # ... when every buffer it reaches was back too (None: it
                                   # reaches none, or one was not back before the end)


@dataclass
class DeviceCopy:
    """What pos itself copied of the jobs' device memory (the concurrent engines)."""

    buffers: int
    bytes: int
    cut: Optional[Cut]
    gate: Optional[Gate]           # the job's calls through the operation (the worst job's)
    shadow_bytes: int = 0
    release_s: float = 0.0         # from the cut (a restore: its start) to the job's release
    d2h_gbps: Optional[float] = None
    h2d_gbps: Optional[float] = None
    foreign_bytes: int = 0         # device memory the agent could not own: the driver's
                                   # checkpoint saves it in a whole-process image
    ranks: Sequence[Union[RankSaved, RankBack]] = field(default_factory=list)  # a job of
                                   # several CUDA processes: each one's part
    waited_for: list[WaitedFor] = field(default_factory=list)   # what the gate's waits named
                                   # (a checkpoint's: the worst job's)


class Operation(enum.Enum):
    """What an engine was asked to do: each engine says so in the Report it builds, so that
    what reads a report (the summary, scripts through --json) need not guess it from its
    fields."""

    CHECKPOINT = "checkpoint"
    RESTORE = "restore"
    MOVE = "move"


@dataclass
class Report:
    engine: str                    # stop-the-world, concurrent or gpu-only
    operation: Operation
    path: str                      # the image
    manifest: Optional[Manifest]   # the image's (None: a move that wrote none)
    timings: dict[str, float] = field(default_factory=dict)
    restored_pid: Optional[int] = None   # a restore into a new process: the job's PID there
    device: Optional[DeviceCopy] = None
    served: bool = False           # run by `pos restore-service` for a `pos restore` client
    filling: bool = False          # a restore's job runs, its device memory still coming back
    filler_pid: Optional[int] = None   # then: the process that fills it (`tail --pid` waits)

    @property
    def held_s(self) -> Optional[float]:
        """The longest the job stood still: where pos gated its calls (the concurrent engines:
        held at the cut and through the frozen part, then each call only for buffers not saved
        yet), the longest wait of any call; otherwise the driver's and CRIU's stall."""
        if self.device is not None and self.device.gate is not None:
            return self.device.gate.held_max_s
        return self.manifest.stall_s if self.manifest else None

    @property
    def restoring(self) -> bool:
        return self.operation is Operation.RESTORE

    def to_json(self) -> dict[str, Any]:
        """The outcome for scripts: one JSON object."""
        m = self.manifest
        out: dict[str, Any] = {
            "engine": self.engine, "operation": self.operation.value, "path": self.path,
            "pid": m.pid if m else None, "pids": m.pids if m else [],
            "gpu_pids": m.gpu_pids if m else [], "restored_pid": self.restored_pid,
            "size_bytes": m.size_bytes if m else 0, "files": len(m.files) if m else 0,
            "timings": self.timings, "served": self.served, "filling": self.filling,
            "filler_pid": self.filler_pid,
            "stall_s": m.stall_s if m else None,
            "predumped": m.predumped if m else None, "predump_note": m.predump_note if m else "",
            "logs": m.logs if m else {}}
        device = asdict(self.device) if self.device else {
            f: None for f in DeviceCopy.__dataclass_fields__}
        return {**out, **device}
