"""Which GPU of this host a process or an image goes onto (pos/scheduler/gpumap.py)."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from pos import image, nvml
from pos.errors import BadInput
from pos.scheduler import gpumap
from pos.scheduler.gpumap import gpu_pairs


def test_gpu_pairs_swap_the_two_gpus_and_keep_the_rest() -> None:
    uuids = ["GPU-a", "GPU-b", "GPU-c"]
    assert gpu_pairs(["GPU-a"], "GPU-c", uuids) == [("GPU-a", "GPU-c"), ("GPU-b", "GPU-b"),
                                                     ("GPU-c", "GPU-a")]
    with pytest.raises(BadInput, match="already runs on"):
        gpu_pairs(["GPU-a"], "GPU-a", uuids)
    with pytest.raises(BadInput, match="uses 2 GPUs"):
        gpu_pairs(["GPU-a", "GPU-b"], "GPU-c", uuids)
    # an image taken on another host: its GPU becomes the target, every GPU here maps once
    assert gpu_pairs(["GPU-x"], "GPU-b", uuids) == [("GPU-x", "GPU-b"), ("GPU-a", "GPU-a"),
                                                    ("GPU-c", "GPU-c")]


def test_restore_onto_another_gpu_maps_the_image_gpu_there(tmp_path: Path, monkeypatch) -> None:
    here = [nvml.Gpu(0, "GPU-a", "H100", 80 << 30), nvml.Gpu(1, "GPU-b", "H100", 80 << 30)]
    monkeypatch.setattr(nvml, "available", lambda: True)
    monkeypatch.setattr(nvml, "gpus", lambda: here)
    taken_on = [{"uuid": "GPU-a"}]
    monkeypatch.setattr(image, "load", lambda _d: SimpleNamespace(gpus=taken_on))
    assert gpumap.onto(tmp_path, 1) == ([("GPU-a", "GPU-b"), ("GPU-b", "GPU-a")], "GPU-b")
    with pytest.raises(BadInput, match="this host has 2 GPU"):
        gpumap.onto(tmp_path, 2)
    taken_on.append({"uuid": "GPU-b"})
    with pytest.raises(BadInput, match="uses 2 GPUs"):
        gpumap.onto(tmp_path, 1)
