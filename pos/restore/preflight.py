"""What must hold on this host before a restore starts, checked in one place before CRIU or any
GPU work, so that a restore that cannot succeed is refused in one sentence (BadInput: the
cause, the fix) and leaves nothing behind, rather than failing half-way and being undone:

- no process holds a PID of the image (CRIU restores every process with its PID);
- the NVIDIA driver, and its CUDA version, are those the image was taken with (the driver's
  checkpoints are tied to them);
- every file of the host that the tree had open or mapped is at its path, of the size it had
  at the dump (CRIU reopens each, and refuses one whose size changed);
- each GPU the image goes to (the one it was taken on, by UUID, or its --to-gpu target) is of
  the model it was taken on, and has the device memory the image needs free.

A GPU this host does not have (an image taken elsewhere, not moved with --to-gpu) goes where
the driver puts it, so neither GPU check applies to it; a host without NVML skips both.
"""

import math
import os
from pathlib import Path
from typing import Optional, Sequence

from pos import host, nvml
from pos.errors import BadInput
from pos.image import Manifest, criufiles, criuimg
from pos.image.opened import Opened
from pos.operation.manifest import NO_NAME
from pos.operation.steps import timed
from pos.process import cudackpt, procs

CONTEXT_BYTES = 512 << 20
"""Device memory each process of a concurrent image needs on its GPU beyond its buffers (its
CUDA context), which the GPU index does not count. Modest on purpose: a restore refused wrongly
cannot be forced, while one let through that then runs short fails as before and is undone.
Nothing is added to a stop-the-world image's figure: NVML counted the processes' device memory
at the checkpoint, their contexts included."""

GiB = 1 << 30


def check(img: Opened, gpu_pairs: Sequence[tuple[str, str]] = (),
          inherit_fds: tuple[str, ...] = (), timings: Optional[dict[str, float]] = None
          ) -> None:
    """Refuse the restore of the image `img` onto this host, moved as `gpu_pairs` say (old
    UUID -> new UUID, the driver's restore's), when it cannot succeed here; `inherit_fds`: the
    --inherit-fd specs the restore is given (their files are not looked for). Each check is
    timed into `timings` (check_*): NVML's start, where a concurrent restore's fill had begun
    CUDA before it, made check_gpus 1.0 s of every restore on 4x H200 hosts; started first
    (pos/concurrent/devices.py start_cuda), 0.0 s (bench/results/2026-11-28.md)."""
    t: dict[str, float] = {} if timings is None else timings
    gpu = bool(img.manifest.gpu_pids)
    timed(t, "check_pids", lambda: pids_free(img.manifest))
    if gpu:
        timed(t, "check_driver", lambda: same_driver(img))
    timed(t, "check_files", lambda: files_in_place(img, inherit_fds))
    if gpu:
        here = timed(t, "check_gpus", lambda: {g.uuid: g for g in nvml.gpus()})  # {}: no NVML
        timed(t, "check_gpus", lambda: same_model(img, here, dict(gpu_pairs)))
        timed(t, "check_memory", lambda: memory_free(img, here, dict(gpu_pairs)))


# how to run several copies of one image at once, by what the image holds
SEVERAL = "for several copies of one image at once, checkpoint a job started with `pos run " \
    "--clonable`"
SEVERAL_GPU = "copies of a CUDA job's image cannot run side by side yet (CUDA did not start " \
    "in the namespaces of `pos run --clonable`: docs/warm-starts.md)"


def pids_free(manifest: Manifest) -> None:
    """Refuse an image one of whose PIDs a live process (or a zombie) holds, unless it is
    restored into new namespaces (a tree of its own, `pos run --clonable`): then it restores
    beside the original and any other copy. The refusal says how to take an image that
    restores many times at once."""
    for pid in [] if manifest.inner_pids else manifest.pids:
        if Path(f"/proc/{pid}").exists():
            comm = host.describe(pid)[0] or "a process"
            if procs.state(pid) == "Z":
                comm += ", a zombie its parent has not reaped"
            how = SEVERAL_GPU if manifest.gpu_pids else SEVERAL
            raise BadInput(f"PID {pid} of the image is taken ({comm})",
                           "stop that process (after a --leave-running checkpoint: the "
                           f"original), then restore again; {how}")


def same_driver(img: Opened) -> None:
    """Refuse an image taken with another NVIDIA driver, or another CUDA version of it."""
    directory, manifest = img.path, img.manifest
    here = nvml.driver_version()
    if manifest.driver_version and here and here != manifest.driver_version:
        raise BadInput(f"{directory} was taken with NVIDIA driver {manifest.driver_version} "
                       f"and this host runs {here}", "restore it on a host with driver "
                       f"{manifest.driver_version} (driver checkpoints are tied to the driver)")
    cuda_here = cudackpt.driver_version()
    if manifest.cuda_version and cuda_here and cuda_here != manifest.cuda_version:
        raise BadInput(f"{directory} was taken with a CUDA {manifest.cuda_version} driver and "
                       f"this host's driver is CUDA {cuda_here}", "restore it on a host with "
                       "the same driver (driver checkpoints are tied to the driver)")


