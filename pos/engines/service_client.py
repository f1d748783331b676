"""`pos restore`'s side of the restore service (pos/engines/service.py): ask it for the restore
before pos imports the engines, whose import, NVML's start and the CUDA context the service has
made already; print what the restore echoes there; hand its outcome back.

No socket (no service runs), a socket that nothing answers on (a service that died) or a
restore that needs what only this process has (InProcess): None, and `pos restore` restores in
its own process. Once the request is sent the restore is the service's: nothing here stops it.
"""

import os
import socket
from typing import BinaryIO, Callable, Optional, Union

from pos import host
from pos.errors import PosError
from pos.engines.service_protocol import (Accepted, Echo, Failed, Held, InProcess, Message,
                                            Request, Restored, Running, decode, encode)

ACCEPT_S = 5.0
"""How long the service may take to accept: one that does not is taken for gone. Nothing was
asked of it then, so the restore runs here without a chance of running twice."""


def restore(path: str, directory: str, to_gpu: Optional[str],
            echo: Callable[[str], None], standby: bool = False, until_filled: bool = False
            ) -> Optional[Union[Restored, Running, Held]]:
    """The restore of the image in `directory` (onto `to_gpu`, --to-gpu's text), done by the
    service on the socket `path` (`standby`: its job held ready there: Held); None where it
    is to be done in this process. It returns once the job runs (Running, where its device
    memory is still coming back: the service fills the rest), or with `until_filled` once
    all of it is back. A failure the service reports is raised here as the PosError it was
    there."""
    if not os.path.exists(path):
        return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        try:
            conn.settimeout(ACCEPT_S)
            conn.connect(path)
            lines = conn.makefile("rb")
            first = decode(lines.readline())
        except (OSError, ValueError) as e:
            why = "it closed the connection" if isinstance(e, ValueError) else \
                "no answer in time" if isinstance(e, socket.timeout) else e.strerror or str(e)
            echo(f"the restore service at {path} does not answer ({why}): restoring in this "
                 "process")
            return None
        if isinstance(first, Failed):
            raise first.error()
        if not isinstance(first, Accepted):
            raise _broken(path, f"it began with {type(first).__name__}")
        conn.settimeout(None)     # a restore takes what it takes; its watchdog guards it
        try:
            conn.sendall(encode(Request(os.path.abspath(directory), to_gpu,
                                        host.age(os.getpid()), os.isatty(0), standby,
                                        not until_filled)))
            return outcome(lines, echo, lambda why: _broken(path, why))
        except OSError as e:
            raise _broken(path, e.strerror or str(e)) from None


def outcome(lines: BinaryIO, echo: Callable[[str], None], broken: Callable[[str], PosError]
            ) -> Optional[Union[Restored, Running, Held]]:
    """The lines the restore echoes, printed; then its outcome (Running where the request
    asked it and the job ran before its memory was all back). `broken`: the error for a
    restorer that gave none (why)."""
    while True:
        try:
            message: Message = decode(lines.readline())
        except ValueError:
            raise broken("it closed the connection") from None
        if isinstance(message, Echo):
            echo(message.text)
        elif isinstance(message, (Restored, Running, Held)):
            return message
        elif isinstance(message, Failed):
            raise message.error()
        elif isinstance(message, InProcess):
            return None
        else:
            raise broken(f"it answered {type(message).__name__}")


def _broken(path: str, why: str) -> PosError:
    """The service took the request and then gave no outcome: whether the job was restored is
    for its log to say, and a second restore could find it running."""
    return PosError(f"the restore service at {path} gave no outcome for the restore ({why})",
                    "see the service's log (journalctl -u pos-restore) and look for the job "
                    "before restoring again")
