"""Which GPUs of this host a process or an image goes onto (pos/operation/gpumap.py)."""

import pytest

from pos import nvml
from pos.errors import BadInput
from pos.operation import gpumap
from pos.operation.gpumap import Onto, gpu_pairs

HERE = [nvml.Gpu(0, "GPU-a", "H100", True), nvml.Gpu(1, "GPU-b", "H100", True),
        nvml.Gpu(2, "GPU-c", "H100", True)]
INDEX = {g.uuid: g.index for g in HERE}


def test_to_gpu_reads_an_index_or_a_map_and_refuses_the_rest() -> None:
    assert Onto.parse("1") == Onto(index=1)
    assert Onto.parse("0=1,1=0") == Onto(pairs=((0, 1), (1, 0)))
    assert str(Onto.parse("0=1,1=0")) == "0=1,1=0"
    for bad, why in (("x", "neither"), ("0=1,1", "neither"), ("-1", "neither"),
                     ("0=1,0=2", "twice"), ("0=1,2=1", "twice")):
        with pytest.raises(BadInput, match=why):
            Onto.parse(bad)


def test_one_gpu_swaps_places_with_its_target_and_the_rest_stay() -> None:
    assert gpu_pairs(["GPU-a"], Onto(index=2), HERE, INDEX) == [
        ("GPU-a", "GPU-c"), ("GPU-b", "GPU-b"), ("GPU-c", "GPU-a")]
    with pytest.raises(BadInput, match="already runs where --to-gpu 0 puts it .GPU-a"):
        gpu_pairs(["GPU-a"], Onto(index=0), HERE, INDEX)
    with pytest.raises(BadInput, match="uses 2 GPUs.*0=1,1=0"):
        gpu_pairs(["GPU-a", "GPU-b"], Onto(index=2), HERE, INDEX)
    # an image taken on another host: its GPU becomes the target, every GPU here maps once
    assert gpu_pairs(["GPU-x"], Onto(index=1), HERE, INDEX) == [
        ("GPU-x", "GPU-b"), ("GPU-a", "GPU-a"), ("GPU-c", "GPU-c")]


def test_a_job_on_two_gpus_goes_where_the_map_says_every_gpu_once() -> None:
    pairs = gpu_pairs(["GPU-a", "GPU-b"], Onto.parse("0=1,1=0"), HERE, INDEX)
    assert pairs == [("GPU-a", "GPU-b"), ("GPU-b", "GPU-a"), ("GPU-c", "GPU-c")]
    pairs = gpu_pairs(["GPU-a", "GPU-b"], Onto.parse("0=1,1=2"), HERE, INDEX)
    assert pairs == [("GPU-a", "GPU-b"), ("GPU-b", "GPU-c"), ("GPU-c", "GPU-a")]
    for pairs in (pairs,):       # a permutation: each GPU of the host once on either side
        assert sorted(a for a, _ in pairs) == sorted(b for _, b in pairs) == sorted(INDEX)
    with pytest.raises(BadInput, match="GPU-b .index 1.*does not name"):
        gpu_pairs(["GPU-a", "GPU-b"], Onto.parse("0=2"), HERE, INDEX)
    with pytest.raises(BadInput, match="already runs"):
        gpu_pairs(["GPU-a", "GPU-b"], Onto.parse("0=0,1=1"), HERE, INDEX)
    with pytest.raises(BadInput, match="no GPU 5"):
        gpu_pairs(["GPU-a"], Onto.parse("0=5"), HERE, INDEX)


def test_restore_onto_other_gpus_maps_the_image_gpus_there(monkeypatch) -> None:
    monkeypatch.setattr(nvml, "available", lambda: True)
    monkeypatch.setattr(nvml, "gpus", lambda: HERE[:2])
    taken_on = [{"uuid": "GPU-a", "index": 0}]
    assert gpumap.onto(taken_on, Onto(index=1)) == (
        [("GPU-a", "GPU-b"), ("GPU-b", "GPU-a")], ["GPU-b"])
    with pytest.raises(BadInput, match="this host has 2 GPU"):
        gpumap.onto(taken_on, Onto(index=2))
    taken_on.append({"uuid": "GPU-b", "index": 1})
    with pytest.raises(BadInput, match="uses 2 GPUs"):
        gpumap.onto(taken_on, Onto(index=1))
    assert gpumap.onto(taken_on, Onto.parse("0=1,1=0")) == (
        [("GPU-a", "GPU-b"), ("GPU-b", "GPU-a")], ["GPU-b", "GPU-a"])
    # taken on another host, its GPUs named by the indices they had there
    taken_on[:] = [{"uuid": "GPU-x", "index": 0}, {"uuid": "GPU-y", "index": 1}]
    assert gpumap.onto(taken_on, Onto.parse("0=1,1=0")) == (
        [("GPU-x", "GPU-b"), ("GPU-y", "GPU-a")], ["GPU-b", "GPU-a"])
