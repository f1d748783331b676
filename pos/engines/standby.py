"""Restores held ready, for `pos restore -D DIR --standby` served by `pos restore-service`: the
job restored as far as it goes without running (CRIU's restore of its processes, its image's
checksums, a concurrent image's device memory made and filled) and held there, its processes
stopped, until `pos restore -D DIR` asks for it. That restore then waits only for the rest: the
driver's restore of the job's CUDA state, its memory mapped back, its release. A restored
inference server spent 0.93-1.55 s of its first answer's 1.8-2.8 s in CRIU's restore of its
1.3-1.4 GiB of host memory (bench/results/2026-11-28.md).

A held job's processes have the image's PIDs: an image is held once at a time. Should the
service stop, its held restores end, their trees (which never ran) ended; should it die, each
restore's watchdog ends its tree (pos/operation/watchdog.py, step "standby").
"""

import threading
from typing import Callable, Optional, Union

from pos.engines.service_protocol import Failed, Held, InProcess, Request, Restored
from pos.errors import EXIT_BAD_INPUT, PosError

Outcome = Union[Restored, Failed, InProcess]
Say = Callable[[str], None]
Run = Callable[[Request, Say, Callable[[], None]], Outcome]
"""The service's restore of a request: its lines to `echo`, its `hold` (engine.Hold)."""


class Standby:
    """One restore held ready. Its thread runs the restore, which calls `hold` once the tree is
    restored and checked; `hold` returns once the job is asked for, and raises if the service
    stops first (the restore's undo then ends the tree)."""

    def __init__(self, request: Request, echo: Say) -> None:
        self.request = request
        self.echo_to = echo              # the lines go to the client that asked, each in turn
        self.changed = threading.Condition()
        self.held = self.asked = self.ended = False
        self.outcome: Optional[Outcome] = None
        self.thread: Optional[threading.Thread] = None

    def echo(self, text: str) -> None:
        self.echo_to(text)

    def hold(self) -> None:
        with self.changed:
            self.held = True
            self.changed.notify_all()
            self.changed.wait_for(lambda: self.asked or self.ended)
            if not self.asked:
                directory = self.request.directory
                raise PosError(f"the restore service stopped before {directory}, held ready, "
                               "was asked for", f"hold it again (`pos restore -D {directory} "
                               f"--standby`), or restore it (`pos restore -D {directory}`)")

    def start(self, run: Run) -> Optional[Outcome]:
        """The restore started, up to its hold: None once it holds, else its outcome (it
        failed, or its engine has nowhere to hold and restored the job whole)."""
        self.thread = threading.Thread(target=self._run, args=(run,), name="pos-standby")
        self.thread.start()
        with self.changed:
            self.changed.wait_for(lambda: self.held or self.outcome is not None)
            return None if self.held else self.outcome

    def _run(self, run: Run) -> None:
        outcome = run(self.request, self.echo, self.hold)
        with self.changed:
            self.outcome = outcome
            self.changed.notify_all()

    def ask(self, echo: Say) -> Outcome:
        """The job run: the rest of its restore, its lines to `echo`; its outcome."""
        with self.changed:
            self.echo_to, self.asked = echo, True
            self.changed.notify_all()
            self.changed.wait_for(lambda: self.outcome is not None)
            assert self.outcome is not None
            return self.outcome

    def end(self) -> None:
        """Not to be asked for any more: the restore ends (unless asked for already)."""
        with self.changed:
            self.ended = True
            self.changed.notify_all()


class Standbys:
    """The service's restores held ready, by image folder."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: dict[str, Standby] = {}

    def stage(self, request: Request, echo: Say, run: Run) -> Union[Held, Outcome]:
        """Hold the job of `request` ready: Held once it is, else the restore's outcome."""
        directory = request.directory
        with self.lock:
            if directory in self.held:
                return Failed(f"{directory} is held ready already", f"`pos restore -D "
                              f"{directory}` runs the job held", EXIT_BAD_INPUT)
            standby = self.held[directory] = Standby(request, echo)
        ended = standby.start(run)
        if ended is not None:
            with self.lock:
                del self.held[directory]
            return ended
        onto = f" onto GPU {request.to_gpu}" if request.to_gpu else ""
        return Held(directory, [f"held ready{onto}: {directory}, restored and checked, its "
                                "processes stopped", f"`pos restore -D {directory}` runs it"])

    def ask(self, request: Request, echo: Say) -> Optional[Outcome]:
        """The held job of `request`'s image run, and its outcome; None where none is held."""
        with self.lock:
            standby = self.held.get(request.directory)
            if standby is None:
                return None
            onto = standby.request.to_gpu
            if onto != request.to_gpu:
                return Failed(f"{request.directory} is held ready " + (
                    f"onto GPU {onto}" if onto else "for the GPUs it was taken on"),
                    f"`pos restore -D {request.directory}" + (f" --to-gpu {onto}" if onto
                                                               else "") + "` runs it",
                    EXIT_BAD_INPUT)
            del self.held[request.directory]
        return standby.ask(echo)

    def stop(self) -> int:
        """Every held restore ended, and waited for; how many there were."""
        with self.lock:
            standbys = list(self.held.values())
            self.held.clear()
        for standby in standbys:
            standby.end()
        for standby in standbys:
            if standby.thread is not None:
                standby.thread.join()
        return len(standbys)
