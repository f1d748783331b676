"""The CDI spec that puts pos's agent into a container: the device `pos.dev/agent=hook` mounts
libposhook.so and preloads it, so that `podman run --device pos.dev/agent=hook IMAGE ...` (or
any CDI-aware runtime: containerd, CRI-O, the NVIDIA container toolkit's) starts a job that pos
can save while it runs, with no change to the image. The agent needs nothing else from the
host: it answers pos on an abstract socket of the container's network namespace, which pos
enters (pos/agent/control.py).

The library is copied into LIBRARY_DIR under a name that holds a hash of its bytes, and the
spec names that copy: a container's image holds the path of the agent it was started with, and
CRIU restores a mapped file only if it is the same as at the dump (seen: "File
opt/pos/lib/libposhook.so has bad size 284376 (expect 280280)" when the library was replaced
under one name). Copies are never removed, so an image taken under an older pos restores after
`pos cdi` installed a newer agent."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

KIND = "pos.dev/agent"
DEVICE = "hook"
QUALIFIED = f"{KIND}={DEVICE}"           # what `--device` takes
CDI_VERSION = "0.5.0"                    # the newest podman 4.3's CDI library reads
SPEC = Path("/etc/cdi/pos.json")
LIBRARY_DIR = Path("/opt/pos/lib")
AGENT = "libposhook"                     # what the agent's copies' names start with


@dataclass(frozen=True)
class Mount:
    hostPath: str
    containerPath: str
    options: list[str] = field(default_factory=lambda: ["ro", "bind"])


@dataclass(frozen=True)
class Edits:
    env: list[str]
    mounts: list[Mount]


@dataclass(frozen=True)
class Device:
    name: str
    containerEdits: Edits


@dataclass(frozen=True)
class Spec:
    """A CDI spec (github.com/cncf-tags/container-device-interface, SPEC.md), field names as
    the JSON has them."""

    kind: str
    devices: list[Device]
    cdiVersion: str = CDI_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def spec(library: Path) -> Spec:
    """The agent's device: the library mounted read-only where it is on the host, preloaded."""
    lib = str(library)
    return Spec(KIND, [Device(DEVICE, Edits([f"LD_PRELOAD={lib}"], [Mount(lib, lib)]))])


def library_for(built: Path, folder: Path = LIBRARY_DIR) -> Path:
    """Where `built` goes in `folder`: libposhook-HASH.so (see the module)."""
    return folder / f"{AGENT}-{hashlib.sha256(built.read_bytes()).hexdigest()[:16]}.so"


def install_library(built: Path, folder: Path = LIBRARY_DIR) -> Path:
    """`built` copied to library_for(built), through a new file renamed into place; its
    path."""
    data = built.read_bytes()
    library = library_for(built, folder)
    if not library.is_file() or library.read_bytes() != data:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = library.with_name(f".{library.name}.{os.getpid()}")
        tmp.write_bytes(data)
        os.chmod(tmp, 0o755)
        os.replace(tmp, library)
    return library


def write(path: Path, library: Path) -> Spec:
    """The spec into `path` (renamed into place: a runtime never reads half a spec)."""
    s = spec(library)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(s.to_json())
    os.replace(tmp, path)
    return s
