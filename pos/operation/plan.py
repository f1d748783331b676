"""What the undo of an operation needs to know (`Plan`): pos sends it to the watchdog at each
step (pos/operation/watchdog.py), and the undo, in pos or in the watchdog, reads nothing else."""

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from pos.settings import (DEFAULT_CRIU_LOG_MAX_MB, DEFAULT_CRIU_WAIT_S,
                                     DEFAULT_LOG_DIR)


@dataclass
class Plan:
    """Everything the undo needs to know, sent to the watchdog at each step."""

    op: str                                   # checkpoint, restore, migrate-gpu
    pids: list[int]                           # the process tree
    gpu_pids: list[int] = field(default_factory=list)
    step: str = "start"                       # the step begun last (for the log)
    stopped: list[int] = field(default_factory=list)   # stopped before pos came: stay stopped
    parent: int = 0                           # checkpoint: the tree's parent, running when pos
                                              # came (see end_tree)
    criu_pid: Optional[int] = None            # a running CRIU (its own process group)
    criu_log: str = ""                        # and its log
    work: str = ""                            # restore: pos's work folder (CRIU's log, pidfile)
    criu_path: str = ""
    images: str = ""                          # checkpoint: DIR.partial; restore: DIR
    staging: str = ""                         # checkpoint: where CRIU writes, when not into
                                              # DIR.partial (pos/concurrent/staging.py)
    criu_options: dict[str, Any] = field(default_factory=dict)
    gpu_pairs: list[list[str]] = field(default_factory=list)   # restore onto these GPUs
    hoisted: bool = False                     # the job's device memory is pos's (hoist..remap)
                                              # or not back yet (a concurrent image's restore)
    verify: Optional[list[str]] = None        # restore: the files checked before the restored
                                              # tree may run (None: all)
    criu_log_max: int = DEFAULT_CRIU_LOG_MAX_MB << 20   # restore: CRIU's log bound (Criu.log_max)
    criu_wait_s: float = DEFAULT_CRIU_WAIT_S  # how long the undo waits for a running CRIU
    log_dir: str = DEFAULT_LOG_DIR            # where CRIU's logs of failed runs are kept
    lazy_pid: Optional[int] = None            # restore: CRIU's lazy-pages daemon (its own
                                              # process group; pos/operation/lazypages.py)
    lazy_log: str = ""                        # and its log
    lazy_deadline: float = 0.0                # time.monotonic() by which it must have served
                                              # every page, or the tree is killed

    def who(self) -> str:
        """The operation's process for a person: its PID, or, for a restore into new
        namespaces before CRIU has made them, its image."""
        return f"PID {self.pids[0]}" if self.pids else f"the image {self.images}"

    def to_json(self) -> str:
        return json.dumps({"plan": asdict(self)})

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Plan":
        return cls(**d)
