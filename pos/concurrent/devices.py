"""Which GPU a `pos run` job uses, and pos's own CUDA number for it: NVML names GPUs by UUID,
and a job's own numbering need not be pos's (CUDA_VISIBLE_DEVICES). Which GPUs pos's own CUDA
sees, in a process that restores one image."""

from typing import Any, Optional, Sequence

from pos import nvml
from pos.errors import BadInput


def gpu_of(pid: int) -> Optional[str]:
    """The UUID of the one GPU the job uses (None: NVML sees none). A job on several is
    refused: pos's concurrent copier shadows and copies one GPU's memory per process."""
    return gpu_use(pid)[0]


def gpu_use(pid: int) -> tuple[Optional[str], int]:
    """gpu_of, and the device memory NVML counts for the job there: beside what pos owns, the
    context's own and what the job maps itself (NCCL's buffers), which the driver's checkpoint
    moves into the job's host memory."""
    used = nvml.gpus_of([pid])
    if len(used) > 1:
        raise BadInput(f"PID {pid} uses {len(used)} GPUs ({', '.join(used)}): pos's concurrent "
                       "copier shadows and copies one GPU's memory",
                       f"checkpoint it stop-the-world: `pos checkpoint {pid} -D DIR`")
    return next(iter(used.items()), (None, 0))


def cuda_device(gpu: Optional[str]) -> int:
    """pos's CUDA number of the GPU named `gpu` (NVML's UUID); None: device 0."""
    from pos.concurrent import gpucopy

    return gpucopy.ordinal(gpu) if gpu else 0


def device_of(pid: int) -> int:
    """pos's CUDA number of the one GPU the job uses: the shadow and the copies go there."""
    return cuda_device(gpu_of(pid))


def home(gpus: Sequence[dict[str, Any]]) -> Optional[str]:
    """The UUID of the GPU an image was taken on (`gpus`: its manifest's), when this host has
    it (None: CUDA's device 0)."""
    here = {g.uuid for g in nvml.gpus()}
    return next((g["uuid"] for g in gpus if g["uuid"] in here), None)


def start_cuda(targets: Sequence[Optional[str]]) -> bool:
    """Start NVML, then, where it gains, CUDA seeing only the GPUs a restore fills (`targets`:
    the GPU of each process with device memory to fill, by UUID); whether CUDA was started.
    NVML first: the restore's checks ask it, and where the fill's threads began CUDA before
    it, they took 1.0 s of every restore of a torchrun job on 4x H200 hosts, against 0.0 s
    where it had started first (most likely NVML's start waits for a cuInit under way in the
    same process; bench/results/2026-11-28.md). cuInit starts every GPU it sees: 0.91-1.04 s
    for four H200s, 0.19-0.33 s for one. Narrowed only where every GPU is in persistence mode
    (the driver's restore of a job needs the GPUs it had started, which without it only a
    cuInit that saw them keeps started), the host has each target and more GPUs besides: this
    cuInit holds up CRIU's start, where the fill's own starts beside it. A process of no
    known GPU, a GPU the host lacks or a CUDA started already: CUDA is left to start as it
    would, on the fill's threads, seeing every GPU."""
    from pos.driver import driver

    if not nvml.available():
        return False
    wanted = list(dict.fromkeys(t for t in targets if t))
    if not wanted or None in targets:
        return False
    gpus = nvml.gpus()
    here = {g.uuid for g in gpus}
    return all(g.persistent for g in gpus) and all(u in here for u in wanted) and \
        len(wanted) < len(here) and driver().init_seeing(wanted)
