"""What a restore refuses before it starts (pos/restore/preflight.py): a GPU of another model,
a GPU with too little free memory, a file of the tree moved or changed, as well as the PIDs and
the driver; each in one sentence, and nothing behind: no CRIU run, no work folder, no device
memory made. No CRIU, no GPU: the images are folders sealed as pos seals one, CRIU's files in
them written with the messages pos reads them with, NVML and CRIU stood in for."""

import os
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import pytest

from pos import image, nvml
from pos.errors import BadInput
from pos.image import Manifest, criufiles, gpuindex, names
from pos.image.criuimg import IMG_COMMON_MAGIC
from pos.image.gpuindex import BufferRecord, GpuIndex
from pos.image.opened import open_image
from pos.process import cudackpt
from pos.restore import preflight
from pos.restore.preflight import CONTEXT_BYTES, GiB
from tests.conftest import need
from tests.engines.conftest import one_sentence, pos

H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
# (not in persistence mode: a restore here leaves CUDA to start as it would, see devices.start_cuda)
HERE = [nvml.Gpu(0, "GPU-a", H200, False), nvml.Gpu(1, "GPU-b", H100, False),
        nvml.Gpu(2, "GPU-c", H100, False)]
FILES_ID = 7                        # the image's one table of descriptors
VMA_FILE_PRIVATE = 1 << 6 | 1       # with VMA_AREA_REGULAR, as CRIU marks a mapped file


def free_pid() -> int:
    """A PID no process holds (the image's: a restore refuses a PID that is taken)."""
    return next(p for p in range(4_000_000, 4_100_000) if not Path(f"/proc/{p}").exists())


def criu_file(folder: Path, name: str, magic: int, entries: list[Any]) -> None:
    """A CRIU image file as CRIU writes it: the magics, then each entry after its length."""
    body = b"".join(struct.pack("<I", len(b)) + b for b in (e.SerializeToString()
                                                            for e in entries))
    (folder / name).write_bytes(struct.pack("<II", IMG_COMMON_MAGIC, magic) + body)


def criu_images(folder: Path, pid: int, opened: dict[str, Optional[int]],
                mapped: dict[str, Optional[int]], ghosts: tuple[str, ...] = (),
                external: tuple[str, ...] = (), own_mount: tuple[str, ...] = (),
                terminals: tuple[str, ...] = ()) -> None:
    """CRIU's images of the files of a one-process tree: `opened` and `mapped` (path -> the
    size CRIU recorded, None: none), files deleted at the dump (`ghosts`), files the dump was
    told are external, files of a mount namespace of the tree's own, terminals (a path no
    descriptor names: CRIU's terminal entry does)."""
    m = criufiles.messages()
    files, fds, vmas, remaps = [], [], [], []

    def add(path: str, size: Optional[int] = None, **reg: Any) -> int:
        i = len(files) + 1
        r = m["reg_file_entry"](id=i, name=path, **reg)
        if size is not None:
            r.size = size
        files.append(m["file_entry"](type=criufiles.REG, id=i, reg=r))
        return i

    root, exe = add("/"), add(sys.executable, os.stat(sys.executable).st_size)
    for path, size in opened.items():
        fds.append(m["fdinfo_entry"](id=add(path, size), fd=3 + len(fds)))
    for path, size in mapped.items():
        vmas.append(m["vma_entry"](shmid=add(path, size), status=VMA_FILE_PRIVATE))
    for path in ghosts:
        fds.append(m["fdinfo_entry"](id=add(path, 10), fd=3 + len(fds)))
        remaps.append(m["remap_file_path_entry"](orig_id=fds[-1].id, remap_id=99))
    for key in external:
        fds.append(m["fdinfo_entry"](id=add(key, ext=True), fd=3 + len(fds)))
    for path in own_mount:
        fds.append(m["fdinfo_entry"](id=add(path, 10, mnt_id=1000), fd=3 + len(fds)))
    for path in terminals:
        add(path)
    criu_file(folder, names.FILES, criufiles.FILES_MAGIC, files)
    if remaps:
        criu_file(folder, names.REMAP_FPATH, criufiles.REMAP_FPATH_MAGIC, remaps)
    criu_file(folder, names.criu_image("ids", pid), criufiles.IDS_MAGIC,
              [m["task_kobj_ids_entry"](files_id=FILES_ID)])
    criu_file(folder, names.criu_image("fdinfo", FILES_ID), criufiles.FDINFO_MAGIC, fds)
    criu_file(folder, names.criu_image("mm", pid), criufiles.MM_MAGIC,
              [m["mm_entry"](exe_file_id=exe, vmas=vmas)])
    criu_file(folder, names.criu_image("fs", pid), criufiles.FS_MAGIC,
              [m["fs_entry"](cwd_id=root, root_id=root)])


