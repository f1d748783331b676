"""What `pos restore` and the restore service (pos/engines/service.py) say to each other over
the service's unix socket: one JSON object a line, each one of the messages below, named by its
"kind".

    service -> client   Accepted, or Failed for a peer other than root
    client -> service   Request
    service -> client   Echo for each line the restore echoes, then its outcome: Restored,
                        Failed, or InProcess (the restore is the client's to run); for a
                        request to hold the job ready (`standby`), Held once it is. For a
                        request that asks it (`answer_running`), Running comes first where
                        the job runs before its device memory is all back (the concurrent
                        engine's fill): the client may end there, and the service fills the
                        rest on its own

A field this side does not know (a pos of another version at the other end) is left out.

Only json and dataclasses are imported here: the client reads this module before pos's heavy
ones, whose import the service is there to spare it. Where the socket is: pos/engines/options.py.
"""

import dataclasses
import json
from dataclasses import asdict, dataclass
from typing import Any, Optional, Union

from pos.errors import Told


@dataclass(frozen=True)
class Accepted:
    """The service took the connection: the request may come."""


@dataclass(frozen=True)
class Request:
    """One restore, as `pos restore -D DIR [--to-gpu N]` asks for it."""

    directory: str                 # the image, absolute: the service's folder is not the client's
    to_gpu: Optional[str]          # --to-gpu as given (pos/operation/gpumap.py Onto's text)
    started_s: Optional[float]     # the client's own start-up: its process's age when it asked
    terminal: bool                 # the client's stdin is a terminal
    standby: bool = False          # restored and held ready, not run, until a request for it
    answer_running: bool = False   # Running, where the job runs before its memory is all back


@dataclass(frozen=True)
class Echo:
    """A line the restore echoed, for the client to print where it prints the steps' lines."""

    text: str


@dataclass(frozen=True)
class Restored:
    path: str                      # the image, which the client's store records as restored
    report: dict[str, Any]         # Report.to_json(): what `pos restore --json` prints
    summary: list[str]             # pos/engines/summary.py's lines: what `pos restore` prints


@dataclass(frozen=True)
class Running:
    """The job runs, its device memory still coming back: what the restore has done so far
    (its report's `filling` set), as Restored says it. The outcome, Restored or Failed,
    follows once the fill ends."""

    path: str
    report: dict[str, Any]
    summary: list[str]


@dataclass(frozen=True)
class Held:
    """The job is restored and held ready by the service (pos/engines/standby.py)."""

    path: str                      # the image
    summary: list[str]             # what `pos restore --standby` prints


@dataclass(frozen=True)
class Failed(Told):
    """A PosError's sentence and exit code, for the client to raise as its own."""


@dataclass(frozen=True)
class InProcess:
    """The restore needs what only the client has (see service.py): it runs it itself."""

    why: str


Message = Union[Accepted, Request, Echo, Restored, Running, Held, Failed, InProcess]
KINDS: dict[str, type] = {k.__name__: k for k in (Accepted, Request, Echo, Restored, Running,
                                                 Held, Failed, InProcess)}


def encode(message: Message) -> bytes:
    return (json.dumps({"kind": type(message).__name__, **asdict(message)}) + "\n").encode()


def decode(line: bytes) -> Message:
    """The message of one line; ValueError for a line that is none (an empty one: the peer
    closed the connection)."""
    try:
        fields = json.loads(line)
        kind = KINDS[fields.pop("kind")]
        known = {f.name for f in dataclasses.fields(kind)}
        message: Message = kind(**{k: v for k, v in fields.items() if k in known})
        return message
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"not a message of the restore service: {line[:80]!r}") from None
