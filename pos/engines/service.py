"""`pos restore-service`: a resident process that restores images for `pos restore`, with what
a restore would first have to set up made once, at its start:

  - the restore's Python modules (the engines, CRIU's and the driver's modules, numpy, the
    image's chunk reader), which `pos restore` imports on its way to CRIU, and CRIU's version;
  - NVML, initialised: the checks before CRIU ask it (pos/restore/preflight.py);
  - a CUDA primary context on each GPU it keeps (--gpus), retained for its whole life: the
    restore's own retain (gpucopy.Context, which refills the job's device memory) then finds
    the context made.

Each connection (root peers only) carries one request (pos/engines/service_protocol.py). Its
restore runs on a thread of its own, as `pos restore` runs it (`engines.for_image(...)
.restore`, with the settings read from the service's environment for each request), and the
lines it echoes go back as it runs, then its report or its error. Where the request asks it
(`pos restore` does, unless --until-filled), a job that runs before its device memory is all
back (the concurrent engine's fill) is said to run (Running) at once, so that `pos restore`
returns with it; the service fills the rest. Restores run side by side.
Off the main thread a restore is as safe as on it: Python runs signal handlers on the main
thread alone, and a step that holds SIGINT and SIGTERM back there has nothing to hold back on
another (pos/operation/steps.py `uninterrupted`); the undo runs on the restore's thread.

A restore, once begun, runs on whatever its client does: a client that goes away (Ctrl-C
included) loses the lines and the outcome, not the restore. Like any restore it has its own
watchdog (pos/operation/watchdog.py), which undoes it should the service die half-way.

A request with `standby` has the job held ready instead, until a request for the same image
runs it (pos/engines/standby.py).

What stays the client's: a shell job restored from a terminal (CRIU attaches it to the
terminal of its own stdin, which pos/restore/tree.py gives it: the client's, not the
service's, whose stdin is /dev/null) is answered InProcess; `pos restore` keeps --inherit-fd
(its descriptors) and --gpu-only (its live job) for itself too.

SIGTERM or SIGINT: no more connections (the socket goes at once, so that clients restore in
their own process meanwhile), the jobs held ready end, the running restores finish, then the
service exits 0.
"""

import importlib
import os
import signal
import socket
import stat
import struct
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Union

from pos.errors import EXIT_BAD_INPUT, EXIT_FAILED, BadInput, PosError, denied
from pos.engines.service_protocol import (Accepted, Echo, Failed, Held, InProcess, Message,
                                            Request, Restored, Running, decode, encode)
from pos.engines.standby import Standbys

if TYPE_CHECKING:
    from pos.concurrent import gpucopy
    from pos.image.opened import Opened
    from pos.operation.engine import Hold, Report

Say = Callable[[str], None]

RESTORE_MODULES = (
    "numpy", "pos.image.gpu", "pos.image.opened", "pos.engines.engines",
    "pos.restore.tree", "pos.restore.timewait", "pos.operation.gpumap",
    "pos.concurrent", "pos.concurrent.prefetch", "pos.concurrent.gpucopy",
    "pos.engines.summary")
"""What a restore imports inside its functions (the engines import their parts where they are
used, so that `pos --help` stays fast): imported once here."""

BACKLOG = 64
REQUEST_S = 10.0     # how long an accepted client may take to send its request
ACCEPT_S = 0.2       # how often the accepting loop looks for a signal another thread received
SEND_S = 10.0        # how long a line to a client may wait: one that does not read is gone


@dataclass
class Warm:
    """A GPU the service keeps a context on: its number as the ready line says it (NVML's
    index; CUDA's on a host without NVML) and the context."""

    index: int
    context: "gpucopy.Context"


def parse_gpus(text: str) -> tuple[int, ...]:
    """--gpus' value: GPU indexes, as nvidia-smi numbers them, separated by commas."""
    try:
        found = tuple(int(x) for x in text.split(","))
        if min(found) < 0:
            raise ValueError(text)
    except ValueError:
        raise BadInput(f"--gpus {text!r} is not a list of GPU indexes",
                       "give them as nvidia-smi numbers them, separated by commas: --gpus 0,1"
                       ) from None
    return found


def keep_warm(wanted: Optional[tuple[int, ...]]) -> list[Warm]:
    """A context retained on each GPU `wanted` names (NVML's indexes; None: every GPU of the
    host that CUDA sees here, which CUDA_VISIBLE_DEVICES may narrow; none where there is no
    CUDA driver)."""
    from pos import nvml
    from pos.concurrent import gpucopy
    from pos.operation.gpumap import Onto

    if nvml.available():
        here = nvml.gpus()
        for index in wanted or ():
            Onto(index=index).check(here)       # a GPU this host does not have: refused
        warm = []
        for g in here:
            if wanted is not None and g.index not in wanted:
                continue
            try:
                device = gpucopy.ordinal(g.uuid)
            except PosError:
                if wanted is not None:          # named, and hidden from CUDA: said
                    raise
                continue
            warm.append(Warm(g.index, gpucopy.Context(device)))
        return warm
    if wanted is not None:
        raise BadInput("NVML is not available (it numbers the GPUs as nvidia-smi does)",
                       "leave --gpus out to keep every GPU the CUDA driver shows, or install "
                       "the NVIDIA driver with libnvidia-ml.so.1")
    try:
        count = gpucopy.device_count()
    except PosError:           # no CUDA driver: no GPU to keep
        return []
    return [Warm(i, gpucopy.Context(i)) for i in range(count)]