def make_image(tmp_path: Path, opened: Optional[dict[str, Optional[int]]] = None,
               mapped: Optional[dict[str, Optional[int]]] = None, gpus: tuple[dict, ...] = (),
               buffers: Optional[list[int]] = None, logs: Optional[dict[str, int]] = None,
               **criu: Any) -> Path:
    """A sealed image of a one-process tree on the GPUs `gpus` (the manifest's records); with
    `buffers` (their mapped sizes), a concurrent one with that GPU index."""
    pid = free_pid()
    tmp_path.mkdir(exist_ok=True)
    partial = image.prepare(tmp_path / "img", 0)
    (partial / names.INVENTORY).write_bytes(b"CRIU's")
    criu_images(partial, pid, opened or {}, mapped or {}, **criu)
    if buffers is not None:
        gpuindex.write(partial, GpuIndex(pid, gpus[0]["uuid"] if gpus else None, tuple(
            BufferRecord(0x7f00_0000_0000 + i * (1 << 40), size, size, 0)
            for i, size in enumerate(buffers))))
    return image.seal(partial, Manifest(
        pid=pid, pids=[pid], gpu_pids=[pid] if gpus else [], comm="job", cmdline="job",
        created_at="2026-12-01T00:00:00+00:00", host="h", kernel="k", criu_version="4.2",
        criu_options={}, leave_running=False, gpus=list(gpus), logs=logs or {}))


def check(img: Path, pairs: tuple[tuple[str, str], ...] = (), inherit: tuple[str, ...] = ()
          ) -> None:
    preflight.check(open_image(img), pairs, inherit)


def refusal(img: Path, pairs: tuple[tuple[str, str], ...] = (),
            inherit: tuple[str, ...] = ()) -> str:
    with pytest.raises(BadInput) as e:
        check(img, pairs, inherit)
    return e.value.message


