"""The files of the host that a dumped process tree had open or mapped and that CRIU's restore
opens again at their paths, read from CRIU's images (pos/image/criuimg.py): what must be in
place before a restore starts (pos/restore/preflight.py).

CRIU records every file once in files.img (a `file_entry` with its `reg_file_entry`: the path,
and the size CRIU checks at the restore), and what refers to it by its id: each process's
descriptors (fdinfo-N.img of its table, named in ids-PID.img), mappings and executable
(mm-PID.img), working directory and root (fs-PID.img). CRIU reopens those by path, but those it
was told are external (`ext`: the restore is handed them, --inherit-fd), those it brings back
itself (remap-fpath.img: a file deleted at the dump, kept in the image as a "ghost", or linked
back; a dead process's /proc folder) and those of a mount namespace of the tree's own
(`mnt_id`: not this host's paths). A file that only another of CRIU's objects names (a
terminal's /dev/pts/N, which a restore gives a terminal of its own; a FIFO) is left to CRIU.
"""

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pos.image import criuimg, names
from pos.image.criuimg import IMG_COMMON_MAGIC, Field

# CRIU's criu/include/magic.h
FILES_MAGIC, REMAP_FPATH_MAGIC = 0x56303138, 0x59133954
IDS_MAGIC, FDINFO_MAGIC, MM_MAGIC, FS_MAGIC = 0x54432030, 0x56213732, 0x57492820, 0x51403912
REG = 1                             # fd_types: a file opened by its path (file, folder, device)
VMA_FILE = (1 << 6) | (1 << 7)      # vma_entry.status: VMA_FILE_PRIVATE | VMA_FILE_SHARED

# CRIU's images/*.proto, the fields pos reads (enums as their varints)
_MESSAGES = {
    "reg_file_entry": (Field("id", 1, "uint32"), Field("name", 6, "string"),
                       Field("mnt_id", 7, "sint32"), Field("size", 8, "uint64"),
                       Field("ext", 9, "bool")),
    "file_entry": (Field("type", 1, "uint32"), Field("id", 2, "uint32"),
                   Field("reg", 3, "reg_file_entry")),
    "remap_file_path_entry": (Field("orig_id", 1, "uint32"), Field("remap_id", 2, "uint32")),
    "task_kobj_ids_entry": (Field("files_id", 2, "uint32"),),
    "fdinfo_entry": (Field("id", 1, "uint32"), Field("fd", 4, "uint32")),
    "vma_entry": (Field("shmid", 4, "uint64"), Field("status", 7, "uint32")),
    "mm_entry": (Field("exe_file_id", 12, "uint32"),
                 Field("vmas", 14, "vma_entry", "repeated")),
    "fs_entry": (Field("cwd_id", 1, "uint32"), Field("root_id", 2, "uint32")),
}


@functools.cache
def messages() -> dict[str, Any]:
    """CRIU's messages that pos reads here, by CRIU's name, as protobuf message classes."""
    return criuimg.messages("pos-criu-files.proto", _MESSAGES)


@dataclass(frozen=True)
class OpenFile:
    """A file CRIU's restore reopens at `path`: `size` at the dump where CRIU checks it (None:
    it does not, as for a file opened to append to, a folder or a device); `pid`, the first
    process of the tree that used it; `mapped`: that process had it mapped (or ran it) rather
    than open."""

    path: str
    size: Optional[int]
    pid: int
    mapped: bool = False


def _read(images: Path, name: str, magic: int, message: str) -> list[Any]:
    return criuimg.entries(images / name, (IMG_COMMON_MAGIC, magic), messages()[message])


def _users(images: Path, pids: list[int]) -> dict[int, tuple[int, bool]]:
    """File id -> the first of `pids` that used it, and whether it had it mapped; a process
    whose images cannot be read names none."""
    out: dict[int, tuple[int, bool]] = {}
    for pid in pids:
        try:
            ids = _read(images, names.criu_image("ids", pid), IDS_MAGIC, "task_kobj_ids_entry")
            fds = _read(images, names.criu_image("fdinfo", ids[0].files_id), FDINFO_MAGIC,
                        "fdinfo_entry") if ids else []
            mm = _read(images, names.criu_image("mm", pid), MM_MAGIC, "mm_entry")
            fs = _read(images, names.criu_image("fs", pid), FS_MAGIC, "fs_entry")
        except (OSError, criuimg.Unreadable):
            continue
        for e in fs:
            out.setdefault(e.cwd_id, (pid, False))
            out.setdefault(e.root_id, (pid, False))
        for e in fds:
            out.setdefault(e.id, (pid, False))
        for m in mm:
            out.setdefault(m.exe_file_id, (pid, True))
            for v in m.vmas:
                if v.status & VMA_FILE:
                    out.setdefault(v.shmid, (pid, True))
    return out


def reopened(images: Path, pids: list[int]) -> list[OpenFile]:
    """The files CRIU's restore of the dump in `images` (of the processes `pids`) reopens at
    their paths for those processes, in CRIU's order (a file opened twice is there twice);
    OSError or criuimg.Unreadable when its files.img cannot be read."""
    images = Path(images)
    files = _read(images, names.FILES, FILES_MAGIC, "file_entry")
    try:
        remapped = {e.orig_id for e in _read(images, names.REMAP_FPATH, REMAP_FPATH_MAGIC,
                                             "remap_file_path_entry")}
    except FileNotFoundError:
        remapped = set()        # CRIU writes it only when it has something to bring back
    users = _users(images, pids)
    out = []
    for f in files:
        reg = f.reg
        if f.type != REG or not f.HasField("reg") or reg.ext or reg.HasField("mnt_id") \
                or reg.id in remapped or reg.id not in users:
            continue
        pid, mapped = users[reg.id]
        out.append(OpenFile(reg.name, reg.size if reg.HasField("size") else None, pid, mapped))
    return out
