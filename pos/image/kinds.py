"""What kind of image a directory holds, told from its files alone (before its manifest is
trusted, and without loading the GPU reader): a restore picks its engine from it once.

- stop-the-world: CRIU's files; the driver's checkpoint put the device memory into the
  process's host memory, which CRIU saved with the rest;
- concurrent (whole process): CRIU's files and a GPU index per CUDA process of the job;
- GPU-only: a GPU index and no process (a live `pos run` job rolls back to it);
- container: a container runtime's export beside the GPU indexes (`pos container restore`).
"""

import enum
from pathlib import Path

from pos.image import gpuindex, names


class ImageKind(enum.Enum):
    STOP_THE_WORLD = "stop-the-world"
    CONCURRENT = "concurrent"
    GPU_ONLY = "gpu-only"
    CONTAINER = "container"


def kind(directory: Path) -> ImageKind:
    """The kind of the image in `directory`. Anything that is neither concurrent kind is taken
    for stop-the-world, whose restore checks the image file by file and says what is wrong."""
    d = Path(directory)
    if (d / names.CONTAINER_ARCHIVE).is_file():
        return ImageKind.CONTAINER
    if (d / names.INVENTORY).is_file():
        return ImageKind.CONCURRENT if gpuindex.jobs(d) else ImageKind.STOP_THE_WORLD
    return ImageKind.GPU_ONLY if (d / names.INDEX).is_file() else ImageKind.STOP_THE_WORLD
