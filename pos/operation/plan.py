"""What the undo of an operation needs to know: pos sends its plan to the watchdog at each step
(pos/operation/watchdog.py), and the undo, in pos or in the watchdog, reads nothing else.

Each operation has a plan of its own, holding what its undo reads and nothing more
(`CheckpointPlan`, `RestorePlan`, `MovePlan`); the undo is picked by the plan's type
(watchdog.UNDO). In the JSON sent to the watchdog a code (`KIND`) names the type."""

import json
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Optional

from pos.process import procs
from pos.settings import (DEFAULT_CRIU_LOG_MAX_MB, DEFAULT_CRIU_WAIT_S, DEFAULT_LOG_DIR,
                          Settings)


@dataclass
class Plan:
    """What every operation's undo needs: its processes, and the step begun last."""

    KIND: ClassVar[str]                       # names the type in the JSON (from_json)
    WHAT: ClassVar[str]                       # the operation, for a person

    pids: list[int]                           # the process tree
    gpu_pids: list[int] = field(default_factory=list)
    step: str = "start"                       # the step begun last (for the log)

    def who(self) -> str:
        """The operation's process, for a person."""
        return f"PID {self.pids[0]}"

    def begin(self, settings: Settings) -> None:
        """What the plan learns as its operation begins, just before the watchdog starts
        behind it (pos/operation/steps.py Guard); a move learns nothing."""

    def to_json(self) -> str:
        return json.dumps({"plan": {"kind": self.KIND, **asdict(self)}})


@dataclass
class ImagePlan(Plan):
    """What the undo of an operation that runs CRIU on an image needs too (a checkpoint's, a
    restore's)."""

    images: str = ""                          # checkpoint: DIR.partial; restore: DIR
    criu_pid: Optional[int] = None            # a running CRIU (its own process group)
    criu_log: str = ""                        # and its log (a restore's undo bounds it)
    criu_wait_s: float = DEFAULT_CRIU_WAIT_S  # how long the undo waits for a running CRIU
    hoisted: bool = False                     # the job's device memory is pos's (hoist..remap)
                                              # or not back yet (a concurrent image's restore)

    def begin(self, settings: Settings) -> None:
        self.criu_wait_s = settings.criu_wait_s


@dataclass
class CheckpointPlan(ImagePlan):
    """A checkpoint's: the tree as pos found it, and where CRIU writes."""

    KIND = "checkpoint"
    WHAT = "checkpoint"

    stopped: list[int] = field(default_factory=list)   # stopped before pos came: stay stopped
    parent: int = 0                           # the tree's parent, running when pos came (see
                                              # watchdog.end_tree)
    staging: str = ""                         # where CRIU writes, when not into DIR.partial
                                              # (pos/concurrent/staging.py)

    def begin(self, settings: Settings) -> None:
        """The processes stopped now stay stopped; a parent running now is continued with the
        tree."""
        super().begin(settings)
        self.stopped = [p for p in self.pids if procs.state(p) in ("T", "t")]
        parent = procs.parent(self.pids[0]) or 0
        if procs.state(parent) not in ("T", "t"):
            self.parent = parent


@dataclass
class RestorePlan(ImagePlan):
    """A restore's: its work folder, how the restored tree is finished, CRIU's lazy-pages
    daemon."""

    KIND = "restore"
    WHAT = "restore"

    work: str = ""                            # pos's work folder (CRIU's log, pidfile)
    gpu_pairs: list[list[str]] = field(default_factory=list)   # restore onto these GPUs
    verify: Optional[list[str]] = None        # the files checked before the restored tree may
                                              # run (None: all)
    criu_log_max: int = DEFAULT_CRIU_LOG_MAX_MB << 20   # CRIU's log bound (Criu.log_max)
    log_dir: str = DEFAULT_LOG_DIR            # where CRIU's logs of failed runs are kept
    lazy_pid: Optional[int] = None            # CRIU's lazy-pages daemon (its own process
                                              # group; pos/operation/lazypages.py)
    lazy_log: str = ""                        # and its log
    lazy_deadline: float = 0.0                # time.monotonic() by which it must have served
                                              # every page, or the tree is killed

    def who(self) -> str:
        """Into new namespaces, before CRIU has made them, the tree has no PID yet: its
        image."""
        return super().who() if self.pids else f"the image {self.images}"

    def begin(self, settings: Settings) -> None:
        super().begin(settings)
        self.log_dir = str(settings.log_dir)


@dataclass
class MovePlan(Plan):
    """A move onto other GPUs (pos/engines/migrate.py): its undo restores the processes onto
    the GPUs they were on, which the driver knows."""

    KIND = "move"
    WHAT = "migrate-gpu"


KINDS: dict[str, type[Plan]] = {k.KIND: k for k in (CheckpointPlan, RestorePlan, MovePlan)}


def from_json(d: dict[str, Any]) -> Plan:
    """The plan of Plan.to_json's object, of the type its code names."""
    return KINDS[d["kind"]](**{k: v for k, v in d.items() if k != "kind"})
