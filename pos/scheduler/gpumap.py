"""Which GPU of this host a process or an image goes onto: the GPU pairs the driver's restore
takes (every GPU of the host once), from NVML's numbering (as nvidia-smi shows it). One rule
for both engines and both ways of moving (`pos migrate --to-gpu`, `pos restore --to-gpu`)."""

from pathlib import Path
from typing import Callable

from pos import image, nvml
from pos.errors import BadInput


def gpu_pairs(used: list[str], target: str, all_uuids: list[str]) -> list[tuple[str, str]]:
    """The GPU mapping for the driver's restore: the process's GPU and the target swap places,
    every other GPU maps to itself, so that the mapping covers every device once. A GPU not on
    this host (an image taken elsewhere) maps to the target, the others to themselves."""
    if len(used) != 1:
        seen = ", ".join(used) or "none seen by NVML"
        raise BadInput(f"the process uses {len(used)} GPUs ({seen})",
                       "--to-gpu moves processes that use exactly one GPU")
    src = used[0]
    if src == target:
        raise BadInput(f"the process already runs on {target}", "give another GPU index")
    if src not in all_uuids:
        return [(src, target)] + [(u, u) for u in all_uuids if u != target]
    swap = {src: target, target: src}
    return [(u, swap.get(u, u)) for u in all_uuids]


def target(index: int) -> tuple[nvml.Gpu, list[nvml.Gpu]]:
    """GPU `index` of this host (NVML's numbering, as nvidia-smi shows it), and all of them."""
    if not nvml.available():
        raise BadInput("NVML is not available (it names the GPUs for the driver's restore)",
                       "install the NVIDIA driver with libnvidia-ml.so.1")
    gpus = nvml.gpus()
    if index >= len(gpus):
        raise BadInput(f"this host has {len(gpus)} GPU(s), no GPU {index}",
                       f"give an index from 0 to {len(gpus) - 1}")
    return gpus[index], gpus


def move(index: int, used: Callable[[], list[str]]) -> tuple[list[tuple[str, str]], nvml.Gpu]:
    """The driver's mapping that moves a process (or an image) on the GPUs `used()` onto GPU
    `index` of this host, and that GPU; the GPU is checked first, before anything is read."""
    gpu, gpus = target(index)
    return gpu_pairs(used(), gpu.uuid, [g.uuid for g in gpus]), gpu


def onto(directory: Path, index: int) -> tuple[list[tuple[str, str]], str]:
    """The driver's mapping that restores the image in `directory` (taken on one GPU) onto GPU
    `index` of this host, and that GPU's UUID."""
    pairs, gpu = move(index, lambda: [g["uuid"] for g in image.load(directory).gpus])
    return pairs, gpu.uuid