@pytest.fixture
def host_gpus(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """This host's GPUs as NVML tells them (GPU 0 an H200, GPUs 1 and 2 H100s), the same
    driver as the image's; the free memory of each, which a test sets."""
    free = {"GPU-a": 100 * GiB, "GPU-b": 60 * GiB, "GPU-c": 60 * GiB}
    monkeypatch.setattr(nvml, "available", lambda: True)
    monkeypatch.setattr(nvml, "gpus", lambda: HERE)
    monkeypatch.setattr(nvml, "memory_free", lambda: dict(free))
    monkeypatch.setattr(nvml, "driver_version", lambda: None)
    monkeypatch.setattr(cudackpt, "driver_version", lambda: None)
    return free


def on(uuid: str, name: Optional[str] = H200, used: int = 0) -> dict:
    """A GPU as the manifest records it."""
    return {"uuid": uuid, "memory_used": used, **({"name": name} if name else {})}


# -- the GPU's model -------------------------------------------------------------------------

def test_a_gpu_of_another_model_is_refused(tmp_path: Path, host_gpus) -> None:
    img = make_image(tmp_path, gpus=(on("GPU-a"),))
    check(img)                                      # where it was taken
    assert refusal(img, (("GPU-a", "GPU-b"), ("GPU-b", "GPU-a"))) == (
        f"{img} was taken on an NVIDIA H200 and GPU 1 of this host (its target) is an NVIDIA "
        "H100 80GB HBM3: restore it onto a GPU of the same model with --to-gpu (GPU 0 of "
        "this host).")
    img = make_image(tmp_path / "2", gpus=(on("GPU-b", H100),))
    assert refusal(img, (("GPU-b", "GPU-a"), ("GPU-a", "GPU-b"))).endswith(
        "restore it onto a GPU of the same model with --to-gpu (GPU 1 or 2 of this host).")


def test_a_model_this_host_lacks_names_another_host(tmp_path: Path, host_gpus) -> None:
    img = make_image(tmp_path, gpus=(on("GPU-x", "NVIDIA A100-SXM4-40GB"),))
    assert refusal(img, (("GPU-x", "GPU-a"),)).endswith(
        "(its target) is an NVIDIA H200: restore it on a host with an NVIDIA A100-SXM4-40GB.")


@pytest.mark.parametrize("name", [None, "n/a"])
def test_an_image_that_did_not_record_the_model_is_not_refused(tmp_path: Path, host_gpus,
                                                               name) -> None:
    check(make_image(tmp_path, gpus=(on("GPU-a", name),)), (("GPU-a", "GPU-b"),))


def test_without_nvml_or_the_gpu_nothing_is_refused(tmp_path: Path, host_gpus,
                                                    monkeypatch) -> None:
    check(make_image(tmp_path, gpus=(on("GPU-elsewhere", "NVIDIA B200", 200 * GiB),)))
    monkeypatch.setattr(nvml, "gpus", lambda: [])
    monkeypatch.setattr(nvml, "memory_free", lambda: {})
    check(make_image(tmp_path / "2", gpus=(on("GPU-a", "NVIDIA B200", 200 * GiB),)),
          (("GPU-a", "GPU-b"),))


def test_each_check_is_timed(tmp_path: Path, host_gpus, monkeypatch) -> None:
    """The checks took 0.8-1.0 s of every restore on the H200 hosts: each is timed apart."""
    slow = nvml.gpus
    monkeypatch.setattr(nvml, "gpus", lambda: (time.sleep(0.05), slow())[1])
    timings: dict[str, float] = {}
    preflight.check(open_image(make_image(tmp_path, gpus=(on("GPU-a"),))), (), (), timings)
    assert set(timings) == {"check_pids", "check_driver", "check_files", "check_gpus",
                            "check_memory"}
    assert timings["check_gpus"] >= 0.05 > timings["check_pids"]


# -- the GPU's free memory -------------------------------------------------------------------

def test_a_stop_the_world_image_needs_what_nvml_saw_it_use(tmp_path: Path, host_gpus) -> None:
    img = make_image(tmp_path, gpus=(on("GPU-a", used=70 * GiB),))
    host_gpus["GPU-a"] = 70 * GiB                   # its contexts are in the figure already
    check(img)
    host_gpus["GPU-a"] = 3 * GiB + (1 << 20)
    assert refusal(img) == (f"GPU 0 of this host has 3.0 GiB free and {img} needs 70.0 GiB "
                            "there: free 67.0 GiB more on GPU 0, or restore onto another GPU "
                            "with --to-gpu.")


def test_a_concurrent_image_needs_its_buffers_and_a_context(tmp_path: Path, host_gpus) -> None:
    img = make_image(tmp_path, gpus=(on("GPU-a", used=1),), buffers=[6 * GiB, 4 * GiB])
    host_gpus["GPU-a"] = 10 * GiB + CONTEXT_BYTES
    check(img)
    host_gpus["GPU-a"] = 10 * GiB
    assert refusal(img) == (f"GPU 0 of this host has 10.0 GiB free and {img} needs 10.5 GiB "
                            "there: free 0.5 GiB more on GPU 0, or restore onto another GPU "
                            "with --to-gpu.")


def test_the_memory_is_asked_of_the_target(tmp_path: Path, host_gpus) -> None:
    img = make_image(tmp_path, gpus=(on("GPU-b", H100),), buffers=[50 * GiB])
    host_gpus["GPU-b"] = 0
    check(img, (("GPU-b", "GPU-c"), ("GPU-c", "GPU-b")))
    assert refusal(img).startswith("GPU 1 of this host has 0.0 GiB free")


# -- the files the tree had ------------------------------------------------------------------

def test_a_file_that_is_gone_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "model.safetensors"
    img = make_image(tmp_path, opened={str(data): 5})
    pid = image.load(img).pid
    assert refusal(img) == (f"the file {data} that PID {pid} had open is not there any more "
                            "(moved or deleted since the checkpoint): put it back at that "
                            "path, then restore again.")
    data.write_bytes(b"12345")
    check(img)


def test_every_file_that_is_gone_is_counted(tmp_path: Path) -> None:
    gone = [str(tmp_path / n) for n in ("a.bin", "b.bin", "c.bin")]
    img = make_image(tmp_path, opened={gone[0]: 1, gone[1]: None}, mapped={gone[2]: 3})
    assert refusal(img) == (f"the file {gone[0]} that PID {image.load(img).pid} had open is "
                            "not there any more (moved or deleted since the checkpoint; 3 "
                            "files in all): put them back at their paths, then restore again.")


def test_a_mapped_file_is_said_mapped(tmp_path: Path) -> None:
    weights = tmp_path / "weights.bin"
    img = make_image(tmp_path, mapped={str(weights): 4096})
    assert f"that PID {image.load(img).pid} had mapped is not there" in refusal(img)


def test_a_file_of_another_size_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data.bin"
    data.write_bytes(b"x" * 100)
    img = make_image(tmp_path, opened={str(data): 64})
    assert refusal(img) == (f"the file {data} that PID {image.load(img).pid} had open changed "
                            "size since the checkpoint (64 bytes then, 100 now): put it back "
                            "as it was at the checkpoint, or hand the restore a descriptor of "
                            f"it with --inherit-fd 'fd[N]:{str(data).lstrip('/')}'.")


def test_what_criu_does_not_reopen_at_its_path_is_not_looked_for(tmp_path: Path) -> None:
    """Files deleted at the dump (CRIU keeps them), external ones, a mount namespace's own,
    a terminal (the restore gives it one of its own), /proc, a file handed with --inherit-fd;
    and a size CRIU does not check."""
    log, handed = tmp_path / "job.log", tmp_path / "handed.bin"
    log.write_text("grew since the dump\n")
    img = make_image(tmp_path, opened={"/proc/4000000/status": 0, str(handed): 1,
                                       str(log): 4, "/dev/null": None},
                     ghosts=(str(tmp_path / "deleted.tmp"),), external=("file[2a:1f]",),
                     own_mount=("/only/in/its/namespace",), terminals=("/dev/pts/999",),
                     logs={str(log): 4})
    check(img, inherit=(f"fd[3]:{str(handed).lstrip('/')}",))
    log.unlink()                                     # a log must be there; its size may change
    assert refusal(img, inherit=(f"fd[3]:{str(handed).lstrip('/')}",)).startswith(
        f"the file {log} that PID")


def test_criu_files_that_cannot_be_read_are_left_to_criu(tmp_path: Path) -> None:
    img = make_image(tmp_path, opened={str(tmp_path / "gone"): 1})
    files = img / names.FILES
    files.write_bytes(bytes(files.stat().st_size))       # its size kept: the image's check
    check(img)


# -- what was checked before, now here too ---------------------------------------------------

def test_a_taken_pid_and_another_driver_are_refused(tmp_path: Path, host_gpus,
                                                    monkeypatch) -> None:
    opened = open_image(make_image(tmp_path, gpus=(on("GPU-a"),)))
    m = opened.manifest
    m.pids = [os.getpid()]
    with pytest.raises(BadInput, match=f"PID {os.getpid()} of the image is taken") as e:
        preflight.check(opened)
    assert ("cannot run side by side" in e.value.fix) == bool(m.gpu_pids)
    m.gpu_pids = []           # a job without CUDA is told how to take an image of many copies
    with pytest.raises(BadInput, match="checkpoint a job started with `pos run --clonable`"):
        preflight.check(opened)
    m.inner_pids = [1]        # ... and such an image is not refused for its PIDs
    preflight.pids_free(m)
    opened = open_image(opened.path)
    opened.manifest.driver_version = "570.1"
    monkeypatch.setattr(nvml, "driver_version", lambda: "580.159.04")
    with pytest.raises(BadInput, match="taken with NVIDIA driver 570.1 and this host runs 580"):
        preflight.check(opened)


# -- nothing behind --------------------------------------------------------------------------

@pytest.fixture
def fake_criu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A CRIU that says it is 4.2 and writes down every other call (none may come); the
    temporary folders of pos go to a folder of their own, which must stay empty."""
    calls = tmp_path / "criu-calls"
    criu = tmp_path / "criu"
    criu.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && echo 'Version: 4.2' && exit 0\n"
                    f"echo \"$@\" >> {calls}\nexit 1\n")
    criu.chmod(0o755)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("POS_CRIU", str(criu))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return calls


def nothing_left(tmp_path: Path, calls: Path) -> None:
    assert not calls.exists(), "CRIU was started"
    assert not list((tmp_path / "tmp").iterdir()), "a work folder was left"


@pytest.mark.parametrize("case", ["model", "memory", "file"])
def test_a_refused_restore_starts_nothing(tmp_path: Path, host_gpus, fake_criu, case) -> None:
    from pos.restore.tree import TreeRequest, restore_tree
    from pos.settings import Settings

    pairs: list[tuple[str, str]] = []
    if case == "model":
        img, pairs = make_image(tmp_path, gpus=(on("GPU-a"),)), [("GPU-a", "GPU-b")]
    elif case == "memory":
        img = make_image(tmp_path, gpus=(on("GPU-a", used=120 * GiB),))
    else:
        img = make_image(tmp_path, opened={str(tmp_path / "gone.bin"): 1})
    with pytest.raises(BadInput):
        restore_tree(TreeRequest(open_image(img), Settings.from_env(), gpu_pairs=tuple(pairs)))
    nothing_left(tmp_path, fake_criu)


def test_a_refused_concurrent_restore_makes_no_device_memory(tmp_path: Path, host_gpus,
                                                             fake_criu, monkeypatch) -> None:
    from pos import concurrent
    from pos.concurrent import restore as concurrent_restore
    from pos.operation.gpumap import Onto

    from pos.concurrent import gpucopy
    from pos.concurrent import prefetch

    class Context:        # the CUDA context is made beside the checks: here, none
        drv = None

        def __init__(self, _device: int) -> None:
            pass

        def use(self) -> None:
            pass

        def close(self) -> None:
            pass

    made: list[int] = []
    monkeypatch.setattr(prefetch, "fill_device", lambda *_: 0)
    monkeypatch.setattr(gpucopy, "Context", Context)
    monkeypatch.setattr(gpucopy.Imported, "create",
                        staticmethod(lambda *a: made.append(1) or pytest.fail("memory made")))
    assert concurrent_restore.Prefetch is prefetch.Prefetch
    img = make_image(tmp_path, gpus=(on("GPU-b", H100, used=1),), buffers=[70 * GiB])
    with pytest.raises(BadInput, match="GPU 2 of this host has 60.0 GiB free"):
        concurrent.restore_full(open_image(img), to_gpu=Onto.parse("2"))
    assert not made, "device memory was made"
    nothing_left(tmp_path, fake_criu)


def test_pos_restore_says_it_in_one_sentence(tmp_path: Path, fake_criu) -> None:
    need(os.geteuid() == 0, "pos restore needs root")
    img = make_image(tmp_path, opened={str(tmp_path / "gone.bin"): 1})
    r = pos("restore", "-D", str(img), env={"POS_CRIU": os.environ["POS_CRIU"],
                                            "POS_DB": str(tmp_path / "pos.db"),
                                            "TMPDIR": str(tmp_path / "tmp")})
    one_sentence(r, 2, f"the file {tmp_path / 'gone.bin'} that PID", "is not there any more",
                 "put it back at that path")
    nothing_left(tmp_path, fake_criu)
