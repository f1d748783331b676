"""GPU jobs in containers: the agent put into a container through CDI (cdi.py), a running
container saved whole while it runs (checkpoint.py: its processes and files through podman's
own checkpoint, CRIU underneath, its GPU memory through pos's concurrent engine) and restored
as one or many new containers (restore.py). podman.py is the one module that drives podman."""

from pos.image.names import CONTAINER_ARCHIVE as ARCHIVE   # podman's export in the image

__all__ = ["ARCHIVE"]
