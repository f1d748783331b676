"""The image pos's containers run from where no registry is reached (the tests, an offline GPU
machine): only empty folders, the links a Debian or Ubuntu /usr needs, and root's passwd and
group lines. Each container mounts the host's /usr read-only, so a job runs there with the
host's own programs and libraries (Python, PyTorch, the NVIDIA driver's libraries)."""

import subprocess
import tarfile
from pathlib import Path

IMAGE = "localhost/pos-test-base:1"
# podman's defaults (1048576 files, and the caller's processes) are above the hard limits some
# hosts give root's services, which runc may not raise ("error setting rlimit type 7"): the
# jobs need few of either
ULIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096"]


def rootfs_tar(work: Path) -> Path:
    """The image's root file system as a tar in `work`, for `podman import`."""
    root = work / "rootfs"
    for d in ("proc", "sys", "dev", "tmp", "run", "etc", "usr", "var/tmp"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for link in ("bin", "lib", "lib64", "sbin"):
        if not (root / link).is_symlink():
            (root / link).symlink_to(f"usr/{link}")
    (root / "etc/passwd").write_text("root:x:0:0:root:/:/bin/sh\n")
    (root / "etc/group").write_text("root:x:0:\n")
    tar = work / "base.tar"
    with tarfile.open(tar, "w") as t:
        t.add(root, arcname=".")
    return tar


def make(work: Path, podman: str = "podman") -> None:
    """IMAGE in `podman`'s storage, unless it is there."""
    if subprocess.run([podman, "image", "exists", IMAGE]).returncode != 0:
        subprocess.run([podman, "import", str(rootfs_tar(work)), IMAGE], check=True,
                       capture_output=True)
