"""The one module that drives podman (rootful): every call pos makes of it, each failure one
sentence naming podman's own words and a fix.

podman checkpoints and restores a container through its OCI runtime (runc here: Debian 12's
crun is built without CRIU), which runs CRIU; the runtime finds CRIU as `criu` on the PATH
(scripts/setup.sh links pos's CRIU there)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pos.errors import BadInput, PosError

CALL_S = 300.0      # the longest one podman call may take (a checkpoint of a big container)


@dataclass(frozen=True)
class Container:
    """A container as podman inspects it."""

    id: str
    name: str
    pid: int            # its first process on this host (0: not running)
    running: bool


def binary() -> str:
    found = shutil.which("podman")
    if found is None:
        raise BadInput("podman is not installed", "install it (scripts/setup.sh does, with "
                       "runc and its configuration)")
    return found


def call(*argv: str, timeout: float = CALL_S,
            started: Callable[[int], None] = lambda _pid: None) -> str:
    """podman ARGV's standard output; its failure as one PosError with its last line.
    `started(pid)`: podman runs, as PID, in a process group of its own (a Ctrl-C to pos does
    not cut its checkpoint short: pos's undo waits for it instead)."""
    p = subprocess.Popen([binary(), *argv], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    started(p.pid)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise PosError(f"`podman {' '.join(argv[:2])}` did not end within {timeout:.0f} s",
                       "see `podman ps -a` and its logs") from None
    if p.returncode != 0:
        # podman's own error line (a line after it names a log that a failed restore removes)
        lines = err.strip().splitlines() or [f"exit {p.returncode}"]
        said = next((ln for ln in lines if ln.startswith("Error: ")), lines[-1])
        raise PosError(f"`podman {' '.join(argv[:2])}` failed: {said.removeprefix('Error: ')}",
                       "see podman's message (it runs CRIU through runc: scripts/setup.sh "
                       "sets both up)")
    return out


def inspect(name: str) -> Container:
    """The container NAME (or ID); BadInput when podman knows none."""
    try:
        out = call("container", "inspect", name)
    except PosError:
        raise BadInput(f"podman has no container {name}", "see `podman ps -a`") from None
    c = json.loads(out)[0]
    state = c.get("State", {})
    return Container(c["Id"], c["Name"], int(state.get("Pid") or 0),
                     bool(state.get("Running")))


def exists(name: str) -> bool:
    return subprocess.run([binary(), "container", "exists", name], capture_output=True,
                          stdin=subprocess.DEVNULL).returncode == 0


def checkpoint(name: str, archive: Path, started: Callable[[int], None] = lambda _pid: None
               ) -> None:
    """The container's processes and files into `archive` (podman's export: CRIU's image, the
    container's configuration and its changed files), the container left running; `started`:
    see _podman."""
    call("container", "checkpoint", "--leave-running", "--export", str(archive), name,
            started=started)


def restore(archive: Path, name: str) -> Container:
    """A new container NAME from `archive`, its processes running where they were dumped."""
    call("container", "restore", "--import", str(archive), "--name", name)
    return inspect(name)


def stop(name: str) -> None:
    """Stop the container (SIGKILL at once: its state is saved by then)."""
    call("container", "stop", "--time", "0", name)


def remove(name: str) -> None:
    """Remove the container, running or not; nothing when there is none."""
    subprocess.run([binary(), "container", "rm", "--force", "--ignore", "--time", "0", name],
                   capture_output=True, stdin=subprocess.DEVNULL, timeout=CALL_S)


# The guard of a restore (see Guard): until pos says "done" on its standard input it waits; if
# pos ends without saying it, it removes the container, again and again until none has been
# there for 10 s (podman's restore, in a process group of its own, may still be making it).
GUARD = """read -r said || true
[ "$said" = done ] && exit 0
gone=0
while [ "$gone" -lt 20 ]; do
  "$0" container rm --force --ignore --time 0 "$1" >/dev/null 2>&1
  if "$0" container exists "$1"; then gone=0; else gone=$((gone + 1)); fi
  sleep 0.5
done"""


class Guard:
    """The new container NAME removed if pos ends before `done()`, killed or not: a process
    of its own that outlives pos (pos's watchdog knows processes, not containers, and podman's
    restore runs the container's processes at once, their device memory not back yet)."""

    def __init__(self, name: str) -> None:
        read, self._write = os.pipe()
        try:
            self._proc = subprocess.Popen(["sh", "-c", GUARD, binary(), name], stdin=read,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True)
        finally:
            os.close(read)

    def done(self) -> None:
        """The container is whole: the guard goes without touching it."""
        os.write(self._write, b"done\n")
        self.close()

    def close(self) -> None:
        """Without done(): the guard removes the container (pos's own undo does it too)."""
        if self._write >= 0:
            os.close(self._write)
            self._write = -1
