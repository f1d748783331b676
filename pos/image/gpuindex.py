"""The index of a GPU image (DIR/gpu-index.json: every buffer saved and its chunks; see
pos/image/gpu.py), apart from the chunk reader so that a restore reads it, and starts CRIU,
before numpy and the reader's library are loaded. A whole-process image of a job of several
CUDA processes (DDP's ranks) holds one index per process instead, DIR/gpu-index-PID.json, and
each process's data files are named after it too."""

import json
import os
from pathlib import Path
from typing import Any, Optional

from pos.errors import BadInput

INDEX = "gpu-index.json"
FORMAT = 1


def index_name(pid: Optional[int] = None) -> str:
    """The index of an image of one job (None), or of the process `pid` of several."""
    return INDEX if pid is None else f"gpu-index-{pid}.json"


def data_prefix(pid: Optional[int] = None) -> str:
    """How the data files of that index begin."""
    return "gpu-data-" if pid is None else f"gpu-data-{pid}-"


def jobs(folder: Path) -> list[Optional[int]]:
    """The jobs whose indexes `folder` holds: [None] for one job's (gpu-index.json), else each
    process's PID (gpu-index-PID.json), or none."""
    if (Path(folder) / INDEX).is_file():
        return [None]
    return sorted(int(p.name[len("gpu-index-"):-len(".json")])
                  for p in Path(folder).glob("gpu-index-*.json"))


def write_index(folder: Path, index: dict[str, Any], pid: Optional[int] = None) -> None:
    fd = os.open(folder / index_name(pid), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(index, f, indent=1)


def read_index(folder: Path, pid: Optional[int] = None) -> dict[str, Any]:
    name = index_name(pid)
    try:
        index = json.loads((Path(folder) / name).read_text())
    except FileNotFoundError:
        raise BadInput(f"{folder} is not a GPU image (no {name})",
                       "give the -D of a `pos checkpoint --concurrent`") from None
    except ValueError:
        raise BadInput(f"{folder}/{name} is not valid JSON", "take a new checkpoint") from None
    if index.get("format") != FORMAT:
        raise BadInput(f"{folder} is a GPU image of format {index.get('format')}, this pos "
                       f"reads {FORMAT}", "restore it with the pos version that wrote it")
    return index


def hot(index: dict[str, Any]) -> set[int]:
    """The buffers (by base address) the job used right after its checkpoint released it: a
    restore fills them first. An image without the mark has none."""
    return {int(b["base"], 16) for b in index["buffers"] if b.get("hot")}


def resolve(folder: Path, index: Optional[dict[str, Any]] = None
            ) -> dict[int, tuple[Path, int, list[dict[str, Any]]]]:
    """base -> (image folder holding it, size, chunks), following parents for `in_parent`;
    `index`: folder's, when the caller has read it already."""
    index = index if index is not None else read_index(folder)
    parent: Optional[dict[int, tuple[Path, int, list[dict[str, Any]]]]] = None
    out = {}
    for b in index["buffers"]:
        base = int(b["base"], 16)
        if b.get("in_parent"):
            if parent is None:
                parent = resolve(Path(index["parent"]))
            if base not in parent or parent[base][1] != b["size"]:
                raise BadInput(f"the parent image {index['parent']} lacks buffer {b['base']}",
                               "restore from a full image")
            out[base] = parent[base]
        else:
            out[base] = (Path(folder), b["size"], b["chunks"])
    return out
