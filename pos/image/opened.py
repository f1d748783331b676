"""An image opened for its restore, once, at the top (`pos restore`, the restore service's
request, a migration's receiver): its folder, its manifest (every file present, of its
recorded size: image.check_files), its kind and its GPU indexes, handed down to every layer
that needs them rather than read again from the path by each.

The GPU indexes are read when first asked for, then kept: a GPU-only restore reads its index
only once the checksums of the image's own files (the index's among them) have passed."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from pos import image
from pos.image import gpuindex, kinds, names
from pos.image.gpuindex import GpuIndex
from pos.image.kinds import ImageKind


@dataclass(frozen=True)
class Opened:
    """One image, as its restore sees it from start to end."""

    path: Path                         # absolute
    manifest: image.Manifest           # its files checked for presence and size
    kind: ImageKind
    ranks: tuple[Optional[int], ...]   # the jobs whose GPU indexes it holds (gpuindex.jobs)
    _indexes: dict[Optional[int], GpuIndex] = field(default_factory=dict, compare=False,
                                                    repr=False)

    @property
    def gpus(self) -> list[dict[str, Any]]:
        """The GPUs it was taken on, as its manifest lists them."""
        return self.manifest.gpus

    @property
    def checked_by_restore(self) -> list[str]:
        """The files whose checksums a restore verifies: all but the device memory, each of
        whose chunks is checked as it is read (a restore does not wait for a hash of gigabytes
        first: at 50 GB of a job's own memory, 2.7-3.1 s, bench/results/2026-12-01.md)."""
        return [n for n in self.manifest.files if not names.checked_as_read(n)]

    def index(self, rank: Optional[int] = None) -> GpuIndex:
        """The GPU index of the job (`rank` None) or of the process `rank` of several, read
        once."""
        if rank not in self._indexes:
            self._indexes[rank] = gpuindex.read(self.path, rank)
        return self._indexes[rank]


def open_image(directory: Path) -> Opened:
    """The image in `directory`, opened: BadInput when there is none to trust (image.load), or
    a file of it is missing, added, or of another size than its manifest says."""
    path = Path(directory).absolute()
    found = kinds.kind(path)
    manifest = image.check_files(path)
    return Opened(path, manifest, found, tuple(gpuindex.jobs(path)))
