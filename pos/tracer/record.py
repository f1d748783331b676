"""`pos trace`: one recording from attach to the end, with the live view."""

import signal
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.live import Live
from sqlalchemy.orm import Session

from pos import host
from pos.store.db import default_db_path, open_db
from pos.store.models import Trace
from pos.tracer import late
from pos.tracer.probes import DEFAULT_RINGBUF_PAGES
from pos.tracer.session import Tracer
from pos.tracer.sink import Sink
from pos.tracer.target import find_libraries, process_exists
from pos.tracer.view import LiveView


def record(pid: int, db: Optional[str] = None, duration: Optional[float] = None,
           lib: Optional[str] = None, quiet: bool = False, ringbuf_pages: int = DEFAULT_RINGBUF_PAGES,
           interval: float = 0.02) -> int:
    """Trace PID until Ctrl-C/SIGTERM, `duration`, or its exit; returns the trace id."""
    libraries = find_libraries(pid, lib)   # bad PID or no GPU library: BadInput first
    host.require_tracing()
    comm, cmdline = host.describe(pid)
    db = db or default_db_path()
    engine = open_db(db)
    with Session(engine) as s:
        row = Trace(pid=pid, comm=comm, cmdline=cmdline, library=libraries[0].path,
                    started_at=datetime.now(timezone.utc), probes=0, status="running")
        s.add(row)
        s.commit()
        trace_id = row.id
    sink = Sink(db, trace_id)
    tracer: Optional[Tracer] = None
    status = "failed"
    view = LiveView(pid, comm)
    console = Console(stderr=True)
    live = Live(console=console, refresh_per_second=4, transient=False) \
        if not quiet and console.is_terminal else None
    # Ctrl-C and SIGTERM only set a flag: raised as an exception they could land between the
    # copy of a drained batch and its hand-off to the sink, and lose it, or break the stop.
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}

    def say(line: str) -> None:
        console.print(f"pos: {line}", highlight=False, soft_wrap=True)

    try:
        tracer = Tracer(pid, libraries, sink, ringbuf_pages=ringbuf_pages, say=say)
        sink.update_trace(probes=tracer.attached)
        say(f"tracing {pid} ({comm}): {tracer.attached} probes on "
            f"{', '.join(lib.path for lib in libraries)}; trace {trace_id} in {engine.url.database}")
        if live:
            live.start()
        view.started = tracer.attached_at
        deadline = tracer.attached_at + duration if duration else None
        while not stop.wait(interval):
            tracer.poll()
            if live:
                view.sample(tracer.stats)
                live.update(view.render(tracer.stats))
            if not process_exists(pid):
                status = "target-exited"
                break
            if deadline and time.monotonic() >= deadline:
                status = "done"
                break
        else:
            status = "stopped"       # by the user (Ctrl-C) or SIGTERM: no error
    finally:
        # the handlers stay until the end: a Ctrl-C during this teardown (say, the stop of a
        # trace whose target has just exited) must not break it half-way, leaving the sink and
        # the parse workers unjoined and pos hanging at exit
        if live:
            live.stop()
        if tracer is not None:
            tracer.detach()        # nothing is recorded after this...
            tracer.poll()          # ...and everything before it is drained
            if tracer.layouts_pending():
                say("finishing the kernel layouts still being read, to complete the launches "
                    "recorded before them")
            tracer.close()
        sink.update_trace(status=status, ended_at=datetime.now(timezone.utc),
                          lost_events=tracer.stats.lost if tracer else 0,
                          captures_dropped=tracer.stats.captures_dropped if tracer else 0)
        sink.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if tracer is not None:
        tracer.stats.completion = late.complete(engine, trace_id)
        tracer.stats.layout_known += tracer.stats.completion.completed
    print(view.summary(tracer.stats, tracer.seconds(), str(Path(db)), status)
          if tracer else "", file=sys.stderr)
    return trace_id
