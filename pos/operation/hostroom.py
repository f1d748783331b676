"""Host memory for the device memory that a checkpoint brings into it while the job is held,
checked before the job is held.

The driver's checkpoint copies the device memory it saves into the job's own host memory, and
CRIU then writes it into the image: a second copy where the image's folder keeps its files in
memory (/dev/shm, any tmpfs). The concurrent engine copies the job's own memory that the GPU
has no room for into host memory too, until it writes it into the image. Where the host cannot
hold that, the kernel ends the job or pos while the job is frozen. On an H200 host with 126 GiB of host memory, a job with PyTorch's
expandable segments at 50% of the GPU would have needed 149.8 GiB (bench/results/2026-12-01.md),
and a stop-the-world image of a job at 90% of that GPU would need 127 GB even on a disk. So
both engines refuse such a checkpoint first, in one sentence, and leave the job running.
"""

from pos.errors import BadInput


def check(brought: int, what: str, image_in_memory: bool, spare: int, fix: str,
          copied: int = 0) -> None:
    """Refused where the host's `spare` bytes cannot hold the `brought` bytes of device memory
    (`what` they are, after "of") that the driver's checkpoint puts into the job's host memory,
    and CRIU's copy of them where the image's files are kept in memory (`image_in_memory`:
    host.in_memory of its folder), beside the `copied` bytes of the job's own memory that pos
    copies into host memory while the job is held (where the GPU has no room for them: pos
    lets each piece go once it is in the image); `fix`: what the user can do."""
    need = brought * (2 if image_in_memory else 1) + copied
    if not need or need <= spare:
        return
    parts = ([f"the driver's checkpoint would bring {brought / 2**30:.1f} GiB of {what} into "
              "host memory" + (", and CRIU would write it again into the image in memory"
                               if image_in_memory else "")] if brought else [])
    if copied:
        parts.append(f"pos would copy {copied / 2**30:.1f} GiB of the job's own memory, which "
                     "the GPU has no room for, into host memory")
    raise BadInput(" and ".join(parts) + f": {need / 2**30:.1f} GiB, where the host has "
                   f"{max(0, spare) / 2**30:.1f} GiB to spare", fix)
