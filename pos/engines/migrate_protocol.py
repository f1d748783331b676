"""What the two hosts of `pos migrate --to HOST` say to each other over their TLS connection
(pos/engines/migrate_key.py): one JSON object a line, each one of the messages below, named by
its "kind" and carrying the protocol's version; a file's or the manifest's bytes follow their
message raw.

    sender -> receiver   Hello
    receiver -> sender   Ready, or Failed
    sender -> receiver   File (and its bytes) for each file of the image, then Manifest (and
                         its bytes)
    receiver -> sender   Restored, or Failed
"""

import json
from dataclasses import asdict, dataclass, replace
from typing import Union

from pos.errors import PosError, Told

VERSION = 2        # 2: a Failed carries the exit code


@dataclass(frozen=True)
class Hello:
    pids: list[int]        # the tree, as the sender sees it
    concurrent: bool       # the image comes whole (no CRIU page server)


@dataclass(frozen=True)
class Ready:
    """The receiver is ready for the image (its page server listens, when one is used)."""


@dataclass(frozen=True)
class File:
    name: str              # relative to the image's folder (pos/image/names.py is_file_name)
    size: int              # the bytes that follow


@dataclass(frozen=True)
class Manifest:
    size: int              # the manifest's bytes that follow: the image is complete


@dataclass(frozen=True)
class Restored:
    pid: int


@dataclass(frozen=True)
class Failed(Told):
    """A PosError's sentence and exit code, for the other side to say; `path`: where the image
    stays."""

    path: str = ""


Message = Union[Hello, Ready, File, Manifest, Restored, Failed]
KINDS: dict[str, type] = {k.__name__: k for k in (Hello, Ready, File, Manifest, Restored, Failed)}


def encode(message: Message) -> bytes:
    return (json.dumps({"v": VERSION, "kind": type(message).__name__, **asdict(message)})
            + "\n").encode()


def decode(line: bytes) -> Message:
    """The message of one line; PosError for another version of the protocol or for a line that
    is no message."""
    try:
        fields = json.loads(line)
        version = fields.pop("v")
    except (ValueError, KeyError, TypeError, AttributeError):
        raise PosError(f"the other host sent something that is no migration message "
                       f"({line[:60]!r})", "migrate with pos on both hosts") from None
    if version != VERSION:
        raise PosError(f"the other host speaks version {version!r} of pos's migration, this "
                       f"pos version {VERSION}", "use the same version of pos on both hosts")
    try:
        message: Message = KINDS[fields.pop("kind")](**fields)
    except (KeyError, TypeError):
        raise PosError(f"the other host sent a migration message this pos does not know "
                       f"({line[:60]!r})", "use the same version of pos on both hosts") from None
    return message


def expect(message: Message, kind: type) -> Message:
    """`message` when it is a `kind`; a Failed becomes the other side's PosError, anything else
    one sentence."""
    if isinstance(message, kind):
        return message
    if isinstance(message, Failed):
        raise replace(message, cause=f"the other host: {message.cause}").error()
    raise PosError(f"the other host sent {type(message).__name__} where {kind.__name__} was due",
                   "use the same version of pos on both hosts")
