"""The CDI spec that puts pos's agent into a container: the device `pos.dev/agent=hook` mounts
libposhook.so and preloads it, so that `podman run --device pos.dev/agent=hook IMAGE ...` (or
any CDI-aware runtime: containerd, CRI-O, the NVIDIA container toolkit's) starts a job that pos
can save while it runs, with no change to the image. The agent needs nothing else from the
host: it answers pos on an abstract socket of the container's network namespace, which pos
enters (pos/agent/control.py).

The library is copied to a path of its own (LIBRARY) rather than mounted from pos's package,
so that a container keeps the agent it started with when pos is rebuilt: a new copy replaces
the file, never rewrites it in place."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

KIND = "pos.dev/agent"
DEVICE = "hook"
QUALIFIED = f"{KIND}={DEVICE}"           # what `--device` takes
CDI_VERSION = "0.5.0"                    # the newest podman 4.3's CDI library reads
SPEC = Path("/etc/cdi/pos.json")
LIBRARY = Path("/opt/pos/lib/libposhook.so")


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


def spec(library: Path = LIBRARY) -> Spec:
    """The agent's device: the library mounted read-only where it is on the host, preloaded."""
    lib = str(library)
    return Spec(KIND, [Device(DEVICE, Edits([f"LD_PRELOAD={lib}"], [Mount(lib, lib)]))])


def install_library(built: Path, library: Path = LIBRARY) -> None:
    """`built` copied to `library` through a new file renamed over it (see the module)."""
    library.parent.mkdir(parents=True, exist_ok=True)
    tmp = library.with_name(f".{library.name}.{os.getpid()}")
    shutil.copyfile(built, tmp)
    os.chmod(tmp, 0o755)
    os.replace(tmp, library)


def write(path: Path, library: Path = LIBRARY) -> Spec:
    """The spec into `path` (renamed into place: a runtime never reads half a spec)."""
    s = spec(library)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(s.to_json())
    os.replace(tmp, path)
    return s
