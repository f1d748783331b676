"""What long work is doing now: the phase of a checkpoint, restore or migration, and its bytes
where they are known, as one rich line on stderr that goes away when the work ends. Only on a
terminal: in pipes, logs and with --json nothing is drawn, so scripts read exactly the report.

The engines call `phase` where a step begins (pos.operation.steps.Guard.step) and `advance`
as bytes get done; `QUIET` is the do-nothing instance they default to.
"""

from __future__ import annotations

import sys
import threading
from types import TracebackType
from typing import TYPE_CHECKING, Callable, Optional

import click

if TYPE_CHECKING:      # rich is imported only where a line is drawn: `pos restore` starts the
    from rich.progress import Progress as Bar, TaskID      # job sooner without it

POLL_S = 0.1


def _bar() -> Bar:
    """rich's progress line: spinner, phase, bar, bytes done (none for a phase that counts
    none) in binary units, as the summaries count them (MiB, GiB), time elapsed; on stderr,
    gone when done."""
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress as Bar, SpinnerColumn, Task,
                               TextColumn, TimeElapsedColumn)
    from rich.text import Text

    class Bytes(DownloadColumn):
        def render(self, task: Task) -> Text:
            return Text("") if not task.total and not task.completed else super().render(task)

    return Bar(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
               Bytes(binary_units=True), TimeElapsedColumn(), console=Console(stderr=True),
               transient=True)


class Progress:
    """One line of progress for one operation (`title`), drawn only when `enabled`."""

    def __init__(self, title: str = "", enabled: bool = False) -> None:
        self.title, self.enabled = title, enabled
        self.name = ""
        self._poll: Optional[Callable[[], int]] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bar: Optional[Bar] = None
        self._task: Optional[TaskID] = None
        self._poller: Optional[threading.Thread] = None

    @classmethod
    def on_terminal(cls, title: str, quiet: bool = False) -> "Progress":
        """Drawn when stderr is a terminal and the caller is not `quiet` (--json)."""
        if quiet or not sys.stderr.isatty():
            return cls(title, False)
        from rich.console import Console

        return cls(title, Console(stderr=True).is_terminal)

    def __enter__(self) -> "Progress":
        if self.enabled:
            self._bar = _bar()
            self._bar.start()
            self._task = self._bar.add_task(self.title, total=None)
            self._poller = threading.Thread(target=self._polling, name="pos-progress",
                                            daemon=True)
            self._poller.start()
        return self

    def __exit__(self, _t: Optional[type], _e: Optional[BaseException],
                 _tb: Optional[TracebackType]) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join()
        if self._bar is not None:
            self._bar.stop()

    def phase(self, name: str, total: Optional[int] = None,
              poll: Optional[Callable[[], int]] = None) -> None:
        """A phase begins: its bytes are `total` (None: not known), counted by `advance` or
        read by calling `poll`. The same phase named again (a step's own bookkeeping) goes
        on unchanged."""
        if not self.enabled or (name == self.name and total is None and poll is None):
            return
        with self._lock:
            self.name, self._poll = name, poll
            if self._bar is not None and self._task is not None:
                self._bar.update(self._task, description=f"{self.title}: {name}", total=total,
                                 completed=0, refresh=True)   # every phase drawn, if briefly

    def echo(self, text: str, err: bool = False) -> None:
        """Print a line of the work's steps (on stdout, or stderr when `err`): above the
        progress line, through its console, when both go to a terminal, so that the line is
        never written into the one being drawn."""
        stream = sys.stderr if err else sys.stdout
        if self._bar is not None and stream.isatty():
            self._bar.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            click.echo(text, err=err)

    def advance(self, done: int) -> None:
        """`done` more bytes of the phase are done (from any thread)."""
        if self._bar is not None and self._task is not None:
            self._bar.advance(self._task, done)

    def _polling(self) -> None:
        while not self._stop.wait(POLL_S):
            with self._lock:
                poll = self._poll
            if poll is not None and self._bar is not None and self._task is not None:
                try:
                    self._bar.update(self._task, completed=poll())
                except OSError:     # what it reads is being renamed or removed
                    pass


QUIET = Progress()
