"""One way to run an operation's work on threads and stop it at the first failure: the copy of
a job's memory to host memory (gpucopy.run_chunks), the hashing and writing behind it
(copier.Copier) and a restore's fill all run so.

The first failure is the one raised (what the others then hit, `Stopped`, is not what the user
needs to hear); once it happened no thread takes more work; whoever waits on the crew learns of
it at once (`on_stop`); and every thread has ended when `wait` returns, so that the memory the
work used may be freed then.
"""

import threading
from typing import Callable, Optional, Sequence


class Stopped(Exception):
    """Work left undone because the crew stopped (another part failed, or it was stopped)."""


class Crew:
    def __init__(self, name: str, on_stop: Callable[[], None] = lambda: None) -> None:
        """`on_stop()`: wake what the crew's threads may be waiting on, once it stops."""
        self.name, self._on_stop = name, on_stop
        self.failure: Optional[BaseException] = None     # the first
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def fail(self, e: BaseException) -> None:
        """Record a failure (only the first is kept) and stop the crew."""
        with self._lock:
            if self.failure is None:
                self.failure = e
        self.stopped.set()
        self._on_stop()

    def stop(self) -> None:
        """Stop the crew without a failure of its own (the caller's failure, or its end)."""
        self.fail(Stopped())

    def check(self) -> None:
        """Raise Stopped once the crew has stopped: a thread takes no more work then."""
        if self.stopped.is_set():
            raise Stopped()

    def start(self, tasks: Sequence[tuple[str, Callable[[], None]]]) -> None:
        """Run each (name, task) on a thread of its own; a task's failure stops the crew."""
        def run(task: Callable[[], None]) -> None:
            try:
                task()
            except BaseException as e:  # noqa: BLE001  (recorded: the crew's caller raises it)
                self.fail(e)

        for name, task in tasks:
            t = threading.Thread(target=run, args=(task,), name=f"{self.name}-{name}",
                                 daemon=True)
            self._threads.append(t)
            t.start()

    def wait(self) -> None:
        """Until every thread started has ended."""
        for t in self._threads:
            t.join()

    def raise_failure(self) -> None:
        """The first failure (Stopped: the crew was stopped before any), if any."""
        if self.failure is not None:
            raise self.failure

    def run(self, tasks: Sequence[tuple[str, Callable[[], None]]]) -> None:
        """start, wait, and raise the first failure."""
        self.start(tasks)
        self.wait()
        self.raise_failure()
