"""CRIU's pre-dump (pos/concurrent/predump.py): when pos tries it, the command lines CRIU gets
for it and for the incremental dump after it, and an image that holds the pre-dump's folder.
No kernel these tests run on keeps soft-dirty bits, so no pre-dump runs here: the answers are
checked against the kernel's own, and the tests of a run pre-dump and its fallback are in
tests/concurrent/test_hook_fake.py."""

import glob
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pos import image
from pos.concurrent import predump
from pos.errors import BadInput
from pos.image import names
from pos.process import criu, procs
from pos.process.criu import Options
from pos.settings import Settings
from tests.conftest import need
from tests.engines.conftest import kernel_keeps_soft_dirty

MAPPER = """
import mmap, os, sys, time
maps = []
for path, kind in (a.split(":") for a in sys.argv[1:]):
    fd = os.open(path, os.O_RDONLY)
    maps.append(mmap.mmap(fd, mmap.PAGESIZE, mmap.MAP_SHARED if kind == "shared"
                          else mmap.MAP_PRIVATE, mmap.PROT_READ))
    os.close(fd)
print("mapped", flush=True)
time.sleep(60)
"""


def mapping(*specs: str) -> subprocess.Popen:
    """A process that maps each PATH:shared|private of `specs`, one page each."""
    p = subprocess.Popen([sys.executable, "-c", MAPPER, *specs], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout is not None and p.stdout.readline() == "mapped\n"
    return p


def test_criu_says_what_the_kernel_says_of_dirty_tracking(criu_ready) -> None:
    found = criu.find()
    assert predump.tracks_dirty_pages(found.path) is kernel_keeps_soft_dirty()


def test_without_soft_dirty_the_reason_names_the_kernel_and_the_fix(criu_ready) -> None:
    found = criu.find()
    why = predump.why_not(found, [os.getpid()], True)
    if kernel_keeps_soft_dirty():
        assert why is None          # pytest maps no device
    else:
        assert why == ("this kernel does not track dirty pages (soft-dirty), so CRIU cannot "
                       "copy a job's host memory before the freeze (run a kernel built with "
                       "CONFIG_MEM_SOFT_DIRTY=y)")
    assert predump.why_not(found, [os.getpid()], False) == "turned off (POS_PREDUMP=0)"
    assert Settings.from_env({"POS_PREDUMP": "0"}).predump is False
    assert Settings.from_env({}).predump is True


def test_a_tree_that_maps_a_device_is_not_predumped(criu_ready, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """As CRIU sees mappings: /dev/zero and files are its own, any other device needs a plugin,
    and a pre-dump has none (CUDA's /dev/nvidia*); a loop device stands in for them here."""
    loops = sorted(glob.glob("/dev/loop[0-9]*"))
    need(bool(loops), "no loop device to map")
    monkeypatch.setattr(predump, "tracks_dirty_pages", lambda _path: True)
    (tmp_path / "f").write_bytes(b"x" * mmap.PAGESIZE)
    plain = mapping("/dev/zero:shared", "/dev/zero:private", f"{tmp_path / 'f'}:shared")
    device = mapping(f"{loops[0]}:shared")
    try:
        assert procs.device_mapping(plain.pid) is None
        assert procs.device_mapping(device.pid) == loops[0]
        found = criu.find()
        assert predump.why_not(found, [plain.pid], True) is None
        assert predump.why_not(found, [plain.pid, device.pid], True) == (
            f"PID {device.pid} maps {loops[0]}, which CRIU's pre-dump cannot save (CRIU issue "
            "2654); only the frozen dump, after the driver's checkpoint, can")
    finally:
        for p in (plain, device):
            p.kill()
            p.wait()


def test_the_command_lines_of_a_predump_and_of_the_dump_after_it() -> None:
    c = criu.Criu("/usr/sbin/criu", (4, 2))
    opts = Options(tcp_established=True, network_lock="skip")
    image_dir = Path("/img.partial")
    assert c.predump_argv(42, image_dir / names.PARENT, opts) == [
        "/usr/sbin/criu", "pre-dump", "-D", "/img.partial/parent", "-o", "criu-predump.log",
        "-v4", "-t", "42", "--network-lock", "skip", "--tcp-established", "--track-mem",
        "--pre-dump-mode", "read"]
    whole = c.dump_argv(42, image_dir, opts, True)
    assert whole == ["/usr/sbin/criu", "dump", "-D", "/img.partial", "-o", "criu-dump.log", "-v4",
                     "-t", "42", "--network-lock", "skip", "--tcp-established",
                     "--leave-running"]
    # the parent relative to -D, so that the image moves as one folder
    assert c.dump_argv(42, image_dir, opts, True, parent=names.PARENT) == [
        *whole, "--track-mem", "--prev-images-dir", "parent"]


def test_an_image_with_a_predump_folder_seals_verifies_and_refuses_additions(
        tmp_path: Path) -> None:
    partial = image.prepare(tmp_path / "img", 0)
    (partial / "inventory.img").write_bytes(b"final")
    (partial / names.PARENT).mkdir()
    (partial / names.PARENT / "pages-1.img").write_bytes(b"pre" * 1000)
    m = image.Manifest(1, [1], [], "job", "job", "now", "host", "k", "4.2", {}, False)
    final = image.seal(partial, m)
    assert sorted(m.files) == ["inventory.img", "parent/pages-1.img"]
    assert m.size_bytes == 3005
    image.verify(final)
    moved = final.rename(tmp_path / "moved")          # one folder: it moves whole
    image.verify(moved)
    (moved / names.PARENT / "pages-1.img").write_bytes(b"PRE" * 1000)
    with pytest.raises(BadInput, match="parent/pages-1.img do not match"):
        image.verify(moved)
    (moved / names.PARENT / "pages-1.img").write_bytes(b"pre" * 1000)
    (moved / names.PARENT / "extra.img").write_bytes(b"")
    with pytest.raises(BadInput, match="holds parent/extra.img, which its manifest"):
        image.verify(moved)


@pytest.mark.parametrize("sent,ok", [("pages-1.img", True), ("parent/pages-1.img", True),
                                     ("../x", False), ("parent/../x", False), ("a/b", False),
                                     ("/etc/passwd", False), ("parent/", False), ("", False),
                                     ("parent/parent/x", False)])
def test_a_migration_receives_the_files_of_an_image_and_nothing_else(sent: str,
                                                                     ok: bool) -> None:
    assert names.is_file_name(sent) is ok

