"""CRIU's image files as pos reads them, in one place: the framing and the messages.

A CRIU image file is two u32 magics (IMG_COMMON_MAGIC, or IMG_SERVICE_MAGIC for its stats,
then the image's own), then its entries, each a u32 length and a protobuf message. The messages
are described here as protobuf describes messages (a FileDescriptorProto: CRIU's names, numbers
and types, for the fields pos reads) and decoded by the `protobuf` library, which keeps CRIU's
other fields as unknown ones, so pos needs neither CRIU's .proto files nor generated code.
protobuf is imported at the first description built, never by `import pos`.
"""

import struct
from pathlib import Path
from typing import Any, NamedTuple

IMG_COMMON_MAGIC = 0x54564319       # CRIU's criu/include/magic.h
IMG_SERVICE_MAGIC = 0x55105940
_MAGICS = struct.Struct("<II")
_LENGTH = struct.Struct("<I")


class Field(NamedTuple):
    """One field of a CRIU message as pos declares it: CRIU's name, number and type (a scalar
    type of protobuf's, "uint32", "string" ..., or another message of the same description)."""

    name: str
    number: int
    kind: str
    label: str = "optional"     # or "required", "repeated"


class Unreadable(ValueError):
    """A file that is not the CRIU image pos asked for: another magic, cut short, or an entry
    that is not the message described."""


def messages(file: str, described: dict[str, tuple[Field, ...]]) -> dict[str, Any]:
    """The message classes of `described` (message name -> its fields), built in a descriptor
    pool of their own under the file name `file`."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    field = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name=file, syntax="proto2")
    for name, fields in described.items():
        message = proto.message_type.add(name=name)
        for f in fields:
            label = getattr(field, f"LABEL_{f.label.upper()}")
            if f.kind in described:
                message.field.add(name=f.name, number=f.number, label=label,
                                  type=field.TYPE_MESSAGE, type_name=f".{f.kind}")
            else:
                message.field.add(name=f.name, number=f.number, label=label,
                                  type=getattr(field, f"TYPE_{f.kind.upper()}"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(name))
            for name in described}


def entries(path: Path, magics: tuple[int, int], message: Any) -> list[Any]:
    """Every entry of the CRIU image `path`, whose head must be `magics`, decoded as `message`
    (a class from `messages`); OSError when it cannot be read, Unreadable when it is not that
    image. Required fields are not enforced (protobuf's parsing leaves that to the caller)."""
    from google.protobuf.message import DecodeError

    raw = Path(path).read_bytes()
    if len(raw) < _MAGICS.size or _MAGICS.unpack_from(raw) != magics:
        raise Unreadable(f"{path} is not the CRIU image {magics[1]:#x}")
    out, at = [], _MAGICS.size
    while at < len(raw):
        if at + _LENGTH.size > len(raw):
            raise Unreadable(f"{path} ends inside an entry's length")
        (size,) = _LENGTH.unpack_from(raw, at)
        at += _LENGTH.size
        if at + size > len(raw):
            raise Unreadable(f"{path} ends inside an entry")
        try:
            out.append(message.FromString(raw[at:at + size]))
        except DecodeError as e:
            raise Unreadable(f"{path} holds an entry that does not decode ({e})") from None
        at += size
    return out