def files_in_place(img: Opened, inherit_fds: tuple[str, ...]) -> None:
    """Refuse an image a file of whose tree is gone from its path (naming the first, and how
    many are gone), or has another size than at the dump. The image's logs are looked for but
    not measured: pos reopens them to append to (pos/process/criu.py reopen_logs)."""
    files = _looked_for(img, inherit_fds)
    sizes = _sizes({f.path for f in files})
    gone = [f for f in files if f.path in sizes and sizes[f.path] is None]
    if gone:
        first, paths = gone[0], {f.path for f in gone}
        more = f"; {len(paths)} files in all" if len(paths) > 1 else ""
        raise BadInput(f"the file {first.path} that {_who(first)} is not there any more (moved "
                       f"or deleted since the checkpoint{more})",
                       "put it back at that path, then restore again" if len(paths) == 1 else
                       "put them back at their paths, then restore again")
    for f in files:
        now = sizes.get(f.path)
        if f.size is not None and now is not None and now != f.size \
                and f.path not in img.manifest.logs:
            raise BadInput(f"the file {f.path} that {_who(f)} changed size since the "
                           f"checkpoint ({f.size} bytes then, {now} now)", "put it back as it "
                           "was at the checkpoint, or hand the restore a descriptor of it with "
                           f"--inherit-fd 'fd[N]:{f.path.lstrip('/')}'")


def _looked_for(img: Opened, inherit_fds: tuple[str, ...]) -> list[criufiles.OpenFile]:
    """The files CRIU will reopen at their paths but those the restore is handed (--inherit-fd
    names a file by its path without the leading "/") and those in /proc (the restored tree's
    own folders appear there as CRIU makes it). None when CRIU's files cannot be read: that is
    left to CRIU and to the image's checksums."""
    try:
        files = criufiles.reopened(img.path, img.manifest.pids)
    except (OSError, criuimg.Unreadable):
        return []
    handed = {spec.split(":", 1)[1] for spec in inherit_fds if ":" in spec}
    return [f for f in files if f.path.lstrip("/") not in handed
            and f.path != "/proc" and not f.path.startswith("/proc/")]


def _sizes(paths: set[str]) -> dict[str, Optional[int]]:
    """Path -> its size now, None where nothing is there; a path that cannot be looked at for
    another reason is left out (it stops CRIU's open too, which says why)."""
    out: dict[str, Optional[int]] = {}
    for path in paths:
        try:
            out[path] = os.stat(path).st_size
        except (FileNotFoundError, NotADirectoryError):
            out[path] = None
        except OSError:
            pass
    return out


def _who(f: criufiles.OpenFile) -> str:
    """Who had the file `f`, and how: "PID 123 had open"."""
    return f"PID {f.pid} had {'mapped' if f.mapped else 'open'}"


def same_model(img: Opened, here: dict[str, nvml.Gpu], moved: dict[str, str]) -> None:
    """Refuse an image whose GPUs would go, as `moved` says (old UUID -> new UUID; a GPU not
    named stays), onto GPUs of this host (`here`, by UUID) of another model than those it was
    taken on. An image that did not record the model is not refused."""
    for g in img.gpus:
        was, onto = g.get("name"), here.get(moved.get(g["uuid"], g["uuid"]))
        if onto is None or not was or was == NO_NAME or onto.name == was:
            continue
        same = [str(h.index) for h in here.values() if h.name == was]
        raise BadInput(f"{img.path} was taken on {_a(was)} and GPU {onto.index} of this host "
                       f"(its target) is {_a(onto.name)}",
                       "restore it onto a GPU of the same model with --to-gpu (GPU "
                       f"{' or '.join(same)} of this host)" if same else
                       f"restore it on a host with {_a(was)}")


def memory_free(img: Opened, here: dict[str, nvml.Gpu], moved: dict[str, str]) -> None:
    """Refuse an image whose GPUs would go, as `moved` says, onto GPUs of this host (`here`)
    with less device memory free than it needs there (device_memory)."""
    needed: dict[str, int] = {}
    for uuid, size in device_memory(img).items():
        onto = moved.get(uuid, uuid)
        if onto in here:
            needed[onto] = needed.get(onto, 0) + size
    free = nvml.memory_free() if needed else {}
    for uuid, need in needed.items():
        if uuid in free and free[uuid] < need:
            index = here[uuid].index
            raise BadInput(f"GPU {index} of this host has {free[uuid] / GiB:.1f} GiB free and "
                           f"{img.path} needs {need / GiB:.1f} GiB there",
                           f"free {math.ceil((need - free[uuid]) / GiB * 10) / 10:.1f} GiB more "
                           f"on GPU {index}, or restore onto another GPU with --to-gpu")


def device_memory(img: Opened) -> dict[str, int]:
    """UUID of a GPU the image was taken on -> the device memory its restore needs there: a
    concurrent image's buffers (as mapped) and CONTEXT_BYTES per process, from its GPU index;
    a stop-the-world image's, what NVML saw its processes use at the checkpoint (none
    recorded: none asked)."""
    if not img.ranks:
        return {g["uuid"]: g["memory_used"] for g in img.gpus if g.get("memory_used")}
    out: dict[str, int] = {}
    for rank in img.ranks:
        index = img.index(rank)
        if index.gpu is not None:
            out[index.gpu] = (out.get(index.gpu, 0) + CONTEXT_BYTES
                              + sum(b.mapped for b in index.buffers))
    return out


def _a(name: str) -> str:
    """A GPU's name with its article: names that begin with a letter said with a vowel sound
    (NVIDIA, A100, H100, RTX, L40S) take "an"."""
    return f"{'an' if name[:1].upper() in 'AEFHILMNORSX' else 'a'} {name}"
