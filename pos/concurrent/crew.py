"""One way to run an operation's work on threads and stop it at the first failure: the copy of
a job's memory to host memory (gpucopy.run_chunks), the hashing and writing behind it
(copier.Copier) and a restore's fill all run so.

The first failure is the one raised (what the others then hit, `Stopped`, is not what the user
needs to hear); once it happened no thread takes more work; whoever waits on the crew learns of
it at once (`on_stop`); and every thread has ended when `wait` returns, so that the memory the
work used may be freed then. Its threads may be started ahead of the work (`Spares`).
The processes of one job, each asked the same at once, run `side_by_side`.
"""

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Callable, Optional, Sequence, TypeVar


Task = Callable[[], None]
A = TypeVar("A")
R = TypeVar("R")


class Stopped(Exception):
    """Work left undone because the crew stopped (another part failed, or it was stopped)."""


class Spares:
    """Threads started before their work, each to run the one task it is handed later.

    Starting a thread waits until the new thread holds the GIL, which a busy thread gives up
    every switch interval (5 ms): beside one Python loop, 129 starts took 0.23-0.88 s, beside
    three 4.1-5.0 s, and handing 129 tasks to spares 1-2 ms (bench/thread_start.py). The copy
    of a checkpoint runs two threads per core of its share, and one per stream: started after
    the cut, they held the job (`copy_start`, 0.19 s a rank on 2x H200). Started before the
    cut, they only wait for a task. `close` lets those never handed one end."""

    def __init__(self, n: int, name: str) -> None:
        self._lock = threading.Lock()
        self._spare: list[tuple[threading.Thread, queue.SimpleQueue[Optional[Task]]]] = []
        for k in range(n):
            inbox: queue.SimpleQueue[Optional[Task]] = queue.SimpleQueue()
            t = threading.Thread(target=_serve, args=(inbox,), name=f"{name}-spare-{k}",
                                 daemon=True)
            t.start()
            self._spare.append((t, inbox))

    def __len__(self) -> int:
        """The spares not yet handed a task."""
        with self._lock:
            return len(self._spare)

    def hand(self, name: str, task: Task) -> Optional[threading.Thread]:
        """The spare thread now running `task` (named `name`); None when none is left."""
        with self._lock:
            if not self._spare:
                return None
            t, inbox = self._spare.pop()
        t.name = name
        inbox.put(task)
        return t

    def close(self) -> None:
        """The spare threads left end."""
        with self._lock:
            left, self._spare = self._spare, []
        for _t, inbox in left:
            inbox.put(None)


def _serve(inbox: queue.SimpleQueue[Optional[Task]]) -> None:
    task = inbox.get()
    if task is not None:
        task()


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

    def start(self, tasks: Sequence[tuple[str, Task]], spares: Optional[Spares] = None
              ) -> None:
        """Run each (name, task) on a thread of its own (one of `spares` while any is left);
        a task's failure stops the crew."""
        def run(task: Task) -> None:
            try:
                task()
            except BaseException as e:  # noqa: BLE001  (recorded: the crew's caller raises it)
                self.fail(e)

        for name, task in tasks:
            named = f"{self.name}-{name}"
            spare = spares.hand(named, partial(run, task)) if spares else None
            if spare is not None:
                self._threads.append(spare)
                continue
            t = threading.Thread(target=run, args=(task,), name=named, daemon=True)
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

    def run(self, tasks: Sequence[tuple[str, Task]], spares: Optional[Spares] = None) -> None:
        """start, wait, and raise the first failure."""
        self.start(tasks, spares)
        self.wait()
        self.raise_failure()


def side_by_side(name: str, items: Sequence[A], fn: Callable[[A], R],
                 keep: Callable[[R], None]) -> None:
    """`fn` of every item at once, on threads named `name` (one item: on this thread); `keep`
    of each result that came, in the items' order, even where another failed (what the
    failure's undo must give back); then the first failure is raised."""
    if len(items) == 1:
        keep(fn(items[0]))
        return
    with ThreadPoolExecutor(len(items), thread_name_prefix=name) as pool:
        tries = [pool.submit(fn, x) for x in items]
    for f in tries:
        if f.exception() is None:
            keep(f.result())
    for f in tries:
        f.result()