def warm_up(wanted: Optional[tuple[int, ...]]) -> list[Warm]:
    """Everything a restore would set up first: its modules, CRIU's version, NVML, CUDA
    seeing every GPU (a restore then finds it started: the service's restores go to any GPU,
    pos/concurrent/devices.py start_cuda), the GPUs' contexts."""
    from pos import nvml
    from pos.driver import driver
    from pos.process import criu, kdat
    from pos.settings import Settings

    for name in RESTORE_MODULES:
        importlib.import_module(name)
    try:
        found = criu.find(Settings.from_env())   # `criu --version`, asked once a process
        kdat.keep(found.path, found.version_text)   # and its probes kept, for every restore
    except PosError:
        pass                   # no CRIU here, or a bad setting: each restore says so
    nvml.available()           # NVML's first use initialises it
    try:
        driver().init()
    except PosError:
        pass                   # no CUDA driver: no GPU image to restore
    return keep_warm(wanted)


def peer(conn: socket.socket) -> tuple[int, int]:
    """(PID, UID) of the process at the other end of `conn` (SO_PEERCRED)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def _answers(path: Path) -> bool:
    """Whether a service listens on the socket at `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except OSError:
            return False
        return True


def listen(path: Path) -> socket.socket:
    """The service's socket at `path`, root's alone (0600; its folder made 0700 where it is
    missing). The socket of a service that died is replaced; a live one is refused."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.is_symlink() or path.exists():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise BadInput(f"{path} exists and is not a socket",
                           "give --socket a path of its own")
        if _answers(path):
            raise BadInput(f"a restore service already listens on {path}",
                           "stop it first, or give this one another --socket")
        path.unlink()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mask = os.umask(0o177)     # the socket is made 0600, never readable by others meanwhile
    try:
        s.bind(str(path))
    finally:
        os.umask(mask)
    s.listen(BACKLOG)
    return s


class Client:
    """One connection's messages out; once the client is gone (closed, or not reading) they
    are dropped and the restore goes on."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.gone = conn, False
        self.lock = threading.Lock()       # lines may come from several of a restore's threads
        conn.settimeout(SEND_S)

    def send(self, message: Message) -> None:
        with self.lock:
            if self.gone:
                return
            try:
                self.conn.sendall(encode(message))
            except OSError:
                self.gone = True

    def echo(self, text: str) -> None:
        self.send(Echo(text))


def restore(request: Request, echo: Say, hold: Optional["Hold"] = None,
            running: Optional[Callable[[Running], None]] = None
            ) -> Union[Restored, Failed, InProcess]:
    """The restore `pos restore` runs, for `request`; its outcome as the client's message.
    `hold`: a standby's (pos/engines/standby.py). `running`: told, where the job runs before
    its device memory is all back, what the restore has done by then."""
    from pos.concurrent.restore import movable
    from pos.engines import engines, summary
    from pos.image.opened import open_image
    from pos.operation.gpumap import Onto, check_host
    from pos.settings import Settings

    try:
        settings = Settings.from_env()
        to_gpu = Onto.parse(request.to_gpu) if request.to_gpu else None
        if to_gpu is not None:      # an image or a host that cannot move it: said first
            movable(Path(request.directory), True)
            check_host(to_gpu)
        img = open_image(Path(request.directory))
        if request.terminal and _takes_terminal(img):
            if hold is not None:
                raise BadInput(f"{request.directory} holds a shell job, which a restore from "
                               "a terminal attaches to it: it cannot be held ready",
                               f"restore it with `pos restore -D {request.directory}`")
            return InProcess("a shell job restored from a terminal is attached to it")
        def told(r: "Report") -> None:
            assert running is not None
            r.served = True
            running(Running(r.path, r.to_json(), summary.of(r)))

        load = engines.Load(to_gpu=to_gpu, started_s=request.started_s, hold=hold,
                            running=None if running is None else told)
        r = engines.for_image(img, settings, echo).restore(img, load)
    except PosError as e:
        return Failed.of(e)
    except PermissionError as e:
        return Failed.of(denied(e))
    except Exception as e:  # noqa: BLE001  (a bug: one sentence there, its traceback here)
        traceback.print_exc()
        return Failed(f"the restore service failed ({e!r})", "see the service's log",
                      EXIT_FAILED)
    r.served = True
    return Restored(r.path, r.to_json(), summary.of(r))


def _takes_terminal(img: "Opened") -> bool:
    """Whether the restore of the image `img` attaches its job to the restoring process's
    terminal: a shell job's does (pos/restore/tree.py)."""
    from pos.process.criu import Options

    return Options.from_json(img.manifest.criu_options).shell_job


def serve_one(conn: socket.socket, say: Say, standbys: Standbys) -> None:
    """One connection: a root peer's request, its restore (or its job held ready, or the job
    held ready for it run), its lines and outcome."""
    client = Client(conn)
    pid, uid = peer(conn)
    if uid != 0:
        client.send(Failed("the restore service answers root only",
                           "run pos restore as root (sudo)", EXIT_BAD_INPUT))
        return
    client.send(Accepted())
    conn.settimeout(REQUEST_S)
    try:
        request = decode(conn.makefile("rb").readline())
    except (OSError, ValueError):
        return
    if not isinstance(request, Request):
        return
    conn.settimeout(SEND_S)
    t = time.monotonic()
    answered: list[Running] = []      # the client ends there: the rest is the service's

    def running(message: Running) -> None:
        client.send(message)
        answered.append(message)

    outcome = standbys.stage(request, client.echo, restore) if request.standby else \
        standbys.ask(request, client.echo) or restore(
            request, client.echo, running=running if request.answer_running else None)
    client.send(outcome)
    said = (outcome.summary[0] if isinstance(outcome, (Restored, Held)) else
            f"restore of {request.directory}: {outcome.error().message}"
            if isinstance(outcome, Failed)
            else f"restore of {request.directory}: left to the client ({outcome.why})")
    gone = ", answered when the job ran" if answered else \
        ", which went away" if client.gone else ""
    say(f"{said} ({time.monotonic() - t:.3f} s, for PID {pid}{gone})")


class Service:
    """The accepting loop on the main thread, a thread for each connection."""

    def __init__(self, listener: socket.socket, path: Path, say: Say) -> None:
        self.listener, self.path, self.say = listener, path, say
        self.inode = path.stat().st_ino
        self.running: set[threading.Thread] = set()
        self.lock = threading.Lock()
        self.standbys = Standbys()

    def serve(self) -> None:
        """Until SIGTERM or SIGINT. Their handler here only says so (`stopping`), and the loop
        looks every ACCEPT_S: the kernel may hand a signal to any thread that does not block
        it, and then accept() on this one is not interrupted; and a KeyboardInterrupt that a
        handler raised at the loop's `continue` reached click ("Aborted!") with the socket
        still in place while a restore ran (CPython 3.11, one run in four under load)."""
        from pos.operation.steps import uninterrupted

        stopping = threading.Event()
        before = {s: signal.signal(s, lambda _n, _f: stopping.set())
                  for s in (signal.SIGINT, signal.SIGTERM)}
        self.listener.settimeout(ACCEPT_S)
        try:
            while not stopping.is_set():
                try:
                    conn, _ = self.listener.accept()
                except socket.timeout:
                    continue
                conn.settimeout(None)
                t = threading.Thread(target=self._one, args=(conn,), name="pos-restore")
                with self.lock:
                    self.running.add(t)
                t.start()
        finally:
            with uninterrupted():
                self._stop()
            for s, h in before.items():
                signal.signal(s, h)

    def _one(self, conn: socket.socket) -> None:
        try:
            with conn:
                serve_one(conn, self.say, self.standbys)
        finally:
            with self.lock:
                self.running.discard(threading.current_thread())

    def _stop(self) -> None:
        """No more connections, the socket gone; the restores held ready end, their trees
        ended; the running restores finish."""
        self.listener.close()
        try:
            if self.path.stat().st_ino == self.inode:    # not another service's since
                self.path.unlink()
        except FileNotFoundError:
            pass
        held = self.standbys.stop()
        if held:
            self.say(f"pos restore-service: ended {held} restore(s) held ready, which never "
                     "ran")
        with self.lock:
            running = list(self.running)
        if running:
            self.say(f"pos restore-service: stopping once {len(running)} restore(s) finish")
        for t in running:
            if t.ident is not None:      # started: a signal may fall between add and start
                t.join()


def run(path: Path, wanted: Optional[tuple[int, ...]], say: Say) -> None:
    """The service: warmed up, listening on `path`, ready said, serving until SIGTERM or
    SIGINT."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)           # no restore takes a terminal the service was started on
    os.close(null)
    warm = warm_up(wanted)
    try:
        listener = listen(path)
        gpus = f"GPUs {', '.join(str(w.index) for w in warm)}" if warm else "no GPU"
        say(f"pos restore-service: ready on {path} ({gpus})")
        Service(listener, path, say).serve()
    finally:
        for w in warm:
            w.context.close()
