"""`pos restore` of a concurrent image where no restore service answers: the restore runs in a
process of its own, detached from the command, so that the command returns once the job runs
while that process fills the rest of the job's device memory (the concurrent engine's fill), as
the restore service does (pos/engines/service.py). In the command's own process the fill held
`pos restore` 1-6 s past the job's first step at 30-90% of an H200 (bench/results/2026-11-30.md).

The restorer is a grandchild of the command, forked twice before pos imports the engines or
touches a GPU (a CUDA context does not survive a fork): in a session of its own, so that the
terminal's ^C and hangup do not reach it; stdin /dev/null; stdout and stderr into a log in
POS_LOG_DIR (DATE-PID-restore.log), opened by the command, which says so where it cannot. It
runs the service's restore (`service.restore`) and speaks the service's protocol over a socket
pair: the lines the restore echoes, Running once the job runs, then the outcome, which nobody
reads once the command has returned. Its log goes when the restore did not fail and wrote
nothing there; otherwise it ends with the outcome's sentence (or a bug's traceback). Like any
restore it has its own watchdog (pos/operation/watchdog.py), which undoes it should the
restorer die half-way.

What stays in the command's process: a shell job restored from a terminal (it is attached to
the command's terminal: the restorer answers InProcess), and the restores that --inherit-fd,
--gpu-only or --no-service ask for (pos/engines/commands.py). With --until-filled the command
waits for the restorer's outcome, the fill's figures in it.
"""

import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, NoReturn, Optional, Union

from pos import host
from pos.errors import BadInput, PosError
from pos.engines import service_client
from pos.engines.service_protocol import Failed, Held, Message, Request, Restored, Running

LOG = "{at}-{pid}-restore.log"
"""The restorer's log in POS_LOG_DIR, named as CRIU's kept logs are there: the command's start
(local time) and PID."""


def restore(directory: str, to_gpu: Optional[str], echo: Callable[[str], None],
            log_dir: Path, until_filled: bool = False
            ) -> Optional[Union[Restored, Running, Held]]:
    """The restore of the image in `directory` (onto `to_gpu`, --to-gpu's text) by a detached
    restorer: Running once the job runs while its device memory comes back, Restored where
    all of it came back first (always with `until_filled`); None where it is to be done in
    this process. A failure the restorer reports is raised here as the PosError it was
    there."""
    log = log_dir / LOG.format(at=time.strftime("%Y%m%dT%H%M%S"), pid=os.getpid())
    try:
        log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
    except OSError as e:
        raise BadInput(f"cannot write the restore's log {log} ({e.strerror or e})",
                       "give POS_LOG_DIR a folder root can write") from None
    request = Request(os.path.abspath(directory), to_gpu, host.age(os.getpid()), os.isatty(0),
                      False, not until_filled)
    ours, theirs = socket.socketpair()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        middle = os.fork()
    except OSError as e:        # no process to spare: the restore runs here
        echo(f"no process for the restore ({e.strerror or e}): restoring in this process")
        for end in (ours, theirs):
            end.close()
        os.close(fd)
        log.unlink()
        return None
    if middle == 0:
        ours.close()
        _restorer(theirs, fd, log, request)
    theirs.close()
    os.close(fd)
    os.waitpid(middle, 0)           # it leaves at once, its child detached

    def broken(why: str) -> PosError:
        return PosError(f"pos's restoring process gave no outcome for the restore of "
                        f"{directory} ({why})", f"see its log {log} and look for the job "
                        "before restoring again")

    with ours:
        try:
            return service_client.outcome(ours.makefile("rb"), echo, broken)
        except OSError as e:
            raise broken(e.strerror or str(e)) from None
        except KeyboardInterrupt:
            raise PosError(f"interrupted: the restore of {directory} goes on in its own "
                           "process", f"its log {log} says how it ended") from None


def _restorer(conn: socket.socket, fd: int, log: Path, request: Request) -> NoReturn:
    """The middle process: a session of its own, then its child restores and it leaves."""
    try:
        os.setsid()
        if os.fork() == 0:
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            # nothing else of the command's stays open here: the store's helper
            # (pos/store/ahead.py) learns from its stdin's end that the command is done with it
            keep = conn.fileno()
            os.closerange(3, keep)
            os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
            sys.stdout = open(1, "w", buffering=1, closefd=False)   # whatever wrapped them
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            _serve(conn, log, request)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()   # a bug: into the log, which the command names
    finally:
        os._exit(0)


def _serve(conn: socket.socket, log: Path, request: Request) -> None:
    """The restore, its messages to the command while it listens, its outcome into the log
    (the log removed where the restore did not fail and nothing else was written there)."""
    from pos.engines import service

    client = service.Client(conn)
    outcome: Message = service.restore(
        request, client.echo, running=client.send if request.answer_running else None)
    client.send(outcome)
    sys.stdout.flush()
    sys.stderr.flush()
    if isinstance(outcome, Failed):
        print(f"restore of {request.directory}: {outcome.error().message}", flush=True)
    elif log.stat().st_size == 0:       # restored, or left to the command (InProcess)
        log.unlink()
