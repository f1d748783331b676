"""What one checkpoint, restore or move did, whichever engine did it: one typed report, whose
JSON (`--json`, the daemon's records) holds every field of every engine, absent ones null."""

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from pos.agent.control import Cut, Gate
from pos.image import Manifest


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
    ranks: list[dict[str, Any]] = field(default_factory=list)   # a job of several CUDA
                                   # processes: each one's pid, gpu, bytes, cut and gate


@dataclass
class Report:
    engine: str                    # stop-the-world, concurrent or gpu-only
    path: str                      # the image
    manifest: Optional[Manifest]   # the image's (None: a move that wrote none)
    timings: dict[str, float] = field(default_factory=dict)
    restored_pid: Optional[int] = None   # a restore into a new process: the job's PID there
    device: Optional[DeviceCopy] = None

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
        return self.device is not None and self.device.h2d_gbps is not None

    def to_json(self) -> dict[str, Any]:
        """The outcome for scripts: one JSON object."""
        m = self.manifest
        out: dict[str, Any] = {
            "engine": self.engine, "path": self.path,
            "pid": m.pid if m else None, "pids": m.pids if m else [],
            "gpu_pids": m.gpu_pids if m else [], "restored_pid": self.restored_pid,
            "size_bytes": m.size_bytes if m else 0, "files": len(m.files) if m else 0,
            "timings": self.timings, "stall_s": m.stall_s if m else None,
            "predumped": m.predumped if m else None, "predump_note": m.predump_note if m else "",
            "logs": m.logs if m else {}}
        device = asdict(self.device) if self.device else {
            f: None for f in DeviceCopy.__dataclass_fields__}
        return {**out, **device}
